"""Llama 3.x (and SmolLM2) mapping table.

The table-driven machinery (``hf_to_mcore``, ``iter_mcore_to_hf``, ``transformer_config_from_hf``,
...) lives in :mod:`megatron_rlhf.convert.mapping` (import it from there or from
``megatron_rlhf.convert``), which imports this table; the table's building blocks
(``ParamRule``, ``ArchSpec``, ``align_names``) come from :mod:`megatron_rlhf.convert.rules`.

HF ``LlamaForCausalLM`` (``modeling_llama.py``) -> megatron GPTModel (local spec names):

=================================================  =========================================================
HF                                                 megatron
=================================================  =========================================================
``model.embed_tokens.weight [V, h]``               ``embedding.word_embeddings.weight [Vpad, h]`` (vocab TP)
``model.layers.i.input_layernorm.weight [h]``      ``decoder.layers.i.input_layernorm.weight``
``self_attn.{q,k,v}_proj.weight``                  ``decoder.layers.i.self_attention.linear_qkv.weight`` (QKV per group)
``self_attn.o_proj.weight [h, q]``                 ``decoder.layers.i.self_attention.linear_proj.weight`` (row TP)
``post_attention_layernorm.weight [h]``            ``decoder.layers.i.pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight [f, h]``               ``decoder.layers.i.mlp.linear_fc1.weight [2f, h]``
``mlp.down_proj.weight [h, f]``                    ``decoder.layers.i.mlp.linear_fc2.weight`` (row TP)
``model.norm.weight [h]``                          ``decoder.final_layernorm.weight``
``lm_head.weight [V, h]`` (untied only)            ``output_layer.weight [Vpad, h]``
=================================================  =========================================================
"""

from __future__ import annotations

from megatron_rlhf.convert.rules import ArchSpec, ParamRule, align_names  # noqa: F401 (re-exported)

__all__ = ["ParamRule", "ArchSpec", "LLAMA", "LLAMA_RULES", "align_names", "validate_no_linear_bias"]

_L = "model.layers.{i}."
_M = "decoder.layers.{i}."

#: embedding, layers, final norm, LM head of the Llama family (Llama, Mistral, and, with extra
#: rules, Qwen2/Qwen3).
EMBED_RULE = ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                       tp="vocab", hf_shapes=("V,h",))
QKV_RULE = ParamRule(_M + "self_attention.linear_qkv.weight",
                     (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
                      _L + "self_attn.v_proj.weight"), kind="qkv", tp="column",
                     hf_shapes=("q,h", "kv,h", "kv,h"))
LAYER_RULES_BEFORE_QKV = (
    ParamRule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), hf_shapes=("h",)),
)
LAYER_RULES_AFTER_QKV = (
    ParamRule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",),
              tp="row", hf_shapes=("h,q",)),
    ParamRule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",),
              hf_shapes=("h",)),
    ParamRule(_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
              kind="gate_up", tp="column", hf_shapes=("f,h", "f,h")),
    ParamRule(_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), tp="row",
              hf_shapes=("h,f",)),
)
FINAL_RULES = (
    ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), hf_shapes=("h",)),
    ParamRule("output_layer.weight", ("lm_head.weight",), tp="vocab", untied_only=True,
              hf_shapes=("V,h",)),
)

LLAMA_RULES = (EMBED_RULE, *LAYER_RULES_BEFORE_QKV, QKV_RULE, *LAYER_RULES_AFTER_QKV, *FINAL_RULES)


def validate_no_linear_bias(hf_config) -> None:
    """Refuse ``attention_bias`` / ``mlp_bias`` (the Llama table has no bias rules).

    Raises:
        ValueError: naming the flag.
    """
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"hf config {flag}=True is not supported for "
                             f"{hf_config.model_type}: the mapping table has no bias rules; add "
                             "them to the arch's table")


LLAMA = ArchSpec(name="llama", model_types=("llama",), rules=LLAMA_RULES,
                 validate=validate_no_linear_bias)
