"""MegatronLearner.train_step with every ``algorithm.loss`` on a tiny random Llama (CPU, gloo):
each loss trains on a hand-built batch of ``RolloutGroup`` s, micro-batching does not change the
update, T = 1 has ratio exactly 1, T = 2 takes two optimizer steps per batch, the learner's
logprobs and entropy are those of ``logits / temperature``, PPO's critic steps with the policy,
and GRPO in a TP = 2 or DP = 2 group equals one process.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
from megatron_rlhf.types import Completion, LearnerBatch, Prompt, Rollout, RolloutGroup

LOSS_NAMES = ["online_dpo", "group_dpo", "grpo", "ppo", "rloo", "proximal_rloo", "best_of_k_sft"]
KNOBS = {  # non-default knobs so that each loss's optional paths run (KL, entropy, NLL, GRPO part)
    "online_dpo": dict(nll_coef=0.1),
    "group_dpo": dict(group_dpo_alpha=0.5),
    "grpo": dict(kl_beta=0.05, entropy_coef=0.01),
    "ppo": dict(kl_beta=0.05),
    "rloo": dict(kl_beta=0.05),
    "proximal_rloo": dict(kl_beta=0.05, proximal_rloo_level="token"),
    "best_of_k_sft": {},
}
EXPECTED = {
    "online_dpo": ("dpo/margin", "dpo/accuracy", "dpo/chosen_reward", "dpo/rejected_reward",
                   "loss/nll", "logprobs/policy_chosen_mean", "train/num_pairs"),
    "group_dpo": ("loss/dpo", "loss/grpo", "group_dpo/num_pairs", "dpo/margin", "grpo/pg/clip_frac"),
    "grpo": ("loss/policy", "loss/kl_ref", "pg/clip_frac", "pg/ratio_mean", "adv/mean", "adv/std",
             "tis/weight_mean", "entropy/mean", "loss/entropy_bonus"),
    "ppo": ("loss/policy", "pg/clip_frac", "adv/mean", "ppo/return_mean", "value/loss",
            "loss/value", "critic/grad_norm"),
    "rloo": ("loss/policy", "adv/mean", "reward/kl_penalty_mean"),
    "proximal_rloo": ("loss/policy", "pg/ratio_mean", "pg/clip_frac", "adv/mean"),
    "best_of_k_sft": ("loss/nll", "sft/num_sequences"),
}
COMMON = ("loss/total", "kl/ref_k3", "kl/ref_k1", "logprobs/vllm_gap_abs_mean",
          "logprobs/vllm_gap_abs_max", "rollout/entropy_mc", "grad/norm", "lr", "train/updates",
          "train/num_units", "train/num_sequences", "time/train_s")


def _vocab(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _groups(vocab: int, num_prompts: int = 3, k: int = 3, seed: int = 0,
            binary: bool = False) -> list[RolloutGroup]:
    """Random prompts (4-6 tokens) with K completions of 2-7 tokens, random negative generator
    logprobs; rewards in [0, 1) or, with ``binary``, 0/1 with both values in every group. Each
    group's pair is (best, worst)."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, n=1):
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    out = []
    for p in range(num_prompts):
        prompt = Prompt(index=p, task="t", token_ids=tuple(ints(3, vocab, ints(4, 7)[0])))
        rollouts = []
        for i in range(k):
            n = ints(2, 8)[0]
            lp = (-torch.rand(n, generator=g) * 3).tolist()
            completion = Completion(token_ids=tuple(ints(3, vocab, n)), logprobs=tuple(lp),
                                    finish_reason="stop", text="", weight_version=0)
            rollouts.append(Rollout(prompt=prompt, completion=completion,
                                    reward=float(torch.rand(1, generator=g))))
        rewards = [r.reward for r in rollouts]
        if binary:
            rewards = [1.0 if i % 2 == p % 2 else 0.0 for i in range(k)]
        best = max(range(k), key=lambda i: rewards[i])
        worst = min(range(k), key=lambda i: rewards[i])
        out.append(RolloutGroup(prompt=prompt, rollouts=tuple(rollouts), pair=(best, worst),
                                loss_rewards=tuple(rewards)))
    return out


def _batch(loss: str, vocab: int, **kw) -> LearnerBatch:
    algo = AlgorithmConfig(loss=loss)
    return LearnerBatch.from_groups(_groups(vocab, binary=loss == "group_dpo", **kw), algo.unit,
                                    pad_id=1, pad_to_multiple=4)


@pytest.fixture
def make_learner():
    """Factory of learners that are all closed at the end of the test."""
    from megatron_rlhf.learner.actor import MegatronLearner

    made = []

    def make(model_dir, loss, *, mbs=2, lr=1e-3, eps=1e-8, clip=1.0, warmup=0, total_steps=10,
             temperature=1.0, **algo_kw):
        opt = OptimizerConfig(lr=lr, adam_eps=eps, clip_grad=clip, warmup_steps=warmup)
        learner = MegatronLearner(model_dir=str(model_dir), total_steps=total_steps, temperature=temperature,
                                  learner_cfg=LearnerConfig(micro_batch_size=mbs, optimizer=opt),
                                  algorithm_cfg=AlgorithmConfig(loss=loss, samples_per_prompt=3, **algo_kw))
        made.append(learner)
        return learner

    yield make
    for learner in made:
        learner.close()


def _params(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.policy.named_parameters()}


def _plain_forward(learner, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` token logprobs and entropies of ``softmax(logits / temperature)`` from a plain
    megatron forward of the policy (full logits, torch.log_softmax), aligned like the learner's."""
    from megatron_rlhf.learner.logprobs import position_ids_for

    with torch.no_grad():
        logits = learner.policy(input_ids=ids, position_ids=position_ids_for(ids), attention_mask=None)
    logp = torch.log_softmax(logits.float()[..., :learner.vocab_size] / temperature, dim=-1)
    tok = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(ids.shape[0], 1)
    return torch.cat([zero, tok], dim=1), torch.cat([zero, ent], dim=1)


# ------------------------------------------------------------------------------ pure units
@pytest.mark.timeout(30)
def test_plan_keeps_each_group_in_one_microbatch_and_deals_whole_groups_over_dp():
    from megatron_rlhf.learner.batching import plan_microbatches, unit_sizes

    gids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    sizes = unit_sizes(gids)
    assert sizes == [3, 2, 4, 1]
    lengths = [5, 9, 7, 3, 4, 8, 8, 2, 6, 9]
    for dp in (1, 2):
        plans = [plan_microbatches(lengths, rows_per_microbatch=3, dp_rank=d, dp_size=dp, units=sizes)
                 for d in range(dp)]
        rows = sorted(r for p in plans for mb in p for r in mb.rows)
        assert rows == list(range(10))
        for mb in (mb for p in plans for mb in p):
            groups = {int(gids[r]) for r in mb.rows}
            assert all(sum(int(gids[r]) == g for r in mb.rows) == sizes[g] for g in groups)  # whole groups
            assert len(mb.rows) <= 3 or len(groups) == 1     # only an oversized group runs alone
            assert mb.seq_len >= max(lengths[r] for r in mb.rows)
    with pytest.raises(ValueError, match="not contiguous"):
        unit_sizes(torch.tensor([0, 1, 0]))


@pytest.mark.timeout(30)
def test_vocab_parallel_entropy_equals_softmax_entropy_and_ignores_padded_columns():
    from megatron_rlhf.learner.logprobs import vocab_parallel_entropy

    logits = torch.randn(2, 5, 11, dtype=torch.float32, requires_grad=True)
    pad = torch.zeros(11, dtype=torch.bool)
    pad[-3:] = True
    p = torch.softmax(logits[..., :8], -1)
    expect = -(p * p.log()).sum(-1)
    got = vocab_parallel_entropy(logits, pad)
    torch.testing.assert_close(got, expect, atol=1e-6, rtol=0)
    got.sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.all(logits.grad[..., -3:] == 0)


# ------------------------------------------------------------------------------ every loss
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_every_loss_trains_two_steps_with_finite_metrics_and_changes_weights(loss, make_learner,
                                                                             tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, loss, **KNOBS[loss])
    batch = _batch(loss, _vocab(tiny_llama_dir))
    before = _params(learner)
    for step in (1, 2):
        m = learner.train_step(batch)
        for key in COMMON + EXPECTED[loss]:
            assert key in m and isinstance(m[key], float) and math.isfinite(m[key]), (key, m.get(key))
        assert learner.weight_version == step and m["train/num_units"] == 3.0
    assert m["train/num_sequences"] == batch.input_ids.shape[0]
    after = _params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # the batch's unit must be the loss's
    other = _batch("online_dpo" if loss != "online_dpo" else "grpo", _vocab(tiny_llama_dir))
    with pytest.raises(ValueError, match=f"algorithm.loss={loss}"):
        learner.train_step(other)


@pytest.mark.timeout(120)
def test_ppo_critic_takes_one_step_per_policy_update_and_its_loss_is_logged(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, "ppo", updates_per_batch=2, value_coef=0.5)
    batch = _batch("ppo", _vocab(tiny_llama_dir))
    m = learner.train_step(batch)
    assert learner.scheduler.num_steps == 2 and learner.critic.scheduler.num_steps == 2
    assert m["loss/value"] == pytest.approx(0.5 * m["value/loss"]) and m["value/loss"] > 0
    assert m["ppo/return_mean"] != 0.0 and math.isfinite(m["critic/grad_norm"])
    assert m["critic/skipped_nonfinite"] == 0.0
    # a critic step skipped as non-finite (test_critic.py) is not retried on the same batch; the
    # policy's updates go on
    calls = []

    def skipped_critic_step(*args, **kwargs):
        calls.append(1)
        return {"critic/grad_norm": float("nan"), "critic/lr": 0.0, "critic/skipped_nonfinite": 1.0}

    learner.critic.train_step = skipped_critic_step
    m = learner.train_step(batch)
    assert len(calls) == 1 and learner.scheduler.num_steps == 4
    assert m["critic/skipped_nonfinite"] == 1.0 and m["train/skipped_nonfinite"] == 0.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss", ["grpo", "group_dpo", "online_dpo"])
def test_microbatch_size_one_and_whole_batch_give_the_same_update(loss, make_learner, tiny_llama_dir):
    batch = _batch(loss, _vocab(tiny_llama_dir))
    rows = batch.input_ids.shape[0]
    kw = dict(lr=1e-2, eps=1e-3, clip=0.0, **KNOBS[loss])  # Adam's first step ~ lr * g / (|g| + eps)
    one = make_learner(tiny_llama_dir, loss, mbs=rows, **kw)
    many = make_learner(tiny_llama_dir, loss, mbs=1, **kw)
    w0 = _params(one)
    m1, m2 = one.train_step(batch), many.train_step(batch)
    assert m1["train/microbatches"] == 1 and m2["train/microbatches"] == (rows if loss == "grpo" else 3)
    assert m1["loss/total"] == pytest.approx(m2["loss/total"], abs=1e-6)
    p1, p2 = _params(one), _params(many)
    assert max((p1[n] - w0[n]).abs().max().item() for n in p1) > 1e-3   # a real update
    assert max((p1[n] - p2[n]).abs().max().item() for n in p1) < 1e-5


@pytest.mark.timeout(120)
def test_one_update_per_batch_has_ratio_exactly_one_and_no_clipping(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, "grpo", clip_eps=0.01)
    m = learner.train_step(_batch("grpo", _vocab(tiny_llama_dir)))
    assert m["pg/ratio_mean"] == 1.0 and m["pg/ratio_min"] == 1.0 and m["pg/ratio_max"] == 1.0
    assert m["pg/clip_frac"] == 0.0 and m["train/updates"] == 1.0 and "time/old_s" not in m


@pytest.mark.timeout(120)
def test_two_updates_per_batch_take_two_optimizer_steps_and_one_weight_version(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, "grpo", warmup=4, total_steps=5, updates_per_batch=2)
    assert learner.total_steps == 10   # the LR schedule counts optimizer steps
    m = learner.train_step(_batch("grpo", _vocab(tiny_llama_dir)))
    assert learner.weight_version == 1 and m["train/updates"] == 2.0
    assert learner.scheduler.num_steps == 2 and m["lr"] == pytest.approx(1e-3 * 2 / 4)
    assert "time/old_s" in m and "loss/total_first_update" in m
    assert m["pg/ratio_mean"] != 1.0   # the second update sees the weights after the first


@pytest.mark.timeout(120)
def test_policy_gradient_logprobs_and_entropy_are_of_logits_over_temperature(make_learner, tiny_llama_dir):
    temp = 0.7
    learner = make_learner(tiny_llama_dir, "grpo", temperature=temp, entropy_coef=0.01)
    batch = _batch("grpo", _vocab(tiny_llama_dir))
    ids, mask, slp = batch.input_ids, batch.loss_mask, batch.sampling_logprobs
    tok, ent = _plain_forward(learner, ids, temp)
    torch.testing.assert_close(learner.token_logprobs(ids, temperature=temp), tok, atol=1e-5, rtol=0)
    assert (learner.token_logprobs(ids) - tok).abs().max() > 1e-2   # temperature 1 differs
    m = learner.train_step(batch)   # before the update: gap and entropy at temperature 0.7
    on = mask > 0
    assert m["logprobs/vllm_gap_abs_mean"] == pytest.approx((tok - slp).abs()[on].mean().item(), abs=1e-5)
    assert m["entropy/mean"] == pytest.approx(ent[on].mean().item(), abs=1e-5)
    assert m["rollout/entropy_mc"] == pytest.approx(-slp[on].mean().item(), abs=1e-6)


# ------------------------------------------------------------------------------ parallel groups
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "dp2"])
def test_grpo_with_entropy_and_temperature_in_a_group_equals_one_process(tp, dp, make_learner,
                                                                         tiny_llama_dir):
    """TP = 2 splits the (odd, padded) vocab: vocab-parallel logprobs at a temperature and the
    vocab-parallel entropy with grad. DP = 2 deals rows over ranks: advantages, denominators and
    metrics over the whole batch. Both must give the one-process update and metrics."""
    import ray

    from megatron_rlhf.learner.group import LearnerGroup
    from megatron_rlhf.runtime import process_env

    kw = dict(kl_beta=0.05, entropy_coef=0.01)
    opt = OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=0.0)
    algo = AlgorithmConfig(loss="grpo", samples_per_prompt=3, **kw)
    batch = _batch("grpo", _vocab(tiny_llama_dir))
    one = make_learner(tiny_llama_dir, "grpo", lr=1e-2, eps=1e-3, clip=0.0, temperature=0.7, **kw)
    m1 = one.train_step(batch)
    w1 = {k: v for b in one.export_weights() for k, v in b.items()}
    one.close()
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    try:
        cfg = LearnerConfig(tensor_parallel=tp, data_parallel=dp, micro_batch_size=2, optimizer=opt)
        group = LearnerGroup(model_dir=str(tiny_llama_dir), algorithm_cfg=algo, temperature=0.7,
                             learner_cfg=cfg, timeout_s=240)
        try:
            m2 = group.train_step(batch)
            w2 = {k: v for ref in group.export_weights() for k, v in ray.get(ref).items()}
            # one group's rewards overflow float32 (non-finite loss on one rank): every rank skips
            huge = list(_groups(_vocab(tiny_llama_dir)))
            huge[0] = dataclasses.replace(huge[0], loss_rewards=(1e300, 0.0, 1.0))
            m3 = group.train_step(LearnerBatch.from_groups(huge, "group", pad_id=1, pad_to_multiple=4))
            w3 = {k: v for ref in group.export_weights() for k, v in ray.get(ref).items()}
        finally:
            group.close()
    finally:
        ray.shutdown()
    for key in ("loss/total", "entropy/mean", "kl/ref_k3", "adv/std", "pg/ratio_mean",
                "logprobs/vllm_gap_abs_mean"):
        assert m2[key] == pytest.approx(m1[key], abs=1e-5), key
    assert set(w1) == set(w2) and max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    assert m3["train/skipped_nonfinite"] == 1.0 and all(torch.equal(w2[k], w3[k]) for k in w2)
