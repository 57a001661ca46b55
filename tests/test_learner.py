"""MegatronLearner on tiny Llamas (world size 1, gloo): logprobs equal transformers', Online DPO
steps train, micro-batching is exact, checkpoints restore everything, exports equal HF tensors."""

from __future__ import annotations

import math
import os
import stat

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
from megatron_rlhf.learner.model import load_hf_state_dict
from megatron_rlhf.types import LearnerBatch


@pytest.fixture
def make_learner():
    """Factory of learners that are all closed at the end of the test."""
    from megatron_rlhf.learner.actor import MegatronLearner

    made = []

    def make(model_dir, *, lr=1e-3, mbs=2, total_steps=10, warmup=0, decay="constant", beta=0.1,
             clip=1.0):
        opt = OptimizerConfig(lr=lr, warmup_steps=warmup, lr_decay=decay, clip_grad=clip)
        learner = MegatronLearner(model_dir=str(model_dir),
                                  learner_cfg=LearnerConfig(micro_batch_size=mbs, optimizer=opt),
                                  algorithm_cfg=AlgorithmConfig(beta=beta), total_steps=total_steps)
        made.append(learner)
        return learner

    yield make
    for learner in made:
        learner.close()


def _batch(vocab: int, num_pairs: int = 2, seq: int = 24, prompt: int = 8, seed: int = 0) -> LearnerBatch:
    """Random pairs sharing a prompt per pair; completions of different lengths; right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2 * num_pairs, seq), generator=g)
    mask = torch.zeros(2 * num_pairs, seq)
    for i in range(num_pairs):
        ids[2 * i + 1, :prompt] = ids[2 * i, :prompt]
        for r, length in ((2 * i, seq - prompt - 2 * i), (2 * i + 1, seq - prompt - 3)):
            mask[r, prompt:prompt + length] = 1.0
            ids[r, prompt + length:] = 1  # pad id
    slp = -torch.rand(2 * num_pairs, seq, generator=g) * mask
    return LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0, sampling_logprobs=slp)


def _hf_token_logprobs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)
    tok = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), tok], dim=1)


def _params(learner, which="policy"):
    model = learner.policy if which == "policy" else learner.reference
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sequence_logprobs_equal_transformers(tied, make_learner, tiny_llama_dir, tiny_llama_tied_dir):
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    learner = make_learner(model_dir, mbs=3)  # 4 rows -> micro-batches of 3 and 1
    b = _batch(learner.hf_config.vocab_size)
    ref_tok = _hf_token_logprobs(model_dir, b.input_ids)
    tok = learner.token_logprobs(b.input_ids)
    assert tok.shape == b.input_ids.shape and torch.all(tok[:, 0] == 0)
    torch.testing.assert_close(tok, ref_tok, atol=1e-4, rtol=0)
    expect = (ref_tok * b.loss_mask).sum(-1)
    for which in ("policy", "reference"):
        got = learner.sequence_logprobs(b.input_ids, b.loss_mask, which)
        assert got.shape == (4,)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_weights_equal_hf_checkpoint_before_training(tied, make_learner, tiny_llama_dir,
                                                            tiny_llama_tied_dir):
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    learner = make_learner(model_dir)
    hf = load_hf_state_dict(model_dir)
    buckets = learner.export_weights(bucket_bytes=300_000)  # small: forces several buckets
    assert len(buckets) > 1
    for bucket in buckets:
        nbytes = sum(t.numel() * t.element_size() for t in bucket.values())
        assert nbytes <= 300_000 or len(bucket) == 1
    flat = {k: v for b in buckets for k, v in b.items()}
    assert sum(len(b) for b in buckets) == len(flat)  # no duplicates
    assert set(flat) == set(hf)  # tied: no lm_head.weight, exactly like the checkpoint
    for name, t in hf.items():
        assert flat[name].is_contiguous() and flat[name].device.type == "cpu"
        assert torch.equal(flat[name], t), name
    # exported tensors are copies: changing them does not change the learner
    flat["model.norm.weight"].add_(1.0)
    again = {k: v for b in learner.export_weights() for k, v in b.items()}
    assert torch.equal(again["model.norm.weight"], hf["model.norm.weight"])


@pytest.mark.timeout(180)
def test_train_step_changes_policy_only_and_lowers_dpo_loss_on_repeated_batch(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, lr=1e-3)
    b = _batch(learner.hf_config.vocab_size)
    before, ref_before = _params(learner), _params(learner, "reference")
    m = learner.train_step(b)
    for key in ("loss/total", "dpo/margin", "dpo/accuracy", "grad/norm", "lr",
                "logprobs/vllm_gap_abs_mean", "time/train_s"):
        assert key in m and isinstance(m[key], float) and math.isfinite(m[key]), key
    assert m["loss/total"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    assert m["lr"] == pytest.approx(1e-3) and m["grad/norm"] > 0 and learner.weight_version == 1
    # the gap metric is |learner - generator| over completion tokens, before the update
    tok = _hf_token_logprobs(tiny_llama_dir, b.input_ids)
    gap = (tok - b.sampling_logprobs).abs()[b.loss_mask > 0].mean().item()
    assert m["logprobs/vllm_gap_abs_mean"] == pytest.approx(gap, abs=1e-4)
    after = _params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(ref_before[n], p) for n, p in _params(learner, "reference").items())
    losses = [learner.train_step(b)["loss/total"] for _ in range(3)]
    assert losses[-1] < losses[0] < math.log(2)
    assert learner.weight_version == 4


@pytest.mark.timeout(180)
def test_micro_batching_gives_the_same_update_as_one_batch(make_learner, tiny_llama_dir):
    b = _batch(512 - 60, num_pairs=3)
    one = make_learner(tiny_llama_dir, mbs=6, clip=0.0)
    many = make_learner(tiny_llama_dir, mbs=2, clip=0.0)
    m1, m2 = one.train_step(b), many.train_step(b)
    assert m1["loss/total"] == pytest.approx(m2["loss/total"], abs=1e-6)
    assert m1["grad/norm"] == pytest.approx(m2["grad/norm"], rel=1e-4)
    # the accumulated gradients (megatron DDP's fp32 main_grad buffers) agree to fp32 round-off
    g1 = {n: p.main_grad.clone() for n, p in one.policy.named_parameters()}
    g2 = {n: p.main_grad.clone() for n, p in many.policy.named_parameters()}
    scale = max(g.abs().max().item() for g in g1.values())
    assert scale > 0 and max((g1[n] - g2[n]).abs().max().item() for n in g1) < 1e-5 * scale


@pytest.mark.timeout(180)
def test_lr_schedule_warms_up_then_decays_linearly_without_a_zero_lr_step(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir, lr=1e-3, warmup=2, decay="linear", total_steps=5)
    b = _batch(learner.hf_config.vocab_size, num_pairs=1)
    lrs = [learner.train_step(b)["lr"] for _ in range(5)]
    # steps 1-2 warm up to lr; steps 3-5 decay linearly towards 0 reached at step 6
    assert lrs == pytest.approx([5e-4, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])


@pytest.mark.timeout(240)
def test_save_then_load_into_fresh_learner_restores_weights_optimizer_and_version(
        make_learner, tiny_llama_dir, tmp_path):
    a = make_learner(tiny_llama_dir, lr=1e-3, warmup=1, decay="cosine", total_steps=6)
    b = _batch(a.hf_config.vocab_size)
    for _ in range(2):
        a.train_step(b)
    a.sync_reference()
    a.train_step(b)
    ckpt = tmp_path / "step_3"
    a.save_checkpoint(str(ckpt))
    assert (ckpt / "policy" / "metadata.json").is_file() and (ckpt / "reference" / "metadata.json").is_file()
    fresh = make_learner(tiny_llama_dir, lr=1e-3, warmup=1, decay="cosine", total_steps=6)
    assert fresh.load_checkpoint(str(ckpt)) == 3 and fresh.weight_version == 3
    for which in ("policy", "reference"):
        pa, pf = _params(a, which), _params(fresh, which)
        assert all(torch.equal(pa[n], pf[n]) for n in pa), which
    sa, sf = a.optimizer.state_dict(), fresh.optimizer.state_dict()
    flat_a = [t for st in sa["state"].values() for t in st.values() if torch.is_tensor(t)]
    flat_f = [t for st in sf["state"].values() for t in st.values() if torch.is_tensor(t)]
    assert len(flat_a) == len(flat_f) > 0 and all(torch.equal(x, y) for x, y in zip(flat_a, flat_f))
    assert a.scheduler.state_dict() == fresh.scheduler.state_dict()
    # both continue identically (same LR, same Adam moments)
    ma, mf = a.train_step(b), fresh.train_step(b)
    assert ma["lr"] == mf["lr"] and ma["loss/total"] == mf["loss/total"]
    pa, pf = _params(a), _params(fresh)
    assert all(torch.equal(pa[n], pf[n]) for n in pa)


@pytest.mark.timeout(300)
def test_reference_is_saved_once_per_version_shared_by_step_checkpoints_and_resumed(
        make_learner, tiny_llama_dir, tmp_path):
    """With the trainer's CheckpointManager: steps 1 and 2 share one saved reference (written once:
    same inode), a reference sync at step 3 writes a new one, rotation (keep_last=1) deletes the
    reference no kept checkpoint names, and a fresh learner resumes both models and the version."""
    from megatron_rlhf.trainer.checkpoint import CheckpointManager

    a = make_learner(tiny_llama_dir)
    b = _batch(a.hf_config.vocab_size)
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=2)
    save = lambda step: mgr.save(step, {"step": step},   # noqa: E731
                                 lambda tmp: a.save_checkpoint(str(tmp / "learner"), str(mgr.root)))
    a.train_step(b)
    save(1)
    ref0 = mgr.root / "reference_v00000000"
    inode = (ref0 / "metadata.json").stat().st_ino
    a.train_step(b)
    save(2)
    assert (ref0 / "metadata.json").stat().st_ino == inode   # not re-saved
    assert not (mgr.root / "step_2" / "learner" / "reference").exists()
    a.train_step(b)
    a.sync_reference()
    save(3)   # keeps steps 2 (reference v0) and 3 (reference v3)
    assert sorted(p.name for p in mgr.root.glob("reference_v*")) == ["reference_v00000000", "reference_v00000003"]
    mgr.keep_last = 1
    a.train_step(b)
    save(4)   # keeps step 4 only: v0 is no longer named by a kept checkpoint
    assert [p.name for p in mgr.root.glob("reference_v*")] == ["reference_v00000003"]
    fresh = make_learner(tiny_llama_dir)
    assert fresh.load_checkpoint(str(mgr.root / "step_4" / "learner")) == 4
    assert fresh.reference_version == 3
    for which in ("policy", "reference"):
        pa, pf = _params(a, which), _params(fresh, which)
        assert all(torch.equal(pa[n], pf[n]) for n in pa), which


@pytest.mark.timeout(180)
def test_sync_reference_copies_policy_into_reference(make_learner, tiny_llama_tied_dir):
    learner = make_learner(tiny_llama_tied_dir)
    b = _batch(learner.hf_config.vocab_size)
    learner.train_step(b)
    pol = learner.sequence_logprobs(b.input_ids, b.loss_mask)
    assert not torch.equal(pol, learner.sequence_logprobs(b.input_ids, b.loss_mask, "reference"))
    learner.sync_reference()
    assert torch.equal(pol, learner.sequence_logprobs(b.input_ids, b.loss_mask, "reference"))
    assert learner.train_step(b)["loss/total"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.timeout(180)
def test_export_hf_folder_loads_in_transformers_with_the_trained_weights(make_learner, tiny_llama_tied_dir,
                                                                         tmp_path):
    learner = make_learner(tiny_llama_tied_dir)
    b = _batch(learner.hf_config.vocab_size)
    learner.train_step(b)
    out = tmp_path / "hf_final"
    learner.export_hf(str(out), str(tiny_llama_tied_dir))
    names = set(os.listdir(out))
    assert {"config.json", "tokenizer.json", "generation_config.json", "model.safetensors"} <= names
    umask = os.umask(0)
    os.umask(umask)  # a serving job of another user can read it: not mkdtemp's 0700 / safetensors' 0600
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    torch.testing.assert_close(_hf_token_logprobs(out, b.input_ids), learner.token_logprobs(b.input_ids),
                               atol=1e-4, rtol=0)
    with pytest.raises(FileExistsError):
        learner.export_hf(str(out), str(tiny_llama_tied_dir))


@pytest.mark.timeout(60)
def test_bad_batch_shape_raises_value_error(make_learner, tiny_llama_dir):
    learner = make_learner(tiny_llama_dir)
    b = _batch(learner.hf_config.vocab_size)
    with pytest.raises(ValueError, match=r"\[2P, S\]"):
        learner.train_step(LearnerBatch(input_ids=b.input_ids[:3], loss_mask=b.loss_mask[:3],
                                        weight_version=0))
    with pytest.raises(ValueError, match="which="):
        learner.token_logprobs(b.input_ids, which="critic")


def _ray_save_load(model_dir: str, ckpt: str) -> tuple[int, float]:
    """Runs inside a Ray actor process: build, train one step, save, load into a second learner."""
    from megatron_rlhf.learner.actor import MegatronLearner

    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3))
    a = MegatronLearner(model_dir=model_dir, learner_cfg=cfg, algorithm_cfg=AlgorithmConfig())
    a.train_step(_batch(a.hf_config.vocab_size))
    a.save_checkpoint(ckpt)
    b = MegatronLearner(model_dir=model_dir, learner_cfg=cfg, algorithm_cfg=AlgorithmConfig())
    version = b.load_checkpoint(ckpt)
    diff = max((p - q).abs().max().item()
               for p, q in zip(a.policy.parameters(), b.policy.parameters()))
    a.close()
    b.close()
    return version, diff


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_checkpoint_save_and_load_work_inside_a_ray_actor(tiny_llama_dir, tmp_path):
    ray = pytest.importorskip("ray")
    from megatron_rlhf.runtime import process_env

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": process_env(os.environ.get("TMPDIR"))})
    try:
        @ray.remote(num_cpus=1)
        class Runner:
            def run(self, model_dir, ckpt):
                return _ray_save_load(model_dir, ckpt)

        runner = Runner.remote()
        version, diff = ray.get(runner.run.remote(str(tiny_llama_dir), str(tmp_path / "ck")), timeout=240)
        assert version == 1 and diff == 0.0
    finally:
        ray.shutdown()
