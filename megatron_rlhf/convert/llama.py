"""Llama 3.x (and SmolLM2) mapping table; also re-exports the generic conversion API.

The table-driven machinery (``hf_to_mcore``, ``iter_mcore_to_hf``, ``transformer_config_from_hf``,
...) lives in :mod:`megatron_rlhf.convert.mapping` and is re-exported here, so
``from megatron_rlhf.convert.llama import hf_to_mcore`` keeps working for every architecture.

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

from megatron_rlhf.convert.mapping import (_TE_ALIASES, ArchSpec, ParamRule, _dims,  # noqa: F401
                                           _expand, _fuse_qkv, _local_names, _pad_vocab,
                                           _split_qkv, _tied, align_names, expected_hf_shapes,
                                           fuse_rule, get_arch, gpt_model_kwargs_from_hf,
                                           hf_rope_theta, hf_to_mcore, iter_mcore_to_hf,
                                           mcore_shape, mcore_to_hf, model_dims, num_parameters,
                                           split_rule, supported_model_types, torch_dtype,
                                           transformer_config_from_hf, validate_parallel_layout)

__all__ = ["ParamRule", "ArchSpec", "LLAMA", "LLAMA_RULES", "get_arch", "hf_to_mcore",
           "mcore_to_hf", "iter_mcore_to_hf", "align_names", "transformer_config_from_hf",
           "gpt_model_kwargs_from_hf", "hf_rope_theta", "torch_dtype"]

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
