"""Progress bars that stay readable in a log: a tqdm bar on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with carriage returns; written to ``> train.log``, a SLURM log or a
pipe, every redraw piles up on one physical line (a fresh-user finding, sessions 10-11). Off a
terminal :func:`progress` returns a :class:`LineProgress` instead: one
``[megatron-rlhf] <desc>: 1,234/5,678 tok (22%, 45 s)`` line at most every ``every_s`` seconds and
one at the end.
"""

from __future__ import annotations

import sys
import time

__all__ = ["LineProgress", "progress"]


class LineProgress:
    """A tqdm-like counter (``update``, ``close``, a context manager) printing plain lines.

    Args:
        total: units in all (``None``: unknown, the line shows the count only).
        desc: what is counted (``features``, ``hf->megatron``).
        unit: the unit's name (``tok``, ``tensor``).
        stream: where lines go (default ``sys.stderr``).
        every_s: the least seconds between two lines (the last line is always written).
        enabled: false for no output at all.
    """

    def __init__(self, total: int | None, desc: str, unit: str, *, stream=None, every_s: float = 30.0,
                 enabled: bool = True):
        self.total, self.desc, self.unit, self.every_s, self.enabled = total, desc, unit, every_s, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.t0 = 0, time.perf_counter()
        self._last = self.t0
        self._closed = False

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        done = f"{self.n:,}/{self.total:,} {self.unit}" if self.total else f"{self.n:,} {self.unit}"
        pct = f"{100.0 * self.n / self.total:.0f}%, " if self.total else ""
        return f"[megatron-rlhf] {self.desc}: {done} ({pct}{elapsed:.0f} s)"

    def update(self, n: int = 1) -> None:
        """``n`` more units done; a line when ``every_s`` has passed since the last one."""
        self.n += n
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.every_s:
            self._last = now
            print(self._line(), file=self.stream, flush=True)

    def close(self) -> None:
        """The final line (once; nothing when no unit was counted)."""
        if self.enabled and not self._closed and self.n:
            print(self._line(), file=self.stream, flush=True)
        self._closed = True

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str, *, enabled: bool = True, stream=None,
             every_s: float = 30.0):
    """A tqdm bar when ``stream`` (default ``sys.stderr``) is a terminal, else a :class:`LineProgress`.

    Both have ``update(n)``, ``close()`` and work as context managers.
    """
    stream = stream if stream is not None else sys.stderr
    if bool(getattr(stream, "isatty", lambda: False)()):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not enabled, dynamic_ncols=True)
    return LineProgress(total, desc, unit, stream=stream, every_s=every_s, enabled=enabled)
