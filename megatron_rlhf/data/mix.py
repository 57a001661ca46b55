"""Exact per-batch task quotas for multi-task batches (math + chat in every batch).

Each batch must hold every task's trained pairs in proportion to its weight *exactly per batch*,
not only on average (issue 7). :func:`task_quotas` splits a batch size by the largest-remainder
(Hamilton) method: every task first gets the floor of its exact quota, and the seats left over go
to the largest fractional remainders. Arithmetic is exact (``fractions.Fraction`` of the float
weights), so e.g. 8 x (0.75, 0.25) is always (6, 2), never (5, 3) through rounding error.

Also here: :class:`MultiTaskSampler` (one seeded :class:`~megatron_rlhf.data.prompts.PromptSampler`
per task, resumable as a whole) and :func:`allocate_draws` (how many prompts of each task one
generation round draws, so that tasks whose prompts yield fewer trainable pairs are topped up),
with :func:`estimate_yield` for the smoothed pairs-per-prompt rate it needs.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from fractions import Fraction

from megatron_rlhf.data.prompts import PromptSampler
from megatron_rlhf.types import Prompt

__all__ = ["task_quotas", "allocate_draws", "estimate_yield", "MultiTaskSampler"]


def task_quotas(weights: dict[str, float], total: int) -> dict[str, int]:
    """Split ``total`` items among tasks in proportion to ``weights`` (largest-remainder rounding).

    Args:
        weights: task name -> non-negative finite weight (need not sum to 1; at least one > 0).
        total: number of items to split (pairs per batch), ``>= 0``.
    Returns:
        task name -> quota (int), same keys and order as ``weights``; quotas sum to ``total``, and
        each task's quota is the floor or the ceiling of its exact share ``total * w / sum(w)``
        (the quota property of Hamilton's method).
    Tie-break (deterministic): among equal remainders the larger weight wins, then the task name
        in ascending order -- independent of dict order.
    Raises:
        ValueError: ``weights`` is empty, a weight is negative/NaN/inf, all weights are 0, or
            ``total < 0``.
    Source: A. Hamilton's apportionment method (1792), a.k.a. largest remainder; Balinski & Young,
        "Fair Representation" (1982), ch. 2.
    """
    if not weights:
        raise ValueError("task_quotas: weights is empty; give at least one task (tasks[].weight)")
    if total < 0:
        raise ValueError(f"task_quotas: total={total}; must be >= 0")
    for name, w in weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
            raise ValueError(f"tasks[{name}].weight={w!r}: must be a finite number >= 0")
    exact = {k: Fraction(w) for k, w in weights.items()}
    s = sum(exact.values())
    if s == 0:
        raise ValueError(f"task_quotas: all weights are 0 ({weights}); at least one must be > 0")
    shares = {k: total * w / s for k, w in exact.items()}
    quotas = {k: math.floor(q) for k, q in shares.items()}
    left = total - sum(quotas.values())
    order = sorted(weights, key=lambda k: (-(shares[k] - quotas[k]), -exact[k], k))
    for k in order[:left]:
        quotas[k] += 1
    return quotas


def allocate_draws(remaining: dict[str, int], rates: dict[str, float], budget: int) -> dict[str, int]:
    """Prompts to draw per task in one generation round, topping up tasks with a low yield.

    A task that still needs ``remaining[t]`` trainable pairs (or groups) and yields about
    ``rates[t]`` of them per prompt needs ``need_t = remaining[t] / rates[t]`` prompts. The round's
    ``budget`` prompts are split in proportion to ``need_t`` over the tasks with ``remaining > 0``
    by largest remainder (:func:`task_quotas`)::

        draws_t = Hamilton(budget, weights = remaining_t / rate_t)      (0 for finished tasks)

    then every unfinished task gets at least one prompt: a task left at 0 takes one from the task
    with the most draws (ties: the task name in ascending order), repeated until none is 0. So a
    task whose samples arrive slower (lower rate) or that lags further behind (larger remaining)
    gets proportionally more prompts: the issue's "adaptive weighting".

    Args:
        remaining: task -> pairs (or groups) still needed this batch, ``>= 0``.
        rates: task -> expected trainable units per prompt, ``> 0`` and finite for every task with
            ``remaining > 0`` (others may be absent); smooth it, e.g. :func:`estimate_yield`.
        budget: prompts for this round (e.g. ``generators.prompts_per_request x num_workers``).
    Returns:
        task -> prompts to draw, same keys and order as ``remaining``; the sum is ``budget`` when
        ``budget >= `` the number of unfinished tasks, else exactly one per unfinished task; all 0
        when no task needs anything. Deterministic and independent of dict order (the split of the
        float needs is computed in ``fractions.Fraction``; ties as in :func:`task_quotas`).
    Raises:
        ValueError: a negative ``remaining`` or ``budget``, or a missing/non-positive/non-finite
            rate of an unfinished task (names the task).
    Example: remaining {math: 6, chat: 2}, rates {math: 0.5, chat: 1.0}, budget 14 -> need 12 and
        2 -> {math: 12, chat: 2}.
    """
    if budget < 0:
        raise ValueError(f"allocate_draws: budget={budget}; must be >= 0 prompts")
    for t, r in remaining.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"allocate_draws: remaining[{t!r}]={r!r}; must be an integer >= 0")
    active = [t for t, r in remaining.items() if r > 0]
    out = {t: 0 for t in remaining}
    if not active:
        return out
    need = {}
    for t in active:
        rate = rates.get(t)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"allocate_draws: rates[{t!r}]={rate!r}; task {t!r} still needs "
                             f"{remaining[t]} and needs a finite yield rate > 0 (use estimate_yield)")
        need[t] = float(Fraction(remaining[t]) / Fraction(rate))
    if budget <= len(active):
        out.update({t: 1 for t in active})
        return out
    quotas = task_quotas(need, budget)
    while True:
        starved = sorted(t for t in active if quotas[t] == 0)
        if not starved:
            break
        donor = max(sorted(active), key=lambda t: quotas[t])   # first name among the largest
        quotas[donor] -= 1
        quotas[starved[0]] += 1
    out.update(quotas)
    return out


def estimate_yield(units: int, prompts: int, *, prior: float = 0.5, strength: float = 2.0) -> float:
    """Smoothed trainable units per prompt: ``(units + prior * strength) / (prompts + strength)``.

    The observed rate ``units / prompts`` shrunk toward ``prior`` as if ``strength`` prompts with
    rate ``prior`` had been seen (a Beta-style prior, when units per prompt are 0/1 pairs), so a task
    that has yielded nothing yet still gets a finite, positive rate for :func:`allocate_draws`.

    Args:
        units: trainable pairs (or groups) obtained so far, ``>= 0``.
        prompts: prompts generated so far, ``>= 0``.
        prior: rate assumed before any data, ``> 0``.
        strength: weight of the prior in prompts, ``> 0``.
    Returns:
        A rate ``> 0`` (units per prompt).
    Raises:
        ValueError: negative counts or a non-positive prior/strength.
    """
    if units < 0 or prompts < 0 or not prior > 0 or not strength > 0:
        raise ValueError(f"estimate_yield(units={units}, prompts={prompts}, prior={prior}, strength={strength}): "
                         "need counts >= 0 and prior, strength > 0")
    return (units + prior * strength) / (prompts + strength)


def _task_seed(seed: int, task: str) -> int:
    """Stable per-task seed: the first 8 bytes of ``sha256(f"{seed}:{task}")`` (no ``hash()``
    randomisation, so a resumed process derives the same seed)."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{task}".encode()).digest()[:8], "big")


def _fingerprint(prompts: list[Prompt]) -> str:
    """sha256 (16 hex digits) over every prompt's index, token ids, answer and text, in order."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(f"{p.index}\x1f{p.answer}\x1f{p.text}\x1f".encode())
        h.update(array("q", p.token_ids).tobytes())
    return h.hexdigest()[:16]


class MultiTaskSampler:
    """One seeded :class:`PromptSampler` per task, with the task weights and quotas of a batch.

    Task ``t`` samples its own prompts without replacement, epoch by epoch, seeded with
    ``sha256(f"{seed}:{t}")`` (stable across processes and independent of the other tasks), so
    drawing more of one task never changes what another task draws next.

    Args:
        prompts_by_task: task name -> its prompts (each list non-empty; every prompt's ``task``
            should be that name). Order of the dict = task order.
        weights: task name -> weight (``tasks[].weight``; same names as ``prompts_by_task``).
        seed: ``run.seed``.
    Raises:
        ValueError: no task, a task without prompts, the names of the two dicts differ, or bad
            weights (see :func:`task_quotas`).
    """

    def __init__(self, prompts_by_task: dict[str, list[Prompt]], weights: dict[str, float], seed: int):
        if not prompts_by_task:
            raise ValueError("MultiTaskSampler: no task given (tasks[] is empty)")
        if set(prompts_by_task) != set(weights):
            raise ValueError(f"MultiTaskSampler: prompt tasks {sorted(prompts_by_task)} and weight tasks "
                             f"{sorted(weights)} differ")
        empty = [t for t, ps in prompts_by_task.items() if not ps]
        if empty:
            raise ValueError(f"MultiTaskSampler: tasks {empty} have no prompts (check tasks[].data)")
        task_quotas(dict(weights), 0)  # validates the weights
        self.seed = int(seed)
        self._weights = {t: float(weights[t]) for t in prompts_by_task}
        self._samplers = {t: PromptSampler(ps, seed=_task_seed(self.seed, t)) for t, ps in prompts_by_task.items()}
        self._fingerprints = {t: _fingerprint(s.prompts) for t, s in self._samplers.items()}

    @property
    def tasks(self) -> list[str]:
        """Task names in config order."""
        return list(self._samplers)

    @property
    def weights(self) -> dict[str, float]:
        """Task name -> weight (a copy)."""
        return dict(self._weights)

    @property
    def epochs(self) -> dict[str, int]:
        """Task name -> its current epoch (0-based: full passes over the task's prompts so far)."""
        return {t: s.epoch for t, s in self._samplers.items()}

    @property
    def epoch(self) -> int:
        """The largest task epoch (the task that has cycled most; see :attr:`epochs`)."""
        return max(self.epochs.values())

    def prompts(self, task: str) -> list[Prompt]:
        """All prompts of ``task`` (a copy). Raises KeyError for an unknown task."""
        return list(self._sampler(task).prompts)

    def quotas(self, total: int) -> dict[str, int]:
        """Per-task share of ``total`` items by weight (:func:`task_quotas`, largest remainder)."""
        return task_quotas(self._weights, total)

    def next(self, task: str, k: int) -> list[Prompt]:
        """The next ``k >= 0`` prompts of ``task`` (may cross into its next epoch).

        Raises:
            KeyError: unknown task (the message lists the tasks).
            ValueError: ``k < 0``.
        """
        return self._sampler(task).next(k)

    def state_dict(self) -> dict:
        """``{"seed", "tasks": {task: {"epoch", "offset", "num_prompts", "seed", "fingerprint"}}}``
        (plain ints and strings: ``json.dumps``-able)."""
        return {"seed": self.seed,
                "tasks": {t: {**s.state_dict(), "fingerprint": self._fingerprints[t]}
                          for t, s in self._samplers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Resume every task at its saved position (from :meth:`state_dict`).

        Raises:
            ValueError: the saved task set differs, a task's prompts changed (count, order, text,
                answers or token ids: the fingerprint differs), the seed differs, or a position is
                invalid. Nothing is changed then.
        """
        if not isinstance(state, dict) or not isinstance(state.get("tasks"), dict) or "seed" not in state:
            raise ValueError("MultiTaskSampler.load_state_dict: expected {'seed', 'tasks': {...}} from state_dict()")
        if set(state["tasks"]) != set(self._samplers):
            raise ValueError(f"MultiTaskSampler.load_state_dict: saved tasks {sorted(state['tasks'])} but this "
                             f"run has {sorted(self._samplers)}; resume with the same tasks[]")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"MultiTaskSampler.load_state_dict: saved with seed {state['seed']}, this run has "
                             f"run.seed {self.seed}")
        for t, st in state["tasks"].items():
            if st.get("fingerprint") != self._fingerprints[t]:
                raise ValueError(f"MultiTaskSampler.load_state_dict: the prompts of task {t!r} changed since the "
                                 f"checkpoint (saved {st.get('num_prompts')} prompts, fingerprint "
                                 f"{st.get('fingerprint')}; now {len(self._samplers[t].prompts)}, "
                                 f"{self._fingerprints[t]}): resume with the same tasks[{t}].data, tokenizer "
                                 "and max prompt length")
        staged = {}
        for t, st in state["tasks"].items():  # validate all before changing any
            s = PromptSampler(self._samplers[t].prompts, seed=self._samplers[t].seed)
            s.load_state_dict({k: st[k] for k in ("seed", "epoch", "offset", "num_prompts")})
            staged[t] = s
        self._samplers.update(staged)

    def _sampler(self, task: str) -> PromptSampler:
        if task not in self._samplers:
            raise KeyError(f"MultiTaskSampler: unknown task {task!r}; tasks are {self.tasks}")
        return self._samplers[task]
