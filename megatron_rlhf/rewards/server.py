"""Reward-model serving: one process that scores (prompt, completion) pairs for a chat task.

:class:`RewardModelWorker` is a plain class; the trainer makes it a Ray actor with its own CPU
core (or GPU share)::

    worker = ray.remote(num_cpus=1)(RewardModelWorker).remote(model_dir=str(folder), cpu_core=2)
    rewards = ray.get(worker.score.remote([p.text for p in prompts], completion_texts))

It wraps :class:`megatron_rlhf.rewards.reward_model.RewardModel`: each (prompt, completion) is read
as ``chat_template([user: prompt], add_generation_prompt=True) + completion.strip() + <eos>`` with
the reward model's *own* tokenizer, so the prompt is passed as text (``Prompt.text``: the user's
message before the chat template), never as the policy's token ids. Rewards are Bradley-Terry
logits: only differences within a task are meaningful (normalise per task with
:class:`~megatron_rlhf.rewards.reward_model.RunningRewardNormalizer` before mixing tasks).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from megatron_rlhf.runtime import pin_to_core

__all__ = ["RewardModelWorker"]


class RewardModelWorker:
    """Loads a reward-model folder once and scores batches of completions.

    Args:
        model_dir: a resolved reward-model folder (``megatron_rlhf.rewards.resolve_reward_model``).
        dtype: ``float32`` (CPU) or ``bfloat16``.
        batch_size: sequences per forward pass.
        max_length: tokens the trunk reads per sequence (cut from the left); ``None``: the length
            the pooled head was trained with (1024 for sequence-classification folders).
        cpu_core: CPU only: pin this process to that core and one torch thread
            (``megatron_rlhf.runtime.pin_to_core``); -1 disables pinning.
        device: ``auto`` (CUDA when this process sees a GPU, else CPU), ``cpu`` or ``cuda``.
    Raises:
        ValueError: the folder is not a loadable reward model (see ``RewardModel``), or a bad
            ``dtype``/``device``.
    """

    def __init__(self, model_dir: str | Path, dtype: str = "float32", batch_size: int = 8,
                 max_length: int | None = None, cpu_core: int = -1, device: str = "auto"):
        pin_to_core(cpu_core)
        import torch

        from megatron_rlhf.rewards.reward_model import RewardModel

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"RewardModelWorker(device={device!r}): expected auto, cpu or cuda")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        t0 = time.perf_counter()
        self.model_dir = str(model_dir)
        self.rm = RewardModel(model_dir, dtype=dtype, device=device, batch_size=batch_size,
                              max_length=max_length)
        self.load_s = time.perf_counter() - t0
        self._score_s = 0.0
        self._calls = 0
        self._non_finite = 0

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """Rewards of ``completions[i]`` as replies to user message ``prompts[i]``.

        Args:
            prompts: ``[N]`` user messages as shown before the chat template (``Prompt.text``).
            completions: ``[N]`` generated texts (no template tokens).
        Returns:
            ``[N]`` floats in reward-model units (Bradley-Terry logits), input order. A non-finite
            score (a broken model) is returned as is and counted in :meth:`stats`.
        Raises:
            ValueError: lengths differ or an item is not a string.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"RewardModelWorker.score: {len(prompts)} prompts but {len(completions)} completions")
        bad = [i for i, (p, c) in enumerate(zip(prompts, completions))
               if not isinstance(p, str) or not isinstance(c, str)]
        if bad:
            raise ValueError(f"RewardModelWorker.score: items {bad[:5]} are not (str prompt, str completion); "
                             "pass Prompt.text and the completion text")
        if not prompts:
            return []
        t0 = time.perf_counter()
        out = self.rm.score(list(prompts), list(completions))
        self._score_s += time.perf_counter() - t0
        self._calls += 1
        self._non_finite += sum(not math.isfinite(r) for r in out)
        return out

    def stats(self) -> dict:
        """Counters since start: ``num_scored`` (sequences), ``num_truncated`` (longer than
        ``max_length``, read from the left-cut end), ``num_non_finite``, ``num_calls``,
        ``score_s`` (seconds in :meth:`score`), ``s_per_seq`` (``score_s / num_scored``, 0 before
        any), ``load_s`` (model load seconds), ``max_length`` (tokens)."""
        n = self.rm.num_scored
        return {"num_scored": n, "num_truncated": self.rm.num_truncated, "num_non_finite": self._non_finite,
                "num_calls": self._calls, "score_s": self._score_s, "s_per_seq": self._score_s / n if n else 0.0,
                "load_s": self.load_s, "max_length": self.rm.max_length}

    def ready(self) -> str:
        """The folder served (a cheap call to wait for the actor to finish loading)."""
        return self.model_dir
