"""PPO critic (megatron_rlhf.learner.critic) on tiny Llamas, CPU/gloo: values are the head applied
to the previous position's final hidden state (checked against transformers), training lowers the
value loss, micro-batching does not change the update, checkpoints restore the critic exactly,
tied embeddings work, a non-finite value loss skips the step (on every DP rank together), and
2-process groups (TP=2 with sequence parallelism, PP=2 with tied embeddings, DP=2;
torch.multiprocessing + gloo) give the values, metrics and one-step update of one process and
restore their sharded checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig

LR, EPS = 1e-2, 1e-3  # Adam's first step moves each weight by ~LR; EPS keeps it smooth in the grad


def _cfg(tp=1, pp=1, dp=1, mbs=2, clip=1.0, **kw) -> LearnerConfig:
    return LearnerConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, micro_batch_size=mbs,
                         optimizer=OptimizerConfig(lr=LR, adam_eps=EPS, clip_grad=clip), **kw)


def _learner(model_dir, cfg=None, **kw):
    """A ppo MegatronLearner with a critic (built here if the learner does not build one)."""
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.learner.critic import Critic

    learner = MegatronLearner(model_dir=str(model_dir), learner_cfg=cfg or _cfg(),
                              algorithm_cfg=AlgorithmConfig(loss="ppo", **kw), total_steps=20)
    if getattr(learner, "critic", None) is None:
        learner.critic = Critic(learner)
    return learner


@pytest.fixture
def learners():
    made = []

    def make(model_dir, cfg=None, **kw):
        made.append(_learner(model_dir, cfg, **kw))
        return made[-1]

    yield make
    for learner in made:
        if getattr(learner, "critic", None) is not None:
            learner.critic.close()
        learner.close()


def _batch(rows: int = 4, seq: int = 14, prompt: int = 5, vocab: int = 256, seed: int = 0):
    """Right-padded rows with completions of different lengths; returns ``(ids, mask, returns)``
    with per-token targets in [-1, 1] on the completion."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq)
    for r in range(rows):
        length = seq - prompt - 2 * (r % 3)
        mask[r, prompt:prompt + length] = 1.0
        ids[r, prompt + length:] = 1
    ret = (torch.rand(rows, seq, generator=g) * 2 - 1) * mask
    return ids, mask, ret


def _mbs(ids, mask, groups, extra=None):
    """Micro-batches of the given row groups, each cut to its longest row rounded up to even
    (sequence parallelism with TP=2 splits the sequence in two)."""
    from megatron_rlhf.learner.schedule import make_microbatch

    out = []
    for rows in groups:
        seq_len = int(max(int(mask[r].nonzero().max()) + 1 for r in rows))
        seq_len += seq_len % 2
        out.append(make_microbatch(ids, rows, seq_len, "cpu", loss_mask=mask, **(extra or {})))
    return out


def _set_head(critic, seed: int = 1, scale: float = 0.05):
    """Deterministic non-zero head (the critic starts at zero, which would hide misalignment)."""
    g = torch.Generator().manual_seed(seed)
    head = getattr(critic.model, "output_layer", None)
    if head is None:  # not the last pipeline stage
        return None, None
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * scale)
        head.bias.fill_(0.25)
    return head.weight.detach().clone(), head.bias.detach().clone()


def _step(critic, mbs, rets, num_rows, num_tokens, loss_agg="token_mean"):
    old = critic.values(mbs)
    return critic.train_step(mbs, old, rets, global_num_sequences=num_rows,
                             global_num_tokens=num_tokens, loss_agg=loss_agg)


def _hf_hidden(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.model(ids).last_hidden_state  # [B, S, h], after the final norm


# ------------------------------------------------------------------------------ one process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_value_at_t_is_head_of_hidden_state_at_t_minus_1_and_zero_off_completion(
        tied, learners, tiny_llama_dir, tiny_llama_tied_dir):
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    learner = learners(model_dir)
    critic = learner.critic
    ids, mask, ret = _batch()
    mbs = _mbs(ids, mask, [(0, 1, 2), (3,)])
    zero = critic.values(mbs)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in zero)  # zero-initialised head
    w, b = _set_head(critic)
    got = critic.values(mbs)
    expect = torch.cat([torch.zeros(4, 1), (_hf_hidden(model_dir, ids) @ w.T + b)[:, :-1, 0]], 1) * mask
    for mb, v in zip(mbs, got):
        s = v.shape[1]
        assert v.shape == mb.input_ids.shape and v.dtype == torch.float32 and v.device.type == "cpu"
        assert torch.all(v[:, 0] == 0) and torch.all(v[mb.loss_mask == 0] == 0)
        torch.testing.assert_close(v, expect[list(mb.rows), :s], atol=1e-4, rtol=0)
    # the tied embedding trains without megatron trying to reduce it with the head
    emb = critic.model.embedding.word_embeddings.weight.detach().clone()
    m = _step(critic, mbs, [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs], 4, float(mask.sum()))
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert not torch.equal(emb, critic.model.embedding.word_embeddings.weight)
    policy_emb = learner.policy.embedding.word_embeddings.weight
    assert torch.equal(emb, policy_emb.detach())  # the critic has its own parameters


@pytest.mark.timeout(180)
def test_train_step_lowers_the_value_loss_on_a_fixed_batch(learners, tiny_llama_dir):
    learner = learners(tiny_llama_dir, _cfg(), critic_lr=3e-3)
    critic = learner.critic
    ids, mask, ret = _batch(rows=6)
    mbs = _mbs(ids, mask, [(0, 1), (2, 3), (4, 5)])
    rets = [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs]
    losses = []
    for _ in range(10):  # old values refreshed every step: one PPO update per batch
        m = _step(critic, mbs, rets, 6, float(mask.sum()))
        losses.append(m["value/loss"])
    assert set(m) == {"critic/grad_norm", "critic/lr", "critic/skipped_nonfinite", "value/loss",
                      "value/clip_frac", "value/pred_mean", "value/return_mean", "value/abs_error"}
    assert m["critic/lr"] == pytest.approx(3e-3) and m["critic/grad_norm"] > 0
    assert m["critic/skipped_nonfinite"] == 0.0
    assert m["value/return_mean"] == pytest.approx(float(ret[mask > 0].mean()), abs=1e-6)
    assert losses[-1] < 0.3 * losses[0], losses
    # values already 1 above old values (> value_clip_eps=0.2) and targets 5 above: the clipped
    # error is the larger on every token and, its value being clamped, gives no gradient
    now = critic.values(mbs)
    old = [v - mb.loss_mask for v, mb in zip(now, mbs)]
    far = [v + 5.0 * mb.loss_mask for v, mb in zip(now, mbs)]
    m = critic.train_step(mbs, old, far, global_num_sequences=6, global_num_tokens=float(mask.sum()),
                          loss_agg="token_mean")
    assert m["value/clip_frac"] == 1.0 and m["critic/grad_norm"] == 0.0
    with pytest.raises(ValueError, match="micro-batches"):
        critic.train_step(mbs, old[:1], rets, global_num_sequences=6, global_num_tokens=1.0,
                          loss_agg="token_mean")


@pytest.mark.timeout(180)
def test_nonfinite_value_loss_skips_the_critic_step_and_the_next_finite_step_trains(learners, tiny_llama_dir):
    """Value targets of 1e20 overflow the float32 squared error: the step is skipped (no optimizer
    or LR-scheduler step, the critic's weights unchanged); the next finite step trains as usual."""
    import math

    critic = learners(tiny_llama_dir).critic
    ids, mask, ret = _batch(rows=4)
    mbs = _mbs(ids, mask, [(0, 1), (2, 3)])
    rets = [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs]
    _set_head(critic)
    before = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
    huge = [r + 1e20 * mb.loss_mask for r, mb in zip(rets, mbs)]
    m = _step(critic, mbs, huge, 4, float(mask.sum()))
    assert m["critic/skipped_nonfinite"] == 1.0 and math.isnan(m["critic/grad_norm"])
    assert not math.isfinite(m["value/loss"]) and critic.scheduler.num_steps == 0
    assert all(torch.equal(p, before[n]) for n, p in critic.model.named_parameters())
    m = _step(critic, mbs, rets, 4, float(mask.sum()))
    assert m["critic/skipped_nonfinite"] == 0.0 and m["critic/grad_norm"] > 0 and critic.scheduler.num_steps == 1
    assert not torch.equal(critic.model.output_layer.weight, before["output_layer.weight"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss_agg", ["token_mean", "sequence_token_mean"])
def test_microbatch_split_does_not_change_the_update(loss_agg, learners, tiny_llama_dir):
    from megatron_rlhf.learner.critic import Critic

    learner = learners(tiny_llama_dir, _cfg(clip=0.0))
    ids, mask, ret = _batch(rows=5)
    params = []
    for groups in ([(r,) for r in range(5)], [tuple(range(5))]):
        critic = Critic(learner)  # same HF weights and zero head each time
        head0, _ = _set_head(critic)
        mbs = _mbs(ids, mask, groups)
        rets = [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs]
        m = _step(critic, mbs, rets, 5, float(mask.sum()), loss_agg)
        params.append((m, {n: p.detach().clone() for n, p in critic.model.named_parameters()}))
        critic.close()
    (m1, p1), (m2, p2) = params
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], atol=1e-5, rtol=0, msg=name)
    moved = float((p1["output_layer.weight"] - head0).abs().max())
    assert moved > 1e-3  # the step did something well above the tolerance
    for key in ("value/loss", "value/pred_mean", "value/abs_error", "critic/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key


@pytest.mark.timeout(240)
def test_checkpoint_round_trip_restores_critic_values_and_next_update(learners, tiny_llama_dir, tmp_path):
    ids, mask, ret = _batch(rows=4)
    groups = [(0, 1), (2, 3)]
    a = learners(tiny_llama_dir)
    critic_a, a.critic = a.critic, None
    a.save_checkpoint(str(tmp_path / "no_critic"))        # what a non-ppo learner writes
    a.critic = critic_a
    mbs = _mbs(ids, mask, groups)
    rets = [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs]
    _set_head(critic_a)
    _step(critic_a, mbs, rets, 4, float(mask.sum()))       # Adam moments and LR step are non-trivial
    a.save_checkpoint(str(tmp_path / "ck"))
    assert (tmp_path / "ck" / "critic" / "metadata.json").is_file()

    b = learners(tiny_llama_dir)
    with pytest.raises(ValueError, match="no PPO critic"):
        b.load_checkpoint(str(tmp_path / "no_critic"))
    b.load_checkpoint(str(tmp_path / "ck"))
    for va, vb in zip(critic_a.values(mbs), b.critic.values(mbs)):
        assert torch.equal(va, vb)
    ma = _step(critic_a, mbs, rets, 4, float(mask.sum()))
    mb_ = _step(b.critic, mbs, rets, 4, float(mask.sum()))
    assert ma == mb_
    pa, pb = dict(critic_a.model.named_parameters()), dict(b.critic.model.named_parameters())
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name


# ------------------------------------------------------------------------------ 2-process groups
_LAYOUTS = {"tp2_sp": dict(tp=2), "pp2_tied": dict(pp=2), "dp2": dict(dp=2)}
_GROUPS = [(0, 1), (2, 3)]


def _run_critic(learner, groups):
    """What one process and every rank of a group are asked: values, one step, values again."""
    ids, mask, ret = _batch(rows=4)
    mbs = _mbs(ids, mask, groups)
    rets = [ret[list(mb.rows), :mb.input_ids.shape[1]] for mb in mbs]
    _set_head(learner.critic)
    before = learner.critic.values(mbs)
    metrics = learner.critic.train_step(mbs, before if before is not None else [r * 0 for r in rets], rets,
                                        global_num_sequences=4, global_num_tokens=float(mask.sum()),
                                        loss_agg="token_mean")
    after = learner.critic.values(mbs)
    rows = [mb.rows for mb in mbs]
    return {"rows": rows, "before": before, "after": after, "metrics": metrics}


def _worker(rank: int, model_dir: str, layout: str, init_method: str, out_dir: str) -> None:
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.learner.critic import Critic

    torch.set_num_threads(1)
    cfg = _cfg(**_LAYOUTS[layout])
    learner = MegatronLearner(model_dir=model_dir, learner_cfg=cfg, algorithm_cfg=AlgorithmConfig(loss="ppo"),
                              total_steps=20, rank=rank, world_size=2, init_method=init_method)
    try:
        if getattr(learner, "critic", None) is None:
            learner.critic = Critic(learner)
        groups = [_GROUPS[learner.dp_rank]] if layout == "dp2" else _GROUPS
        res = _run_critic(learner, groups)
        res["layout"] = learner.layout()
        # checkpoint round trip of the sharded critic into a fresh (zero-head) critic
        learner.save_checkpoint(os.path.join(out_dir, "ck"))
        learner.critic.close()
        learner.critic = Critic(learner)
        learner.load_checkpoint(os.path.join(out_dir, "ck"))
        ids, mask, _ = _batch(rows=4)
        res["reloaded"] = learner.critic.values(_mbs(ids, mask, groups))
        if layout == "dp2":   # only DP rank 1's value loss overflows: both ranks skip the step
            mbs = _mbs(ids, mask, groups)
            rets = [(1e20 * learner.dp_rank) * mb.loss_mask for mb in mbs]
            m = learner.critic.train_step(mbs, res["reloaded"], rets, global_num_sequences=4,
                                          global_num_tokens=float(mask.sum()), loss_agg="token_mean")
            res["skipped"] = (m["critic/skipped_nonfinite"], learner.critic.values(mbs))
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if getattr(learner, "critic", None) is not None:
            learner.critic.close()
        learner.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_two_process_layout_equals_one_process(layout, learners, tiny_llama_dir, tiny_llama_tied_dir,
                                                tmp_path):
    import torch.multiprocessing as mp

    from megatron_rlhf.learner.parallel import free_port

    model_dir = tiny_llama_tied_dir if layout.endswith("tied") else tiny_llama_dir
    ref = _run_critic(learners(model_dir), _GROUPS)
    mp.start_processes(_worker, args=(str(model_dir), layout, f"tcp://127.0.0.1:{free_port()}",
                                      str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    got = {"before": {}, "after": {}}
    assert all(res["layout"]["sequence_parallel"] == (layout == "tp2_sp") for res in ranks)
    for res in ranks:
        assert res["metrics"]["critic/grad_norm"] == pytest.approx(ref["metrics"]["critic/grad_norm"], rel=1e-4)
        if not res["layout"]["is_last_stage"]:
            assert res["before"] is None and set(res["metrics"]) == {"critic/grad_norm", "critic/lr",
                                                                     "critic/skipped_nonfinite"}
            continue
        for key, v in ref["metrics"].items():
            assert res["metrics"][key] == pytest.approx(v, rel=1e-5, abs=1e-6), key
        for when in ("before", "after"):
            for rows, v in zip(res["rows"], res[when]):
                got[when][rows] = v
        for v, v_reloaded in zip(res["after"], res["reloaded"]):
            assert torch.equal(v, v_reloaded)
        if layout == "dp2":
            skipped, values = res["skipped"]
            assert skipped == 1.0 and all(torch.equal(a, b) for a, b in zip(values, res["reloaded"]))
    for when in ("before", "after"):
        for rows, v in zip(ref["rows"], ref[when]):
            torch.testing.assert_close(got[when][rows], v, atol=1e-5, rtol=0, msg=f"{when} {rows}")
