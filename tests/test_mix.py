"""Exact per-batch task quotas (largest-remainder / Hamilton rounding)."""

import math
import random

import pytest

from megatron_rlhf.data.mix import task_quotas


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_batch_of_8_with_weights_075_025_is_exactly_6_math_2_chat():
    assert task_quotas({"math": 0.75, "chat": 0.25}, 8) == {"math": 6, "chat": 2}
    # unnormalised weights give the same split
    assert task_quotas({"math": 3.0, "chat": 1.0}, 8) == {"math": 6, "chat": 2}


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_largest_remainder_gives_leftover_seats_to_largest_fractions():
    # exact shares 10 * (0.47, 0.33, 0.2) = 4.7, 3.3, 2.0 -> floors 4, 3, 2, one seat left -> a (0.7)
    assert task_quotas({"a": 0.47, "b": 0.33, "c": 0.2}, 10) == {"a": 5, "b": 3, "c": 2}
    # shares 7 * (0.4, 0.35, 0.25) = 2.8, 2.45, 1.75 -> 2, 2, 1 + two seats -> a (.8), c (.75)
    assert task_quotas({"a": 0.4, "b": 0.35, "c": 0.25}, 7) == {"a": 3, "b": 2, "c": 2}


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_ties_are_broken_by_weight_then_name_independent_of_dict_order():
    # equal weights, one seat: name order decides, whatever the insertion order
    assert task_quotas({"b": 1.0, "a": 1.0}, 1) == {"b": 0, "a": 1}
    assert task_quotas({"a": 1.0, "b": 1.0}, 1) == {"a": 1, "b": 0}
    # three equal thirds of 3 -> exactly one each (no float rounding drift)
    assert task_quotas({"x": 1 / 3, "y": 1 / 3, "z": 1 / 3}, 3) == {"x": 1, "y": 1, "z": 1}


@pytest.mark.timeout(30)
def test_random_weights_sum_to_total_and_respect_the_quota_property():
    rng = random.Random(0)
    for _ in range(2000):
        k = rng.randint(1, 6)
        weights = {f"t{i}": rng.choice([0.0, rng.random(), rng.randint(1, 9)]) for i in range(k)}
        if sum(weights.values()) == 0:
            weights["t0"] = 1.0
        total = rng.randint(0, 64)
        q = task_quotas(weights, total)
        assert list(q) == list(weights)
        assert sum(q.values()) == total
        s = sum(weights.values())
        for name, w in weights.items():
            share = total * w / s
            assert math.floor(share) - 1e-9 <= q[name] <= math.ceil(share) + 1e-9, (weights, total, q)
            if w == 0:
                assert q[name] == 0


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
@pytest.mark.parametrize("weights,total", [({}, 8), ({"a": -1.0}, 8), ({"a": float("nan")}, 8),
                                           ({"a": 0.0, "b": 0.0}, 8), ({"a": 1.0}, -1)])
def test_invalid_weights_or_total_raise_value_error_naming_the_problem(weights, total):
    with pytest.raises(ValueError):
        task_quotas(weights, total)
