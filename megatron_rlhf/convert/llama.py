"""Hugging Face Llama (and SmolLM2) <-> megatron-core GPTModel: config and weights.

One mapping table per architecture (:data:`LLAMA`); the same table drives checkpoint conversion
(:func:`hf_to_mcore`, :func:`mcore_to_hf`) and learner -> generator weight sync (HF-named buckets).
Tensors here are *full* (unsharded) tensors with *global* layer indices; each rule records how a
tensor is split under tensor parallelism (``tp``) so TP/PP sharding can be added on top.

Layouts (megatron-core 0.16.1, ``megatron/core/transformer/attention.py``
``SelfAttention.get_query_key_value_tensors`` and ``megatron/core/transformer/mlp.py``):

* ``linear_qkv.weight [ng * (np/ng + 2) * hn, h]``: interleaved per query group ``g``:
  ``[q heads of group g (np/ng * hn rows), k_g (hn rows), v_g (hn rows)]`` for g = 0..ng-1.
  HF keeps ``q_proj [np*hn, h]``, ``k_proj [ng*hn, h]``, ``v_proj [ng*hn, h]`` apart; HF query
  head ``j`` belongs to KV group ``j // (np/ng)`` (``repeat_kv`` in ``modeling_llama.py``).
* ``linear_fc1.weight [2 * ffn, h]`` = ``cat([gate_proj, up_proj])``: megatron's gated linear
  unit computes ``silu(x[..., :ffn]) * x[..., ffn:]``.
* Norms: the local spec keeps ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` as their
  own modules; the Transformer Engine spec fuses them into ``self_attention.linear_qkv.layer_norm_weight``
  / ``mlp.linear_fc1.layer_norm_weight`` (:func:`align_names` converts between the two).
* Tied embeddings (``tie_word_embeddings``): megatron keeps only ``embedding.word_embeddings.weight``
  (``share_embeddings_and_output_weights=True``); HF checkpoints then have no ``lm_head.weight``.
* RoPE: both use the non-interleaved "rotate half" form with ``inv_freq = base^(-2i/hn)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

__all__ = ["ParamRule", "ArchSpec", "LLAMA", "get_arch", "hf_to_mcore", "mcore_to_hf",
           "iter_mcore_to_hf", "align_names", "transformer_config_from_hf",
           "gpt_model_kwargs_from_hf", "hf_rope_theta", "torch_dtype"]


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter and the HF tensor(s) it is made of.

    Attributes:
        mcore: megatron name; ``{i}`` = global layer index.
        hf: HF names in fusion order (``{i}`` = layer index).
        kind: ``copy`` (one tensor as is), ``qkv`` (q, k, v interleaved per query group),
            ``gate_up`` (gate and up concatenated along dim 0).
        tp: how tensor parallelism splits it: ``replicated``, ``column`` (dim 0), ``row`` (dim 1),
            ``vocab`` (dim 0, padded to the padded vocab size).
        untied_only: present only when input and output embeddings are not tied.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"
    tp: str = "replicated"
    untied_only: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """An architecture: its HF ``model_type`` values and its ordered mapping table
    (global rules with no ``{i}`` and per-layer rules with ``{i}``)."""

    name: str
    model_types: tuple[str, ...]
    rules: tuple[ParamRule, ...]


LLAMA = ArchSpec(
    name="llama",
    model_types=("llama",),
    rules=(
        ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp="vocab"),
        ParamRule("decoder.layers.{i}.input_layernorm.weight",
                  ("model.layers.{i}.input_layernorm.weight",)),
        ParamRule("decoder.layers.{i}.self_attention.linear_qkv.weight",
                  ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                   "model.layers.{i}.self_attn.v_proj.weight"), kind="qkv", tp="column"),
        ParamRule("decoder.layers.{i}.self_attention.linear_proj.weight",
                  ("model.layers.{i}.self_attn.o_proj.weight",), tp="row"),
        ParamRule("decoder.layers.{i}.pre_mlp_layernorm.weight",
                  ("model.layers.{i}.post_attention_layernorm.weight",)),
        ParamRule("decoder.layers.{i}.mlp.linear_fc1.weight",
                  ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
                  kind="gate_up", tp="column"),
        ParamRule("decoder.layers.{i}.mlp.linear_fc2.weight",
                  ("model.layers.{i}.mlp.down_proj.weight",), tp="row"),
        ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        ParamRule("output_layer.weight", ("lm_head.weight",), tp="vocab", untied_only=True),
    ),
)

_ARCHS = {t: a for a in (LLAMA,) for t in a.model_types}

# local-spec name suffix -> Transformer Engine spec name suffix (same tensor)
_TE_ALIASES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
               ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def get_arch(hf_config) -> ArchSpec:
    """The mapping table for ``hf_config.model_type``.

    Raises:
        ValueError: unsupported model type or a Llama option this converter does not handle
            (``attention_bias``, ``mlp_bias``).
    """
    mt = getattr(hf_config, "model_type", None)
    if mt not in _ARCHS:
        raise ValueError(f"model_type={mt!r} is not supported by megatron_rlhf.convert "
                         f"(supported: {sorted(_ARCHS)})")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"hf config {flag}=True is not supported for {mt}: the mapping "
                             "table has no bias rules; add them to the arch's table")
    return _ARCHS[mt]


def _dims(hf_config) -> tuple[int, int, int]:
    """(num_heads np, num_kv_groups ng, head_dim hn)."""
    np_ = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or np_
    hn = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // np_
    if np_ % ng:
        raise ValueError(f"num_attention_heads={np_} is not a multiple of num_key_value_heads={ng}")
    return np_, ng, hn


def _tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _expand(rules, num_layers: int, tied: bool) -> Iterator[tuple[ParamRule, str, list[str]]]:
    """Yield (rule, mcore name, hf names) for every parameter in HF checkpoint order: global rules
    listed before the first per-layer rule, then layer 0..L-1, then the remaining global rules."""
    rules = [r for r in rules if not (r.untied_only and tied)]
    first = next(k for k, r in enumerate(rules) if "{i}" in r.mcore)
    for r in rules[:first]:
        if "{i}" not in r.mcore:
            yield r, r.mcore, list(r.hf)
    for i in range(num_layers):
        for r in rules:
            if "{i}" in r.mcore:
                yield r, r.mcore.format(i=i), [h.format(i=i) for h in r.hf]
    for r in rules[first:]:
        if "{i}" not in r.mcore:
            yield r, r.mcore, list(r.hf)


def _fuse_qkv(q, k, v, np_, ng, hn):
    """q ``[np*hn, ...]``, k/v ``[ng*hn, ...]`` -> ``[ng*(np/ng+2)*hn, ...]`` (see module doc)."""
    rest = q.shape[1:]
    q = q.reshape(ng, np_ // ng, hn, *rest)
    k = k.reshape(ng, 1, hn, *rest)
    v = v.reshape(ng, 1, hn, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (np_ // ng + 2) * hn, *rest)


def _split_qkv(qkv, np_, ng, hn):
    """Inverse of :func:`_fuse_qkv`: returns contiguous (q, k, v)."""
    rest = qkv.shape[1:]
    x = qkv.reshape(ng, np_ // ng + 2, hn, *rest)
    q, k, v = torch.split(x, [np_ // ng, 1, 1], dim=1)
    return (q.reshape(np_ * hn, *rest).contiguous(), k.reshape(ng * hn, *rest).contiguous(),
            v.reshape(ng * hn, *rest).contiguous())


def _pad_vocab(t: torch.Tensor, padded: int | None) -> torch.Tensor:
    if padded is None or padded == t.shape[0]:
        return t
    if padded < t.shape[0]:
        raise ValueError(f"padded_vocab_size={padded} < vocab size {t.shape[0]}")
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])


def hf_to_mcore(hf_state_dict: Mapping[str, torch.Tensor], hf_config, *,
                padded_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Convert a full HF causal-LM state dict to a full megatron GPTModel state dict.

    Args:
        hf_state_dict: HF names -> tensors (e.g. ``model.state_dict()`` or the safetensors
            files); ``lm_head.weight`` may be absent when embeddings are tied.
        hf_config: the HF ``PretrainedConfig`` (``model_type`` selects the mapping table).
        padded_vocab_size: pad embedding/output rows with zeros to this size (TP vocab padding);
            None keeps ``vocab_size`` rows.
    Returns:
        megatron names (local-spec layout, global layer indices) -> new contiguous tensors
        (dtype unchanged). Shapes: ``linear_qkv.weight [(np+2ng)*hn, h]``,
        ``linear_fc1.weight [2*ffn, h]``, embeddings ``[V, h]``.
    Raises:
        KeyError: an HF tensor the table needs is missing (names it).
        ValueError: unsupported architecture (see :func:`get_arch`).
    """
    arch = get_arch(hf_config)
    np_, ng, hn = _dims(hf_config)
    out: dict[str, torch.Tensor] = {}
    for rule, mname, hnames in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config)):
        missing = [h for h in hnames if h not in hf_state_dict]
        if missing:
            raise KeyError(f"hf_to_mcore: HF tensor(s) {missing} missing for {mname}")
        ts = [hf_state_dict[h] for h in hnames]
        if rule.kind == "qkv":
            t = _fuse_qkv(*ts, np_, ng, hn)
        elif rule.kind == "gate_up":
            t = torch.cat(ts, dim=0)
        else:
            t = ts[0].clone()
        if rule.tp == "vocab":
            t = _pad_vocab(t, padded_vocab_size)
        out[mname] = t.contiguous()
    return out


def iter_mcore_to_hf(mcore_state_dict: Mapping[str, torch.Tensor], hf_config
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for a full megatron state dict, in HF checkpoint order.

    Accepts local-spec or TE-spec names (:func:`align_names`) and padded vocab rows (truncated
    to ``hf_config.vocab_size``). The tied ``lm_head.weight`` is not yielded (HF checkpoints of
    tied models do not store it). Tensors are contiguous and may share no storage with the input
    (``qkv``/``gate_up`` splits are copies; ``copy`` rules return the input tensor itself).

    Raises:
        KeyError: a megatron tensor the table needs is missing (names it).
    """
    arch = get_arch(hf_config)
    np_, ng, hn = _dims(hf_config)
    sd = align_names(mcore_state_dict, _local_names(arch, hf_config))
    for rule, mname, hnames in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config)):
        if mname not in sd:
            raise KeyError(f"mcore_to_hf: megatron tensor {mname!r} missing")
        t = sd[mname]
        if rule.tp == "vocab":
            t = t[: hf_config.vocab_size]
        if rule.kind == "qkv":
            parts = _split_qkv(t, np_, ng, hn)
        elif rule.kind == "gate_up":
            parts = tuple(p.contiguous() for p in torch.chunk(t, 2, dim=0))
        else:
            parts = (t.contiguous(),)
        yield from zip(hnames, parts)


def mcore_to_hf(mcore_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Dict form of :func:`iter_mcore_to_hf` (HF names -> full tensors)."""
    return dict(iter_mcore_to_hf(mcore_state_dict, hf_config))


def _local_names(arch: ArchSpec, hf_config) -> list[str]:
    return [m for _, m, _ in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config))]


def align_names(state_dict: Mapping[str, Any], target_names) -> dict[str, Any]:
    """Rename local-spec <-> Transformer-Engine-spec norm names so they match ``target_names``.

    ``decoder.layers.N.input_layernorm.weight`` <-> ``decoder.layers.N.self_attention.linear_qkv.layer_norm_weight``
    and ``pre_mlp_layernorm.weight`` <-> ``mlp.linear_fc1.layer_norm_weight``. Other names pass
    unchanged. Returns a new dict (same tensor objects).
    """
    target = set(target_names)
    out = {}
    for name, t in state_dict.items():
        if name not in target:
            for local, te in _TE_ALIASES.items():
                if name.endswith(local) and name[: -len(local)] + te in target:
                    name = name[: -len(local)] + te
                    break
                if name.endswith(te) and name[: -len(te)] + local in target:
                    name = name[: -len(te)] + local
                    break
        out[name] = t
    return out


# ------------------------------------------------------------------------------------ config
def torch_dtype(dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16" | torch.dtype`` -> ``torch.dtype``.

    Raises:
        ValueError: other strings.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(table)}")
    return table[dtype]


def hf_rope_theta(hf_config) -> float:
    """RoPE base from an HF config (transformers 5: ``rope_parameters['rope_theta']``; older
    versions: ``rope_theta``). Raises ValueError when absent."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("hf config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def _rope_scaling(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return {}
    # megatron's RotaryEmbedding(rope_scaling=True) hard-codes Llama 3.1's low/high frequency
    # factors 1 and 4 and original context 8192 (megatron/core/models/common/embeddings/rope_utils.py)
    if kind == "llama3" and params.get("low_freq_factor", 1.0) == 1.0 \
            and params.get("high_freq_factor", 4.0) == 4.0 \
            and params.get("original_max_position_embeddings", 8192) == 8192:
        return {"rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}
    raise ValueError(f"hf config rope type {kind!r} with {params} is not supported by the "
                     "megatron conversion (supported: default, llama3 with Llama 3.1 factors)")


def transformer_config_from_hf(hf_config, *, dtype="float32", tp: int = 1, pp: int = 1,
                               **overrides):
    """Megatron ``TransformerConfig`` equivalent to an HF Llama-family config.

    Maps: layers, hidden, ``ffn_hidden_size = intermediate_size``, heads,
    ``num_query_groups = num_key_value_heads`` (GQA), ``kv_channels = head_dim``, RMSNorm with
    ``layernorm_epsilon = rms_norm_eps``, SwiGLU (``gated_linear_unit`` + ``silu``), no linear
    biases, HF dropouts (0 for inference-equivalence), fp32 softmax/residual in ``dtype``;
    fusions off (they need CUDA kernels), CPU initialisation. RoPE base and tying are GPTModel
    arguments: see :func:`gpt_model_kwargs_from_hf`.

    Args:
        hf_config: HF ``PretrainedConfig``.
        dtype: parameter dtype (``float32`` on CPU, ``bfloat16`` on GPU).
        tp, pp: tensor / pipeline parallel sizes.
        **overrides: any ``TransformerConfig`` field (e.g. ``perform_initialization=False``).
    Raises:
        ValueError: unsupported architecture/option (see :func:`get_arch`).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    get_arch(hf_config)
    np_, ng, hn = _dims(hf_config)
    dt = torch_dtype(dtype)
    kw = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=np_,
        num_query_groups=ng, kv_channels=hn, normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps), gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        params_dtype=dt, pipeline_dtype=dt, bf16=dt == torch.bfloat16, fp16=dt == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def gpt_model_kwargs_from_hf(hf_config) -> dict:
    """``GPTModel`` keyword arguments (besides config and spec) for an HF config:
    ``vocab_size``, ``max_sequence_length``, ``position_embedding_type='rope'``, ``rotary_base``,
    ``share_embeddings_and_output_weights``, RoPE scaling (Llama 3.1), ``parallel_output=True``
    (logits stay vocab-parallel under TP; :mod:`megatron_rlhf.learner.logprobs` never gathers them)."""
    get_arch(hf_config)
    return dict(vocab_size=hf_config.vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                position_embedding_type="rope", rotary_percent=1.0,
                rotary_base=hf_rope_theta(hf_config),
                share_embeddings_and_output_weights=_tied(hf_config), parallel_output=True,
                **_rope_scaling(hf_config))
