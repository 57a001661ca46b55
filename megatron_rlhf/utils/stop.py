"""The stop signal as an exception: what SIGTERM/SIGINT raise where the work cannot poll a flag.

:class:`StopSignal` derives from ``BaseException``, as ``KeyboardInterrupt`` does, so that no
``except Exception`` (ours, or a library's that rewraps what it catches: an import hook, a
checker wrapped in ``except Exception: raise ConfigError(...)``) can catch it and turn a stop into a
false error. Catch it by name (``except StoppedBeforeStart``); an ``except BaseException`` that
cleans up must re-raise it.

Raised by ``trainer.loop._StopFlag`` (start-up work that polls nothing: model conversion,
reward-model training, the pre-flight), by ``trainer.setup.check_stop`` / ``wait_ready`` between and
during start-up phases, and by ``train.py``'s own handler while the config loads, before
``trainer.loop.train`` installs its handler. This module imports nothing, so ``train.py`` can
install that handler on its first line.
"""

from __future__ import annotations

__all__ = ["StopSignal", "StoppedBeforeStart"]


class StopSignal(BaseException):
    """A stop signal (SIGTERM/SIGINT) arrived; a ``BaseException``, so ``except Exception`` lets it by."""


class StoppedBeforeStart(StopSignal):
    """A stop signal arrived during start-up: the run stops before its first step (exit 0).

    Args:
        next_step: the step the run would have trained next (``start_step + 1``), or None when
            the stop came before the run folder was read (while the config loaded: nothing was
            written).
    """

    def __init__(self, next_step: int | None):
        super().__init__(f"stopped before step {next_step}" if next_step is not None
                         else "stopped before start-up (nothing was written)")
        self.next_step = next_step
