"""Generators: the vLLM sampling engines the trainer runs as Ray actors (``VLLMGenerator``), their pool,
step loop and the receiving end of weight sync. It may import sync/, platform/, config, types, runtime,
utils/ (the fault-injection hook) and ``rollout.carry`` (the partial-rollout records it continues);
never learner/ or trainer/."""

from megatron_rlhf.generator.vllm_engine import VLLMGenerator

__all__ = ["VLLMGenerator"]
