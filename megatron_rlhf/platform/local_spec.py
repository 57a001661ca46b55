"""The device-agnostic layer spec: SDPA core attention and torch norms inside megatron's local
GPT layer spec. The CPU learner and the GPU learner without Transformer Engine build exactly this
spec (:func:`megatron_rlhf.platform.layer_spec`), so CI runs the no-TE GPU model code.

Nothing here calls CUDA or patches anything; importing it imports megatron-core.
Source: megatron-core 0.16.1 ``models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_local_spec``),
``transformer/torch_norm.py`` (``WrappedTorchNorm`` refuses sequence parallelism);
nanochat ``flash_attention.py`` (one attention API, SDPA fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SDPACoreAttention", "TorchNorm", "local_layer_spec", "packed_causal_attention"]


class SDPACoreAttention(DotProductAttention):
    """Megatron core attention computed with ``torch.nn.functional.scaled_dot_product_attention``.

    Inputs ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (GQA: ``ng`` query groups;
    query head ``h`` uses group ``h // (np // ng)``, as megatron lays out QKV), ``attention_mask``
    (megatron convention: True = masked out) or None for the spec's causal mask.
    Returns ``[sq, b, np * hn]``. Dropout uses ``config.attention_dropout`` in training mode.
    Same constructor as ``megatron.core.transformer.dot_product_attention.DotProductAttention``.

    Packed sequences (``packed_seq_params.qkv_format == "thd"``, see
    :mod:`megatron_rlhf.learner.packing`): megatron's ``Attention`` hands over ``query [t, np, hn]``,
    ``key``/``value [t, ng, hn]`` (RoPE already applied per segment); attention keeps the
    sequences of ``cu_seqlens_q`` apart: the block-diagonal causal mask
    (:func:`megatron_rlhf.learner.packing.block_causal_mask`: a token sees only earlier tokens of
    its own sequence), computed segment by segment (:func:`packed_causal_attention`), and the
    result is ``[t, np * hn]``. This is the same tensor code on CPU and on a GPU without
    Transformer Engine. On CUDA the further speed-up is one varlen flash kernel launch for all
    segments (not used here); where TE
    is present the TE spec's ``TEDotProductAttention`` takes ``packed_seq_params`` itself (THD
    varlen attention; ``platform/gpu.py`` builds megatron's TE spec unchanged, so megatron's
    ``Attention`` passes the params straight through).

    Raises:
        NotImplementedError: attention bias, query-key layer scaling, sliding-window attention
            (not needed by Llama-family models), a packed format other than ``thd``, or packed
            queries and keys with different boundaries (cross-attention).
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention bias")
        if self.config.apply_query_key_layer_scaling or self.config.window_size is not None:
            raise NotImplementedError("SDPACoreAttention: set apply_query_key_layer_scaling=False "
                                      "and window_size=None")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b, np_, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.config.attention_dropout if self.training else 0.0
        gqa = key.size(2) != np_
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 dropout_p=dropout, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                 is_causal=mask_type == AttnMaskType.causal,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query, key, value, params):
        """THD attention: ``query [t, np, hn]``, ``key``/``value [t, ng, hn]`` -> ``[t, np * hn]``
        (see the class doc)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPACoreAttention: packed qkv_format={params.qkv_format!r}; "
                                      "only 'thd' is supported")
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise NotImplementedError("SDPACoreAttention: packed queries and keys with different "
                                      "cu_seqlens (cross-attention)")
        bounds = getattr(params, "_sdpa_bounds", None)   # one host copy per micro-batch, all layers
        if bounds is None:
            bounds = params._sdpa_bounds = [int(v) for v in cu_q.tolist()]
        t = query.shape[0]
        out = packed_causal_attention(query, key, value, bounds, scale=self.softmax_scale,
                                      dropout_p=self.config.attention_dropout if self.training else 0.0)
        return out.reshape(t, self.hidden_size_per_partition)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens,
                            *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal self-attention of packed sequences: each segment ``[cu_k, cu_{k+1})`` attends only
    to itself, causally. Exactly SDPA over the whole packed row with the block-diagonal causal
    mask of :func:`megatron_rlhf.learner.packing.block_causal_mask` (the slow reference the tests
    compare with), computed per segment with ``is_causal=True``: ``sum L_i^2`` score entries instead
    of ``t^2``, and the causal SDPA kernels (CPU flash attention; on CUDA FlashAttention / memory-
    efficient) instead of the masked path, whose CPU backward was 10x slower in a profile of
    ``bench/learner.py``. A varlen flash kernel does the same in one launch on CUDA.

    Args:
        query: ``[t, np, hn]``; key, value: ``[t, ng, hn]`` (GQA when ``ng < np``: query head h uses
            group ``h // (np // ng)``).
        cu_seqlens: ``n + 1`` int boundaries (a list, or a tensor: then copied to the host),
            ``cu_seqlens[-1] == t``.
        scale: softmax scale (None: ``1 / sqrt(hn)``); dropout_p: attention dropout.
    Returns:
        ``[t, np, hn]``.
    """
    bounds = [int(v) for v in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))   # [1, heads, t, hn]
    gqa = key.size(1) != query.size(1)
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                           dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=2)[0].permute(1, 0, 2)


class TorchNorm:
    """Norm factory for megatron ModuleSpecs: torch ``RMSNorm`` or ``LayerNorm`` per
    ``config.normalization``; parameters are tagged ``sequence_parallel`` so megatron's
    ``finalize_model_grads`` all-reduces their grads under sequence parallelism.

    Args (as megatron passes them): ``config`` (TransformerConfig), ``hidden_size``, ``eps``.
    Returns a ``torch.nn.RMSNorm``/``LayerNorm`` over the last dimension ``[..., hidden_size]``.
    Raises ValueError for other ``normalization`` values.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"TorchNorm: normalization={config.normalization!r}; "
                             "expected RMSNorm or LayerNorm")
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def local_layer_spec(config):
    """The device-agnostic GPT block spec (CPU, and GPU without Transformer Engine): megatron's
    local layer spec with :class:`SDPACoreAttention` and :class:`TorchNorm` for the input, pre-MLP
    (and QK) and final norms. On CUDA, SDPA dispatches causal bf16 attention to FlashAttention
    (no ``s x s`` score matrix kept); megatron's own local spec instead keeps ``DotProductAttention``
    (unfused softmax) and ``WrappedTorchNorm``, which asserts ``not sequence_parallel``.

    Parameter names are those of the local spec (``decoder.layers.N.input_layernorm.weight``,
    ``...self_attention.linear_qkv.weight``, ``...mlp.linear_fc1.weight``, ...,
    ``decoder.final_layernorm.weight``); checkpoints use the TE layout names through the spec's
    ``sharded_state_dict_keys_map`` (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``).

    Args:
        config: megatron ``TransformerConfig`` (its PP size decides how many layers this rank builds).
    Returns:
        ``ModuleSpec(TransformerBlock)`` to pass as ``GPTModel(transformer_layer_spec=...)``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layer = get_gpt_layer_local_spec(normalization=config.normalization,
                                     qk_layernorm=bool(getattr(config, "qk_layernorm", False)))
    attn = layer.submodules.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if attn.q_layernorm is not None and getattr(config, "qk_layernorm", False):
        attn.q_layernorm = TorchNorm
        attn.k_layernorm = TorchNorm
    layer.submodules.input_layernorm = TorchNorm
    layer.submodules.pre_mlp_layernorm = TorchNorm
    n = get_num_layers_to_build(config)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * n,
                                                            layer_norm=TorchNorm))
