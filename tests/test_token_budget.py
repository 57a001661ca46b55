"""learner.max_tokens_per_microbatch: micro-batches packed under a token budget keep DPO pairs whole,
and the gradient equals the gradient of the whole batch as one micro-batch (1e-6), on one process
and under PP=2, where micro-batches differ in sequence length and row count."""

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


def _cfg(pp=1, **kw) -> LearnerConfig:
    return LearnerConfig(pipeline_parallel=pp, optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=0.0), **kw)


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
