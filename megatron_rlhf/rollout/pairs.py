"""Choose the DPO pair among the K scored completions of one prompt.

* Verifiable (binary 0/1) rewards: one correct completion, drawn at random, vs one incorrect,
  drawn at random (Lanchantin et al. 2025, "Bridging Offline and Online Reinforcement Learning for
  LLMs", verifiable-task pairs). All correct or all incorrect: no pair.
* Scalar rewards (reward model): the highest- vs the lowest-scored completion, skipping the prompt
  when all scores are equal (Yuan et al. 2024, "Self-Rewarding Language Models";
  Lanchantin et al. 2025 for non-verifiable tasks; with K=2 this is the online-feedback pair of
  Guo et al. 2024). Ties at the top or bottom are broken at random.

``None`` means "skip this prompt"; the trainer draws more prompts until it has enough pairs.
"""

from __future__ import annotations

import math
import random

__all__ = ["select_pair"]


def select_pair(rewards: list[float], rng: random.Random, binary: bool) -> tuple[int, int] | None:
    """Indices ``(chosen, rejected)`` into ``rewards`` (the K completions of one prompt), or None.

    Args:
        rewards: ``[K]`` rewards of the completions of one prompt.
        rng: the caller's seeded generator (the only source of randomness here).
        binary: True for 0/1 rewards: chosen is a random index with reward == 1.0, rejected a
            random index with reward != 1.0. False: chosen has the maximum reward, rejected the
            minimum.
    Returns:
        ``(chosen, rejected)`` with ``rewards[chosen] > rewards[rejected]``, or None when fewer
        than 2 completions, all correct / all incorrect (binary), or all rewards equal.
    Raises:
        ValueError: a reward is NaN or infinite (message gives its index).
    """
    for i, r in enumerate(rewards):
        if not math.isfinite(float(r)):
            raise ValueError(f"select_pair: rewards[{i}] = {r!r} is not finite; the reward "
                             "function must return finite numbers")
    if len(rewards) < 2:
        return None
    if binary:
        correct = [i for i, r in enumerate(rewards) if float(r) == 1.0]
        wrong = [i for i, r in enumerate(rewards) if float(r) != 1.0]
        if not correct or not wrong:
            return None
        return rng.choice(correct), rng.choice(wrong)
    hi, lo = max(rewards), min(rewards)
    if hi == lo:
        return None
    best = [i for i, r in enumerate(rewards) if r == hi]
    worst = [i for i, r in enumerate(rewards) if r == lo]
    return rng.choice(best), rng.choice(worst)
