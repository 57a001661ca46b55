"""``async.max_staleness: auto``: the staleness bound as a controlled quantity.

With a fixed ``async.max_staleness`` the bound is a guess made before the run. With ``auto`` the
learner loop hands every metrics row to :meth:`StalenessController.update`, which weighs what
waiting costs against what being off-policy costs and moves the bound by one within
``[floor, async.max_staleness_cap]``, ``floor = max(1, async.sync_interval - 1)`` (the handshake's
rule: a bound below ``sync_interval - 1`` would wait for a version that is never published, see
``AsyncConfig``). Per step, from the row (each share is of the step's ``time/step_s``)::

    learner wait   w_L = time/learner_idle_s / time/step_s      (the learner waited for a batch)
    generator wait w_G = time/generator_idle_s / time/step_s    (the producer waited for weights,
                                                                 or for the learner to take a batch)
    off-policy over    logprobs/token_mult_prob_error > async.auto_max_mult_prob_error
                    or is/ess        < async.auto_min_is_ess         (policy-gradient losses with an
                    or is/masked_frac > async.auto_max_is_masked_frac  importance correction only)

    vote down  "off_policy:<metric>"  when the off-policy cost is over (first metric that is)
    vote up    "learner_wait"         else when w_L > async.auto_learner_wait_frac
    vote down  "generator_ahead"      else when w_G > auto_learner_wait_frac and w_L <= half of it
                                      (the generator has slack: fresher samples cost no learner time)
    no vote    otherwise

Hysteresis: the bound moves only after ``async.auto_patience`` counted votes in a row the same
way (then the count starts again), and a step counts only when its batch was generated under the
bound in force (the batch's ``staleness/bound``): after a move, the one or two batches already
generated or generating under the old bound say nothing about the new one (with the hand-over
queue of one batch that is at most two steps). The first step of a session never counts: it waits
for a batch generated from cold (and for the step-0 eval).

The bound reaches the producer through ``RolloutProducer.set_bound``, with the bound of carried
work that follows it (``async.max_carry_staleness`` when set, else the bound + 1): a batch keeps
the bounds it started with (its handshake and carry use them; they are stamped in
``staleness/bound`` and ``staleness/carry_bound``, and :meth:`StalenessController.split` checks the
batch against those same bounds, so a move never drops what the handshake allowed). A lowered bound waits for the newer weights it needs, also when the
producer was already waiting: the handshake is never broken, it only gets stricter.

What the bound can buy: with the hand-over queue of one batch the producer runs at most two
batches ahead of the learner, so with ``sync_interval`` 1 a bound above 2 changes nothing for
freshly generated groups; it still lets older carried surplus groups and parked partial requests
(``rollout.carry``) train instead of being requeued as stale. A generator that is simply slower than the learner makes the learner wait
at any bound (the wait then raises the bound to the cap, where it holds; a bound that does not bind
costs nothing, the staleness trained stays where the pipeline puts it): the controller buys overlap
where waits come from the handshake (uneven batches, weight pushes, evals), not generation speed.

Every row gets ``async/max_staleness`` (the bound in force after this step: the one the next
batches are generated under; with a fixed int, that int, 0 with ``async.sync``) and
``async/max_staleness_reason`` (a short code, :data:`REASONS`); a move also prints one line naming
the step, the old and new bound, and the numbers behind it. The controller's state (bound and the
current vote count) is part of the checkpoint (``trainer_state.json``: ``staleness_control``), so a
resumed run continues with the bound in force. The bound depends on measured times, so two runs
with the same seed may choose differently; only a fixed bound makes the run's batches a function
of the seed alone.
"""

from __future__ import annotations

import math
from typing import Callable

from megatron_rlhf.rollout.staleness import split_by_staleness

__all__ = ["StalenessController", "REASONS", "BOUND_STAT", "CARRY_BOUND_STAT", "AUTO"]

AUTO = "auto"
"""The ``async.max_staleness`` value that turns the controller on."""

BOUND_STAT = "staleness/bound"
"""Key of a batch's stats (and so of its metrics row): the staleness bound of fresh work the
producer generated the batch under, which the learner checks it against."""
CARRY_BOUND_STAT = "staleness/carry_bound"
"""Likewise for carried work (``async.max_carry_staleness``; by default the bound + 1)."""

REASONS = {
    "fixed": "a fixed async.max_staleness (or a debug run.mode): the controller is off",
    "warmup": "the session's first step: it waited for a batch generated from cold; not counted",
    "settling": "this step's batch was generated under an earlier bound; not counted",
    "hold": "no vote: the learner did not wait, the generator had no slack, off-policy cost under",
    "vote_up:learner_wait": "counted toward a rise (async.auto_patience not reached yet)",
    "up:learner_wait": "raised by one: the learner waited, off-policy cost under its thresholds",
    "at_cap:learner_wait": "the learner waited, but the bound is at async.max_staleness_cap",
    "vote_down:<why>": "counted toward a cut (async.auto_patience not reached yet)",
    "down:off_policy:<metric>": "lowered by one: <metric> (mult_prob_error, is_ess, is_masked_frac) "
                                "over its threshold",
    "down:generator_ahead": "lowered by one: the generator waited and the learner did not",
    "at_floor:<why>": "a cut was due, but the bound is at the floor max(1, async.sync_interval - 1)",
}
"""``async/max_staleness_reason`` codes and what each means (``<why>`` is ``off_policy:<metric>`` or
``generator_ahead``)."""


def _finite(row: dict, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


class StalenessController:
    """The staleness bound in force, and (with ``async.max_staleness: auto``) the rule that moves
    it (see the module docstring).

    Args:
        async_cfg: ``AsyncConfig`` (``max_staleness``, ``max_staleness_cap``, ``sync_interval``,
            ``sync``, the ``auto_*`` thresholds).
        active: whether the bound may move (False in the debug modes ``rollout_only`` /
            ``train_only``: nothing is generated against a training learner there).
        state: :meth:`state_dict` of a checkpoint to continue from (None: start at the floor);
            a bound outside this config's ``[floor, cap]`` is clamped into it.
        on_change: called with the new bound and its carry bound (:meth:`carry_bound`) after
            every move (``RolloutProducer.set_bound``).
        log: called with one line per move (the console).

    Attributes:
        auto: ``max_staleness == "auto"`` and ``active``.
        bound: the bound in force (``async/max_staleness``).
        floor, cap: the range ``auto`` moves in.
    """

    def __init__(self, async_cfg, *, active: bool = True, state: dict | None = None,
                 on_change: Callable[[int, int], None] | None = None, log: Callable[[str], None] | None = None):
        self.cfg = async_cfg
        self.floor = max(1, async_cfg.sync_interval - 1)
        self.cap = async_cfg.max_staleness_cap
        self.auto = async_cfg.max_staleness == AUTO and active and not async_cfg.sync
        self.on_change, self.log = on_change, log
        if async_cfg.max_staleness == AUTO:
            self.bound = self.floor
        else:
            self.bound = 0 if async_cfg.sync else async_cfg.max_staleness
        self.votes, self.direction = 0, 0   # counted votes in a row, and their sign
        self._warm = False   # whether this session saw its first step
        if self.auto and state:
            self.bound = min(self.cap, max(self.floor, int(state["bound"])))
            self.votes, self.direction = int(state.get("votes", 0)), int(state.get("direction", 0))

    def carry_bound(self, bound: int) -> int:
        """The bound of carried work that goes with fresh-work ``bound``: ``async.max_carry_staleness``
        when set, else ``bound + 1`` (0 with ``async.sync``)."""
        if getattr(self.cfg, "max_carry_staleness", None) is not None:
            return self.cfg.max_carry_staleness
        return 0 if self.cfg.sync else bound + 1

    # ------------------------------------------------------------------------- the learner's check
    def bounds(self, batch) -> tuple[int, int]:
        """``(fresh, carry)``: the bounds ``batch`` (a ``RolloutBatch``) is checked against. With
        ``auto`` the ones it was generated under (its ``staleness/bound`` and
        ``staleness/carry_bound`` stats; the ones in force when it has none), else
        ``async.max_staleness`` and ``AsyncConfig.carry_staleness_bound`` as configured."""
        if not self.auto:
            fresh = self.cfg.max_staleness if self.cfg.max_staleness != AUTO else self.bound
            return fresh, getattr(self.cfg, "carry_staleness_bound", fresh)
        fresh, carry = (batch.stats.get(k) for k in (BOUND_STAT, CARRY_BOUND_STAT))
        fresh = fresh if isinstance(fresh, int) and not isinstance(fresh, bool) else self.bound
        carry = carry if isinstance(carry, int) and not isinstance(carry, bool) else self.carry_bound(fresh)
        return fresh, carry

    def split(self, batch, learner_version: int, unit: str) -> tuple[list, dict, int, int]:
        """:func:`rollout.staleness.split_by_staleness` of ``batch.groups`` against the larger of
        its :meth:`bounds` (fresh work within the first, carried work within the second); with
        ``auto`` the histogram has a key for every staleness ``0..carry_bound(cap)`` (the keys stay
        the same whatever the bound).

        Returns:
            ``(kept groups, staleness metrics, fresh bound, carry bound)``.
        Raises:
            ValueError: as ``split_by_staleness`` (versions out of step, no groups).
        """
        fresh, carry = self.bounds(batch)
        kept, metrics = split_by_staleness(batch.groups, learner_version, max(fresh, carry), unit)
        if self.auto:
            top = max(self.cap, self.carry_bound(self.cap))
            metrics = {**{f"staleness/hist_{d}": 0 for d in range(top + 1)}, **metrics}
        return kept, metrics, fresh, carry

    # ------------------------------------------------------------------------------ the controller
    def update(self, row: dict) -> dict:
        """Read one step's metrics row, maybe move the bound, and return the row's two keys.

        Args:
            row: the step's metrics (``step``, ``time/step_s``, ``time/learner_idle_s``,
                ``time/generator_idle_s``, and when present ``staleness/bound``,
                ``logprobs/token_mult_prob_error``, ``is/ess``, ``is/masked_frac``; a missing or
                non-finite off-policy metric is not checked).
        Returns:
            ``{"async/max_staleness": int, "async/max_staleness_reason": str}``.
        """
        reason = self._decide(row) if self.auto else "fixed"
        return {"async/max_staleness": self.bound, "async/max_staleness_reason": reason}

    def _decide(self, row: dict) -> str:
        if not self._warm:
            self._warm = True
            return "warmup"
        made_under = row.get(BOUND_STAT)
        if isinstance(made_under, int) and made_under != self.bound:
            return "settling"
        step_s = _finite(row, "time/step_s") or 0.0
        learner_wait = (_finite(row, "time/learner_idle_s") or 0.0) / step_s if step_s > 0 else 0.0
        gen_wait = (_finite(row, "time/generator_idle_s") or 0.0) / step_s if step_s > 0 else 0.0
        over = self._off_policy_over(row)
        wait_frac = self.cfg.auto_learner_wait_frac
        if over:
            vote, why = -1, "off_policy:" + over
        elif learner_wait > wait_frac:
            vote, why = 1, "learner_wait"
        elif gen_wait > wait_frac and learner_wait <= wait_frac / 2:
            vote, why = -1, "generator_ahead"
        else:
            self.votes = self.direction = 0
            return "hold"
        self.votes = self.votes + 1 if vote == self.direction else 1
        self.direction = vote
        new = min(self.cap, max(self.floor, self.bound + vote))
        if new == self.bound:
            return ("at_cap:" if vote > 0 else "at_floor:") + why
        if self.votes < self.cfg.auto_patience:
            return ("vote_up:" if vote > 0 else "vote_down:") + why
        old, self.bound, self.votes = self.bound, new, 0
        if self.on_change is not None:
            self.on_change(new, self.carry_bound(new))
        if self.log is not None:
            self.log(f"step {row.get('step')}: async.max_staleness {old} -> {new} ({why}: learner waited "
                     f"{learner_wait:.0%} of the step, generator {gen_wait:.0%}; "
                     f"{self._costs(row)})")
        return ("up:" if vote > 0 else "down:") + why

    def _off_policy_over(self, row: dict) -> str | None:
        """The first off-policy metric over its threshold (``mult_prob_error``, ``is_ess``,
        ``is_masked_frac``), or None."""
        c = self.cfg
        mult, ess, masked = (_finite(row, k) for k in ("logprobs/token_mult_prob_error", "is/ess",
                                                        "is/masked_frac"))
        if mult is not None and mult > c.auto_max_mult_prob_error:
            return "mult_prob_error"
        if ess is not None and ess < c.auto_min_is_ess:
            return "is_ess"
        if masked is not None and masked > c.auto_max_is_masked_frac:
            return "is_masked_frac"
        return None

    def _costs(self, row: dict) -> str:
        c = self.cfg
        parts = [f"{name} {v:.4g} (threshold {t:g})" for name, key, t in (
            ("token_mult_prob_error", "logprobs/token_mult_prob_error", c.auto_max_mult_prob_error),
            ("is/ess", "is/ess", c.auto_min_is_ess), ("is/masked_frac", "is/masked_frac", c.auto_max_is_masked_frac))
            if (v := _finite(row, key)) is not None]
        return ", ".join(parts) or "no off-policy metric in the row"

    # ------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """JSON-plain state for ``trainer_state.json``: ``bound``, ``votes``, ``direction``."""
        return {"bound": self.bound, "votes": self.votes, "direction": self.direction}
