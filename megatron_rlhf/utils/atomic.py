"""Atomic file writes: every file a run writes goes through here (or, for whole folders such as a
checkpoint or ``hf_final``, is written into a temporary sibling folder that is renamed at the end).

A file is written to ``.<name>.tmp-<pid>`` in the same folder, flushed and ``fsync``-ed, then
``os.replace``-d onto its name and the folder is ``fsync``-ed: a reader sees the old file or the
new one, never a torn one, also after a crash or a power loss (rename(2) within one file system is
atomic; the fsyncs make it durable; the pattern of ``torch.distributed.checkpoint``'s
``FileSystemWriter`` and of ``safetensors``' users). A failed write removes its temporary file and
raises :class:`AtomicWriteError` naming the path and the cause ("no space left on device",
"read-only file system", ...); the old file, if any, is untouched.

Exceptions, by design: append-only logs (``metrics.jsonl`` rows, whose torn last line the resume
moves aside; ``logs/``), and TensorBoard's and wandb's own files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["AtomicWriteError", "write_error", "atomic_open", "write_bytes", "write_text", "write_json", "fsync_dir",
           "fsync_file", "move_aside"]


class AtomicWriteError(OSError):
    """A file could not be written; the message names the path and the cause (nothing was
    changed: the old file, if any, is intact, and no temporary file is left)."""


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "no space left on device: free space, or set run.output_dir to a larger disk"
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        return "read-only file system: set run.output_dir to a writable folder"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied: make the folder writable, or set another run.output_dir"
    if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:
        return "file name too long: choose a shorter run.name or run.output_dir"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def _os_error_of(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: ``e`` itself, its ``__cause__`` / ``__context__``, or one
    rebuilt from a message ending in ``(os error N)`` (``safetensors``' ``SafetensorError: Error
    while serializing: I/O error: No space left on device (os error 28)``)."""
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        m = re.search(r"os error (\d+)\)", str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def write_error(path: str | os.PathLike, e: BaseException) -> AtomicWriteError:
    """The :class:`AtomicWriteError` for a failed write of ``path`` (a file or a folder another
    library writes: ``safetensors``, ``torch.save``): one line naming the path, the cause and the
    fix (no space, read-only, permission, name too long). Raise it ``from e``.

    Args:
        path: what was being written.
        e: the error (an ``OSError``, or e.g. a ``SafetensorError`` naming an OS error).
    """
    if isinstance(e, AtomicWriteError):
        return e
    os_err = _os_error_of(e)
    cause = _describe(os_err if os_err is not None else e)
    return AtomicWriteError(os_err.errno if os_err is not None else None, f"cannot write {path}: {cause}",
                            str(path))


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a folder (makes a rename inside it durable); best effort (some file systems
    refuse ``open`` of a folder)."""
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


def fsync_file(path: str | os.PathLike) -> None:
    """``fsync`` an already written file (a file another library wrote, e.g. ``torch.save``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, opener=None, **kw) -> Iterator[IO]:
    """``with atomic_open(path, "w") as f: f.write(...)``: ``f`` is a temporary file in ``path``'s
    folder, renamed onto ``path`` when the block ends without an error (removed otherwise).

    Args:
        path: the final file.
        mode: ``"w"`` / ``"wt"`` (text) or ``"wb"``.
        opener: ``callable(tmp_path, mode, **kw)`` returning a file object to write through instead
            of ``open`` (e.g. ``gzip.open``); it is closed before the fsync.
    Raises:
        AtomicWriteError: the folder or the file could not be written (path and cause named).
    """
    if mode not in ("w", "wt", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r}; use 'w', 'wt' or 'wb'")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = (opener or open)(tmp, mode, **kw)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise AtomicWriteError(e.errno, f"cannot write {path}: {_describe(e)}", str(path)) from e
    try:
        with f:
            yield f
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, AtomicWriteError):
            raise AtomicWriteError(e.errno, f"cannot write {path}: {_describe(e)}", str(path)) from e
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module doc); returns ``path``.

    Raises:
        AtomicWriteError: names the path and the cause.
    """
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``.

    Raises:
        AtomicWriteError: names the path and the cause.
    """
    return write_bytes(path, text.encode(encoding))


def write_json(path: str | os.PathLike, obj: Any, **dump_kw) -> Path:
    """``json.dumps(obj, **dump_kw)`` written to ``path`` atomically; returns ``path``.

    Raises:
        AtomicWriteError: names the path and the cause.
        TypeError / ValueError: ``obj`` is not JSON-serialisable (nothing is written).
    """
    return write_text(path, json.dumps(obj, **dump_kw))


def move_aside(path: str | os.PathLike) -> Path:
    """Rename a damaged file or folder ``path`` to ``<name>.damaged-<UTC time>`` (``-2``, ``-3``, ...
    when taken) in the same folder, never deleting it, and make the rename durable; returns the
    new path (a checkpoint moved aside is no checkpoint for resume or rotation any more).

    Raises:
        AtomicWriteError: the rename failed (path and cause named).
    """
    import time

    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    try:
        os.rename(path, dest)
    except OSError as e:
        raise AtomicWriteError(e.errno, f"cannot move {path} aside: {_describe(e)}", str(path)) from e
    fsync_dir(path.parent)
    return dest
