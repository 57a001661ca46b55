"""algorithm.overlong (DAPO overlong filtering / soft overlong punishment), values computed by hand:
the penalty formula, the producer's scoring/pairing path (``RolloutProducer._absorb``, no engine),
the learner rows (``LearnerBatch.from_groups``) and the GRPO loss with its denominators."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, ConfigError, GeneratorConfig, load_config
from megatron_rlhf.rollout.overlong import OverlongFilter, soft_overlong_penalty
from megatron_rlhf.rollout.pairs import select_pair
from megatron_rlhf.types import Completion, LearnerBatch, Prompt, Rollout, RolloutGroup

pytestmark = pytest.mark.timeout(60)


def test_soft_penalty_is_dapo_eq13_by_hand():
    # L_max = 64, L_buf = 16: no penalty up to 48 tokens, then (48 - |y|) / 16 down to -1 at 64
    assert soft_overlong_penalty(0, 64, 16) == 0.0
    assert soft_overlong_penalty(48, 64, 16) == 0.0
    assert soft_overlong_penalty(49, 64, 16) == -1 / 16
    assert soft_overlong_penalty(56, 64, 16) == -0.5
    assert soft_overlong_penalty(60, 64, 16) == -0.75
    assert soft_overlong_penalty(64, 64, 16) == -1.0
    assert soft_overlong_penalty(65, 64, 16) == -1.0   # beyond L_max
    assert soft_overlong_penalty(10, 10, 10) == -1.0   # buffer = whole length: |y| / L_max
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(5, 64, 0)
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(5, 64, 65)


def _c(n: int, cut: bool) -> Completion:
    return Completion(token_ids=tuple(range(3, 3 + n)), logprobs=(-0.5,) * n,
                      finish_reason="length" if cut else "stop", text="x" * n, weight_version=0)


def _producer(loss: str, overlong: str, buffer: int = 0, max_new_tokens: int = 8, rewards=None):
    """A RolloutProducer with no engine: only its scoring/pairing path is used."""
    from megatron_rlhf.rollout.producer import RolloutProducer

    algo = AlgorithmConfig(loss=loss, overlong=overlong, overlong_buffer=buffer, samples_per_prompt=4,
                           prompts_per_step=1, normalize_rewards=False)
    gen = GeneratorConfig(max_new_tokens=max_new_tokens)
    fn = lambda prompts, texts: list(rewards)   # noqa: E731 - the rewards given, in order
    return RolloutProducer(pool=None, sampler=SimpleNamespace(tasks=["math"]), reward_fns={"math": fn},
                           pair_fn=select_pair, channel=None, out_queue=None, algorithm_cfg=algo,
                           generator_cfg=gen, staleness_bound=1, first_batch=0, num_batches=1, min_version=0)


def _absorb(p, comps):
    from megatron_rlhf.rollout.producer import _BatchState

    b = _BatchState({"math": 1})
    p._absorb(b, [Prompt(index=0, task="math", token_ids=(1, 2))], [comps])
    return b


def test_mask_never_pairs_a_truncated_completion():
    # rewards 1, 0, 1, 0; completions 0 and 3 cut at max_new_tokens: the only pair left is (2, 1)
    comps = [_c(8, True), _c(5, False), _c(4, False), _c(8, True)]
    for seed in range(20):
        p = _producer("online_dpo", "mask", rewards=[1.0, 0.0, 1.0, 0.0])
        p.rng = random.Random(seed)
        b = _absorb(p, comps)
        (g,) = b.got["math"]
        chosen, rejected = (g.rollouts[i].completion for i in g.pair)
        assert chosen is comps[2] and rejected is comps[1]
        assert all(r.completion.finish_reason == "stop" for r in g.rollouts)
    assert p.overlong.take_stats() == {"task/math/overlong_frac": 0.5, "task/math/overlong_masked": 2}
    # keep: the same seeds pair truncated completions too
    cut = 0
    for seed in range(20):
        p = _producer("online_dpo", "keep", rewards=[1.0, 0.0, 1.0, 0.0])
        p.rng = random.Random(seed)
        (g,) = _absorb(p, comps).got["math"]
        cut += any(g.rollouts[i].completion.finish_reason == "length" for i in g.pair)
    assert cut > 0


def test_mask_skips_a_prompt_with_one_untruncated_completion():
    p = _producer("online_dpo", "mask", rewards=[1.0, 0.0, 1.0, 1.0])
    b = _absorb(p, [_c(8, True), _c(5, False), _c(8, True), _c(8, True)])
    assert b.got["math"] == [] and b.per_task["math"]["skipped"] == 1


def test_mask_gives_truncated_rows_zero_loss_weight_for_grpo():
    p = _producer("grpo", "mask", rewards=[1.0, 0.0, 1.0, 0.0])
    comps = [_c(8, True), _c(2, False), _c(3, False), _c(8, True)]
    (g,) = _absorb(p, comps).got["math"]
    assert len(g.rollouts) == 4 and g.loss_weights == (0.0, 1.0, 1.0, 0.0)   # all 4 stay in the baseline
    lb = LearnerBatch.from_groups([g], "group", pad_id=0, pad_to_multiple=1)
    # prompt (1, 2) then the completion: row i has mask 1 on its completion tokens unless truncated
    assert lb.loss_mask.sum(-1).tolist() == [0.0, 2.0, 3.0, 0.0]
    assert lb.sampling_logprobs[0].abs().sum() == 0 and lb.sampling_logprobs[1].sum() == -1.0
    # GRPO at ratio 1 (logprobs == old): per token -A_i; A over ALL 4 rewards: mean 0.5, std 0.5
    # -> A = (1, -1, 1, -1) (up to eps). sequence_sum over the 2 valid sequences:
    # -((-1) * 2 + 1 * 3) / 2 = -0.5; token_mean: -((-1) * 2 + 1 * 3) / 5 = -0.2
    from megatron_rlhf.learner.objectives import SliceInputs, loss_on_slice, prepare_batch

    for agg, want in (("sequence_sum", -0.5), ("token_mean", -0.2), ("sequence_token_mean", 0.0)):
        algo = AlgorithmConfig(loss="grpo", overlong="mask", tis_cap=None, loss_agg=agg)
        prep = prepare_batch(algo, mask=lb.loss_mask, rewards=lb.rewards, group_ids=lb.group_ids)
        assert prep.totals.num_sequences == 2 and prep.totals.num_tokens == 5
        assert torch.allclose(prep.advantages, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
        lp = torch.full_like(lb.loss_mask, -0.5)
        x = SliceInputs(logprobs=lp, mask=lb.loss_mask, ref_logprobs=lp, old_logprobs=lp,
                        rewards=lb.rewards, group_ids=lb.group_ids, advantages=prep.advantages)
        loss, _ = loss_on_slice(algo, x, prep.totals)
        assert loss.item() == pytest.approx(want, abs=1e-4), agg


def test_mask_grpo_group_with_every_completion_truncated_is_skipped():
    p = _producer("grpo", "mask", rewards=[1.0, 0.0, 1.0, 0.0])
    b = _absorb(p, [_c(8, True)] * 4)
    assert b.got["math"] == [] and b.per_task["math"]["skipped"] == 1
    assert p.overlong.take_stats()["task/math/overlong_frac"] == 1.0


def test_mask_drops_truncated_rows_from_group_dpo_and_best_of_k():
    comps = [_c(8, True), _c(2, False), _c(3, False), _c(8, True)]
    for loss in ("group_dpo", "best_of_k_sft"):
        p = _producer(loss, "mask", rewards=[1.0, 0.0, 1.0, 1.0])
        (g,) = _absorb(p, comps).got["math"]
        assert [r.completion for r in g.rollouts] == comps[1:3] and g.loss_weights is None


def test_soft_penalty_adds_to_the_rewards_the_pairs_and_the_stats():
    # L_max 8, L_buf 4: lengths 4, 6, 8, 8 -> penalties 0, -0.5, -1, -1
    p = _producer("online_dpo", "soft_penalty", buffer=4, rewards=[0.0, 1.0, 1.0, 0.0])
    b = _absorb(p, [_c(4, False), _c(6, False), _c(8, True), _c(8, True)])
    assert b.per_task["math"]["rewards"] == [0.0, 0.5, 0.0, -1.0]
    (g,) = b.got["math"]
    assert g.pair == (1, 3)   # scalar rewards now: best (0.5) vs worst (-1.0)
    stats = p.overlong.take_stats()
    assert stats == {"task/math/overlong_frac": 0.5, "task/math/overlong_masked": 0,
                     "task/math/overlong_penalty_mean": -2.5 / 4}
    assert p.overlong.take_stats() == {}   # reset per batch


def test_keep_changes_nothing():
    p = _producer("grpo", "keep", rewards=[1.0, 0.0, 1.0, 0.0])
    (g,) = _absorb(p, [_c(8, True), _c(2, False), _c(3, False), _c(8, True)]).got["math"]
    assert g.loss_weights is None and [r.reward for r in g.rollouts] == [1.0, 0.0, 1.0, 0.0]


def test_loss_weights_survive_the_batch_file(tmp_path):
    from megatron_rlhf.rollout.batch_io import load_batch, save_batch
    from megatron_rlhf.types import RolloutBatch

    prompt = Prompt(index=0, task="math", token_ids=(1, 2))
    g = RolloutGroup(prompt=prompt, rollouts=tuple(Rollout(prompt, _c(3, i == 0), float(i % 2)) for i in range(2)),
                     loss_weights=(0.0, 1.0))
    back = load_batch(save_batch(RolloutBatch(index=0, weight_version=0, groups=(g,), sampler_state={},
                                              rng_state=None), tmp_path))
    assert back.groups[0] == g and back.groups[0].loss_weights == (0.0, 1.0)
    with pytest.raises(ValueError, match="loss_weights"):
        RolloutGroup(prompt=prompt, rollouts=g.rollouts, loss_weights=(1.0,))


def test_config_refuses_bad_overlong_settings():
    with pytest.raises(ConfigError, match="algorithm.overlong"):
        AlgorithmConfig(overlong="drop")
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer"):
        AlgorithmConfig(overlong="soft_penalty")
    with pytest.raises(ConfigError, match="generators.max_new_tokens"):
        load_config("configs/ci_tiny.yaml", ["algorithm.overlong=soft_penalty", "algorithm.overlong_buffer=17"])
    cfg = load_config("configs/ci_tiny.yaml", ["algorithm.overlong=soft_penalty", "algorithm.overlong_buffer=16"])
    assert OverlongFilter.of(cfg.algorithm, cfg.generators.max_new_tokens).buffer == 16
