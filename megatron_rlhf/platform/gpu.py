"""GPU platform: Transformer Engine layer spec when TE imports, megatron's local spec otherwise.

Never imported on CPU (``megatron_rlhf.platform.get_platform`` picks this module only when
``torch.cuda.is_available()``). No shims: megatron-core runs natively on CUDA.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["gpu_layer_spec", "seed", "have_transformer_engine"]


def have_transformer_engine() -> bool:
    """True when ``transformer_engine.pytorch`` imports (TE's PyTorch modules: fused attention,
    norm + linear). Importing only ``transformer_engine`` is not enough: the top-level package
    installs without its PyTorch extension (e.g. ``pip install transformer-engine`` without the
    ``[pytorch]`` extra, or a build without ``--no-build-isolation`` that skipped it), and
    megatron's TE spec then fails at model build. A broken extension (``OSError`` from a missing
    CUDA library) counts as absent and is logged."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    except OSError as e:  # e.g. libcudnn / libnvrtc not found
        logging.getLogger(__name__).warning("transformer_engine.pytorch failed to load (%s); "
                                            "using megatron's local layer spec", e)
        return False
    return True


def gpu_layer_spec(config):
    """GPT layer spec on GPU.

    With TE: ``get_gpt_layer_with_transformer_engine_spec`` (parameter names then follow the TE
    layout, e.g. ``self_attention.linear_qkv.layer_norm_weight`` holds the input RMSNorm; the
    conversion aligns names with :func:`megatron_rlhf.convert.llama.align_names`). Without TE:
    megatron's local spec (DotProductAttention works on CUDA).

    Args:
        config: megatron ``TransformerConfig``.
    Returns:
        a ``ModuleSpec`` for ``GPTModel(transformer_layer_spec=...)``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    qk = bool(getattr(config, "qk_layernorm", False))
    if have_transformer_engine():
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
    return specs.get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=qk)


def seed(seed_value: int) -> None:
    """Seed torch (CPU and CUDA) and megatron's CUDA RNG tracker
    (``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed_value)
    model_parallel_cuda_manual_seed(seed_value)
