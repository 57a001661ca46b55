"""Atomic, rotating checkpoints of a run: ``<run>/checkpoints/step_N/``.

A checkpoint is written into ``checkpoints/.tmp-step_N-<pid>/``, completed with a ``COMPLETE``
marker, then renamed to ``step_N`` (a rename within one folder is atomic on POSIX file systems),
so a crash at any point leaves the previous complete checkpoint intact and never a half-written
``step_N``. Only the newest ``keep_last`` complete checkpoints are kept (older ones are deleted
after the new one is complete). Leftover ``.tmp-*`` folders of a crashed save are removed on the
next save.

Layout of one checkpoint::

    step_N/
      learner/            # written by MegatronLearner.save_checkpoint (models, optimizer, RNG, version)
      trainer_state.json  # step, weight_version, data sampler + pair RNG position, run stats
      COMPLETE
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from megatron_rlhf.testing.faults import kill_point

__all__ = ["CheckpointManager"]

_STEP_RE = re.compile(r"^step_(\d+)$")


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
        self.root.mkdir(parents=True, exist_ok=True)

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

    def save(self, step: int, trainer_state: dict, write_fn: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step_<step>`` atomically.

        Args:
            step: 1-based step number (learner batches finished).
            trainer_state: JSON-serialisable state (step, weight_version, sampler position, ...).
            write_fn: called with the temporary folder; writes the learner's files into it.
        Returns:
            The final ``step_<step>`` path.
        Raises:
            Whatever ``write_fn`` raises; the temporary folder is removed and no checkpoint
            changes.
        """
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-step_{step}-{os.getpid()}"
        final = self.root / f"step_{step}"
        tmp.mkdir(parents=True)
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
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in self.complete_checkpoints()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def _test_delay() -> None:
    """Tests only: ``MRLHF_TEST_SLOW_SAVE_S`` seconds of sleep at the start of every save (before the
    learner writes its files), to make a save outlast a signal or to
    kill the driver mid-save. Unset in real runs."""
    delay = float(os.environ.get("MRLHF_TEST_SLOW_SAVE_S") or 0)
    if delay > 0:
        import time

        time.sleep(delay)


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
