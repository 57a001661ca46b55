"""learner.max_tokens_per_microbatch: micro-batches packed under a token budget keep DPO pairs whole,
and the gradient equals the gradient of the whole batch as one micro-batch (1e-6), on one process
and under PP=2, where micro-batches differ in sequence length and row count.

learner.pack_sequences: a packed micro-batch (rows back to back, THD ``PackedSeqParams``) gives the
same per-token logprobs, sequence logprobs, loss and gradients as the padded one (1e-6, float32)
at TP=1, TP=2 with sequence parallelism, and PP=2 (two gloo ranks, spawned); the cu_seqlens and
block-diagonal causal mask against hand-computed values. The padded token-budget tests above run
with ``pack_sequences=False`` (what they measure is padding)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig

TOL = 1e-6
PAIRS, SEQ, BUDGET = 6, 32, 96


def _batch(vocab: int):
    from bench.learner import make_batch

    return make_batch(PAIRS, SEQ, vocab, True, seed=3)   # completion lengths uniform in [8, 32]


def _cfg(pp=1, tp=1, pack_sequences=False, **kw) -> LearnerConfig:
    return LearnerConfig(pipeline_parallel=pp, tensor_parallel=tp, pack_sequences=pack_sequences,
                         optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=0.0), **kw)


def _grads(learner) -> tuple[dict, dict]:
    batch = _batch(learner.vocab_size)
    metrics = learner.train_step(batch)
    return learner.gradients_hf(), metrics


@pytest.mark.timeout(30)
def test_token_budget_plan_keeps_pairs_whole_covers_every_row_once_and_respects_the_budget():
    from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches, row_lengths

    b = _batch(512)
    lengths = row_lengths(b.loss_mask, SEQ, 2 * PAIRS)
    for dp in (1, 2):
        plans = [plan_microbatches(lengths, rows_per_microbatch=2, dp_rank=d, dp_size=dp, units=[2] * PAIRS,
                                   max_tokens=BUDGET, pad_multiple=2) for d in range(dp)]
        assert sorted(r for p in plans for mb in p for r in mb.rows) == list(range(2 * PAIRS))
        for mb in (mb for p in plans for mb in p):
            assert all(mb.rows[k] % 2 == 0 and mb.rows[k + 1] == mb.rows[k] + 1 for k in range(0, len(mb.rows), 2))
            assert len(mb.rows) * mb.seq_len <= BUDGET or len(mb.rows) == 2
            assert mb.seq_len % 2 == 0 and mb.seq_len >= max(lengths[r] for r in mb.rows)
    one = plan_microbatches(lengths, rows_per_microbatch=2, units=[2] * PAIRS, max_tokens=BUDGET)
    assert len({len(mb.rows) for mb in one}) > 1 and len({mb.seq_len for mb in one}) > 1  # not vacuous
    rows2 = plan_microbatches(lengths, rows_per_microbatch=2, units=[2] * PAIRS)
    big = plan_microbatches(lengths, rows_per_microbatch=2 * PAIRS, units=[2] * PAIRS)
    assert len(one) < len(rows2)                            # fewer, fuller micro-batches than 2 rows each
    assert padding_fraction(lengths, [one]) < padding_fraction(lengths, [big])
    with pytest.raises(ValueError, match="max_tokens"):
        plan_microbatches(lengths, rows_per_microbatch=2, max_tokens=-1)


@pytest.mark.timeout(180)
def test_token_budget_gradient_equals_the_one_microbatch_gradient(tiny_llama_dir):
    from megatron_rlhf.learner.actor import MegatronLearner

    out = {}
    for name, cfg in (("budget", _cfg(max_tokens_per_microbatch=BUDGET)), ("one", _cfg(micro_batch_size=2 * PAIRS))):
        learner = MegatronLearner(model_dir=str(tiny_llama_dir), learner_cfg=cfg, algorithm_cfg=AlgorithmConfig())
        try:
            out[name] = _grads(learner)
        finally:
            learner.close()
    (g_b, m_b), (g_1, m_1) = out["budget"], out["one"]
    assert max(g.abs().max().item() for g in g_1.values()) > 1e-3
    err = max((g_b[k] - g_1[k]).abs().max().item() for k in g_1)
    assert err <= TOL, f"token-budget gradient differs by {err}"
    assert m_b["loss/total"] == pytest.approx(m_1["loss/total"], abs=TOL)
    assert m_b["batch/padding_fraction"] < m_1["batch/padding_fraction"]


def _pp_worker(rank: int, model_dir: str, init_method: str, out_dir: str) -> None:
    from megatron_rlhf.learner.actor import MegatronLearner

    torch.set_num_threads(1)
    kw = dict(model_dir=model_dir, algorithm_cfg=AlgorithmConfig(), rank=rank, world_size=2, init_method=init_method)
    a = MegatronLearner(learner_cfg=_cfg(pp=2, max_tokens_per_microbatch=BUDGET), **kw)
    b = MegatronLearner(learner_cfg=_cfg(pp=2, micro_batch_size=2 * PAIRS), **kw)   # shares the groups
    try:
        lengths = [int(x) for x in (_batch(a.vocab_size).loss_mask.cumsum(1).argmax(1) + 1).tolist()]
        plan = a._plans(lengths, units=[2] * PAIRS)[0]
        res = {"budget": _grads(a), "one": _grads(b), "plan": [(len(mb.rows), mb.seq_len) for mb in plan],
               "stage": a.pp_rank}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        b.close()
        a.close()


@pytest.mark.timeout(300)
def test_token_budget_gradient_equals_the_one_microbatch_gradient_under_pp2(tiny_llama_dir, tmp_path):
    import torch.multiprocessing as mp

    from megatron_rlhf.learner.parallel import free_port

    mp.start_processes(_pp_worker, args=(str(tiny_llama_dir), f"tcp://127.0.0.1:{free_port()}", str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(r["stage"] for r in ranks) == [0, 1]
    plan = ranks[0]["plan"]   # variable rows and sequence lengths per micro-batch through the pipeline
    assert len(plan) > 1 and len({s for _, s in plan}) > 1 and len({n for n, _ in plan}) > 1
    for r in ranks:
        (g_b, _), (g_1, _) = r["budget"], r["one"]
        assert g_1 and set(g_b) == set(g_1)      # each stage's own tensors
        err = max((g_b[k] - g_1[k]).abs().max().item() for k in g_1)
        assert err <= TOL, f"stage {r['stage']}: token-budget gradient differs by {err} under PP=2"


# ------------------------------------------------------------------------------ packed sequences
@pytest.mark.timeout(120)   # the first megatron import (PackedSeqParams) on a loaded machine
def test_packed_cu_seqlens_positions_unpacking_and_block_causal_mask_by_hand():
    from megatron_rlhf.learner.packing import block_causal_mask, pack_rows, packed_cu_seqlens, unpack_rows
    from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches

    assert packed_cu_seqlens([3, 1, 2]) == [0, 3, 4, 6]
    assert packed_cu_seqlens([3, 1, 2], pad_multiple=4) == [0, 3, 4, 8]   # the pad joins the last row
    ids = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 0, 0]])
    p = pack_rows(ids, [3, 1, 2], pad_multiple=4)
    assert p.input_ids.tolist() == [[11, 12, 13, 21, 31, 32, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]          # restart per sequence
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 4
    prm = p.params()
    assert prm.qkv_format == "thd" and prm.cu_seqlens_q is prm.cu_seqlens_kv and prm.max_seqlen_q == 4
    # token-aligned packed values -> [b, s]: column 0 and columns past a row's length are 0
    packed = torch.arange(1.0, 9.0).unsqueeze(0)                          # 1..8 at packed positions 0..7
    assert unpack_rows(packed, p, 4).tolist() == [[0, 2, 3, 0], [0, 0, 0, 0], [0, 6, 0, 0]]
    m = block_causal_mask(torch.tensor([0, 2, 3, 5]))                     # True = masked (megatron)
    allowed = (~m).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 0, 1, 0],
                       [0, 0, 0, 1, 1]]
    # packed planning: the budget counts real tokens (rounded once), so 3 rows fit where 2 did padded
    lengths = [10, 4, 4]
    padded = plan_microbatches(lengths, rows_per_microbatch=1, pairs=False, max_tokens=20)
    packed_plan = plan_microbatches(lengths, rows_per_microbatch=1, pairs=False, max_tokens=20,
                                    packed=True, pad_multiple=4)
    assert [mb.rows for mb in padded] == [(0, 1), (2,)] and [mb.packed_len for mb in padded] == [0, 0]
    assert [mb.rows for mb in packed_plan] == [(0, 1, 2)] and packed_plan[0].packed_len == 20
    assert padding_fraction(lengths, [packed_plan]) == pytest.approx(1 - 18 / 20)
    with pytest.raises(ValueError, match="lengths"):
        pack_rows(ids, [3, 5, 2])


def _packed_vs_padded(kw: dict, tp: int, pp: int) -> dict:
    """Padded and packed learners on the same weights and batch (same process group): per-token
    logprobs of the same micro-batches both ways, sequence logprobs, one train step's loss and
    gradients (``{}`` of per-token values on non-last stages)."""
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.learner.batching import row_lengths

    out = {}
    learners = {}
    try:
        for pack in (False, True):
            learners[pack] = MegatronLearner(learner_cfg=_cfg(pp=pp, tp=tp, pack_sequences=pack,
                                                              max_tokens_per_microbatch=BUDGET), **kw)
        pad_l, pack_l = learners[False], learners[True]
        batch = _batch(pad_l.vocab_size)
        b, s = batch.input_ids.shape
        lengths = row_lengths(batch.loss_mask, s, b)
        plan = pack_l._plans(lengths, units=[2] * PAIRS)[pad_l.dp_rank]
        assert all(mb.packed_len for mb in plan)
        both = {}
        for name, packed in (("padded", False), ("packed", True)):
            mbs = pad_l._microbatches(batch.input_ids, plan, lengths)
            if not packed:
                for mb in mbs:
                    mb.packed = None
            both[name] = pad_l._forward_token_logprobs(pad_l.policy, mbs)
        out["tok"] = both
        out["rows"] = [[lengths[r] for r in mb.rows] for mb in plan]
        out["plan"] = [(len(mb.rows), mb.seq_len, mb.packed_len) for mb in plan]
        for name, lr in (("padded", pad_l), ("packed", pack_l)):
            seq = lr.sequence_logprobs(batch.input_ids, batch.loss_mask)
            metrics = lr.train_step(batch)
            out[name] = {"seq": seq, "metrics": metrics, "grads": lr.gradients_hf()}
        out["stage"], out["tp_rank"] = pad_l.pp_rank, pad_l.tp_rank
        out["sequence_parallel"] = pad_l.sequence_parallel
    finally:
        for lr in reversed(list(learners.values())):
            lr.close()
    return out


def _check_packed_equals_padded(r: dict) -> None:
    for rows, a, p in zip(r["rows"], r["tok"]["padded"], r["tok"]["packed"]):
        for i, n in enumerate(rows):   # |logprob| up to ~12 nats: float32 ulp there is 9.5e-7
            torch.testing.assert_close(p[i, :n], a[i, :n], rtol=TOL, atol=TOL)
            assert torch.all(p[i, n:] == 0) and p[i, 0] == 0
    assert len(r["tok"]["packed"]) in (0, len(r["rows"]))
    a, p = r["padded"], r["packed"]
    if a["seq"] is not None:    # last stage: ~60-200-nat sums, float32 ulp 4e-6..1.5e-5
        torch.testing.assert_close(p["seq"], a["seq"], rtol=TOL, atol=TOL)
        assert p["metrics"]["loss/total"] == pytest.approx(a["metrics"]["loss/total"], abs=TOL)
        assert p["metrics"]["batch/padding_fraction"] < a["metrics"]["batch/padding_fraction"]
    if a["grads"]:              # TP rank 0 of each stage holds the gathered gradients
        assert set(p["grads"]) == set(a["grads"])
        assert max(g.abs().max().item() for g in a["grads"].values()) > 1e-3
        err = max((p["grads"][k] - g).abs().max().item() for k, g in a["grads"].items())
        assert err <= TOL, f"stage {r['stage']}: packed gradient differs by {err}"


@pytest.mark.timeout(120)
def test_packed_microbatches_equal_padded_logprobs_and_gradients_tp1(tiny_llama_dir):
    r = _packed_vs_padded(dict(model_dir=str(tiny_llama_dir), algorithm_cfg=AlgorithmConfig()), tp=1, pp=1)
    assert len(r["plan"]) > 1 and len({t for _, _, t in r["plan"]}) > 1    # several packed lengths
    _check_packed_equals_padded(r)


def _pack_worker(rank: int, layout: str, model_dir: str, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp, pp = {"tp2": (2, 1), "pp2": (1, 2)}[layout]
    kw = dict(model_dir=model_dir, algorithm_cfg=AlgorithmConfig(), rank=rank, world_size=2,
              init_method=init_method)
    torch.save(_packed_vs_padded(kw, tp, pp), os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_packed_microbatches_equal_padded_logprobs_and_gradients_two_ranks(layout, tiny_llama_dir, tmp_path):
    import torch.multiprocessing as mp

    from megatron_rlhf.learner.parallel import free_port

    mp.start_processes(_pack_worker, args=(layout, str(tiny_llama_dir), f"tcp://127.0.0.1:{free_port()}",
                                           str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    if layout == "tp2":
        assert all(r["sequence_parallel"] for r in ranks) and sorted(r["tp_rank"] for r in ranks) == [0, 1]
    else:
        assert sorted(r["stage"] for r in ranks) == [0, 1]
    for r in ranks:
        _check_packed_equals_padded(r)


@pytest.mark.timeout(120)   # imports megatron-core (local_spec)
def test_packed_causal_attention_equals_sdpa_with_the_block_causal_mask_and_per_row_causal_sdpa_gqa():
    import torch.nn.functional as F

    from megatron_rlhf.learner.packing import block_causal_mask
    from megatron_rlhf.platform.local_spec import packed_causal_attention

    g = torch.Generator().manual_seed(0)
    cu = [0, 5, 6, 13]                                # lengths 5, 1, 7 (the last one with pad)
    t, heads, groups, hn = 13, 4, 2, 8
    q = torch.randn(t, heads, hn, generator=g, requires_grad=True)
    k, v = (torch.randn(t, groups, hn, generator=g, requires_grad=True) for _ in range(2))
    out = packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), scale=0.3)
    assert out.shape == (t, heads, hn)
    # the slow reference: one SDPA over the packed row with the block-diagonal causal mask
    allowed = ~block_causal_mask(torch.tensor(cu, dtype=torch.int32))
    qb, kb, vb = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref[0].permute(1, 0, 2), rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # and each row alone, causally, with query head h on KV group h // 2 (megatron's GQA layout)
    a, b = cu[2], cu[3]
    row = F.scaled_dot_product_attention(q[a:b].permute(1, 0, 2), k[a:b].repeat_interleave(2, 1).permute(1, 0, 2),
                                         v[a:b].repeat_interleave(2, 1).permute(1, 0, 2), is_causal=True, scale=0.3)
    torch.testing.assert_close(out[a:b], row.permute(1, 0, 2), rtol=1e-6, atol=1e-6)
