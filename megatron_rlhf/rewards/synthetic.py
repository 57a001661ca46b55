"""Synthetic rewards for controlled experiments (``bench/seeds_repro.py --dry-run``, tests on tiny models).

A tiny random model cannot solve math or please a reward model, but it can learn to shift its
token distribution. These rewards are smooth functions of the completion text that a policy
improves by moving probability mass, so reward-vs-KL curves of different losses and staleness
levels can be compared in minutes on CPU (the same role as the "generate positive sentiment"
or length rewards of the RLHF literature's controlled tasks, e.g. Rafailov et al. 2023, sec. 6.1).
Used as reward plug-ins: ``tasks[].reward: megatron_rlhf.rewards.synthetic:letter_rate``.
"""

from __future__ import annotations

__all__ = ["letter_rate"]

TARGET_LETTERS = "aeiou"


def letter_rate(completions: list[str], answers: list[str]) -> list[float]:
    """Fraction of a completion's characters that are lower-case vowels (``aeiou``), in [0, 1].

    Args:
        completions: ``[N]`` generated texts.
        answers: ``[N]`` gold answers (ignored; part of the plug-in signature).
    Returns:
        ``[N]`` rewards; an empty completion scores 0.0.
    Raises:
        ValueError: the two lists differ in length.
    """
    if len(completions) != len(answers):
        raise ValueError(f"letter_rate: {len(completions)} completions but {len(answers)} answers")
    return [sum(ch in TARGET_LETTERS for ch in c) / len(c) if c else 0.0 for c in completions]
