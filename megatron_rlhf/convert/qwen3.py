"""Qwen3 (dense, ``Qwen3ForCausalLM``) mapping table: Llama plus per-head QK RMSNorm.

Qwen3 normalises each query and key head (``q_norm``/``k_norm``: RMSNorm over ``head_dim``
channels, before RoPE) and has no Q/K/V biases; its ``head_dim`` is set explicitly (128 for all
sizes, not ``hidden/heads``). megatron: ``qk_layernorm=True`` gives
``self_attention.q_layernorm`` / ``k_layernorm`` (RMSNorm over ``kv_channels``, applied per
head to ``[s, b, heads, hn]`` before RoPE), replicated across TP ranks.
Source: transformers ``models/qwen3/modeling_qwen3.py`` (``Qwen3Attention``);
megatron ``transformer/attention.py`` ``SelfAttention.get_query_key_value_tensors``.
"""

from __future__ import annotations

from megatron_rlhf.convert.llama import (_L, _M, EMBED_RULE, FINAL_RULES, LAYER_RULES_AFTER_QKV,
                                         LAYER_RULES_BEFORE_QKV, QKV_RULE)
from megatron_rlhf.convert.rules import ArchSpec, ParamRule
from megatron_rlhf.convert.qwen2 import validate_qwen2

__all__ = ["QWEN3", "QK_NORM_RULES", "validate_qwen3"]

QK_NORM_RULES = (
    ParamRule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",),
              hf_shapes=("hn",)),
    ParamRule(_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",),
              hf_shapes=("hn",)),
)


def validate_qwen3(hf_config) -> None:
    """Refuse ``attention_bias=True`` and sliding-window attention.

    Raises:
        ValueError: naming the field.
    """
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("hf config attention_bias=True is not supported for qwen3: the mapping "
                         "table has no bias rules")
    validate_qwen2(hf_config)


QWEN3 = ArchSpec(
    name="qwen3", model_types=("qwen3",),
    rules=(EMBED_RULE, *LAYER_RULES_BEFORE_QKV, QKV_RULE, *QK_NORM_RULES, *LAYER_RULES_AFTER_QKV,
           *FINAL_RULES),
    tconfig_fields={"qk_layernorm": True}, validate=validate_qwen3)
