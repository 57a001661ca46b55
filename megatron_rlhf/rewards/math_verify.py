"""Binary math reward: 1.0 when the completion's final answer equals the gold answer.

Checked with math-verify 0.9.0 (Hugging Face, ``parse`` + ``verify``: numbers, ``1,000``,
fractions vs decimals, ``\\boxed{}``, LaTeX). math-verify bounds its own work with
``signal.alarm``, which only works in a process's main thread: called from a thread it raises,
and runs have shipped where every reward silently became 0. So scoring runs in worker processes
(``concurrent.futures.ProcessPoolExecutor``, ``spawn`` context), each item bounded twice:

1. inside the worker, our own ``SIGALRM`` timer (``timeout_s``) around parse + verify (math-verify's
   internal alarms are disabled so they cannot cancel ours);
2. in the caller, a wall-clock wait of ``timeout_s + grace_s``; a worker stuck past it (in C code a
   signal cannot interrupt) is killed with the pool, the pool is rebuilt and the items that were
   in flight beside it are resubmitted.

A timed-out item scores 0.0 and adds to ``num_timeouts``; an item whose scoring raised scores 0.0
and adds to ``num_errors``; a dead worker (``BrokenProcessPool``) rebuilds the pool
(``num_restarts``) and its items are retried once.

Answer extraction (:func:`extract_answer_text`), in this order, so the rule is predictable:

1. ``####`` present: the first non-empty line after the LAST ``####`` (``"... 48/2 = 24 ...
   #### 72"`` -> ``"72"``; ``"#### 72 clips"`` -> ``"72 clips"``, which math-verify reads as 72);
2. else ``\\boxed{`` present: the text from the last ``\\boxed{`` on (LaTeX: fractions, roots);
3. else the last plain number in the text (``"so the total is 72 clips."`` -> ``"72"``).

Rule 3 replaces math-verify's free-text extraction, which on rambling sampled text picked
numbers from the middle (``"... 5 variables ..."``) or evaluated stray expressions (``"6/3."``
-> 2): measured on SmolLM2-135M samples, most "correct" free-text scores were such accidents.
Gold answers may be numbers written as floats (``43.0``) or GSM8K solutions (text after ``####``).

Note for callers: the pool uses ``spawn``, which re-imports the caller's ``__main__`` module in
each worker: scripts must guard their entry point with ``if __name__ == "__main__":``.

Sources: math-verify README (github.com/huggingface/Math-Verify, "parse"/"verify", timeouts);
Python docs, ``concurrent.futures.ProcessPoolExecutor`` and ``signal.setitimer``.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import re
import sys
import time
from concurrent.futures.process import BrokenProcessPool

__all__ = ["MathVerifyReward", "default_num_workers", "extract_answer_text", "score_one"]


_NUMBER = re.compile(r"(?<![A-Za-z])-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_answer_text(completion: str) -> str:
    """The part of ``completion`` that holds its final answer (``""`` when there is none).

    1. text after the last ``####``: its first non-empty line;
    2. else, with ``\\boxed{``: the completion from the last ``\\boxed{`` on;
    3. else the last number (``-?\\d+(,ddd)*(.d+)?`` not glued to a preceding letter, so
       ``"x2"`` is no number and ``"GL-3"`` gives ``3``).
    """
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1]
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        return lines[0] if lines else ""
    k = completion.rfind("\\boxed{")
    if k >= 0:
        return completion[k:]
    matches = list(_NUMBER.finditer(completion))
    if not matches:
        return ""
    m = matches[-1]
    num = m.group(0)
    if num.startswith("-") and m.start() > 0 and completion[m.start() - 1].isalnum():
        num = num[1:]
    return num


def _normalise_gold(answer: str) -> str:
    return str(answer).rsplit("####", 1)[-1].strip()


def score_one(completion: str, answer: str, timeout_s: float | None = None) -> tuple[float, str]:
    """Score one completion in THIS process (must be a main thread when ``timeout_s`` is set).

    Args:
        completion: the model's text.
        answer: gold answer text (``"72"``, ``"43.0"``, ``"1/2"``, or a GSM8K solution).
        timeout_s: wall-clock bound (seconds) via ``SIGALRM``; ``None`` = unbounded.
    Returns:
        ``(reward, status)``: reward 1.0 or 0.0; status ``"ok"`` or ``"timeout"``.
    Raises:
        whatever math-verify raises on input it cannot handle (the pool counts it as an error).
    """
    import signal

    from math_verify import parse, verify

    class _Timeout(Exception):
        pass

    def handler(signum, frame):
        raise _Timeout()

    old = None
    if timeout_s:
        old = signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        gold = parse(_normalise_gold(answer), parsing_timeout=None)
        text = extract_answer_text(completion)
        if not gold or not text:
            return 0.0, "ok"
        pred = parse(text, parsing_timeout=None)
        if not pred:
            return 0.0, "ok"
        return (1.0 if verify(gold, pred, timeout_seconds=None) else 0.0), "ok"
    except _Timeout:
        return 0.0, "timeout"
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def default_num_workers(configured: int = 0, cores: int | None = None) -> int:
    """Pool size for ``rewards.math_verify_workers = configured``: ``configured`` when > 0, else
    ``min(32, cores - 1)``, at least 1, with ``cores`` the cores this process may run on
    (``os.sched_getaffinity``, which a SLURM step or container narrows; ``os.cpu_count()`` where
    the OS has no affinity). One core is left for the driver, which also runs the rollout
    producer; 32 bounds the sympy import each worker pays at start (~1-2 s, ~100 MiB each). About
    4k completions a step at ~5 ms each take ~20 s on one worker (gpu-path-review C4) and under a
    second on 32. ``bench/rewards.py`` measures the scaling."""
    if configured > 0:
        return int(configured)
    if cores is None:
        from megatron_rlhf.runtime import usable_cores

        cores = usable_cores()
    return max(1, min(32, int(cores) - 1))


def _ready(hold_s: float) -> int:
    time.sleep(hold_s)
    return os.getpid()


def _worker_init(stacks_dir: str | None = None) -> None:
    import logging

    from megatron_rlhf.runtime import ignore_stop_signals
    from megatron_rlhf.utils.stacks import register_stack_dump

    ignore_stop_signals()   # a signal to the driver's process group: the driver stops the pool itself
    if stacks_dir:   # the hang watchdog's stack dump reaches this worker too (trainer.watchdog)
        register_stack_dump(stacks_dir)

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401  (pay the sympy import once per worker, not per item)


class MathVerifyReward:
    """Binary math-verify reward scored in a pool of worker processes.

    One item is in flight per worker (submitted = started), so each item's deadline measures its
    own scoring; the cost is one IPC round trip per item between two items of a worker, which
    ``bench/rewards.py`` measures against in-process scoring (``pool/in-process`` row). The run
    sizes the pool with :func:`default_num_workers` (``rewards.math_verify_workers``).

    Args:
        num_workers: worker processes (>= 1); each costs one sympy import (~1-2 s at start).
        timeout_s: per-item time bound in seconds (> 0).
        grace_s: extra seconds the caller waits before declaring a worker stuck and killing it.
        startup_timeout_s: how long a (re)started pool may take until all workers are ready.
        stacks_dir: where each worker registers its stack dump for the hang watchdog
            (``utils.stacks.register_stack_dump``; the run's ``logs/stacks-*/``); None: no dump.

    Attributes:
        num_scored: items scored so far; num_timeouts: items that hit ``timeout_s`` (scored 0);
        num_errors: items whose scoring raised (scored 0); num_restarts: pool rebuilds.

    Raises:
        ValueError: ``num_workers < 1`` or ``timeout_s <= 0``.
    """

    binary = True
    """Rewards are 0/1: pairs are one correct vs one incorrect (``rollout.pairs.select_pair``)."""

    def __init__(self, num_workers: int = 1, timeout_s: float = 10.0, grace_s: float = 5.0,
                 startup_timeout_s: float = 300.0, stacks_dir: str | os.PathLike | None = None):
        if num_workers < 1:
            raise ValueError(f"MathVerifyReward(num_workers={num_workers}): must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"MathVerifyReward(timeout_s={timeout_s}): must be > 0 seconds")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.stacks_dir = str(stacks_dir) if stacks_dir else None
        self.num_scored = self.num_timeouts = self.num_errors = self.num_restarts = 0
        self._pool: cf.ProcessPoolExecutor | None = None

    # ------------------------------------------------------------------------------ verbs
    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        """Score completions against gold answers (same length, item i with item i).

        Safe to call from any thread (the work happens in worker processes).

        Returns:
            ``[len(completions)]`` floats, 1.0 correct / 0.0 otherwise (also 0.0 on timeout/error).
        Raises:
            ValueError: the two lists differ in length.
            RuntimeError: the worker processes did not start within ``startup_timeout_s``.
        """
        if len(completions) != len(answers):
            raise ValueError(f"MathVerifyReward: {len(completions)} completions but {len(answers)} "
                             "answers; pass one gold answer per completion")
        n = len(completions)
        rewards = [0.0] * n
        todo = list(range(n))  # items not yet submitted, in order
        tries = [0] * n
        inflight: dict[cf.Future, tuple[int, float]] = {}  # future -> (item, deadline)
        while todo or inflight:
            pool = self._ensure_pool()
            try:
                while todo and len(inflight) < self.num_workers:  # <= one item per worker:
                    i = todo.pop(0)                              # submitted = started
                    tries[i] += 1
                    fut = pool.submit(score_one, str(completions[i]), str(answers[i]), self.timeout_s)
                    inflight[fut] = (i, time.monotonic() + self.timeout_s + self.grace_s)
            except BrokenProcessPool:
                todo.insert(0, i)
                tries[i] -= 1
                self._restart(inflight, todo, tries, rewards)
                continue
            wait_s = max(0.0, min(d for _, d in inflight.values()) - time.monotonic())
            done, _ = cf.wait(list(inflight), timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                i, _ = inflight.pop(fut)
                try:
                    r, status = fut.result()
                except BrokenProcessPool:
                    inflight[fut] = (i, 0.0)
                    broken = True
                    continue
                except Exception:
                    r, status = 0.0, "error"
                rewards[i] = r
                self._count(status)
            if broken:
                self._restart(inflight, todo, tries, rewards)
                continue
            now = time.monotonic()
            stuck = [f for f, (_, d) in inflight.items() if d <= now and not f.done()]
            if stuck:
                for f in stuck:
                    i, _ = inflight.pop(f)
                    rewards[i] = 0.0
                    self._count("timeout")
                self._restart(inflight, todo, tries, rewards, killed=True)
        return rewards

    def close(self) -> None:
        """Stop the worker processes (idempotent; the next call starts a new pool)."""
        if self._pool is not None:
            self._kill_pool()

    def stats(self) -> dict:
        """Counters with namespaced keys: ``reward/scored``, ``reward/timeouts``,
        ``reward/errors``, ``reward/pool_restarts``."""
        return {"reward/scored": self.num_scored, "reward/timeouts": self.num_timeouts,
                "reward/errors": self.num_errors, "reward/pool_restarts": self.num_restarts}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if sys.is_finalizing():  # concurrent.futures' own exit hook stops the workers then
            return
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------ pool
    def _count(self, status: str) -> None:
        self.num_scored += 1
        if status == "timeout":
            self.num_timeouts += 1
        elif status == "error":
            self.num_errors += 1

    def _ensure_pool(self) -> cf.ProcessPoolExecutor:
        """Start the pool and wait until every worker has imported math-verify, so per-item
        deadlines measure scoring, not process start-up (seconds on a loaded machine)."""
        if self._pool is None:
            pool = cf.ProcessPoolExecutor(max_workers=self.num_workers,
                                          mp_context=mp.get_context("spawn"),
                                          initializer=_worker_init, initargs=(self.stacks_dir,))
            # each ready-task holds its worker briefly, so every submit spawns a new worker
            futs = [pool.submit(_ready, 0.2) for _ in range(self.num_workers)]
            try:
                for f in futs:
                    f.result(timeout=self.startup_timeout_s)
            except Exception as e:
                self._pool = pool
                self._kill_pool()
                raise RuntimeError(f"MathVerifyReward: worker processes did not start within "
                                   f"{self.startup_timeout_s:.0f} s ({e!r}); is the machine "
                                   "overloaded, or does the main script lack an "
                                   "'if __name__ == \"__main__\":' guard (spawn)?") from e
            self._pool = pool
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if hasattr(pool, "kill_workers"):  # Python >= 3.14
            pool.kill_workers()
        else:  # Python 3.11-3.13: no public API to stop a busy worker
            for p in list((getattr(pool, "_processes", None) or {}).values()):
                if p.is_alive():
                    p.kill()
        pool.shutdown(wait=True, cancel_futures=True)

    def _restart(self, inflight: dict, todo: list, tries: list, rewards: list, killed: bool = False) -> None:
        """Rebuild the pool; in-flight items go back to the queue (retried once, then scored 0 as
        errors). ``killed``: we killed a stuck worker, so the others' items are not at fault. One
        line on stderr says so (a recovery: ``recovery/reward_worker_restarts``)."""
        self.num_restarts += 1
        self._kill_pool()
        print(f"[megatron-rlhf] WARNING math-verify: "
              f"{'an item ran past timeout_s, its worker was killed' if killed else 'a worker process died'}; "
              f"the worker pool is rebuilt (restart {self.num_restarts}) and {len(inflight)} items in flight "
              "are scored again", file=sys.stderr, flush=True)
        for fut, (i, _) in list(inflight.items()):
            if killed or tries[i] < 2:
                if killed:
                    tries[i] -= 1
                todo.insert(0, i)
            else:
                rewards[i] = 0.0
                self._count("error")
        inflight.clear()
