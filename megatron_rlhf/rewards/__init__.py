"""Reward functions, registered by name (``tasks[].reward``), and reward models.
It may import convert/ (to load a reward model), data/ (its preference pairs), runtime and utils/;
never generator/, learner/, rollout/ or trainer/ (the rollout and the trainer call it).

Reward-model tasks (``tasks[].reward: {reward_model: NAME_OR_PATH}``): resolve the folder with
:func:`resolve_reward_model` (a demo name is trained on first use), serve it with
:class:`RewardModelWorker` (a Ray actor in the trainer), normalise per task with
:class:`RunningRewardNormalizer`.

Each registered reward is a callable class ``reward(completions: list[str], answers: list[str]) ->
list[float]`` with ``close()``, ``stats()`` and a class attribute ``binary`` (True when rewards
are 0/1, which selects the pair rule in ``rollout.pairs.select_pair``).
"""

from __future__ import annotations

from typing import Any

from megatron_rlhf.rewards.math_verify import MathVerifyReward
from megatron_rlhf.rewards.reward_model import RewardModel, RunningRewardNormalizer, length_normalized_rewards
from megatron_rlhf.rewards.server import RewardModelWorker
from megatron_rlhf.rewards.train import DEMO_REWARD_MODELS, resolve_reward_model

__all__ = ["REWARDS", "register_reward", "make_reward", "MathVerifyReward", "RewardModel", "RewardModelWorker",
           "RunningRewardNormalizer", "length_normalized_rewards", "resolve_reward_model", "DEMO_REWARD_MODELS"]

REWARDS: dict[str, type] = {"math_verify": MathVerifyReward}


def register_reward(name: str, cls: type, *, overwrite: bool = False) -> type:
    """Register reward class ``cls`` under ``name``.

    Raises:
        ValueError: the name is taken and ``overwrite`` is False.
    """
    if name in REWARDS and not overwrite:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
    REWARDS[name] = cls
    return cls


def make_reward(name: str, **kwargs: Any):
    """Instantiate the reward registered as ``name`` (``kwargs`` go to its constructor).

    Raises:
        KeyError: unknown name (the message lists the registered ones; config key tasks[].reward).
    """
    if name not in REWARDS:
        raise KeyError(f"tasks[].reward = {name!r} is not a registered reward; known: {sorted(REWARDS)}")
    return REWARDS[name](**kwargs)
