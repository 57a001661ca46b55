"""What a run's setup and its verbs share: the run's result and the learner-death guard.

:mod:`megatron_rlhf.trainer.setup` (start-up) and :mod:`megatron_rlhf.trainer.run` (the verbs the
loop calls) both wrap learner calls in :func:`learner_guard` and return a :class:`RunResult`; they
live here so that setup never imports run (run calls setup).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rlhf.trainer.checkpoint import CheckpointManager

__all__ = ["LearnerDiedError", "RunResult", "learner_guard"]


class LearnerDiedError(RuntimeError):
    """The learner actor died; the run stops (the last complete checkpoint is left intact)."""


class RunResult(dict):
    """Summary of a finished (or stopped) run: :func:`metrics.summarize` plus ``run_dir``,
    ``stopped_early``, ``resumed_from_step``, ``report`` (the HTML page) and ``tensorboard`` (the
    event-file folder, or None with ``logging.tensorboard: false``)."""


@contextlib.contextmanager
def learner_guard(what: str, ckpts: CheckpointManager):
    """Every learner call (train_step, checkpoint save, weight publish, final export) runs inside
    this: an actor death (``RayActorError``, also when raised by the transport's own ``ray.get``)
    becomes :class:`LearnerDiedError` naming ``what`` and the last complete checkpoint."""
    from ray.exceptions import RayActorError

    try:
        yield
    except RayActorError as e:
        latest = ckpts.latest()
        where = (f"the last complete checkpoint {latest[0]} is intact: rerun the same command to resume "
                 "from it" if latest else "no checkpoint was written yet")
        raise LearnerDiedError(f"the learner died during {what} ({type(e).__name__}); {where}") from e
