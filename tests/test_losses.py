"""Unit tests of megatron_rlhf.losses: every loss and transform against a hand-computed value (the
arithmetic is written out in the comments), plus GAE vectorised == loop, micro-batching invariance
with global denominators, clip fractions, gradient flow, GroupDPO pair counting and the RLOO K>=2 check.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.losses import (LOSSES, best_of_k_sft_loss, dpo_loss, group_dpo_loss, grpo_loss,
                                  online_dpo_loss, ppo_loss, ppo_value_loss, proximal_rloo_loss,
                                  rloo_loss)
from megatron_rlhf.losses.advantages import (best_of_k_mask, gae, group_dpo_pairs,
                                             group_relative_advantages, kl_penalized_rewards,
                                             leave_one_out_advantages, masked_whiten,
                                             ppo_advantages, ppo_token_rewards)

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def approx(x, rel=1e-6, abs=1e-9):
    return pytest.approx(x, rel=rel, abs=abs)


# ----------------------------------------------------------------------------- advantages


@pytest.mark.timeout(60)
def test_group_relative_advantages_hand_values():
    # rewards [1, 0, 0]: mean = 1/3; population std = sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3
    # A = (2/3) / (sqrt(2)/3) = sqrt(2); (-1/3) / (sqrt(2)/3) = -1/sqrt(2)
    a = group_relative_advantages(t([[1.0, 0.0, 0.0]]), eps=0.0)
    assert a.tolist()[0] == approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    # without std normalisation: r - mean = [2/3, -1/3, -1/3]
    a = group_relative_advantages(t([[1.0, 0.0, 0.0]]), normalize_std=False)
    assert a.tolist()[0] == approx([2 / 3, -1 / 3, -1 / 3])
    # [B] + group ids, unequal labels: group 7 = [1, 0] (mean .5, std .5) -> [1, -1];
    # group 2 = [5, 3] (mean 4, std 1) -> [1, -1]
    a = group_relative_advantages(t([1.0, 5.0, 0.0, 3.0]), torch.tensor([7, 2, 7, 2]), eps=0.0)
    assert a.tolist() == approx([1.0, 1.0, -1.0, -1.0])
    # all-equal group: advantage 0 (not nan)
    assert group_relative_advantages(t([[1.0, 1.0]])).tolist() == [[0.0, 0.0]]


@pytest.mark.timeout(60)
def test_leave_one_out_advantages_hand_values():
    # [1, 0, 0]: A0 = 1 - (0+0)/2 = 1; A1 = 0 - (1+0)/2 = -0.5; A2 = -0.5
    a = leave_one_out_advantages(t([[1.0, 0.0, 0.0]]))
    assert a.tolist() == [[1.0, -0.5, -0.5]]
    # [B] + ids, K=2: [3, 1] -> A = [3-1, 1-3] = [2, -2]
    a = leave_one_out_advantages(t([3.0, 1.0]), torch.tensor([0, 0]))
    assert a.tolist() == [2.0, -2.0]


@pytest.mark.timeout(60)
def test_rloo_baseline_with_one_sample_per_group_raises_clear_error():
    with pytest.raises(ValueError, match="K >= 2"):
        leave_one_out_advantages(t([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="samples_per_prompt"):
        leave_one_out_advantages(t([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def _kl_example():
    mask = t([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    old = t([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])   # 9.0 sits on padding: must be ignored
    ref = t([[0.0, -1.5, -1.0], [0.0, -1.0, 0.0]])
    return mask, old, ref


@pytest.mark.timeout(60)
def test_kl_penalized_rewards_hand_values():
    mask, old, ref = _kl_example()
    # row0: sum (old - ref) = (-1 + 1.5) + (-2 + 1) = -0.5 -> 1 - 0.1 * (-0.5) = 1.05
    # row1: (-0.5 + 1) = 0.5 -> 2 - 0.1 * 0.5 = 1.95
    r = kl_penalized_rewards(t([1.0, 2.0]), mask, old, ref, 0.1)
    assert r.tolist() == approx([1.05, 1.95])


@pytest.mark.timeout(60)
def test_ppo_token_rewards_puts_reward_on_last_token_and_kl_on_every_token():
    mask, old, ref = _kl_example()
    # row0: [0, -0.1*0.5, -0.1*(-1) + 1] = [0, -0.05, 1.1]
    # row1: [0, -0.1*0.5 + 2, 0]          = [0, 1.95, 0]
    r = ppo_token_rewards(t([1.0, 2.0]), mask, old, ref, 0.1)
    assert r[0].tolist() == approx([0.0, -0.05, 1.1])
    assert r[1].tolist() == approx([0.0, 1.95, 0.0])
    with pytest.raises(ValueError, match="rows without completion tokens"):
        ppo_token_rewards(t([1.0]), t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[0.0, 0.0]]), 0.1)


@pytest.mark.timeout(60)
def test_gae_hand_values():
    # mask [0,1,1], r = [0, 0, 1], V = [9 (prompt, ignored), 0.5, 0.8], gamma = 1, lam = 0.5
    # t=2: delta = 1 + 0 - 0.8 = 0.2;             A2 = 0.2
    # t=1: delta = 0 + 0.8 - 0.5 = 0.3;           A1 = 0.3 + 0.5 * 0.2 = 0.4
    # returns = A + V = [0, 0.9, 1.0]
    adv, ret = gae(t([[0.0, 0.0, 1.0]]), t([[9.0, 0.5, 0.8]]), t([[0.0, 1.0, 1.0]]),
                   gamma=1.0, lam=0.5)
    assert adv[0].tolist() == approx([0.0, 0.4, 0.2])
    assert ret[0].tolist() == approx([0.0, 0.9, 1.0])


def _gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE (Schulman et al. 2016, eq. 16), one row and one token at a time."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [i for i in range(rewards.shape[1]) if mask[b, i] > 0]
        a_next, v_next = 0.0, 0.0
        for i in reversed(idx):
            delta = float(rewards[b, i]) + gamma * v_next - float(values[b, i])
            a_next = delta + gamma * lam * a_next
            v_next = float(values[b, i])
            adv[b, i] = a_next
    return adv


@pytest.mark.timeout(60)
def test_gae_vectorised_matches_looped_reference():
    g = torch.Generator().manual_seed(0)
    mask = t([[0, 0, 1, 1, 1, 1, 0, 0],
              [0, 1, 1, 1, 1, 1, 1, 1],
              [0, 0, 0, 1, 0, 0, 0, 0],
              [0, 1, 1, 0, 0, 1, 1, 0]])   # last row: a masked-out span inside the completion
    rewards = torch.randn(4, 8, generator=g, dtype=D)
    values = torch.randn(4, 8, generator=g, dtype=D)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)]:
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
        ref = _gae_loop(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv, ref)
        torch.testing.assert_close(ret, (ref + values) * mask)


@pytest.mark.timeout(60)
def test_masked_whiten_and_ppo_advantages():
    # x = [1, 2, 3] (4th position masked): mean 2, var = (1 + 0 + 1)/3 = 2/3 -> [-1.2247, 0, 1.2247]
    w = masked_whiten(t([[1.0, 2.0, 3.0, 100.0]]), t([[1.0, 1.0, 1.0, 0.0]]), eps=0.0)
    s = math.sqrt(1.5)
    assert w[0].tolist() == approx([-s, 0.0, s, 0.0])
    # ppo_advantages(whiten=False) == gae(ppo_token_rewards(...))
    mask, old, ref = _kl_example()
    values = t([[0.0, 0.3, -0.2], [0.0, 0.7, 0.0]])
    adv, ret, m = ppo_advantages(t([1.0, 2.0]), mask, old, ref, values, kl_beta=0.1, gamma=1.0,
                                 lam=0.9, whiten=False)
    tok = ppo_token_rewards(t([1.0, 2.0]), mask, old, ref, 0.1)
    adv2, ret2 = gae(tok, values, mask, gamma=1.0, lam=0.9)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    # mean token KL penalty: (-0.05 + 0.1 - 0.05) / 3 = 0
    assert float(m["ppo/token_kl_penalty"]) == approx(0.0)


@pytest.mark.timeout(60)
def test_best_of_k_mask_and_group_dpo_pairs():
    # group 0: max 0.9 at index 1 and 2 -> first (1); group 1: max 0.5 at index 0
    m = best_of_k_mask(t([[0.1, 0.9, 0.9], [0.5, 0.2, 0.1]]))
    assert m.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    m = best_of_k_mask(t([0.0, 3.0, 1.0, 2.0]), torch.tensor([5, 6, 5, 6]))
    assert m.tolist() == [0.0, 1.0, 1.0, 0.0]
    # 2 correct (0, 1) x 1 incorrect (2) = 2 pairs; all-correct group 1 (3, 4) adds none
    c, r = group_dpo_pairs(t([1.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert list(zip(c.tolist(), r.tolist())) == [(0, 2), (1, 2)]


# ----------------------------------------------------------------------------- DPO family


@pytest.mark.timeout(60)
def test_online_dpo_loss_hand_value_with_nll_on_chosen():
    # beta = 0.5: chosen = 0.5 (-1 + 1.5) = 0.25; rejected = 0.5 (-2 + 1.5) = -0.25; margin 0.5
    # -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077
    # NLL on chosen, length-normalised: -(-1)/4 = 0.25; nll_coef 0.2 -> + 0.05 => 0.524077
    args = (t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5]), 0.5)
    dpo_only = LN(1 + math.exp(-0.5))
    loss, m = online_dpo_loss(*args, chosen_lengths=t([4.0]), nll_coef=0.2)
    assert float(loss) == approx(dpo_only + 0.05)
    assert float(m["loss/nll"]) == approx(0.25)
    assert float(m["dpo/margin"]) == approx(0.5)
    # nll_coef = 0 reproduces dpo_loss exactly (the learner's current behaviour)
    loss0, _ = online_dpo_loss(*args)
    assert float(loss0) == approx(float(dpo_loss(*args)[0])) == approx(dpo_only)


@pytest.mark.timeout(60)
def test_group_dpo_two_correct_one_incorrect_averages_exactly_two_pairs():
    # sequence logps (2 tokens each): policy [-1, -2, -3], ref [-2, -2, -2]
    # log-ratios: [1, 0, -1]; rewards [1, 1, 0] -> pairs (0,2): margin 2, (1,2): margin 1 (beta 1)
    # loss = (log(1+e^-2) + log(1+e^-1)) / 2 = (0.126928 + 0.313262) / 2 = 0.220095
    logp = t([[-0.5, -0.5], [-1.0, -1.0], [-1.5, -1.5]])
    ref = torch.full((3, 2), -1.0, dtype=D)
    mask = torch.ones(3, 2, dtype=D)
    loss, m = group_dpo_loss(logp, ref, mask, t([[1.0, 1.0, 0.0]]), 1.0)
    expected = (LN(1 + math.exp(-2)) + LN(1 + math.exp(-1))) / 2
    assert float(loss) == approx(expected)
    assert float(m["group_dpo/num_pairs"]) == 2.0
    assert float(m["dpo/accuracy"]) == 1.0


@pytest.mark.timeout(60)
def test_group_dpo_plus_alpha_grpo_adds_the_grpo_loss():
    logp = t([[-0.5, -0.5], [-1.0, -1.0], [-1.5, -1.5]])
    old = logp - 0.1
    ref = torch.full((3, 2), -1.0, dtype=D)
    mask = torch.ones(3, 2, dtype=D)
    rewards = t([[1.0, 1.0, 0.0]])
    adv = group_relative_advantages(rewards).reshape(-1)
    base, _ = group_dpo_loss(logp, ref, mask, rewards, 1.0)
    g, _ = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, clip_eps=0.2)
    total, m = group_dpo_loss(logp, ref, mask, rewards, 1.0, alpha=0.5, old_logprobs=old,
                              advantages=adv, clip_eps=0.2)
    assert float(total) == approx(float(base) + 0.5 * float(g))
    assert "grpo/pg/clip_frac" in m


# ----------------------------------------------------------------------------- GRPO


def _grpo_example():
    # old logprobs all log 0.5; current ratios: row0 [1.5, 0.9, pad], row1 [1.0, 0.7, 1.1]
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.full((2, 3), LN(0.5), dtype=D)
    ratios = t([[1.5, 0.9, 1.0], [1.0, 0.7, 1.1]])
    logp = old + torch.log(ratios)
    logp[0, 2] = float("nan")   # padding may hold garbage; must not leak into the loss
    return logp, old, mask, t([1.0, -1.0])


@pytest.mark.timeout(60)
def test_grpo_loss_hand_values_each_aggregation_and_clip_fraction():
    logp, old, mask, adv = _grpo_example()
    # eps 0.2. A=+1 row: max(-r, -clip(r)): r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped);
    #                                       r=0.9 -> -0.9
    # A=-1 row: max(r, clip(r)): r=1.0 -> 1.0; r=0.7 -> max(0.7, 0.8) = 0.8 (clipped); r=1.1 -> 1.1
    # sequence_sum:        (-1.2 - 0.9 + 1.0 + 0.8 + 1.1) / 2 = 0.8 / 2 = 0.4
    # sequence_token_mean: ((-2.1)/2 + 2.9/3) / 2 = (-1.05 + 0.966667) / 2 = -0.0416667
    # token_mean:          0.8 / 5 = 0.16
    # clip fraction: 2 of 5 tokens
    expected = {"sequence_sum": 0.4, "sequence_token_mean": (-1.05 + 2.9 / 3) / 2,
                "token_mean": 0.16}
    for agg, value in expected.items():
        loss, m = grpo_loss(logp, old, adv, mask, clip_eps=0.2, loss_agg=agg)
        assert float(loss) == approx(value), agg
        assert float(m["pg/clip_frac"]) == approx(0.4)
        assert float(m["pg/ratio_max"]) == approx(1.5)
        assert float(m["pg/ratio_min"]) == approx(0.7)
        assert float(m["adv/mean"]) == approx(0.0) and float(m["adv/std"]) == approx(1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        grpo_loss(logp, old, adv, mask, loss_agg="mean")


@pytest.mark.timeout(60)
def test_grpo_k3_kl_term_hand_value():
    # one token: logp = log 0.5, ref = log 0.25: d = ref - logp = -ln 2
    # k3 = e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147; A = 0 -> loss = 0.1 * 0.193147 / 1 sequence
    logp, ref, mask = t([[LN(0.5)]]), t([[LN(0.25)]]), t([[1.0]])
    loss, m = grpo_loss(logp, logp.clone(), t([0.0]), mask, ref_logprobs=ref, kl_beta=0.1)
    k3 = 0.5 + LN(2) - 1
    assert float(loss) == approx(0.1 * k3)
    assert float(m["kl/ref_k3"]) == approx(k3)
    assert float(m["kl/ref_k1"]) == approx(LN(2))


@pytest.mark.timeout(60)
def test_grpo_truncated_importance_sampling_hand_value():
    # pi_old = pi_theta (ratio 1) on 3 tokens, A = 1; generator logprobs:
    # tok0: gen 0.2 -> w = min(0.5/0.2 = 2.5, cap 2) = 2; tok1: gen 0.5 -> w = 1;
    # tok2: gen -inf (malformed) -> dropped and counted
    # loss = (-1 * 2) + (-1 * 1) = -3 over 1 sequence
    old = torch.full((1, 3), LN(0.5), dtype=D)
    gen = t([[LN(0.2), LN(0.5), float("-inf")]])
    loss, m = grpo_loss(old.clone(), old, t([1.0]), torch.ones(1, 3, dtype=D),
                        generator_logprobs=gen, tis_cap=2.0)
    assert float(loss) == approx(-3.0)
    assert float(m["tis/nonfinite_tokens"]) == 1.0
    assert float(m["tis/capped_frac"]) == approx(0.5)      # 1 of the 2 finite tokens
    assert float(m["tis/weight_mean"]) == approx(1.5)
    # gap metric: |ln .5 - ln .2| = 0.916291 and 0 -> mean 0.458145
    assert float(m["logprobs/gen_gap_abs_mean"]) == approx(LN(2.5) / 2)


@pytest.mark.timeout(60)
def test_grpo_entropy_bonus_hand_value():
    # ratio 1, A = 0: loss = -0.01 * (2 + 1) / 1 sequence = -0.03 (sequence_sum)
    lp = torch.full((1, 2), -1.0, dtype=D)
    loss, m = grpo_loss(lp, lp.clone(), t([0.0]), torch.ones(1, 2, dtype=D), entropy=t([[2.0, 1.0]]),
                        entropy_coef=0.01)
    assert float(loss) == approx(-0.03)
    assert float(m["entropy/mean"]) == approx(1.5)


# ----------------------------------------------------------------------------- PPO


@pytest.mark.timeout(60)
def test_ppo_value_loss_with_clipping_hand_value():
    # token0: v=1, v_old=.5, R=2: v_clip = .5 + clamp(.5, +-.2) = .7; (1-2)^2 = 1, (.7-2)^2 = 1.69
    #         -> 0.5 * 1.69 = 0.845 (clip active)
    # token1: v=0, v_old=.5, R=0: v_clip = .3; 0 vs .09 -> 0.045 (clip active)
    # token_mean: (0.845 + 0.045) / 2 = 0.445
    v, v_old, ret, mask = t([[1.0, 0.0]]), t([[0.5, 0.5]]), t([[2.0, 0.0]]), t([[1.0, 1.0]])
    loss, m = ppo_value_loss(v, v_old, ret, mask, value_clip_eps=0.2)
    assert float(loss) == approx(0.445)
    assert float(m["value/clip_frac"]) == approx(1.0)
    # no clipping: 0.5 * (1 + 0) / 2 = 0.25
    assert float(ppo_value_loss(v, v_old, ret, mask, value_clip_eps=None)[0]) == approx(0.25)


@pytest.mark.timeout(60)
def test_ppo_loss_hand_value_policy_plus_value():
    # ratios 1.3 on both tokens, eps .2, per-token A = [0.5, -2]:
    # tok0: max(-0.65, -0.5*1.2 = -0.6) = -0.6 (clipped); tok1: max(2.6, 2.4) = 2.6
    # policy token_mean = (-0.6 + 2.6) / 2 = 1.0; value part 0.5 * 0.445 (test above) = 0.2225
    old = torch.full((1, 2), -1.0, dtype=D)
    logp = old + LN(1.3)
    mask = t([[1.0, 1.0]])
    loss, m = ppo_loss(logp, old, t([[0.5, -2.0]]), mask, clip_eps=0.2, values=t([[1.0, 0.0]]),
                       old_values=t([[0.5, 0.5]]), returns=t([[2.0, 0.0]]), value_clip_eps=0.2,
                       value_coef=0.5)
    assert float(loss) == approx(1.2225)
    assert float(m["loss/policy"]) == approx(1.0)
    assert float(m["loss/value"]) == approx(0.2225)
    assert float(m["pg/clip_frac"]) == approx(0.5)
    with pytest.raises(ValueError, match="together"):
        ppo_loss(logp, old, t([[0.5, -2.0]]), mask, values=t([[1.0, 0.0]]))


# ----------------------------------------------------------------------------- RLOO family


@pytest.mark.timeout(60)
def test_rloo_loss_hand_value():
    # seq logps: row0 -1 - 2 = -3, row1 -0.5 (2nd token padding); A = [1, -0.5]
    # loss = -(1 * -3 + -0.5 * -0.5) / 2 = -(-3 + 0.25) / 2 = 1.375
    logp = t([[-1.0, -2.0], [-0.5, float("nan")]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    loss, m = rloo_loss(logp, t([1.0, -0.5]), mask)
    assert float(loss) == approx(1.375)
    assert float(m["adv/mean"]) == approx(0.25)


def _prloo_example():
    # log-ratios: row0 tokens [0.1, 0.2], row1 [-0.05, pad]; A = [1, -0.5]
    old = t([[-1.0, -1.0], [-2.0, -2.0]])
    logp = old + t([[0.1, 0.2], [-0.05, 0.0]])
    return logp, old, t([[1.0, 1.0], [1.0, 0.0]]), t([1.0, -0.5])


@pytest.mark.timeout(60)
def test_proximal_rloo_sequence_level_hand_value():
    logp, old, mask, adv = _prloo_example()
    # row0: rho = e^0.3 = 1.349859, A = 1: max(-1.349859, -1.2) = -1.2 (clipped)
    # row1: rho = e^-0.05 = 0.951229 (inside [0.8, 1.2]), A = -0.5: 0.475615
    # loss = (-1.2 + 0.475615) / 2 = -0.362193; clip fraction 1 of 2 sequences
    loss, m = proximal_rloo_loss(logp, old, adv, mask, level="sequence", clip_eps=0.2)
    assert float(loss) == approx((-1.2 + 0.5 * math.exp(-0.05)) / 2)
    assert float(m["pg/clip_frac"]) == approx(0.5)
    assert float(m["pg/ratio_max"]) == approx(math.exp(0.3))


@pytest.mark.timeout(60)
def test_proximal_rloo_token_level_hand_value():
    logp, old, mask, adv = _prloo_example()
    # row0 tokens: r = e^.1 = 1.105171 -> -1.105171; r = e^.2 = 1.221403 -> max(-1.2214, -1.2) = -1.2
    # row1: r = e^-.05 -> 0.5 * 0.951229 = 0.475615
    # sequence_sum: (-1.105171 - 1.2 + 0.475615) / 2 = -0.914778; clip fraction 1 of 3 tokens
    loss, m = proximal_rloo_loss(logp, old, adv, mask, level="token", clip_eps=0.2)
    assert float(loss) == approx((-math.exp(0.1) - 1.2 + 0.5 * math.exp(-0.05)) / 2)
    assert float(m["pg/clip_frac"]) == approx(1 / 3)
    with pytest.raises(ValueError, match="level"):
        proximal_rloo_loss(logp, old, adv, mask, level="tokens")


# ----------------------------------------------------------------------------- Best-of-K SFT


@pytest.mark.timeout(60)
def test_best_of_k_sft_loss_hand_value():
    logp = t([[-1.0, -2.0], [-3.0, -4.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    # row0 selected: NLL token mean = (1 + 2) / 2 = 1.5; row1 selected: 3 / 1 = 3
    assert float(best_of_k_sft_loss(logp, mask, selected=t([1.0, 0.0]))[0]) == approx(1.5)
    assert float(best_of_k_sft_loss(logp, mask, selected=t([0.0, 1.0]))[0]) == approx(3.0)
    # sequence_sum over both rows: (3 + 3) / 2 = 3
    assert float(best_of_k_sft_loss(logp, mask, loss_agg="sequence_sum")[0]) == approx(3.0)


# ----------------------------------------------------------------------------- invariances


def _random_batch(seed, b=4, tt=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, tt, dtype=D)
    for i, (s, e) in enumerate([(1, 6), (2, 4), (1, 2), (3, 6)][:b]):
        mask[i, s:e] = 1.0
    old = -torch.rand(b, tt, generator=g, dtype=D) * 2
    logp = old + 0.3 * torch.randn(b, tt, generator=g, dtype=D)
    ref = old + 0.2 * torch.randn(b, tt, generator=g, dtype=D)
    gen = old + 0.5 * torch.randn(b, tt, generator=g, dtype=D)
    ent = torch.rand(b, tt, generator=g, dtype=D)
    return dict(mask=mask, old=old, logp=logp, ref=ref, gen=gen, ent=ent,
                adv=torch.randn(b, generator=g, dtype=D),
                tok_adv=torch.randn(b, tt, generator=g, dtype=D),
                values=torch.randn(b, tt, generator=g, dtype=D),
                old_values=torch.randn(b, tt, generator=g, dtype=D),
                returns=torch.randn(b, tt, generator=g, dtype=D))


def _loss_cases():
    """(name, fn(batch dict, index slice, global kwargs) -> loss)."""
    def grpo(agg):
        return lambda d, s, gk: grpo_loss(
            d["logp"][s], d["old"][s], d["adv"][s], d["mask"][s], clip_eps=0.2,
            ref_logprobs=d["ref"][s], kl_beta=0.05, generator_logprobs=d["gen"][s], tis_cap=2.0,
            entropy=d["ent"][s], entropy_coef=0.01, loss_agg=agg, **gk)[0]

    def ppo(d, s, gk):
        return ppo_loss(d["logp"][s], d["old"][s], d["tok_adv"][s], d["mask"][s],
                        values=d["values"][s], old_values=d["old_values"][s],
                        returns=d["returns"][s], generator_logprobs=d["gen"][s], tis_cap=2.0,
                        **gk)[0]

    def rloo(d, s, gk):
        return rloo_loss(d["logp"][s], d["adv"][s], d["mask"][s], **gk)[0]

    def prloo(level):
        return lambda d, s, gk: proximal_rloo_loss(
            d["logp"][s], d["old"][s], d["adv"][s], d["mask"][s], level=level,
            generator_logprobs=d["gen"][s], tis_cap=2.0, **gk)[0]

    def sft(d, s, gk):
        return best_of_k_sft_loss(d["logp"][s], d["mask"][s], **gk)[0]

    return [("grpo_seq_sum", grpo("sequence_sum")), ("grpo_seq_tok_mean", grpo("sequence_token_mean")),
            ("grpo_tok_mean", grpo("token_mean")), ("ppo", ppo), ("rloo", rloo),
            ("proximal_rloo_seq", prloo("sequence")), ("proximal_rloo_tok", prloo("token")),
            ("best_of_k_sft", sft)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,fn", _loss_cases(), ids=[c[0] for c in _loss_cases()])
def test_micro_batches_with_global_denominators_sum_to_the_full_batch_loss(name, fn):
    d = _random_batch(1)
    gk = {"global_num_sequences": 4, "global_num_tokens": float(d["mask"].sum())}
    full = fn(d, slice(0, 4), {})
    halves = fn(d, slice(0, 2), gk) + fn(d, slice(2, 4), gk)
    assert float(full) == approx(float(halves), rel=1e-10)


@pytest.mark.timeout(60)
def test_dpo_family_micro_batching_with_global_pair_counts():
    # online DPO: 3 pairs split 2 + 1
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (torch.randn(3, generator=g, dtype=D) for _ in range(4))
    lens = t([3.0, 5.0, 2.0])
    kw = dict(nll_coef=0.3)
    full = online_dpo_loss(pc, pr, rc, rr, 0.1, chosen_lengths=lens, **kw)[0]
    a = online_dpo_loss(pc[:2], pr[:2], rc[:2], rr[:2], 0.1, chosen_lengths=lens[:2],
                        global_num_pairs=3, **kw)[0]
    b = online_dpo_loss(pc[2:], pr[2:], rc[2:], rr[2:], 0.1, chosen_lengths=lens[2:],
                        global_num_pairs=3, **kw)[0]
    assert float(full) == approx(float(a + b), rel=1e-10)
    # group DPO: 2 groups of 3 kept whole (group 0: 2x1 pairs, group 1: 1x2 pairs)
    d = _random_batch(3, b=4, tt=6)
    logp = torch.cat([d["logp"], d["logp"][:2]])
    ref = torch.cat([d["ref"], d["ref"][:2]])
    mask = torch.cat([d["mask"], d["mask"][:2]])
    rewards = t([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    full = group_dpo_loss(logp, ref, mask, rewards, 0.2)[0]
    a = group_dpo_loss(logp[:3], ref[:3], mask[:3], rewards[:1], 0.2, global_num_pairs=4)[0]
    b = group_dpo_loss(logp[3:], ref[3:], mask[3:], rewards[1:], 0.2, global_num_pairs=4)[0]
    assert float(full) == approx(float(a + b), rel=1e-10)


@pytest.mark.timeout(60)
def test_gradients_flow_only_through_current_logprobs_and_values():
    d = _random_batch(4)
    leaves = {k: v.clone().requires_grad_(True) for k, v in d.items() if k != "mask"}
    mask = d["mask"]
    losses = [
        grpo_loss(leaves["logp"], leaves["old"], leaves["adv"], mask, ref_logprobs=leaves["ref"],
                  kl_beta=0.1, generator_logprobs=leaves["gen"], tis_cap=2.0)[0],
        ppo_loss(leaves["logp"], leaves["old"], leaves["tok_adv"], mask, values=leaves["values"],
                 old_values=leaves["old_values"], returns=leaves["returns"],
                 ref_logprobs=leaves["ref"], generator_logprobs=leaves["gen"], tis_cap=2.0)[0],
        rloo_loss(leaves["logp"], leaves["adv"], mask)[0],
        proximal_rloo_loss(leaves["logp"], leaves["old"], leaves["adv"], mask,
                           generator_logprobs=leaves["gen"], tis_cap=2.0)[0],
        group_dpo_loss(leaves["logp"], leaves["ref"], mask, t([[1.0, 0.0], [1.0, 0.0]]), 0.1,
                       alpha=1.0, old_logprobs=leaves["old"], advantages=leaves["adv"],
                       generator_logprobs=leaves["gen"], tis_cap=2.0)[0],
        best_of_k_sft_loss(leaves["logp"], mask)[0],
    ]
    sum(losses).backward()
    assert leaves["logp"].grad is not None and leaves["logp"].grad.abs().sum() > 0
    assert leaves["values"].grad is not None and leaves["values"].grad.abs().sum() > 0
    # padding positions get no gradient
    assert float(leaves["logp"].grad[mask == 0].abs().sum()) == 0.0
    for name in ("old", "ref", "gen", "adv", "tok_adv", "old_values", "returns"):
        assert leaves[name].grad is None, name


@pytest.mark.timeout(60)
def test_registry_names_every_loss():
    assert set(LOSSES) == {"online_dpo", "group_dpo", "grpo", "ppo", "rloo", "proximal_rloo",
                           "best_of_k_sft"}
    assert LOSSES["grpo"] is grpo_loss and LOSSES["online_dpo"] is online_dpo_loss
