"""Hang watchdog: when a step takes far longer than usual, say where every process is stuck.

Cluster recipes wait up to ``async.timeout_s`` (3600 s) for a step; a run that hangs (a collective
that never completes, an engine that stopped answering) would otherwise sit silent for that long
with idle GPUs (NeMo-RL #2717, prime-rl #1713). :class:`HangWatchdog` is a driver thread: when the
current step has run longer than ``async.watchdog_factor`` times the median of the finished steps
(at least ``async.watchdog_min_steps`` of them), it logs, once per step:

* which remote calls are pending (the learner call the loop waits on, each generator request in
  flight, what the rollout producer is doing), from :meth:`Run.pending_calls`;
* the Python stack of every thread of every Ray worker process of the run, of the driver's
  math-verify pool workers and of the driver (:func:`dump_actor_stacks`: ``faulthandler``
  registered on SIGUSR2 in each process, by the Ray ``worker_process_setup_hook`` or the pool's
  initializer, :func:`~megatron_rlhf.utils.stacks.register_stack_dump`, which writes to
  ``<run>/logs/stacks-*/<host>-<pid>.txt``);

and then lets the run go on waiting until ``async.timeout_s``.

Sources: Python docs, ``faulthandler.register`` / ``dump_traceback``; Ray docs, "runtime_env"
(``worker_process_setup_hook``) and ``NodeAffinitySchedulingStrategy``.
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from megatron_rlhf.utils.stacks import STACK_SIGNAL, STACKS_ENV, register_stack_dump

__all__ = ["HangWatchdog", "register_stack_dump", "dump_actor_stacks", "prune_empty_stack_files", "STACKS_ENV",
           "STACK_SIGNAL"]



def prune_empty_stack_files(folder) -> int:
    """Remove the stack files of ``folder`` that no dump ever wrote to (each worker opens one at
    start, :func:`register_stack_dump`), and ``folder`` itself when nothing is left; returns the
    files removed. A run calls it at its end, so ``logs/`` keeps only real dumps."""
    if not folder or not Path(folder).is_dir():
        return 0
    removed = 0
    for f in Path(folder).glob("*.txt"):
        try:
            if f.stat().st_size == 0:
                f.unlink()
                removed += 1
        except OSError:
            pass
    try:
        Path(folder).rmdir()   # only when empty
    except OSError:
        pass
    return removed


def _process_title(pid: int) -> str | None:
    """What ``pid`` is, when it is a process of this run: ``"Ray worker"`` (its title starts with
    ``ray::``) or ``"math-verify worker"`` (a ``multiprocessing`` child of this process); ``None``
    otherwise, so a recycled PID of another program is never signalled. ``"process"`` where
    ``/proc`` is missing."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if cmdline.startswith(b"ray::"):
            return "Ray worker"
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"multiprocessing" in cmdline:
            return "math-verify worker"
        return None
    except FileNotFoundError:
        return None if Path("/proc/self").exists() else "process"
    except (OSError, ValueError, IndexError):
        return None


def _signal_local(folder: str, host: str) -> list[int]:
    """SIGUSR2 to every live process of the run on ``host`` listed in ``folder`` (Ray workers,
    and the math-verify pool workers when this is the driver); returns their PIDs."""
    sent = []
    for f in Path(folder).glob(f"{host}-*.txt"):
        pid = int(f.stem.rsplit("-", 1)[1])
        if _process_title(pid) is None:
            continue
        try:
            os.kill(pid, STACK_SIGNAL)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return sent


def dump_actor_stacks(folder: str | os.PathLike, wait_s: float = 2.0, timeout_s: float = 30.0) -> str:
    """Every Ray worker's stacks (all threads), the driver's math-verify pool workers' and the
    driver's, as one text.

    Processes of this host are signalled directly; on every other node of the cluster a one-CPU-free
    Ray task pinned to that node signals its workers. Each worker's new output is read back from
    its file in ``folder`` after ``wait_s`` seconds.
    """
    import ray

    folder = str(folder)
    sizes = {f: f.stat().st_size for f in Path(folder).glob("*.txt")}
    host = socket.gethostname()
    _signal_local(folder, host)
    try:
        if not ray.is_initialized():   # no cluster (a driver-side wait): the driver's stacks only
            raise LookupError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = ray.remote(num_cpus=0)(_signal_local)
        refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(folder, n["NodeManagerHostname"])
                for n in ray.nodes() if n["Alive"] and n["NodeManagerHostname"] != host]
        ray.get(refs, timeout=timeout_s)
    except LookupError:
        pass
    except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the run
        print(f"[megatron-rlhf] watchdog: could not signal other nodes ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
    time.sleep(wait_s)
    parts = []
    for f in sorted(Path(folder).glob("*.txt")):
        with open(f, "rb") as fh:
            fh.seek(sizes.get(f, 0))
            new = fh.read().decode(errors="replace").strip()
        if new:
            title = "Ray worker"
            if f.stem.startswith(f"{host}-"):
                title = _process_title(int(f.stem.rsplit("-", 1)[1])) or "process (exited)"
            parts.append(f"--- {title} {f.stem} ---\n{new}")
    buf = io.StringIO()
    try:
        faulthandler.dump_traceback(file=buf, all_threads=True)
    except (ValueError, io.UnsupportedOperation):   # needs a real file descriptor
        import tempfile

        with tempfile.TemporaryFile("w+") as tmp:
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            buf.write(tmp.read())
    parts.append(f"--- driver {host}-{os.getpid()} ---\n{buf.getvalue().strip()}")
    return "\n".join(parts)


class HangWatchdog:
    """A driver thread that reports a step taking more than ``factor`` x the median step.

    Args:
        factor: k (``async.watchdog_factor``); 0 turns the watchdog off.
        min_steps: finished steps needed before the median counts (``async.watchdog_min_steps``).
        pending_calls: returns the remote calls in flight, one line each.
        dump_stacks: returns the stacks of every process (``dump_actor_stacks``).
        log: where the report goes (the driver's log).
        poll_s: how often the thread looks.
    """

    def __init__(self, *, factor: float, min_steps: int, pending_calls: Callable[[], list[str]],
                 dump_stacks: Callable[[], str], log: Callable[[str], None], poll_s: float = 1.0):
        self.factor, self.min_steps, self.poll_s = float(factor), int(min_steps), float(poll_s)
        self.pending_calls, self.dump_stacks, self.log = pending_calls, dump_stacks, log
        self.durations: list[float] = []
        self.fired_steps: list[int] = []
        self._step: int | None = None
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.factor > 0:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def start_step(self, step: int) -> None:
        """Step ``step`` (1-based) begins now."""
        with self._lock:
            self._step, self._t0 = step, time.monotonic()

    def end_step(self) -> None:
        """The current step finished: its duration joins the median."""
        with self._lock:
            if self._step is not None:
                self.durations.append(time.monotonic() - self._t0)
            self._step = None

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check(self) -> bool:
        """Report now if the current step is overdue and not reported yet; returns whether it did."""
        with self._lock:
            step, t0, done = self._step, self._t0, list(self.durations)
        if step is None or len(done) < self.min_steps or step in self.fired_steps:
            return False
        median = statistics.median(done)
        elapsed = time.monotonic() - t0
        if elapsed <= self.factor * median:
            return False
        self.fired_steps.append(step)
        calls = self.pending_calls() or ["(none tracked)"]
        self.log(f"[megatron-rlhf] HANG WATCHDOG: step {step} has run {elapsed:.0f} s, more than "
                 f"async.watchdog_factor={self.factor:g} x the median step ({median:.1f} s over {len(done)} "
                 f"steps); still waiting (until async.timeout_s). Pending remote calls:\n  "
                 + "\n  ".join(calls))
        try:
            stacks = self.dump_stacks()
        except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the run
            stacks = f"(stack dump failed: {type(e).__name__}: {e})"
        self.log(f"[megatron-rlhf] HANG WATCHDOG: Python stacks of every process (step {step}):\n{stacks}")
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001
                self.log(f"[megatron-rlhf] watchdog error: {type(e).__name__}: {e}")
