"""Data that crosses process boundaries: prompts, completions, rollouts, pairs, rollout and learner batches.

Frozen dataclasses, never positional tuples (a payload is read by field name on both sides).
Token ids are the generator's (vLLM's) ids: the learner never re-tokenises text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Prompt", "Completion", "Rollout", "PreferencePair", "RolloutGroup", "RolloutBatch", "LearnerBatch"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task, chat template applied and tokenised.

    Attributes:
        index: row index in the task's dataset (stable across runs with the same data).
        task: task name (``tasks[].name``).
        token_ids: prompt tokens, chat template and generation prompt included.
        answer: gold answer text (verifiable tasks; ``""`` otherwise).
        text: the problem as shown to the model (before the chat template).
        group: the row's ``product`` field when it has one (the arithmetic datasets' unordered
            problem id, e.g. ``"6 x 8"`` for every wording of 6 x 8 and 8 x 6), else ``""``: the
            cluster of the eval's cluster-robust standard error (``trainer.evaluate.cluster_se``).
    """

    index: int
    task: str
    token_ids: tuple[int, ...]
    answer: str = ""
    text: str = ""
    group: str = ""


@dataclass(frozen=True)
class Completion:
    """One sampled completion as the generator returned it.

    Attributes:
        token_ids: completion tokens ``[completion_len]`` (EOS included when it stopped on EOS).
        logprobs: the generator's sampling logprob of each token ``[completion_len]`` (nats,
            after temperature).
        finish_reason: ``"stop"`` (EOS/stop string) or ``"length"`` (hit ``max_new_tokens``).
        text: detokenised completion.
        weight_version: learner version of the weights that sampled its FIRST token: the oldest
            version in it, the one staleness is measured from.
        weight_version_last: version that sampled its last token (``None`` given: the same as
            ``weight_version``). Larger than ``weight_version`` when new weights were loaded
            while it was being generated (``generators.inflight_updates``); each token's
            ``logprobs`` entry is then that of the version that sampled it.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str
    weight_version: int
    weight_version_last: int | None = None

    def __post_init__(self):
        if self.weight_version_last is None:
            object.__setattr__(self, "weight_version_last", self.weight_version)
        if self.weight_version_last < self.weight_version:
            raise ValueError(f"Completion: weight_version_last={self.weight_version_last} < "
                             f"weight_version={self.weight_version} (the first token's version is the oldest)")

    @property
    def weight_version_first(self) -> int:
        """Version of the first token (= ``weight_version``, the oldest)."""
        return self.weight_version


@dataclass(frozen=True)
class Rollout:
    """A scored completion of a prompt. ``reward`` is in the task's reward units (0/1 for math)."""

    prompt: Prompt
    completion: Completion
    reward: float


@dataclass(frozen=True)
class PreferencePair:
    """A DPO pair: two rollouts of the same prompt, ``chosen`` preferred over ``rejected``."""

    chosen: Rollout
    rejected: Rollout


@dataclass(frozen=True)
class RolloutGroup:
    """The K scored rollouts of one prompt: the unit a batch is made of.

    Attributes:
        prompt: the prompt.
        rollouts: its K rollouts, in generation order.
        pair: ``(chosen, rejected)`` indices into ``rollouts`` (pair losses), or None.
        loss_rewards: ``[K]`` the rewards the loss sees (per-task normalised for the
            policy-gradient losses, 0/1 correctness for group_dpo); None: the rollouts' rewards.
        loss_weights: ``[K]`` weight of each rollout's tokens in the loss (its ``loss_mask`` row
            is multiplied by it; 0 keeps a truncated completion out of the loss with
            ``algorithm.overlong: mask``, ``megatron_rlhf.rollout.overlong``); None: all 1.
    """

    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    pair: tuple[int, int] | None = None
    loss_rewards: tuple[float, ...] | None = None
    loss_weights: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.loss_weights is not None:
            object.__setattr__(self, "loss_weights", tuple(float(w) for w in self.loss_weights))  # JSON lists
            if len(self.loss_weights) != len(self.rollouts):
                raise ValueError(f"RolloutGroup: {len(self.loss_weights)} loss_weights for "
                                 f"{len(self.rollouts)} rollouts")

    @property
    def rewards(self) -> tuple[float, ...]:
        """``[K]`` rewards the loss uses."""
        return self.loss_rewards if self.loss_rewards is not None else tuple(r.reward for r in self.rollouts)

    @property
    def weight_version(self) -> int:
        """Oldest weight version among the rollouts (the group's staleness is measured from it)."""
        return min(r.completion.weight_version for r in self.rollouts)

    def best_index(self) -> int:
        """Index of the highest loss reward (first on ties; best-of-K SFT)."""
        rw = self.rewards
        return max(range(len(rw)), key=lambda i: (rw[i], -i))

    def trained_indices(self, unit: str) -> list[int]:
        """Indices of the rollouts that become learner rows: the pair ``(chosen, rejected)`` for
        ``unit='pair'``, the best one for ``'best'``, all K for ``'group'``.

        Raises:
            ValueError: unknown ``unit``, or ``'pair'`` on a group without a pair.
        """
        if unit == "pair":
            if self.pair is None:
                raise ValueError(f"group of prompt {self.prompt.index} (task {self.prompt.task}) has no pair")
            return list(self.pair)
        if unit == "best":
            return [self.best_index()]
        if unit == "group":
            return list(range(len(self.rollouts)))
        raise ValueError(f"unit={unit!r}; expected pair, group or best")


def _stack(rollouts: list[Rollout], pad_id: int, pad_to_multiple: int):
    """``input_ids [B, S]`` int64, ``loss_mask [B, S]`` and ``sampling_logprobs [B, S]`` float32
    of prompt+completion rows, right-padded (``S`` rounded up to ``pad_to_multiple``)."""
    import torch

    seqs = [list(r.prompt.token_ids) + list(r.completion.token_ids) for r in rollouts]
    s = max(len(x) for x in seqs)
    s = -(-s // pad_to_multiple) * pad_to_multiple
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), s), dtype=torch.float32)
    slp = torch.zeros((len(seqs), s), dtype=torch.float32)
    for i, (r, x) in enumerate(zip(rollouts, seqs)):
        lp, lc = len(r.prompt.token_ids), len(r.completion.token_ids)
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, lp: lp + lc] = 1.0
        slp[i, lp: lp + lc] = torch.tensor(r.completion.logprobs[:lc], dtype=torch.float32)
    return ids, mask, slp


@dataclass(frozen=True)
class RolloutBatch:
    """One learner batch worth of trainable prompt groups, tagged with the weight version that
    generated it.

    Attributes:
        index: 0-based batch index (the learner trains it as step ``index + 1``).
        weight_version: oldest version that generated any token of its groups (carried ones
            included).
        groups: exactly ``algorithm.prompts_per_step`` :class:`RolloutGroup` s, each task holding
            its quota (``tasks[].weight``, largest remainder), in task order.
        sampler_state: data-sampler position after the last prompt this batch consumed.
        rng_state: pair-selection RNG state after this batch.
        producer_state: the rest of the producer's resumable state (reward normaliser, yield
            estimates, the pool's completion-length estimate, and the carry: surplus groups and
            parked partial requests in the ``rollout.batch_io`` encoding), JSON-plain.
        stats: per-batch numbers for the metrics row (``time/gen_s``, ``reward/mean``, ...).
    """

    index: int
    weight_version: int
    groups: tuple[RolloutGroup, ...]
    sampler_state: dict
    rng_state: Any
    producer_state: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LearnerBatch:
    """Padded token tensors the learner trains on, built from preference pairs.

    Attributes:
        input_ids: ``[2P, S]`` int64; row ``2i`` is pair i's chosen sequence (prompt+completion),
            row ``2i+1`` its rejected one; right-padded with ``pad_id``.
        loss_mask: ``[2P, S]`` float32; 1.0 where the token at that position is a completion token
            (its logprob ``log p(x_t | x_<t)`` counts), 0.0 on prompt and padding, times the
            rollout's ``RolloutGroup.loss_weights`` entry (0 for a masked truncated completion).
            Position 0 is always 0.
        weight_version: oldest weight version that generated any sequence in the batch.
        sampling_logprobs: ``[2P, S]`` float32 generator logprobs aligned like ``loss_mask``
            (0 where the mask is 0).
        meta: free-form per-batch info (``tasks``: task name per unit, ...).
        rewards: ``[B]`` float32 reward of each row as the loss sees it (None for plain pairs).
        group_ids: ``[B]`` int64 unit (prompt) index of each row; rows of a unit are contiguous
            and must stay in one micro-batch for pair and group_dpo losses.
        unit: ``pair`` (rows 2i/2i+1 chosen/rejected), ``group`` (all K rows of each prompt) or
            ``best`` (one row per prompt).
    """

    input_ids: Any
    loss_mask: Any
    weight_version: int
    sampling_logprobs: Any = None
    meta: dict = field(default_factory=dict)
    rewards: Any = None
    group_ids: Any = None
    unit: str = "pair"

    @property
    def num_units(self) -> int:
        """Trained prompts in the batch (pairs, groups or best rows)."""
        if self.group_ids is None:
            return self.num_pairs
        return int(self.group_ids.max()) + 1 if len(self.group_ids) else 0

    @staticmethod
    def from_groups(groups: list[RolloutGroup], unit: str, pad_id: int,
                    pad_to_multiple: int = 8) -> "LearnerBatch":
        """Rows of ``groups`` as the loss needs them (see ``unit``); ``rewards`` and ``group_ids``
        filled, ``meta['tasks']`` per group.

        Raises:
            ValueError: ``groups`` empty, unknown ``unit``, or ``unit='pair'`` on a group without
                a pair.
        """
        import torch

        if not groups:
            raise ValueError("LearnerBatch.from_groups: no groups given")
        if unit not in ("pair", "group", "best"):
            raise ValueError(f"LearnerBatch.from_groups: unit={unit!r}; expected pair, group or best")
        rows: list[Rollout] = []
        rewards: list[float] = []
        gids: list[int] = []
        weights: list[float] = []
        for g, grp in enumerate(groups):
            rw = grp.rewards
            try:
                idx = grp.trained_indices(unit)
            except ValueError as e:
                raise ValueError(f"LearnerBatch.from_groups: group {g}: {e}") from e
            rows.extend(grp.rollouts[i] for i in idx)
            rewards.extend(float(rw[i]) for i in idx)
            gids.extend([g] * len(idx))
            weights.extend(1.0 if grp.loss_weights is None else grp.loss_weights[i] for i in idx)
        ids, mask, slp = _stack(rows, pad_id, pad_to_multiple)
        if any(w != 1.0 for w in weights):   # RolloutGroup.loss_weights (overlong: mask)
            w = torch.tensor(weights, dtype=torch.float32)[:, None]
            mask, slp = mask * w, torch.where(w > 0, slp, torch.zeros_like(slp))
        return LearnerBatch(
            input_ids=ids, loss_mask=mask, sampling_logprobs=slp,
            weight_version=min(r.completion.weight_version for r in rows),
            meta={"tasks": [grp.prompt.task for grp in groups]},
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.tensor(gids, dtype=torch.long), unit=unit)

    @property
    def num_pairs(self) -> int:
        """Rows // 2: the number of pairs of a ``pair`` batch."""
        return int(self.input_ids.shape[0]) // 2
