"""The learner as a TP x PP x DP group (Ray actors, gloo on CPU) equals the one-process learner.

Every parallel layout runs the same tiny random Llama (hidden 128, 4 heads / 2 KV heads, vocab
461: odd, so TP=2 also exercises vocab padding) on the same batch as one ``MegatronLearner`` in
the test process, and must give: the same per-sequence and per-token logprobs (within 1e-5),
exported HF-named buckets equal to the HF checkpoint bit for bit, the same Online DPO gradients
(within 1e-5) and, after one Adam step with a learning rate whose update (~1e-2) is three orders
above the tolerance, the same weights. One Ray cluster for the module; ranks run with
OMP_NUM_THREADS=1 (``runtime.process_env``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
from megatron_rlhf.types import LearnerBatch

REPO = Path(__file__).resolve().parents[1]
LR, EPS = 1e-2, 1e-3   # Adam's first step moves each weight by ~LR; EPS keeps it smooth in the grad
TOL = 1e-5


def _cfg(tp=1, pp=1, dp=1, **kw) -> LearnerConfig:
    return LearnerConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, micro_batch_size=2,
                         optimizer=OptimizerConfig(lr=LR, adam_eps=EPS, clip_grad=0.0), **kw)


def _batch(vocab: int = 461, num_pairs: int = 4, seq: int = 16, prompt: int = 6, seed: int = 0) -> LearnerBatch:
    """Pairs sharing a prompt, completions of 4..10 tokens (|sequence logprob| < 64, where a
    float32 ulp is 4e-6), right-padded with id 1; random generator logprobs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2 * num_pairs, seq), generator=g)
    mask = torch.zeros(2 * num_pairs, seq)
    for i in range(num_pairs):
        ids[2 * i + 1, :prompt] = ids[2 * i, :prompt]
        for r, length in ((2 * i, seq - prompt - i), (2 * i + 1, seq - prompt - 2 - i)):
            mask[r, prompt:prompt + length] = 1.0
            ids[r, prompt + length:] = 1
    slp = -torch.rand(2 * num_pairs, seq, generator=g) * mask
    return LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0, sampling_logprobs=slp)


def _flat(buckets) -> dict:
    out = {}
    for b in buckets:
        assert not set(out) & set(b), "a tensor is exported twice"
        out.update(b)
    return out


def _run(learner, batch, export) -> dict:
    """What both the reference and the groups are asked, in this order."""
    res = {"seq": learner.sequence_logprobs(batch.input_ids, batch.loss_mask),
           "ref_seq": learner.sequence_logprobs(batch.input_ids, batch.loss_mask, "reference"),
           "tok": learner.token_logprobs(batch.input_ids), "w0": export(learner),
           "ref_tok": learner.reference_logprobs(batch.input_ids, batch.loss_mask)["logprobs"]}   # eval.kl_ref
    res["metrics"] = learner.train_step(batch)
    res["grads"] = learner.gradients_hf()
    res["w1"] = export(learner)
    res["seq_after"] = learner.sequence_logprobs(batch.input_ids, batch.loss_mask)
    return res


# ------------------------------------------------------------------------------ fast unit tests
@pytest.mark.timeout(30)
def test_shard_then_unshard_round_trips_and_swiglu_shards_hold_their_own_gate_and_up():
    from megatron_rlhf.convert.llama import LLAMA
    from megatron_rlhf.convert.sharding import padded_vocab_size, shard, unshard

    rules = {r.mcore.split(".")[-2] if "{i}" in r.mcore else r.mcore: r for r in LLAMA.rules}
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for rule in LLAMA.rules:
        parts = [shard(rule, full, r, 2) for r in range(2)]
        assert torch.equal(unshard(rule, parts), full), rule.mcore
        if rule.tp == "replicated":
            assert all(p is full for p in parts)
    fc1 = rules["linear_fc1"]
    gate, up = full[:4], full[4:]   # linear_fc1 = [gate; up]; rank r must hold [gate_r; up_r]
    assert torch.equal(shard(fc1, full, 1, 2), torch.cat([gate[2:], up[2:]]))
    assert torch.equal(shard(rules["linear_proj"], full, 0, 2), full[:, :3])
    assert padded_vocab_size(461, 2) == 462 and padded_vocab_size(461, 1) == 461
    with pytest.raises(ValueError, match="does not split"):
        shard(rules["linear_proj"], full[:, :5], 0, 2)


@pytest.mark.timeout(30)
def test_length_plan_keeps_pairs_together_covers_every_pair_once_and_cuts_padding():
    from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches, row_lengths

    b = _batch(num_pairs=6, seq=32, prompt=4)
    lengths = row_lengths(b.loss_mask, 32, 12)
    assert lengths[0] == 4 + 28 and lengths[1] == 4 + 26   # last completion token + 1
    for dp in (1, 2, 3):
        plans = [plan_microbatches(lengths, rows_per_microbatch=4, dp_rank=d, dp_size=dp, pad_multiple=2)
                 for d in range(dp)]
        rows = sorted(r for p in plans for mb in p for r in mb.rows)
        assert rows == list(range(12))                      # every row exactly once
        for mb in (mb for p in plans for mb in p):
            assert len(mb.rows) <= 4 and mb.seq_len % 2 == 0
            assert all(mb.rows[k] % 2 == 0 and mb.rows[k + 1] == mb.rows[k] + 1
                       for k in range(0, len(mb.rows), 2))  # (chosen, rejected) adjacent
            assert mb.seq_len >= max(lengths[r] for r in mb.rows)
        pairs = [sum(len(mb.rows) for mb in p) // 2 for p in plans]
        assert max(pairs) - min(pairs) <= 1                 # balanced over DP ranks
        assert padding_fraction(lengths, plans) < 1 - sum(lengths) / (12 * 32)
    one = plan_microbatches(lengths, rows_per_microbatch=12)
    assert padding_fraction(lengths, [one]) == pytest.approx(1 - sum(lengths) / (12 * max(lengths)))
    with pytest.raises(ValueError, match="pairs"):
        plan_microbatches(lengths[:3], rows_per_microbatch=2)


@pytest.mark.timeout(120)
def test_ref_sync_interval_resets_reference_to_policy_every_r_batches(tiny_llama_dir):
    from megatron_rlhf.learner.actor import MegatronLearner

    learner = MegatronLearner(model_dir=str(tiny_llama_dir), learner_cfg=_cfg(ref_sync_interval=2),
                              algorithm_cfg=AlgorithmConfig())
    try:
        b = _batch()
        seq = lambda which: learner.sequence_logprobs(b.input_ids, b.loss_mask, which)  # noqa: E731
        m1 = learner.train_step(b)
        assert m1["ref/synced"] == 0.0 and not torch.equal(seq("policy"), seq("reference"))
        m2 = learner.train_step(b)
        assert m2["ref/synced"] == 1.0 and torch.equal(seq("policy"), seq("reference"))
        assert m2["batch/padding_fraction"] < m2["batch/padding_fraction_unsorted"]
        assert learner.train_step(b)["loss/total"] == pytest.approx(math.log(2), abs=1e-6)
    finally:
        learner.close()


# ------------------------------------------------------------------------------ Ray groups
@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from megatron_rlhf.runtime import process_env

    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, tiny_llama_tied_dir):
    """The one-process learner's answers for each model (computed in the test process), with
    padded micro-batches: the ``*_packed`` layouts compare packed micro-batches against them."""
    from megatron_rlhf.learner.actor import MegatronLearner

    cache = {}

    def get(model_dir):
        if model_dir not in cache:
            learner = MegatronLearner(model_dir=str(model_dir), learner_cfg=_cfg(pack_sequences=False),
                                      algorithm_cfg=AlgorithmConfig())
            try:
                cache[model_dir] = _run(learner, _batch(), lambda lr: _flat(lr.export_weights()))
            finally:
                learner.close()
        return cache[model_dir]

    return get


LAYOUTS = {  # name: (tp, pp, dp, tied, packed); tied embeddings exercise the embedding group under PP
    "tp2_packed": (2, 1, 1, False, True), "pp2_tied_packed": (1, 2, 1, True, True),
    "tp2pp2_tied": (2, 2, 1, True, False), "dp2": (1, 1, 2, False, False)}


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_learner_matches_one_process_logprobs_export_grads_and_update(
        name, ray_cluster, one_process, tiny_llama_dir, tiny_llama_tied_dir, tmp_path):
    from megatron_rlhf.learner.group import LearnerGroup
    from megatron_rlhf.learner.model import load_hf_state_dict

    tp, pp, dp, tied, packed = LAYOUTS[name]
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    ref = one_process(model_dir)   # padded micro-batches, one process
    group = LearnerGroup(model_dir=str(model_dir), learner_cfg=_cfg(tp, pp, dp, pack_sequences=packed),
                         algorithm_cfg=AlgorithmConfig(), timeout_s=240)
    try:
        got = _run(group, _batch(), lambda g: _flat(ray_cluster.get(g.export_weights(bucket_bytes=100_000))))
        assert len(group.layout()) == tp * pp * dp
        # logprobs: vocab-parallel CE on TP shards, pipeline stages, DP-dealt rows
        for key in ("seq", "ref_seq", "tok", "ref_tok"):
            assert got[key].shape == ref[key].shape
            assert (got[key] - ref[key]).abs().max().item() < TOL, key
        # the eval's reference pass (rows cut to their length) = the reference's token logprobs on
        # the completion tokens (before training the policy is the reference)
        on = _batch().loss_mask > 0
        assert (got["ref_tok"] - ref["tok"])[on].abs().max().item() < TOL
        # export before training: every HF tensor, bit for bit, no lm_head when tied
        hf = load_hf_state_dict(model_dir)
        assert list(got["w0"]) == list(ref["w0"])           # HF checkpoint order across stages
        assert set(got["w0"]) == set(hf) and all(torch.equal(got["w0"][k], hf[k]) for k in hf)
        # one DPO step: loss metrics, gradients, grad norm, updated weights
        m, mr = got["metrics"], ref["metrics"]
        for key in ("loss/total", "dpo/margin", "dpo/accuracy", "logprobs/vllm_gap_abs_mean"):
            assert m[key] == pytest.approx(mr[key], abs=TOL), key
        assert m["grad/norm"] == pytest.approx(mr["grad/norm"], rel=TOL)
        assert set(got["grads"]) == set(ref["grads"])
        scale = max(g.abs().max().item() for g in ref["grads"].values())
        assert scale > 1e-2
        assert max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()) < TOL
        update = max((ref["w1"][k] - hf[k]).abs().max().item() for k in hf)
        assert update > 100 * TOL
        assert max((got["w1"][k] - ref["w1"][k]).abs().max().item() for k in hf) < TOL
        # weights within 1e-5 move a ~60-nat sequence logprob by ~1e-5: compare relative to it
        torch.testing.assert_close(got["seq_after"], ref["seq_after"], rtol=1e-6, atol=TOL)
        assert 0 <= m["batch/padding_fraction"] < m["batch/padding_fraction_unsorted"]
        if name == "tp2pp2_tied":   # every rank writes/reads its own shards and state file
            ckpt = tmp_path / "ckpt"
            group.save_checkpoint(str(ckpt))
            assert len(list(ckpt.glob("learner_state*.pt"))) == 4
            group.train_step(_batch(seed=1))
            assert group.load_checkpoint(str(ckpt)) == 1 and group.get_weight_version() == 1
            again = _flat(ray_cluster.get(group.export_weights()))
            assert all(torch.equal(again[k], got["w1"][k]) for k in hf)
    finally:
        group.close()


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_three_step_async_run_with_tensor_parallel_2_completes(ray_cluster, tiny_llama_dir, tmp_path):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainer.loop import train

    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}", "run.name=tp2",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false",
        "learner.tensor_parallel=2"])
    res = train(cfg, quiet=True)
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss/total"]) and 0 <= r["batch/padding_fraction"] < 1 for r in rows)
    run = Path(res["run_dir"])
    assert (run / "hf_final" / "model.safetensors").is_file()
    assert any((run / "checkpoints" / "step_3").rglob("learner_state.rank00001.pt"))  # both ranks saved
