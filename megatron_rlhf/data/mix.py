"""Exact per-batch task quotas for multi-task batches (math + chat in every batch).

Each batch must hold every task's trained pairs in proportion to its weight *exactly per batch*,
not only on average (issue 7). :func:`task_quotas` splits a batch size by the largest-remainder
(Hamilton) method: every task first gets the floor of its exact quota, and the seats left over go
to the largest fractional remainders. Arithmetic is exact (``fractions.Fraction`` of the float
weights), so e.g. 8 x (0.75, 0.25) is always (6, 2), never (5, 3) through rounding error.
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["task_quotas"]


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
