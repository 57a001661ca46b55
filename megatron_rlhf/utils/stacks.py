"""Stack dumps on a signal, for the hang watchdog (``trainer.watchdog``): every process of a run
(each Ray worker through Ray's ``worker_process_setup_hook``, each math-verify pool worker through
its pool initializer) registers ``faulthandler`` on SIGUSR2, writing to
``<folder>/<host>-<pid>.txt``; the watchdog signals them and reads the new text back.

Sources: Python docs, ``faulthandler.register``; Ray docs, "runtime_env" (``worker_process_setup_hook``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
from pathlib import Path

__all__ = ["register_stack_dump", "STACKS_ENV", "STACK_SIGNAL"]

STACKS_ENV = "MRLHF_STACKS_DIR"
STACK_SIGNAL = signal.SIGUSR2
_stack_file = None   # kept open for faulthandler (it writes to the file descriptor)


def register_stack_dump(folder: str | os.PathLike | None = None) -> None:
    """In this process, make SIGUSR2 dump every thread's stack to ``<folder>/<host>-<pid>.txt``.

    ``folder``: default ``$MRLHF_STACKS_DIR`` (how Ray workers get it); nothing happens when both
    are unset. Called with no argument it is the Ray ``worker_process_setup_hook``.
    """
    global _stack_file
    folder = folder or os.environ.get(STACKS_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    _stack_file = open(Path(folder) / f"{socket.gethostname()}-{os.getpid()}.txt", "a")
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
