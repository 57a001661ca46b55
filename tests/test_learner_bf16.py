"""The GPU recipes' dtype on CPU: MegatronLearner in bf16 with fp32 main weights (world size 1,
gloo). The checks ``tests/test_gpu.py`` makes on a GPU run here on the CPU platform, and a bf16
checkpoint must bring back the fp32 main weights, which hold updates the bf16 weights cannot
(at a small lr most updates are below bf16's spacing: bench/RESULTS.md, "The demo in bf16 against
fp32"). A resume that rebuilt them from the bf16 weights would silently drop those updates: a
GPU-only bug until bf16 ran on CPU. Skipped where the CPU cannot compute bf16
(``platform.cpu_bf16_support``)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.platform import cpu_bf16_support
from tests.test_learner_losses import _batch, _vocab

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(cpu_bf16_support() is None, reason="this CPU cannot compute bf16")]


def _learner(model_dir, dtype, *, loss="online_dpo", lr=1e-3, dist_opt=False):
    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    return MegatronLearner(
        model_dir=str(model_dir), dtype=dtype, total_steps=8,
        learner_cfg=LearnerConfig(micro_batch_size=2, distributed_optimizer=dist_opt,
                                  optimizer=OptimizerConfig(lr=lr)),
        algorithm_cfg=AlgorithmConfig(loss=loss, samples_per_prompt=3))


def _main_weights(learner) -> dict[str, torch.Tensor]:
    """The fp32 main (master) weight of every policy parameter, flattened, by name: from the
    DistributedOptimizer's shards, or megatron's Float16OptimizerWithFloat16Params groups."""
    from megatron_rlhf.learner.checkpoint import distributed_optimizer_state

    if learner.use_distributed_optimizer:
        return {n: s["param"] for n, s in distributed_optimizer_state(learner.optimizer, learner.policy).items()}
    names = {id(p): n for n, p in learner.policy.named_parameters()}
    out = {}
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out[names[id(p)]] = main.detach().float().flatten().clone()
    return out


def _bf16_weights(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.policy.named_parameters()}


@pytest.mark.parametrize("loss", ["online_dpo", "grpo"])
def test_bf16_learner_on_cpu_trains_with_fp32_main_weights_and_logprobs_within_0_1_nats_of_fp32(
        tiny_llama_dir, loss):
    """``tests/test_gpu.py``'s check on the CPU platform: a bf16 learner's parameters are bf16,
    its optimizer keeps fp32 main weights, its logprobs are within 0.1 nats of an fp32 learner of
    the same weights (and not equal: the bf16 arithmetic is real), and two steps train finitely."""
    batch = _batch(loss, _vocab(tiny_llama_dir))
    fp, bf = _learner(tiny_llama_dir, "float32", loss=loss), _learner(tiny_llama_dir, "bfloat16", loss=loss)
    try:
        assert bf.platform.is_cpu and next(bf.policy.parameters()).dtype == torch.bfloat16
        mains = _main_weights(bf)
        assert mains and all(m.dtype == torch.float32 for m in mains.values())
        diff = (bf.token_logprobs(batch.input_ids).float() - fp.token_logprobs(batch.input_ids).float()).abs()
        diff = diff[batch.loss_mask > 0]
        assert 0 < float(diff.max()) < 0.1, float(diff.max())
        for _ in range(2):
            m = bf.train_step(batch)
            assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])
        assert bf.weight_version == 2
    finally:
        fp.close()
        bf.close()


@pytest.mark.parametrize("dist_opt", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_a_bf16_checkpoint_restores_the_fp32_main_weights_the_bf16_weights_cannot_hold(
        tiny_llama_dir, tmp_path, dist_opt):
    """At lr 1e-5, three steps leave the fp32 main weights away from their bf16 copies (updates
    below bf16's spacing); a checkpoint loaded into a fresh bf16 learner restores the main weights
    bit for bit (not re-derived from the bf16 weights) and the next step is the same on both."""
    a = _learner(tiny_llama_dir, "bfloat16", lr=1e-5, dist_opt=dist_opt)
    fresh = None
    try:
        batch = _batch("online_dpo", _vocab(tiny_llama_dir))
        start = _bf16_weights(a)
        for _ in range(3):
            a.train_step(batch)
        mains, weights = _main_weights(a), _bf16_weights(a)
        held = sum(int((mains[n] != weights[n].float().flatten()[:mains[n].numel()]).sum()) for n in mains)
        moved = sum(int((weights[n] != start[n]).sum()) for n in weights)
        total = sum(w.numel() for w in weights.values())
        assert held > 0.5 * total, (held, total)      # most updates live only in the fp32 main weights
        assert moved < held, (moved, held)            # ... and fewer bf16 weights changed at all
        a.save_checkpoint(str(tmp_path / "step_3"))
        fresh = _learner(tiny_llama_dir, "bfloat16", lr=1e-5, dist_opt=dist_opt)
        assert fresh.load_checkpoint(str(tmp_path / "step_3")) == 3
        restored = _main_weights(fresh)
        assert set(restored) == set(mains) and all(torch.equal(restored[n], mains[n]) for n in mains)
        assert all(torch.equal(w, weights[n]) for n, w in _bf16_weights(fresh).items())
        ma, mf = a.train_step(batch), fresh.train_step(batch)
        assert ma["loss/total"] == mf["loss/total"]
        after_a, after_f = _main_weights(a), _main_weights(fresh)
        assert all(torch.equal(after_a[n], after_f[n]) for n in after_a)
    finally:
        a.close()
        if fresh is not None:
            fresh.close()
