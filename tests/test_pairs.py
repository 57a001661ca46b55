"""select_pair: the DPO pair rule for one prompt's K scored completions."""

import random

import pytest

from megatron_rlhf.rollout.pairs import select_pair


@pytest.mark.timeout(10)
def test_binary_all_correct_or_all_wrong_gives_no_pair():
    rng = random.Random(0)
    assert select_pair([1.0] * 8, rng, binary=True) is None
    assert select_pair([0.0] * 8, rng, binary=True) is None
    assert select_pair([1.0], rng, binary=True) is None
    assert select_pair([], rng, binary=True) is None


@pytest.mark.timeout(10)
def test_binary_picks_a_correct_chosen_and_an_incorrect_rejected():
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    rng = random.Random(1)
    seen_chosen, seen_rejected = set(), set()
    for _ in range(200):
        c, r = select_pair(rewards, rng, binary=True)
        assert rewards[c] == 1.0 and rewards[r] == 0.0
        seen_chosen.add(c)
        seen_rejected.add(r)
    # random among ALL correct / incorrect, not always the first one
    assert seen_chosen == {1, 4, 7}
    assert seen_rejected == {0, 2, 3, 5, 6}


@pytest.mark.timeout(10)
def test_scalar_ties_give_no_pair_and_best_vs_worst_otherwise():
    rng = random.Random(0)
    assert select_pair([0.3, 0.3, 0.3], rng, binary=False) is None
    assert select_pair([0.1, 0.9, -0.5, 0.2], rng, binary=False) == (1, 2)
    for _ in range(50):  # tied best: either max index, rejected is the unique min
        c, r = select_pair([2.0, -1.0, 2.0], rng, binary=False)
        assert c in (0, 2) and r == 1


@pytest.mark.timeout(10)
def test_same_seed_gives_same_choices_and_other_seeds_differ():
    rewards = [1.0, 0.0] * 8

    def draws(seed):
        rng = random.Random(seed)
        return [select_pair(rewards, rng, binary=True) for _ in range(20)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


@pytest.mark.timeout(10)
def test_non_finite_reward_raises_naming_the_index():
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        select_pair([1.0, float("nan")], random.Random(0), binary=True)
