"""Atomic, rotating checkpoints of a run: ``<run>/checkpoints/step_N/``.

A checkpoint is written into ``checkpoints/.tmp-step_N-<pid>/``, completed with a ``COMPLETE``
marker, then renamed to ``step_N`` (a rename within one folder is atomic on POSIX file systems),
so a crash at any point leaves the previous complete checkpoint intact and never a half-written
``step_N``. Only the newest ``keep_last`` complete checkpoints are kept (older ones are deleted
after the new one is complete). Leftover ``.tmp-*`` folders of a crashed save are removed on the
next save.

Failures name the path and the cause (:class:`CheckpointError`): a file where the ``checkpoints``
folder or ``step_N`` must go, and a full disk (``ENOSPC`` anywhere in the error chain, or under
64 MiB free when the save failed: the learner's C++ writer reports a full disk only as
``basic_ios::clear: iostream error``). A failed save removes its temporary folder and leaves the
last complete checkpoint as it was.

Layout of one checkpoint::

    step_N/
      learner/            # written by MegatronLearner.save_checkpoint (models, optimizer, RNG, version)
      trainer_state.json  # step, weight_version, data sampler + pair RNG position, run stats
      COMPLETE
    reference_vK/         # the frozen reference, saved once per reference version K and shared:
                          # a step's learner/reference.json names the one it uses; rotation
                          # deletes a reference_vK only when no kept checkpoint names it
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from megatron_rlhf.testing.faults import kill_point

__all__ = ["CheckpointManager", "CheckpointError"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_LOW_DISK_BYTES = 64 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the path and the cause (the last
    complete checkpoint is untouched)."""


class CheckpointManager:
    """Saves, finds and rotates checkpoints under ``root``.

    Args:
        root: the run's ``checkpoints`` folder (created).
        keep_last: complete checkpoints to keep (>= 1).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
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
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / "COMPLETE").is_file() and (p / "trainer_state.json").is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint and its trainer state, or ``None``."""
        ckpts = self.complete_checkpoints()
        if not ckpts:
            return None
        path = ckpts[-1][1]
        return path, json.loads((path / "trainer_state.json").read_text())

    def save(self, step: int, trainer_state: dict, write_fn: Callable[[Path], None], *,
             passthrough: tuple[type[BaseException], ...] = ()) -> Path:
        """Write checkpoint ``step_<step>`` atomically.

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
        try:
            _test_delay()
            write_fn(tmp)
            kill_point("save", step)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
            (tmp / "COMPLETE").write_text(f"step {step}\n")
            _fsync_dir(tmp)
            if final.exists():  # a previous incomplete or superseded save of the same step
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except passthrough:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:
            cause = _cause(e, self.root)   # before the cleanup frees the space
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot save checkpoint step {step} into {tmp}: {cause}; the last "
                                  "complete checkpoint is intact") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in self.complete_checkpoints()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self._drop_unused_references()
        return final

    def _drop_unused_references(self) -> None:
        """Delete ``reference_v*`` folders that no kept checkpoint names in a ``*/reference.json``
        (:mod:`megatron_rlhf.learner.checkpoint`)."""
        used = set()
        for _, ckpt in self.complete_checkpoints():
            for marker in ckpt.glob("*/reference.json"):
                used.add((marker.parent / json.loads(marker.read_text())["dir"]).resolve())
        for ref in self.root.glob("reference_v*"):
            if ref.is_dir() and ref.resolve() not in used:
                shutil.rmtree(ref, ignore_errors=True)


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
