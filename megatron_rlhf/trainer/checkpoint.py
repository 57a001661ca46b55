"""Atomic, rotating checkpoints of a run: ``<run>/checkpoints/step_N/``.

A checkpoint is written into ``checkpoints/.tmp-step_N-<pid>/``, completed with a ``COMPLETE``
marker, then renamed to ``step_N`` (a rename within one folder is atomic on POSIX file systems),
so a crash at any point leaves the previous complete checkpoint intact and never a half-written
``step_N``. Only the newest ``keep_last`` complete checkpoints are kept (older ones are deleted
after the new one is complete). Leftover ``.tmp-*`` folders of a crashed save are removed on the
next save.

With ``checkpoint.async_save`` a save is split in two: :meth:`CheckpointManager.start` creates the
temporary folder and starts the learner's writers; :meth:`CheckpointManager.finish`, called once
they are done (``trainer.run.Run``: polled after every train step, waited for by the next save, the
end of the run and a stop signal), writes ``trainer_state.json``, ``COMPLETE`` and the manifest and
renames. Until then the checkpoint is a ``.tmp-*`` folder: a crash leaves the previous complete
checkpoint, and rotation never counts the unfinished one.

Failures name the path and the cause (:class:`CheckpointError`): a file where the ``checkpoints``
folder or ``step_N`` must go, and a full disk (``ENOSPC`` anywhere in the error chain, or under
64 MiB free when the save failed: the learner's C++ writer reports a full disk only as
``basic_ios::clear: iostream error``). A failed save removes its temporary folder and leaves the
last complete checkpoint as it was.

Layout of one checkpoint::

    step_N/
      learner/            # written by MegatronLearner.save_checkpoint (models, optimizer, RNG, version)
      batches/            # the untrained (pending) batches, rollout.batch_io format
      trainer_state.json  # step, weight_version, data sampler + pair RNG position, run stats
      COMPLETE
      MANIFEST.json       # written last: size and checksum of every other file (verify_manifest)
    reference_vK/         # the frozen reference, saved once per reference version K and shared:
                          # a step's learner/reference.json names the one it uses; rotation
                          # deletes a reference_vK only when no kept checkpoint names it;
                          # its own MANIFEST.json is written with the first checkpoint using it

Verified before trusted (:meth:`CheckpointManager.resumable`): on start the newest checkpoint
whose manifest verifies is used; a damaged newer one (a file missing, truncated, changed or not
listed; an unreadable ``trainer_state.json``; a damaged shared ``reference_vK`` it uses) is moved
aside to ``step_N.damaged-<UTC time>`` (never deleted) and named, and so is a damaged reference. The manifest holds each file's size and SHA-256, the whole file up to
``FULL_HASH_MAX_BYTES`` (16 MiB: ``trainer_state.json``, ``learner_state*.pt``, dist_checkpointing's
``.metadata``/``common.pt``, batches), and for larger files (the model and optimizer shards) the
SHA-256 of their first and last MiB. Why not a full hash: SHA-256 runs at about 0.5-1 GB/s per
core, so a 1 TB checkpoint would take 20-30 min to verify on every start; the size catches a
truncation (the usual damage: a full disk, a killed copy or rsync), the head and tail hashes a torn
or overwritten header or end, at 2 MiB of reads per shard. Bit rot inside a large shard is left to
the storage's own checksums. Anchors: torch.distributed.checkpoint and Megatron's
dist_checkpointing write their ``.metadata`` / ``metadata.json`` last as the completion marker but
check no sizes; NeMo-RL and torchtitan rely on a rename of a ``tmp_step_N`` folder as here; Orbax
writes a ``commit_success`` file. None of them verifies the bytes before loading.

Checkpoints written before manifests existed (``COMPLETE`` without ``MANIFEST.json``) are trusted
unverified, with a note (they were completed by the same atomic rename; refusing them would stop
every earlier run's resume); only their ``trainer_state.json`` is checked to parse.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from megatron_rlhf.utils.faults import kill_point
from megatron_rlhf.utils.atomic import fsync_dir, fsync_file, move_aside, write_json, write_text

__all__ = ["CheckpointManager", "CheckpointError", "PendingCheckpoint", "Resumable", "MANIFEST", "write_manifest",
           "verify_manifest", "FULL_HASH_MAX_BYTES"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_LOW_DISK_BYTES = 64 * 2**20
MANIFEST = "MANIFEST.json"
FULL_HASH_MAX_BYTES = 16 * 2**20
_EDGE_BYTES = 2**20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the path and the cause (the last
    complete checkpoint is untouched)."""


class CheckpointManager:
    """Saves, finds and rotates checkpoints under ``root``.

    Args:
        root: the run's ``checkpoints`` folder (created by the first :meth:`save`, so that a run
            refused at start leaves the run folder as it was).
        keep_last: complete checkpoints to keep (>= 1).
    Raises:
        CheckpointError: a file is where ``root`` or a folder above it must go.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        blocker = next((p for p in (self.root, *self.root.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise CheckpointError(f"cannot create the checkpoint folder {self.root}: Not a directory "
                                  f"({blocker}); a file is in the way: move it, or set another "
                                  "run.output_dir / run.name")

    def _create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise CheckpointError(f"cannot create the checkpoint folder {self.root}: {e.strerror} "
                                  f"({e.filename}); a file is in the way: move it, or set another "
                                  "run.output_dir / run.name") from e
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint folder {self.root}: {e.strerror or e}") from e

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """All complete checkpoints as ``(step, path)``, oldest first."""
        out = []
        if not self.root.is_dir():
            return out
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / "COMPLETE").is_file() and (p / "trainer_state.json").is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint whose trainer state reads, and that state, or ``None``
        (not verified against its manifest: :meth:`resumable` does that)."""
        for _, path in reversed(self.complete_checkpoints()):
            try:
                return path, _read_state(path)
            except ValueError:
                continue
        return None

    def save(self, step: int, trainer_state: dict, write_fn: Callable[[Path], None], *,
             passthrough: tuple[type[BaseException], ...] = ()) -> Path:
        """Write checkpoint ``step_<step>`` atomically: :meth:`start`, then :meth:`finish`.

        Args:
            step: 1-based step number (learner batches finished).
            trainer_state: JSON-serialisable state (step, weight_version, sampler position, ...).
            write_fn: called with the temporary folder; writes the learner's files into it.
            passthrough: exception types of ``write_fn`` re-raised as they are (after the cleanup),
                not wrapped in :class:`CheckpointError` (errors that already name their cause).
        Returns:
            The final ``step_<step>`` path.
        Raises:
            CheckpointError: a file (not a folder) is where ``step_<step>`` must go, or writing
                failed (the message names the folder and the cause, "no space left on device"
                for a full disk; the original error is the ``__cause__``); the temporary folder
                is removed and no checkpoint changes.
        """
        return self.finish(self.start(step, trainer_state, write_fn, passthrough=passthrough))

    def start(self, step: int, trainer_state: dict, write_fn: Callable[[Path], None], *,
              passthrough: tuple[type[BaseException], ...] = ()) -> "PendingCheckpoint":
        """Create ``.tmp-step_<step>-<pid>`` and call ``write_fn`` on it (which may only start the
        learner's writers: ``checkpoint.async_save``); nothing is complete until :meth:`finish`.
        Leftover ``.tmp-*`` folders (a crashed or abandoned save) are removed first.

        Raises:
            CheckpointError: as :meth:`save`.
        """
        self._create()
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-step_{step}-{os.getpid()}"
        final = self.root / f"step_{step}"
        if final.exists() and not final.is_dir():
            raise CheckpointError(f"cannot save checkpoint step {step}: {final} is a file, not a "
                                  "checkpoint folder; move it away (nothing was written)")
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise CheckpointError(f"cannot save checkpoint step {step}: creating {tmp} failed: "
                                  f"{_cause(e, self.root)}") from e
        pending = PendingCheckpoint(step, dict(trainer_state), tmp, final, passthrough)

        def write() -> None:
            _test_delay()
            write_fn(tmp)

        self._guarded(pending, write)
        return pending

    def finish(self, pending: "PendingCheckpoint", wait_fn: Callable[[], object] | None = None) -> Path:
        """Complete ``pending``: ``wait_fn()`` (waits for the learner's writers of an asynchronous
        save; its errors are handled as ``write_fn``'s), then ``trainer_state.json``, ``COMPLETE``,
        the manifest and the rename to ``step_<step>``; then the rotation (``keep_last`` counts
        complete checkpoints only: an unfinished one is never a reason to delete a complete one).

        Returns:
            The final ``step_<step>`` path.
        Raises:
            CheckpointError: as :meth:`save`.
        """
        step, tmp, final = pending.step, pending.tmp, pending.final

        def complete() -> None:
            if wait_fn is not None:
                wait_fn()
            kill_point("save", step)
            write_json(tmp / "trainer_state.json", pending.trainer_state, indent=1)
            write_text(tmp / "COMPLETE", f"step {step}\n")
            for ref in _references(tmp):   # the shared reference, once (complete now: its writers are done)
                if ref.is_dir() and not (ref / MANIFEST).is_file():
                    write_manifest(ref, step)
            write_manifest(tmp, step)   # last: covers every file above
            if final.exists():  # a previous incomplete or superseded save of the same step
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.root)

        self._guarded(pending, complete)
        for _, old in self.complete_checkpoints()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self._drop_unused_references()
        return final

    def _guarded(self, pending: "PendingCheckpoint", fn: Callable[[], None]) -> None:
        """``fn()``; on any error the temporary folder is removed and the error is raised
        (wrapped in :class:`CheckpointError` unless it is one of ``pending.passthrough``)."""
        try:
            fn()
        except pending.passthrough:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            raise
        except Exception as e:
            cause = _cause(e, self.root)   # before the cleanup frees the space
            shutil.rmtree(pending.tmp, ignore_errors=True)
            raise CheckpointError(f"cannot save checkpoint step {pending.step} into {pending.tmp}: {cause}; "
                                  "the last complete checkpoint is intact") from e
        except BaseException:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            raise

    def _drop_unused_references(self) -> None:
        """Delete ``reference_v*`` folders that no kept checkpoint names in a ``*/reference.json``
        (:mod:`megatron_rlhf.learner.checkpoint`)."""
        used = set()
        for _, ckpt in self.complete_checkpoints():
            used.update(_references(ckpt))
        for ref in self.root.glob("reference_v*"):
            if ref.is_dir() and ref.resolve() not in used:
                shutil.rmtree(ref, ignore_errors=True)

    # ----- verification before use (issue 25) -----------------------------------------------------
    def resumable(self) -> "Resumable":
        """The newest checkpoint whose manifest verifies, and the damaged newer ones.

        Reads every checkpoint's ``trainer_state.json`` and verifies its manifest, newest first,
        until one passes; then the manifest of the shared ``reference_vK`` it names (written once,
        with the first checkpoint that uses it; a reference written before references had one is
        trusted). A damaged reference is listed itself, and every checkpoint using it is damaged
        too. Changes nothing on disk (:meth:`move_aside` does, once the run is accepted).

        Returns:
            :class:`Resumable` (``path`` None when no checkpoint verifies).
        """
        damaged, bad_refs = [], {}
        for _, path in reversed(self.complete_checkpoints()):
            try:
                state = _read_state(path)
            except ValueError as e:
                damaged.append((path, str(e)))
                continue
            if not (path / MANIFEST).is_file():
                return Resumable(path, state, damaged, verified=False)
            problem = verify_manifest(path) or self._reference_problem(path, bad_refs)
            if problem is None:
                return Resumable(path, state, [*bad_refs.items(), *damaged], verified=True)
            damaged.append((path, problem))
        return Resumable(None, None, [*bad_refs.items(), *damaged], verified=False)

    @staticmethod
    def _reference_problem(path: Path, bad_refs: dict) -> str | None:
        """What is wrong with the shared reference(s) checkpoint ``path`` names (None: intact,
        or written without a manifest); a damaged one is added to ``bad_refs`` (path -> reason)."""
        for ref in _references(path):
            if ref not in bad_refs and (ref / MANIFEST).is_file():
                problem = verify_manifest(ref)
                if problem is not None:
                    bad_refs[ref] = problem
            if ref in bad_refs:
                return f"the shared reference {ref.name} it uses is damaged ({bad_refs[ref]})"
        return None

    def move_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint ``step_N`` (or shared ``reference_vK``) to
        ``<name>.damaged-<UTC time>`` in the same folder (never deleted; no longer a checkpoint for
        resume or rotation, :func:`~megatron_rlhf.utils.atomic.move_aside`); returns the new path."""
        return move_aside(path)


@dataclasses.dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint :meth:`CheckpointManager.start` began: written into ``tmp``, becomes ``final``
    at :meth:`CheckpointManager.finish` (``trainer_state`` is written then)."""

    step: int
    trainer_state: dict
    tmp: Path
    final: Path
    passthrough: tuple = ()


@dataclasses.dataclass(frozen=True)
class Resumable:
    """What :meth:`CheckpointManager.resumable` found.

    Attributes:
        path / state: the newest usable checkpoint and its trainer state (None / None: none).
        damaged: ``[(path, reason)]``, the newer checkpoints that failed (newest first).
        verified: the manifest of ``path`` verified (False: an old checkpoint without one).
    """

    path: Path | None
    state: dict | None
    damaged: list
    verified: bool


def _read_state(path: Path) -> dict:
    """``trainer_state.json`` of checkpoint ``path``.

    Raises:
        ValueError: unreadable or not a JSON object with ``step`` (names the file and the cause).
    """
    f = path / "trainer_state.json"
    try:
        state = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{f} holds no step number")
    return state


def _references(folder: Path) -> list[Path]:
    """The shared reference folders a checkpoint (or its temporary folder) names in its
    ``*/reference.json`` (``megatron_rlhf.learner.checkpoint``), resolved; an unreadable marker
    names none (the manifest reports it)."""
    out = []
    for marker in folder.glob("*/reference.json"):
        try:
            out.append((marker.parent / json.loads(marker.read_text())["dir"]).resolve())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _digest(path: Path, size: int) -> dict:
    """Size and SHA-256 (whole file up to FULL_HASH_MAX_BYTES, else its first and last MiB)."""
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            return {"size": size, "sha256": hashlib.sha256(f.read()).hexdigest()}
        head = hashlib.sha256(f.read(_EDGE_BYTES)).hexdigest()
        f.seek(size - _EDGE_BYTES)
        tail = hashlib.sha256(f.read(_EDGE_BYTES)).hexdigest()
    return {"size": size, "head_sha256": head, "tail_sha256": tail}


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, step: int) -> Path:
    """Write ``folder/MANIFEST.json`` (module doc) over every other file of ``folder``, fsyncing each
    file first (the learner's writers do not), so the manifest is durable after what it lists."""
    files = {}
    for rel in _files(folder):
        p = folder / rel
        fsync_file(p)
        files[rel] = _digest(p, p.stat().st_size)
    for d in {p.parent for p in folder.rglob("*") if p.is_file()}:
        fsync_dir(d)
    return write_json(folder / MANIFEST, {"format": 1, "step": step, "files": files}, indent=0)


def verify_manifest(folder: Path) -> str | None:
    """None when every file of checkpoint ``folder`` matches its ``MANIFEST.json``, else the first
    problem in words (a file missing, truncated, changed, or not listed; an unreadable manifest)."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for rel, want in listed.items():
        p = folder / rel
        try:
            size = p.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != want.get("size"):
            return f"{rel} is {size} bytes, the manifest says {want.get('size')} (truncated or replaced)"
        try:
            got = _digest(p, size)
        except OSError as e:
            return f"{rel} is unreadable ({e.strerror or e})"
        if got != want:
            return f"{rel} has other bytes than when it was saved (checksum differs)"
    extra = [rel for rel in _files(folder) if rel not in listed]
    if extra:
        return f"{extra[0]} is not in the manifest (written after the checkpoint was completed)"
    return None


def _test_delay() -> None:
    """Tests only: ``MRLHF_TEST_SLOW_SAVE_S`` seconds of sleep at the start of every save (before the
    learner writes its files), to make a save outlast a signal or to
    kill the driver mid-save. Unset in real runs."""
    delay = float(os.environ.get("MRLHF_TEST_SLOW_SAVE_S") or 0)
    if delay > 0:
        import time

        time.sleep(delay)


def _cause(err: BaseException, root: Path) -> str:
    """What went wrong, in words: "no space left on device" for a full disk, else the error."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    full = any(getattr(x, "errno", None) == errno.ENOSPC or "No space left" in str(x) for x in chain)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if full or (free is not None and free < _LOW_DISK_BYTES):
        left = "" if free is None else f" ({free / 2**20:.1f} MiB free on the file system of {root})"
        return f"no space left on device{left}: free space, or set run.output_dir to a larger disk"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"

