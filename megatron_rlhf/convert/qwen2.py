"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``) mapping table: Llama plus Q/K/V biases.

Qwen2 attention has biases on ``q_proj``/``k_proj``/``v_proj`` (not on ``o_proj``, not in the
MLP): megatron ``add_qkv_bias=True`` with ``add_bias_linear=False``. The fused
``linear_qkv.bias [ng*(np/ng+2)*hn]`` is interleaved per query group exactly like the weight
rows (same ``qkv`` rule kind on 1-D tensors) and split like them under TP (``column``).
Source: transformers ``models/qwen2/modeling_qwen2.py`` (``Qwen2Attention``: ``bias=True`` for
q/k/v, ``bias=False`` for o_proj); megatron ``ColumnParallelLinear`` bias sharding.
"""

from __future__ import annotations

from megatron_rlhf.convert.llama import (_L, _M, EMBED_RULE, FINAL_RULES, LAYER_RULES_AFTER_QKV,
                                         LAYER_RULES_BEFORE_QKV, QKV_RULE)
from megatron_rlhf.convert.rules import ArchSpec, ParamRule

__all__ = ["QWEN2", "QKV_BIAS_RULE", "validate_qwen2"]

QKV_BIAS_RULE = ParamRule(_M + "self_attention.linear_qkv.bias",
                          (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias",
                           _L + "self_attn.v_proj.bias"), kind="qkv", tp="column",
                          hf_shapes=("q", "kv", "kv"))


def validate_qwen2(hf_config) -> None:
    """Refuse sliding-window attention (``use_sliding_window=True``): megatron's attention here
    is full causal attention.

    Raises:
        ValueError: naming ``use_sliding_window``.
    """
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"hf config use_sliding_window=True is not supported for "
                         f"{hf_config.model_type} (megatron attention here is full causal); "
                         "set it to false if the model was trained without it")


QWEN2 = ArchSpec(
    name="qwen2", model_types=("qwen2",),
    rules=(EMBED_RULE, *LAYER_RULES_BEFORE_QKV, QKV_RULE, QKV_BIAS_RULE, *LAYER_RULES_AFTER_QKV,
           *FINAL_RULES),
    tconfig_fields={"add_qkv_bias": True}, validate=validate_qwen2)
