"""Data that crosses process boundaries: prompts, completions, rollouts, pairs, learner batches.

Frozen dataclasses, never positional tuples (a payload is read by field name on both sides).
Token ids are the generator's (vLLM's) ids: the learner never re-tokenises text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Prompt", "Completion", "Rollout", "PreferencePair", "LearnerBatch"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task, chat template applied and tokenised.

    Attributes:
        index: row index in the task's dataset (stable across runs with the same data).
        task: task name (``tasks[].name``).
        token_ids: prompt tokens, chat template and generation prompt included.
        answer: gold answer text (verifiable tasks; ``""`` otherwise).
        text: the problem as shown to the model (before the chat template).
    """

    index: int
    task: str
    token_ids: tuple[int, ...]
    answer: str = ""
    text: str = ""


@dataclass(frozen=True)
class Completion:
    """One sampled completion as the generator returned it.

    Attributes:
        token_ids: completion tokens ``[completion_len]`` (EOS included when it stopped on EOS).
        logprobs: the generator's sampling logprob of each token ``[completion_len]`` (nats,
            after temperature).
        finish_reason: ``"stop"`` (EOS/stop string) or ``"length"`` (hit ``max_new_tokens``).
        text: detokenised completion.
        weight_version: learner version of the weights that produced it.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str
    weight_version: int


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
class LearnerBatch:
    """Padded token tensors the learner trains on, built from preference pairs.

    Attributes:
        input_ids: ``[2P, S]`` int64; row ``2i`` is pair i's chosen sequence (prompt+completion),
            row ``2i+1`` its rejected one; right-padded with ``pad_id``.
        loss_mask: ``[2P, S]`` float32; 1.0 where the token at that position is a completion token
            (its logprob ``log p(x_t | x_<t)`` counts), 0.0 on prompt and padding. Position 0 is
            always 0.
        weight_version: oldest weight version that generated any sequence in the batch.
        sampling_logprobs: ``[2P, S]`` float32 generator logprobs aligned like ``loss_mask``
            (0 where the mask is 0).
        meta: free-form per-batch info (task names per pair, ...).
    """

    input_ids: Any
    loss_mask: Any
    weight_version: int
    sampling_logprobs: Any = None
    meta: dict = field(default_factory=dict)

    @property
    def num_pairs(self) -> int:
        return int(self.input_ids.shape[0]) // 2

    @staticmethod
    def from_pairs(pairs: list[PreferencePair], pad_id: int, pad_to_multiple: int = 8) -> "LearnerBatch":
        """Stack pairs into ``[2P, S]`` tensors (``S`` = longest sequence, rounded up to
        ``pad_to_multiple``).

        Raises:
            ValueError: ``pairs`` is empty.
        """
        import torch

        if not pairs:
            raise ValueError("LearnerBatch.from_pairs: no pairs given")
        rollouts = [r for p in pairs for r in (p.chosen, p.rejected)]
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
        return LearnerBatch(
            input_ids=ids, loss_mask=mask, sampling_logprobs=slp,
            weight_version=min(r.completion.weight_version for r in rollouts),
            meta={"tasks": [p.chosen.prompt.task for p in pairs]})
