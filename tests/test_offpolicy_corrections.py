"""Off-policy corrections (``algorithm.is_correction``) and KL choices (``algorithm.kl_estimator``,
``algorithm.kl_in_reward``), every value checked against numbers worked out by hand.

The fixed batch: two completions, masks [1, 1, 1, 0] and [1, 1, 0, 0], pi_old = 0 and generator
logprobs chosen so that the per-token ratios pi_old / pi_gen are

    row 0: 3, 0.25, 1        (product 0.75, geometric mean 0.75^(1/3) = 0.9086)
    row 1: 1.5, 1.5          (product 2.25, geometric mean 1.5)
"""

from __future__ import annotations

import math

import pytest
import torch
from pytest import approx

pytestmark = pytest.mark.timeout(60)

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
RHO = torch.tensor([[3.0, 0.25, 1.0, 1.0], [1.5, 1.5, 1.0, 1.0]])
OLD = torch.zeros(2, 4)
GEN = OLD - torch.log(RHO)


def _flat(rows):
    return [v for r in rows for v in r]


def _w(correction, cap=2.0, bounds=(0.5, 2.0), gen=GEN):
    from megatron_rlhf.losses._common import offpolicy_weights

    w, m = offpolicy_weights(OLD, gen, MASK, correction, cap=cap, bounds=bounds)
    return w, {k: float(v) for k, v in m.items()}


def test_token_tis_truncates_each_token_ratio_at_the_cap():
    w, m = _w("token_tis")
    assert w.flatten().tolist() == approx(_flat([[2.0, 0.25, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert m["is/masked_frac"] == 0.0
    assert m["is/weight_mean"] == approx(6.25 / 5)
    assert m["is/weight_max"] == approx(2.0)
    assert m["is/ess"] == approx(6.25 ** 2 / (5 * 9.5625))          # (sum w)^2 / (n sum w^2)
    assert m["tis/capped_frac"] == approx(1 / 5) and m["tis/weight_mean"] == approx(1.25)


def test_token_mask_zeroes_tokens_outside_the_bounds_and_keeps_the_others_untruncated():
    w, m = _w("token_mask", bounds=(0.5, 2.0))                      # icepop / MIS
    assert w.flatten().tolist() == approx(_flat([[0.0, 0.0, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert m["is/masked_frac"] == approx(2 / 5)
    assert m["is/weight_mean"] == approx(4 / 3) and m["is/weight_max"] == approx(1.5)
    assert m["is/ess"] == approx(16 / (5 * 5.5))


def test_sequence_tis_gives_each_completion_its_truncated_ratio_product():
    w, m = _w("sequence_tis", cap=2.0)
    assert w.flatten().tolist() == approx(_flat([[0.75, 0.75, 0.75, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    assert m["is/masked_frac"] == 0.0
    assert m["is/weight_mean"] == approx((3 * 0.75 + 2 * 2.0) / 5) and m["is/weight_max"] == approx(2.0)
    assert m["is/ess"] == approx(2.75 ** 2 / (2 * (0.75 ** 2 + 4.0)))   # over the 2 sequences


def test_sequence_mask_drops_completions_by_geometric_mean_and_keeps_token_ratios():
    w, m = _w("sequence_mask", bounds=(0.5, 1.4))                   # seq-mask-tis: row 1 (1.5) out
    assert w.flatten().tolist() == approx(_flat([[3.0, 0.25, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert m["is/masked_frac"] == approx(2 / 5)
    assert m["is/weight_mean"] == approx(4.25 / 3) and m["is/weight_max"] == approx(3.0)
    assert m["is/ess"] == approx(4.25 ** 2 / (5 * 10.0625))
    w, m = _w("sequence_mask", bounds=(0.95, 2.0))                  # row 0 (0.9086) out instead
    assert w.flatten().tolist() == approx(_flat([[0.0, 0.0, 0.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert m["is/masked_frac"] == approx(3 / 5)


def test_none_weights_one_and_a_nonfinite_generator_logprob_drops_its_token_or_sequence():
    w, m = _w("none")
    assert w.tolist() == MASK.tolist() and m == {}
    gen = GEN.clone()
    gen[1, 0] = float("-inf")
    w, m = _w("token_mask", gen=gen)
    assert w[1].tolist() == approx([0.0, 1.5, 0.0, 0.0]) and m["is/nonfinite_tokens"] == 1.0
    w, m = _w("sequence_tis", gen=gen)
    assert w[1].tolist() == [0.0] * 4 and w[0, 0] == approx(0.75)
    w, _ = _w("sequence_mask", gen=gen)
    assert w[1].tolist() == [0.0] * 4


def test_effective_sample_size_is_one_for_equal_weights_and_one_over_n_for_one_weight():
    from megatron_rlhf.losses._common import effective_sample_size

    m = torch.ones(4)
    assert float(effective_sample_size(torch.full((4,), 0.3), m)) == approx(1.0)
    assert float(effective_sample_size(torch.tensor([0.0, 0.0, 5.0, 0.0]), m)) == approx(0.25)
    assert float(effective_sample_size(torch.zeros(4), m)) == 0.0


def test_bad_cap_bounds_and_names_raise():
    from megatron_rlhf.losses._common import offpolicy_weights, sequence_offpolicy_weights

    with pytest.raises(ValueError, match="is_bounds"):
        offpolicy_weights(OLD, GEN, MASK, "token_mask", cap=2.0, bounds=(2.0, 0.5))
    with pytest.raises(ValueError, match="tis_cap"):
        offpolicy_weights(OLD, GEN, MASK, "sequence_tis", cap=None, bounds=None)
    with pytest.raises(ValueError, match="is_correction"):
        offpolicy_weights(OLD, GEN, MASK, "clip", cap=2.0, bounds=None)
    with pytest.raises(ValueError, match="no sequence-level form"):
        sequence_offpolicy_weights(OLD, GEN, MASK, "token_mask", cap=2.0, bounds=(0.5, 2.0))


def test_grpo_loss_with_token_mask_weights_each_token_by_hand():
    from megatron_rlhf.losses.grpo import grpo_loss

    lp = OLD.clone().requires_grad_(True)       # ratio pi_theta / pi_old = 1: the clip is inactive
    adv = torch.tensor([1.0, -1.0])
    loss, m = grpo_loss(lp, OLD, adv, MASK, generator_logprobs=GEN, tis_cap=2.0,
                        is_correction="token_mask", is_bounds=(0.5, 2.0))
    # sequence_sum / N: row 0: -1 * (0 + 0 + 1); row 1: +1 * (1.5 + 1.5)  ->  (-1 + 3) / 2
    assert loss.item() == approx(1.0) and float(m["is/masked_frac"]) == approx(0.4)
    loss.backward()
    assert lp.grad.flatten().tolist() == approx(_flat([[0.0, 0.0, -0.5, 0.0], [0.75, 0.75, 0.0, 0.0]]))
    loss_tis, _ = grpo_loss(OLD, OLD, adv, MASK, generator_logprobs=GEN, tis_cap=2.0)   # the default
    assert float(loss_tis) == approx((-(2 + 0.25 + 1) + 3) / 2)
    loss_none, _ = grpo_loss(OLD, OLD, adv, MASK, generator_logprobs=GEN, tis_cap=2.0, is_correction="none")
    assert float(loss_none) == approx((-3 + 2) / 2)


def test_rloo_and_sequence_level_proximal_rloo_take_the_corrections():
    from megatron_rlhf.losses.rloo import proximal_rloo_loss, rloo_loss

    adv = torch.tensor([1.0, -1.0])
    lp = OLD.clone()                      # rloo's numerator is pi_theta (detached): the same ratios
    loss, m = rloo_loss(lp, adv, MASK, generator_logprobs=GEN, tis_cap=2.0, is_correction="sequence_tis")
    assert float(loss) == 0.0 and float(m["is/weight_max"]) == approx(2.0)   # logp = 0: the value is 0
    # proximal (sequence level), rho = 1: per-sequence -A_i w_i / N with w = (0.75, 2) truncated
    loss, m = proximal_rloo_loss(lp, OLD, adv, MASK, generator_logprobs=GEN, tis_cap=2.0,
                                 is_correction="sequence_tis")
    assert float(loss) == approx((-0.75 + 2.0) / 2)
    loss, m = proximal_rloo_loss(lp, OLD, adv, MASK, generator_logprobs=GEN, tis_cap=2.0,
                                 is_correction="sequence_mask", is_bounds=(0.5, 1.4))
    assert float(loss) == approx(-0.75 / 2) and float(m["is/masked_frac"]) == approx(0.4)


# ----------------------------------------------------------------------------- KL estimators
LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.2, -1.5]])          # r = log pi - log pi_ref = (0.2, -0.5)
ONE = torch.ones(1, 2)
BY_HAND = {"k1": [0.2, -0.5], "k2": [0.02, 0.125],
           "k3": [math.exp(-0.2) - 1 + 0.2, math.exp(0.5) - 1 - 0.5]}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_on_fixed_logprobs(estimator):
    from megatron_rlhf.losses._common import kl_estimate

    assert kl_estimate(LP, REF, ONE, estimator)[0].tolist() == approx(BY_HAND[estimator])
    assert kl_estimate(LP, REF, torch.tensor([[1.0, 0.0]]), estimator)[0, 1] == 0.0
    lp = LP.clone().requires_grad_(True)
    kl_estimate(lp, REF, ONE, estimator).sum().backward()
    grad = {"k1": [1.0, 1.0], "k2": [0.2, -0.5], "k3": [1 - math.exp(-0.2), 1 - math.exp(0.5)]}
    assert lp.grad[0].tolist() == approx(grad[estimator])          # d/d logp of each estimator


def test_kl_in_the_reward_uses_the_estimator_on_pi_old():
    from megatron_rlhf.losses.advantages import kl_penalized_rewards, ppo_token_rewards

    r = kl_penalized_rewards(torch.tensor([1.0]), ONE, LP, REF, 0.1, "k2")
    assert float(r[0]) == approx(1.0 - 0.1 * (0.02 + 0.125))
    assert float(kl_penalized_rewards(torch.tensor([1.0]), ONE, LP, REF, 0.1)[0]) == approx(1.0 - 0.1 * -0.3)
    tok = ppo_token_rewards(torch.tensor([1.0]), ONE, LP, REF, 0.1, "k3")
    assert tok[0].tolist() == approx([-0.1 * BY_HAND["k3"][0], 1.0 - 0.1 * BY_HAND["k3"][1]])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalized_rewards(torch.tensor([1.0]), ONE, LP, REF, 0.1, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_loss_for_ppo_and_rloo(estimator):
    from megatron_rlhf.losses.ppo import ppo_loss
    from megatron_rlhf.losses.rloo import rloo_loss

    zero_adv = torch.zeros(1, 2)
    loss, m = ppo_loss(LP, LP, zero_adv, ONE, ref_logprobs=REF, kl_beta=0.5, kl_estimator=estimator)
    assert float(loss) == approx(0.5 * sum(BY_HAND[estimator]) / 2)        # token_mean over 2 tokens
    assert float(m["kl/ref_k2"]) == approx(0.0725)
    loss, m = rloo_loss(LP, torch.zeros(1), ONE, ref_logprobs=REF, kl_beta=0.5, kl_estimator=estimator)
    assert float(loss) == approx(0.5 * sum(BY_HAND[estimator]))           # sequence_sum, N = 1


def test_config_defaults_keep_the_kl_where_it_was_and_the_learner_follows_kl_in_reward():
    from megatron_rlhf.config import AlgorithmConfig, ConfigError
    from megatron_rlhf.learner.objectives import LossSpec, prepare_batch

    grpo, ppo = AlgorithmConfig(loss="grpo", kl_beta=0.1), AlgorithmConfig(loss="ppo", kl_beta=0.1)
    assert (grpo.kl_in_reward_used, grpo.kl_estimator_used) == (False, "k3")
    assert (ppo.kl_in_reward_used, ppo.kl_estimator_used) == (True, "k1")
    assert AlgorithmConfig(loss="rloo", kl_in_reward=False).kl_estimator_used == "k3"
    grpo_r = AlgorithmConfig(loss="grpo", kl_beta=0.5, kl_in_reward=True, kl_estimator="k2")
    spec = LossSpec.of(grpo_r)
    assert spec.kl_in_reward and spec.recompute_old
    assert not LossSpec.of(AlgorithmConfig(loss="rloo", kl_beta=0.5, kl_in_reward=False)).kl_in_reward
    mask = torch.ones(2, 2)
    lp, ref = torch.cat([LP, LP]), torch.tensor([[-1.2, -1.5], [-1.2, -3.0]])   # r1 = (0.2, 1.0)
    prep = prepare_batch(grpo_r, mask=mask, rewards=torch.tensor([1.0, 1.0]),
                         group_ids=torch.tensor([0, 0]), ref_logprobs=ref, old_logprobs=lp)
    # penalties 0.5 * sum_t k2: row 0: 0.5 * (0.02 + 0.125), row 1: 0.5 * (0.02 + 0.5)
    assert prep.metrics["reward/kl_penalty_mean"] == approx((0.0725 + 0.26) / 2)
    assert prep.advantages.tolist() == approx([1.0, -1.0], abs=1e-4)    # equal rewards, KL decides
    for bad in (dict(kl_estimator="k4"), dict(loss="online_dpo", kl_in_reward=True),
                dict(is_correction="clip"), dict(is_correction="token_mask", is_bounds=[2.0, 1.0]),
                dict(loss="grpo", is_correction="sequence_tis", tis_cap=None),
                dict(loss="proximal_rloo", is_correction="token_mask")):
        with pytest.raises(ConfigError):
            AlgorithmConfig(**bad)


def test_config_names_match_the_losses():
    from megatron_rlhf import config
    from megatron_rlhf.losses import _common

    assert config.IS_CORRECTIONS == _common.IS_CORRECTIONS and config.KL_ESTIMATORS == _common.KL_ESTIMATORS


# ----------------------------------------------------------------------------- through the learner
LEARNER_CASES = [   # (loss, knobs): every correction and KL choice once, on MegatronLearner.train_step
    ("grpo", dict(is_correction="token_mask", kl_estimator="k2")),
    ("grpo", dict(is_correction="none", kl_in_reward=True, kl_estimator="k1")),
    ("ppo", dict(is_correction="sequence_mask", is_bounds=[0.01, 100.0], kl_in_reward=False)),
    ("rloo", dict(is_correction="sequence_tis", kl_estimator="k3")),
    ("proximal_rloo", dict(is_correction="sequence_mask", is_bounds=[0.01, 100.0], kl_in_reward=False,
                           updates_per_batch=2)),
]


@pytest.mark.timeout(300)
def test_each_correction_and_kl_choice_trains_through_the_learner(tiny_llama_dir):
    """One process, no Ray: two train steps per case on hand-built batches whose generator logprobs
    are random (so the masks do drop tokens), with the metrics each choice must log."""
    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner
    from tests.test_learner_losses import _batch, _vocab

    vocab = _vocab(tiny_llama_dir)
    for loss, knobs in LEARNER_CASES:
        algo = AlgorithmConfig(loss=loss, samples_per_prompt=3, kl_beta=0.05, **knobs)
        learner = MegatronLearner(model_dir=str(tiny_llama_dir), total_steps=4,
                                  learner_cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-3)),
                                  algorithm_cfg=algo)
        try:
            rows = [learner.train_step(_batch(loss, vocab, seed=s)) for s in range(2)]
        finally:
            learner.close()
        for m in rows:
            assert math.isfinite(m["loss/total"]) and m["perf/learner_tokens_per_s"] > 0, (loss, knobs)
            assert m["perf/learner_tflops"] > 0 and "perf/mfu" not in m
            assert ("loss/kl_ref" in m) == (not algo.kl_in_reward_used), (loss, knobs)
            assert ("reward/kl_penalty_mean" in m) == algo.kl_in_reward_used, (loss, knobs)
            if knobs["is_correction"] == "none":
                assert "is/masked_frac" not in m
            else:
                assert 0.0 <= m["is/ess"] <= 1.0 + 1e-6 and math.isfinite(m["is/weight_max"])
        if knobs["is_correction"] in ("token_mask", "sequence_mask"):
            assert any(m["is/masked_frac"] > 0 for m in rows), (loss, knobs)   # random gen logprobs
