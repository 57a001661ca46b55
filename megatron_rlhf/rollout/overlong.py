"""Overlong completions: completions cut at ``generators.max_new_tokens`` (``finish_reason ==
"length"``), handled as ``algorithm.overlong`` says (DAPO, Yu et al. 2025, sec. 3.4):

* ``keep``: train on them like any other completion (the default; nothing changes).
* ``mask``: overlong filtering. A truncated completion never trains: a DPO pair is chosen among
  the untruncated completions only (online_dpo); group_dpo and best_of_k_sft lose the truncated
  rows from the group before their pairs / best row are chosen; the policy-gradient losses (grpo,
  ppo, rloo, proximal_rloo) keep every row in the group's reward baseline but give the truncated
  rows loss weight 0 (their ``loss_mask`` row is zeroed in ``LearnerBatch.from_groups``, so they
  drop out of every token and sequence denominator; the learner counts the sequences that have a
  completion token). This is NeMo-RL's ``grpo.overlong_filtering`` (``loss_multiplier[truncated] =
  0``, baseline over all samples; nemo_rl/algorithms/grpo.py) and SkyRL's
  ``apply_overlong_filtering`` (loss mask zeroed for responses without EOS). A group left with
  nothing to train is skipped and counted like any prompt without a pair.
* ``soft_penalty``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) is added to each
  completion's reward (:func:`soft_overlong_penalty`), with ``L_max = generators.max_new_tokens``
  and ``L_buf = algorithm.overlong_buffer``; verl's DAPO reward manager does the same
  (``overlong_reward = min(-(len - (L_max - L_buf)) / L_buf * factor, 0)`` added to the score,
  verl/workers/reward_manager/dapo.py, factor 1 here). Rewards then are no longer 0/1, so pairs
  are the best vs the worst completion.

Counted per task in each batch's metrics: ``task/<t>/overlong_frac`` (truncated completions over
the task's completions), ``task/<t>/overlong_masked`` (truncated completions ``mask`` kept out of a trainable group's loss),
``task/<t>/overlong_penalty_mean`` (mean penalty added, ``soft_penalty``).

Used from one place, the producer's scoring/pairing path (``rollout.producer.RolloutProducer``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

__all__ = ["OVERLONG_MODES", "soft_overlong_penalty", "OverlongFilter"]

OVERLONG_MODES = ("keep", "mask", "soft_penalty")
"""Valid ``algorithm.overlong`` values."""


def soft_overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of one completion (Yu et al. 2025, "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale", eq. 13)::

        R_length(y) = 0                               if |y| <= L_max - L_buf
                      ((L_max - L_buf) - |y|) / L_buf if L_max - L_buf < |y| <= L_max
                      -1                              if |y| > L_max

    Args:
        length: ``|y|``, completion tokens.
        max_len: ``L_max`` (``generators.max_new_tokens``).
        buffer: ``L_buf`` (``algorithm.overlong_buffer``), ``1 <= buffer <= max_len``.
    Returns:
        The penalty in reward units, in ``[-1, 0]``.
    Raises:
        ValueError: ``buffer`` outside ``[1, max_len]`` or a negative ``length``.
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"soft_overlong_penalty: buffer (algorithm.overlong_buffer) must be in "
                         f"[1, L_max={max_len}]; got {buffer}")
    if length < 0:
        raise ValueError(f"soft_overlong_penalty: length must be >= 0; got {length}")
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buffer
    return -1.0


class OverlongFilter:
    """``algorithm.overlong`` applied to each scored prompt (module doc).

    Args:
        mode: ``keep`` | ``mask`` | ``soft_penalty``.
        buffer: ``L_buf`` tokens (``soft_penalty``).
        max_new_tokens: ``L_max`` (``generators.max_new_tokens``).
        loss: ``algorithm.loss`` (decides how ``mask`` keeps a truncated row out of the loss).
        unit: ``algorithm.unit`` (``pair``, ``group`` or ``best``).
    Raises:
        ValueError: unknown ``mode``, or ``soft_penalty`` with a buffer outside ``[1, max_new_tokens]``.
    """

    def __init__(self, mode: str, buffer: int, max_new_tokens: int, loss: str, unit: str):
        if mode not in OVERLONG_MODES:
            raise ValueError(f"algorithm.overlong={mode!r}; expected one of {OVERLONG_MODES}")
        if mode == "soft_penalty" and not 1 <= buffer <= max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer={buffer}: soft_penalty needs 1 <= buffer <= "
                             f"generators.max_new_tokens ({max_new_tokens})")
        self.mode, self.buffer, self.max_len, self.loss, self.unit = mode, buffer, max_new_tokens, loss, unit
        self._counts: dict[str, dict[str, float]] = {}

    @classmethod
    def of(cls, algorithm_cfg, max_new_tokens: int) -> "OverlongFilter":
        """From ``AlgorithmConfig`` (``overlong``, ``overlong_buffer``, ``loss``, ``unit``)."""
        return cls(algorithm_cfg.overlong, algorithm_cfg.overlong_buffer, max_new_tokens,
                   algorithm_cfg.loss, algorithm_cfg.unit)

    def _count(self, task: str) -> dict[str, float]:
        return self._counts.setdefault(task, {"completions": 0, "truncated": 0, "masked": 0, "penalty": 0.0})

    def rewards(self, task: str, completions: Sequence, rewards: Sequence[float]) -> list[float]:
        """``[K]`` rewards of one prompt's completions with the soft penalty added (``soft_penalty``;
        unchanged otherwise); counts the truncated ones.

        Args:
            task: the prompt's task.
            completions: ``[K]`` ``Completion`` s (``token_ids``, ``finish_reason``).
            rewards: ``[K]`` finite rewards from the task's reward function.
        """
        c = self._count(task)
        c["completions"] += len(completions)
        c["truncated"] += sum(x.finish_reason == "length" for x in completions)
        if self.mode != "soft_penalty":
            return list(rewards)
        pen = [soft_overlong_penalty(len(x.token_ids), self.max_len, self.buffer) for x in completions]
        c["penalty"] += sum(pen)
        return [r + p for r, p in zip(rewards, pen)]

    def group(self, make_group: Callable, prompt, rollouts: Sequence):
        """The trainable group of one prompt, with ``mask`` applied.

        Args:
            make_group: ``(prompt, rollouts) -> RolloutGroup | None`` (the producer's pairing).
            prompt: the prompt.
            rollouts: its ``[K]`` scored ``Rollout`` s.
        Returns:
            ``make_group(prompt, rollouts)`` for ``keep``/``soft_penalty``. For ``mask``: pair and
            best units (and group_dpo) get only the untruncated rollouts; the policy-gradient
            losses get all K with ``loss_weights`` 0 on the truncated ones. None when nothing
            is left to train.
        """
        if self.mode != "mask":
            return make_group(prompt, rollouts)
        cut = [r.completion.finish_reason == "length" for r in rollouts]
        if not any(cut):
            return make_group(prompt, rollouts)
        if self.unit != "group" or self.loss == "group_dpo":
            kept = [r for r, t in zip(rollouts, cut) if not t]
            g = make_group(prompt, kept) if len(kept) >= 1 else None
            if g is not None:   # the truncated ones never become learner rows
                self._count(prompt.task)["masked"] += sum(cut)
            return g
        if all(cut):
            return None
        g = make_group(prompt, rollouts)
        if g is None:
            return None
        self._count(prompt.task)["masked"] += sum(cut)
        return dataclasses.replace(g, loss_weights=tuple(0.0 if t else 1.0 for t in cut))

    def take_stats(self) -> dict[str, float]:
        """Per-task metrics since the last call (``task/<t>/overlong_frac``, ``.../overlong_masked``,
        ``.../overlong_penalty_mean``), then reset."""
        out = {}
        for t, c in self._counts.items():
            n = max(c["completions"], 1)
            out[f"task/{t}/overlong_frac"] = c["truncated"] / n
            out[f"task/{t}/overlong_masked"] = c["masked"]
            if self.mode == "soft_penalty":
                out[f"task/{t}/overlong_penalty_mean"] = c["penalty"] / n
        self._counts = {}
        return out
