"""Generators: sampling engines the trainer runs as Ray actors (``VLLMGenerator``)."""

from megatron_rlhf.generator.vllm_engine import VLLMGenerator

__all__ = ["VLLMGenerator"]
