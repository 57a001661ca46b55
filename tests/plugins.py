"""Reward plug-ins for integration tests (loaded by dotted path, like a user's custom reward).

Tiny random models never solve a math problem, so the loop tests use rewards that a random
model satisfies about half the time; they exercise exactly the same pairing and training path.
"""


def has_digit(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion contains an ASCII digit, else 0.0 (binary)."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def char_parity(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion has an even number of characters, else 0.0 (binary, ~50/50)."""
    return [float(len(c) % 2 == 0) for c in completions]


SLOW_REWARD_S = 1.0
"""Seconds :func:`slow_char_parity` sleeps per call: a generator side slower than the tiny
learner's step, so the learner waits for every batch (``tests/test_async_loop.py``)."""


def slow_char_parity(completions: list[str], answers: list[str]) -> list[float]:
    """:func:`char_parity` after sleeping :data:`SLOW_REWARD_S` (a slowed generator side: rewards are
    scored on the producer's thread, inside each batch's generation time)."""
    import time

    time.sleep(SLOW_REWARD_S)
    return char_parity(completions, answers)


def nan_for_odd_lengths(completions: list[str], answers: list[str]) -> list[float]:
    """NaN for completions of odd length, else 1.0: a broken reward (issue 16, failure 1)."""
    return [float("nan") if len(c) % 2 else 1.0 for c in completions]


def huge_parity(completions: list[str], answers: list[str]) -> list[float]:
    """1e300 or 0.0 by character parity: finite in Python, inf in the learner's float32."""
    return [1e300 if len(c) % 2 == 0 else 0.0 for c in completions]
