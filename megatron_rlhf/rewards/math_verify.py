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

Answer extraction (:func:`extract_answer_text`): if the completion contains ``####``, only the
text after the LAST ``####`` is parsed (``"... 48/2 = 24 ... #### 72"`` -> 72); otherwise the
whole completion goes to math-verify, which prefers ``\\boxed{}`` and else takes the last number.
Gold answers may be numbers written as floats (``43.0``) or GSM8K solutions (text after ``####``).

Note for callers: the pool uses ``spawn``, which re-imports the caller's ``__main__`` module in
each worker: scripts must guard their entry point with ``if __name__ == "__main__":``.

Sources: math-verify README (github.com/huggingface/Math-Verify, "parse"/"verify", timeouts);
Python docs, ``concurrent.futures.ProcessPoolExecutor`` and ``signal.setitimer``.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from concurrent.futures.process import BrokenProcessPool

__all__ = ["MathVerifyReward", "extract_answer_text", "score_one"]


def extract_answer_text(completion: str) -> str:
    """The part of ``completion`` that holds its final answer: the text after the last ``####``
    when there is one (possibly empty), else the whole completion."""
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    return completion


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


def _worker_init() -> None:
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401  (pay the sympy import once per worker, not per item)


class MathVerifyReward:
    """Binary math-verify reward scored in a pool of worker processes.

    Args:
        num_workers: worker processes (>= 1); each costs one sympy import (~1-2 s at start).
        timeout_s: per-item time bound in seconds (> 0).
        grace_s: extra seconds the caller waits before declaring a worker stuck and killing it.

    Attributes:
        num_scored: items scored so far; num_timeouts: items that hit ``timeout_s`` (scored 0);
        num_errors: items whose scoring raised (scored 0); num_restarts: pool rebuilds.

    Raises:
        ValueError: ``num_workers < 1`` or ``timeout_s <= 0``.
    """

    binary = True
    """Rewards are 0/1: pairs are one correct vs one incorrect (``rollout.pairs.select_pair``)."""

    def __init__(self, num_workers: int = 1, timeout_s: float = 10.0, grace_s: float = 5.0):
        if num_workers < 1:
            raise ValueError(f"MathVerifyReward(num_workers={num_workers}): must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"MathVerifyReward(timeout_s={timeout_s}): must be > 0 seconds")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
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
        import sys

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
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(max_workers=self.num_workers,
                                                mp_context=mp.get_context("spawn"),
                                                initializer=_worker_init)
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
        errors). ``killed``: we killed a stuck worker, so the others' items are not at fault."""
        self.num_restarts += 1
        self._kill_pool()
        for fut, (i, _) in list(inflight.items()):
            if killed or tries[i] < 2:
                if killed:
                    tries[i] -= 1
                todo.insert(0, i)
            else:
                rewards[i] = 0.0
                self._count("error")
        inflight.clear()
