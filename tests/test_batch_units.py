"""Units of a learner batch per loss (pair / group / best), staleness over groups, the algorithm
config's knobs, and the synthetic sweep reward."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, ConfigError
from megatron_rlhf.rollout.staleness import split_by_staleness
from megatron_rlhf.types import Completion, LearnerBatch, Prompt, Rollout, RolloutGroup

pytestmark = pytest.mark.timeout(60)


def _group(index=0, versions=(0, 1, 1), rewards=(0.0, 1.0, 1.0), pair=(1, 0), loss_rewards=None):
    p = Prompt(index=index, task="math", token_ids=(1, 2, 3), answer="4", text="2+2?")
    rollouts = tuple(Rollout(prompt=p, reward=r, completion=Completion(
        token_ids=tuple(range(10, 12 + i)), logprobs=tuple(-0.1 * (k + 1) for k in range(2 + i)),
        finish_reason="stop", text=f"c{i}", weight_version=v)) for i, (v, r) in enumerate(zip(versions, rewards)))
    return RolloutGroup(prompt=p, rollouts=rollouts, pair=pair, loss_rewards=loss_rewards)


def test_pair_rows_are_chosen_then_rejected():
    b = LearnerBatch.from_groups([_group(), _group(1)], "pair", pad_id=0)
    assert b.unit == "pair" and b.num_units == 2 and b.input_ids.shape == (4, 8)
    assert b.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and b.group_ids.tolist() == [0, 0, 1, 1]
    # chosen = completion 1: 3 prompt tokens then 3 completion tokens 10, 11, 12
    assert b.input_ids[0, :6].tolist() == [1, 2, 3, 10, 11, 12]
    assert b.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert b.sampling_logprobs[0, 3:6].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.weight_version == 0


def test_group_rows_keep_all_k_and_loss_rewards():
    g = _group(loss_rewards=(-1.0, 0.5, 0.5))
    b = LearnerBatch.from_groups([g], "group", pad_id=0)
    assert b.input_ids.shape[0] == 3 and b.rewards.tolist() == [-1.0, 0.5, 0.5]
    assert b.group_ids.tolist() == [0, 0, 0] and b.loss_mask.sum().item() == 2 + 3 + 4


def test_best_row_is_the_first_highest_reward():
    b = LearnerBatch.from_groups([_group(rewards=(0.2, 0.9, 0.9))], "best", pad_id=0)
    assert b.input_ids.shape[0] == 1 and b.rewards.tolist() == [pytest.approx(0.9)]
    assert b.loss_mask.sum().item() == 3            # completion 1 (3 tokens), not completion 2


def test_from_groups_errors():
    with pytest.raises(ValueError, match="no groups"):
        LearnerBatch.from_groups([], "group", 0)
    with pytest.raises(ValueError, match="unit"):
        LearnerBatch.from_groups([_group()], "triple", 0)
    with pytest.raises(ValueError, match="has no pair"):
        LearnerBatch.from_groups([_group(pair=None)], "pair", 0)


def test_staleness_counts_only_trained_rollouts():
    g = _group(versions=(0, 2, 2), pair=(1, 2))
    kept, m = split_by_staleness([g], learner_version=2, max_staleness=1, unit="pair")
    assert kept == [g] and m["staleness/max"] == 0 and m["staleness/hist_0"] == 2
    kept, m = split_by_staleness([g], learner_version=2, max_staleness=1, unit="group")
    assert kept == [] and m["staleness/dropped_pairs"] == 1 and m["staleness/dropped_samples"] == 3
    assert m["staleness/hist_over"] == 1 and m["staleness/max"] == 2


def test_algorithm_config_knobs():
    a = AlgorithmConfig(pairs_per_step=6)
    assert a.prompts_per_step == 6 and a.unit == "pair" and not a.is_policy_gradient
    assert AlgorithmConfig(loss="grpo").unit == "group" and AlgorithmConfig(loss="ppo").is_policy_gradient
    assert AlgorithmConfig(loss="best_of_k_sft").unit == "best"
    assert AlgorithmConfig().prompts_per_step == 4
    with pytest.raises(ConfigError, match="pairs_per_step"):
        AlgorithmConfig(prompts_per_step=4, pairs_per_step=2)
    with pytest.raises(ConfigError, match="algorithm.loss"):
        AlgorithmConfig(loss="reinforce")
    for bad in (dict(tis_cap=0.5), dict(updates_per_batch=0), dict(clip_eps=0), dict(loss_agg="mean"),
                dict(gamma=0), dict(proximal_rloo_level="batch"), dict(kl_beta=-1)):
        with pytest.raises(ConfigError):
            AlgorithmConfig(**bad)


def test_loss_names_match_the_registry():
    from megatron_rlhf.config import LOSS_NAMES
    from megatron_rlhf.losses.registry import LOSSES

    assert set(LOSS_NAMES) == set(LOSSES)


def test_letter_rate_by_hand():
    from megatron_rlhf.rewards.synthetic import letter_rate

    assert letter_rate(["aab", "", "xyz", "Io"], ["", "", "", ""]) == [2 / 3, 0.0, 0.0, 0.5]
    with pytest.raises(ValueError):
        letter_rate(["a"], [])
    assert torch.tensor(letter_rate(["hello world"], [""])).item() == pytest.approx(3 / 11)
