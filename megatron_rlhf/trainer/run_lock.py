"""One driver per run folder: an OS lock on ``<run>/run.lock``, held for the driver's life.

``fcntl.flock(LOCK_EX | LOCK_NB)`` on a file inside the run folder: the kernel releases it when the
holding process exits, however it dies (``kill -9``, OOM, node reboot of a local disk), so a stale
lock never blocks (there is no PID file to clean up). While held, the file records
``pid <PID> host <HOST> since <UTC time>``; a second driver on the folder stops at once with
:class:`RunLockedError` naming them (a requeued SLURM job whose old step still runs, two users with
one ``run.name``). On a clean release the file is emptied again, so a refused start leaves the
folder's bytes as they were. The lock is not inherited by processes this driver forks (the
descriptor is closed in every forked child; ``subprocess`` children never get it).

Network file systems: NFSv4 maps ``flock`` onto its byte-range locks (works across hosts); Lustre
needs the ``flock`` mount option; where locking is unsupported (``ENOLCK``, ``ENOSYS``,
``EOPNOTSUPP``) a warning is printed and the run goes on unlocked.

Sources: flock(2); the same single-writer lock as ``git``'s ``index.lock`` without its stale-file
problem (the kernel, not a file, holds it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

__all__ = ["RunLock", "RunLockedError", "LOCK_FILE", "hold_run_folder"]

LOCK_FILE = "run.lock"


class RunLockedError(RuntimeError):
    """Another live process holds the run folder's lock (the message names its PID and host)."""


_held: set = set()   # fds held by this process: closed in forked children (os.register_at_fork)


def _close_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLock:
    """The lock of one run folder (a context manager; re-entrant use is an error).

    Args:
        run_dir: the run folder (created if missing).
    Raises (from :meth:`acquire` / ``__enter__``):
        RunLockedError: another process holds it (names the PID, the host and since when).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.created_dir = self.created_file = False
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.created_dir = True
        self.created_file = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _same_file(fd, self.path):   # unlinked by a refused start meanwhile: lock the new one
                os.close(fd)
                return self.acquire()
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunLockedError(
                    f"the run folder {self.run_dir} is in use by another driver "
                    f"({holder or 'a process that has not written its PID yet'}; lock {self.path}): "
                    "wait for it to end or stop it, or pick another run.name") from None
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                print(f"[megatron-rlhf] warning: {self.path}: the file system does not support flock "
                      f"({e.strerror}); this run folder is not protected against a second driver",
                      file=sys.stderr, flush=True)
                return self
            raise
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} since {stamp}\n".encode(), 0)
        self._fd = fd
        _held.add(fd)
        return self

    def release(self) -> None:
        """Empty the file (no holder) and release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held.discard(fd)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)   # closing the last descriptor of the open file releases the flock

    def remove_if_created(self) -> None:
        """For a start refused before it wrote anything: remove the lock file if this lock created
        it, and the run folder if it created that and it is empty now (the folder is as it was)."""
        if self._fd is not None and self.created_file:
            try:
                self.path.unlink()
            except OSError:
                pass
        self.release()
        if self.created_dir:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold_run_folder(run_dir: str | os.PathLike, explain=None):
    """Hold :class:`RunLock` of ``run_dir`` for the block (the whole driver run).

    A :class:`~megatron_rlhf.config.ConfigError` out of the block (a refused start) removes what the
    lock created (the lock file, an empty run folder), so the folder is left as it was.

    Args:
        explain: called when the lock cannot be created, to raise the precise ``ConfigError``
            (``preflight.check_output_folder``: which key, which file is in the way).
    Raises:
        RunLockedError: another live process holds it.
        ConfigError: the run folder or its lock file cannot be created (a file in the way, an
            unwritable folder): names the path and ``run.name`` / ``run.output_dir``.
    """
    from megatron_rlhf.config import ConfigError

    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except OSError as e:
        if explain is not None:
            explain()
        raise ConfigError(f"config key 'run.name': cannot create the run folder {lock.run_dir} or its lock "
                          f"{lock.path}: {e.strerror or e} ({e.filename or lock.path}); move what is in the "
                          "way, or choose another run.name / a writable run.output_dir") from e
    try:
        yield lock
    except ConfigError:
        lock.remove_if_created()
        raise
    finally:
        lock.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
