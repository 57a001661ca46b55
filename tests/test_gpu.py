"""Checks only a GPU can make (marked ``gpu``; skipped without CUDA, see conftest): the learner
trains in bf16 with fp32 master weights on the GPU platform (Transformer Engine layer spec when TE
imports, fused kernels), for a pair loss and a policy-gradient loss, and its logprobs agree with
an fp32 run of the same weights."""

from __future__ import annotations

import math

import pytest

from tests.test_learner_losses import _batch, _vocab

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.mark.parametrize("loss", ["online_dpo", "grpo"])
def test_bf16_learner_trains_on_gpu(tiny_llama_dir, loss):
    import torch

    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    batch = _batch(loss, _vocab(tiny_llama_dir))
    learners = {}
    for dtype in ("float32", "bfloat16"):
        learners[dtype] = MegatronLearner(
            model_dir=str(tiny_llama_dir), dtype=dtype, total_steps=4,
            learner_cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-3)),
            algorithm_cfg=AlgorithmConfig(loss=loss, samples_per_prompt=3))
        assert not learners[dtype].platform.is_cpu
    try:
        bf, fp = learners["bfloat16"], learners["float32"]
        assert next(bf.policy.parameters()).dtype == torch.bfloat16
        diff = (bf.token_logprobs(batch.input_ids).float() - fp.token_logprobs(batch.input_ids).float()).abs()
        assert float(diff[batch.loss_mask > 0].max()) < 0.1     # bf16 vs fp32 logprobs, nats
        for _ in range(2):
            m = bf.train_step(batch)
            assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])
        assert bf.weight_version == 2
    finally:
        for lr in learners.values():
            lr.close()
