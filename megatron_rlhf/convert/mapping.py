"""Table-driven HF <-> megatron-core GPTModel conversion shared by every architecture.

What a table is made of (:class:`ParamRule`, :class:`ArchSpec`, :func:`align_names`) lives in
:mod:`megatron_rlhf.convert.rules`, below both this module and the tables. Each architecture module (:mod:`~megatron_rlhf.convert.llama`, :mod:`~megatron_rlhf.convert.mistral`,
:mod:`~megatron_rlhf.convert.qwen2`, :mod:`~megatron_rlhf.convert.qwen3`) defines one
:class:`ArchSpec`: its HF ``model_type`` values, its ordered table of :class:`ParamRule` and the
megatron ``TransformerConfig`` fields it needs beyond the Llama defaults. The same table drives
checkpoint conversion (:func:`hf_to_mcore`, :func:`iter_mcore_to_hf`, ``tools/convert/``), TP
sharding (:mod:`megatron_rlhf.convert.sharding`) and learner -> generator weight sync.
Tensors here are *full* (unsharded) tensors with *global* layer indices.

Layouts (megatron-core 0.16.1, ``megatron/core/transformer/attention.py``
``SelfAttention.get_query_key_value_tensors`` and ``megatron/core/transformer/mlp.py``):

* ``linear_qkv.weight [ng * (np/ng + 2) * hn, h]`` (and ``linear_qkv.bias [ng*(np/ng+2)*hn]``
  for Qwen2): interleaved per query group ``g``: ``[q heads of group g (np/ng * hn rows), k_g
  (hn rows), v_g (hn rows)]`` for g = 0..ng-1. HF keeps ``q_proj [np*hn, h]``,
  ``k_proj [ng*hn, h]``, ``v_proj [ng*hn, h]`` apart; HF query head ``j`` belongs to KV group
  ``j // (np/ng)`` (``repeat_kv`` in ``modeling_llama.py``).
* ``linear_fc1.weight [2 * ffn, h]`` = ``cat([gate_proj, up_proj])``: megatron's gated linear
  unit computes ``silu(x[..., :ffn]) * x[..., ffn:]``.
* Norms: the local spec keeps ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` as their
  own modules; the Transformer Engine spec (and every dist checkpoint, through the local spec's
  ``sharded_state_dict_keys_map``) names them ``self_attention.linear_qkv.layer_norm_weight`` /
  ``mlp.linear_fc1.layer_norm_weight`` (:func:`align_names` converts between the two).
* Qwen3 QK norm: HF ``self_attn.q_norm.weight [hn]`` / ``k_norm`` = megatron
  ``self_attention.q_layernorm.weight`` / ``k_layernorm`` (``qk_layernorm=True``: RMSNorm over
  each head's ``hn`` channels before RoPE, as in ``modeling_qwen3.py``).
* Tied embeddings (``tie_word_embeddings``): megatron keeps only ``embedding.word_embeddings.weight``
  (``share_embeddings_and_output_weights=True``); HF checkpoints then have no ``lm_head.weight``.
* Vocab padding: embedding / output rows may be zero-padded (TP needs ``V % tp == 0``); exports
  truncate to ``hf_config.vocab_size``.
* RoPE: both use the non-interleaved "rotate half" form with ``inv_freq = base^(-2i/hn)``.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from megatron_rlhf.convert.llama import LLAMA
from megatron_rlhf.convert.mistral import MISTRAL
from megatron_rlhf.convert.qwen2 import QWEN2
from megatron_rlhf.convert.qwen3 import QWEN3
from megatron_rlhf.convert.rules import _TE_ALIASES, ArchSpec, ParamRule, align_names  # noqa: F401 (re-exported)

__all__ = ["ParamRule", "ArchSpec", "get_arch", "supported_model_types", "hf_to_mcore",
           "mcore_to_hf", "iter_mcore_to_hf", "align_names", "transformer_config_from_hf",
           "gpt_model_kwargs_from_hf", "hf_rope_theta", "torch_dtype", "model_dims",
           "expected_hf_shapes", "mcore_shape", "validate_parallel_layout", "num_parameters"]


def _archs() -> dict[str, ArchSpec]:
    """model_type -> ArchSpec of every built-in architecture."""
    return {t: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3) for t in a.model_types}


def supported_model_types() -> list[str]:
    """Sorted HF ``model_type`` values with a mapping table."""
    return sorted(_archs())


def _check_common(hf_config) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hf config hidden_act={act!r} is not supported (the SwiGLU mapping needs "
                         "'silu')")


def get_arch(hf_config) -> ArchSpec:
    """The mapping table for ``hf_config.model_type`` after validating the config.

    Raises:
        ValueError: unsupported model type, or an option this converter does not handle (named:
            e.g. ``attention_bias`` on Llama, ``use_sliding_window`` on Qwen2, ``hidden_act``).
    """
    mt = getattr(hf_config, "model_type", None)
    archs = _archs()
    if mt not in archs:
        raise ValueError(f"model_type={mt!r} is not supported by megatron_rlhf.convert "
                         f"(supported: {sorted(archs)})")
    arch = archs[mt]
    _check_common(hf_config)
    if arch.validate is not None:
        arch.validate(hf_config)
    return arch


def _dims(hf_config) -> tuple[int, int, int]:
    """(num_heads np, num_kv_groups ng, head_dim hn)."""
    np_ = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or np_
    hn = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // np_
    if np_ % ng:
        raise ValueError(f"num_attention_heads={np_} is not a multiple of num_key_value_heads={ng}")
    return np_, ng, hn


def model_dims(hf_config) -> dict[str, int]:
    """Dimension symbols of :attr:`ParamRule.hf_shapes`: ``V`` (vocab_size), ``h``
    (hidden_size), ``f`` (intermediate_size), ``q`` (np*hn), ``kv`` (ng*hn), ``hn`` (head_dim),
    plus ``np``, ``ng`` and ``L`` (layers)."""
    np_, ng, hn = _dims(hf_config)
    return {"V": hf_config.vocab_size, "h": hf_config.hidden_size, "f": hf_config.intermediate_size,
            "q": np_ * hn, "kv": ng * hn, "hn": hn, "np": np_, "ng": ng,
            "L": hf_config.num_hidden_layers}


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


def expected_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the config implies, for every tensor the table reads (tied
    ``lm_head.weight`` excluded). Raises ValueError for an unsupported architecture."""
    arch = get_arch(hf_config)
    dims = model_dims(hf_config)
    out = {}
    for rule, _, hnames in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config)):
        for name, sym in zip(hnames, rule.hf_shapes):
            out[name] = tuple(dims[s.strip()] for s in sym.split(","))
    return out


def mcore_shape(rule: ParamRule, hf_shapes: list[tuple[int, ...]], *,
                padded_vocab_size: int | None = None) -> tuple[int, ...]:
    """Shape of the full megatron tensor built from HF tensors of ``hf_shapes`` (no data read):
    ``qkv``/``gate_up`` concatenate dim 0; vocab rules get ``padded_vocab_size`` rows."""
    first = tuple(hf_shapes[0])
    rows = sum(s[0] for s in hf_shapes) if rule.kind in ("qkv", "gate_up") else first[0]
    if rule.tp == "vocab" and padded_vocab_size is not None:
        rows = padded_vocab_size
    return (rows, *first[1:])


def _check_shapes(names, tensors_or_shapes, expected: Mapping[str, tuple], where: str) -> None:
    for name, t in zip(names, tensors_or_shapes):
        shape = tuple(t.shape) if torch.is_tensor(t) else tuple(t)
        if name in expected and shape != expected[name]:
            raise ValueError(f"{where}: HF tensor {name!r} has shape {shape}, the config implies "
                             f"{expected[name]}")


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
        ValueError: unsupported architecture (see :func:`get_arch`) or an HF tensor whose shape
            differs from what the config implies (names it).
    """
    arch = get_arch(hf_config)
    np_, ng, hn = _dims(hf_config)
    expected = expected_hf_shapes(hf_config)
    out: dict[str, torch.Tensor] = {}
    for rule, mname, hnames in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config)):
        missing = [h for h in hnames if h not in hf_state_dict]
        if missing:
            raise KeyError(f"hf_to_mcore: HF tensor(s) {missing} missing for {mname}")
        ts = [hf_state_dict[h] for h in hnames]
        _check_shapes(hnames, ts, expected, "hf_to_mcore")
        out[mname] = fuse_rule(rule, ts, np_, ng, hn, padded_vocab_size)
    return out


def fuse_rule(rule: ParamRule, ts, np_: int, ng: int, hn: int,
              padded_vocab_size: int | None = None) -> torch.Tensor:
    """One full megatron tensor from its HF tensors ``ts`` (in ``rule.hf`` order): a new
    contiguous tensor (QKV interleave, gate/up concatenation, vocab zero-padding)."""
    if rule.kind == "qkv":
        t = _fuse_qkv(*ts, np_, ng, hn)
    elif rule.kind == "gate_up":
        t = torch.cat(list(ts), dim=0)
    else:
        t = ts[0].clone()
    if rule.tp == "vocab":
        t = _pad_vocab(t, padded_vocab_size)
    return t.contiguous()


def split_rule(rule: ParamRule, t: torch.Tensor, hf_config) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`fuse_rule`: the HF tensors (``rule.hf`` order) of one full megatron
    tensor; vocab rows truncated to ``hf_config.vocab_size``. ``copy`` rules may return ``t``
    itself (contiguous input) or a view.

    Raises:
        ValueError: vocab rules with fewer than ``vocab_size`` rows.
    """
    np_, ng, hn = _dims(hf_config)
    if rule.tp == "vocab":
        if t.shape[0] < hf_config.vocab_size:
            raise ValueError(f"{rule.mcore}: {t.shape[0]} rows < vocab_size {hf_config.vocab_size}")
        t = t[: hf_config.vocab_size]
    if rule.kind == "qkv":
        return _split_qkv(t, np_, ng, hn)
    if rule.kind == "gate_up":
        return tuple(p.contiguous() for p in torch.chunk(t, 2, dim=0))
    return (t.contiguous(),)


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
    sd = align_names(mcore_state_dict, _local_names(arch, hf_config))
    for rule, mname, hnames in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config)):
        if mname not in sd:
            raise KeyError(f"mcore_to_hf: megatron tensor {mname!r} missing")
        yield from zip(hnames, split_rule(rule, sd[mname], hf_config))


def mcore_to_hf(mcore_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Dict form of :func:`iter_mcore_to_hf` (HF names -> full tensors)."""
    return dict(iter_mcore_to_hf(mcore_state_dict, hf_config))


def _local_names(arch: ArchSpec, hf_config) -> list[str]:
    return [m for _, m, _ in _expand(arch.rules, hf_config.num_hidden_layers, _tied(hf_config))]


def validate_parallel_layout(hf_config, tp: int, pp: int) -> None:
    """Check that a TP x PP layout can hold the model.

    TP must divide the attention heads, the KV groups (GQA: each TP rank holds whole query
    groups) and the FFN width; PP must divide the layers (megatron's even split).

    Raises:
        ValueError: names the field that does not divide (and the fix).
    """
    d = model_dims(hf_config)
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp}, pp={pp}: both must be >= 1")
    for field_name, value in (("num_attention_heads", d["np"]), ("num_key_value_heads", d["ng"]),
                              ("intermediate_size", d["f"])):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {field_name}={value}; "
                             f"choose a TP that divides it")
    if d["L"] % pp:
        raise ValueError(f"pipeline parallel size {pp} does not divide num_hidden_layers="
                         f"{d['L']}; choose a PP that divides it")


def num_parameters(hf_config) -> int:
    """Number of model parameters (HF count: tied embeddings counted once, no vocab padding)."""
    return sum(int(torch.Size(s).numel()) for s in expected_hf_shapes(hf_config).values())


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
    """Megatron ``TransformerConfig`` equivalent to an HF config of a supported architecture.

    Maps: layers, hidden, ``ffn_hidden_size = intermediate_size``, heads,
    ``num_query_groups = num_key_value_heads`` (GQA), ``kv_channels = head_dim``, RMSNorm with
    ``layernorm_epsilon = rms_norm_eps``, SwiGLU (``gated_linear_unit`` + ``silu``), no linear
    biases, HF dropouts (0 for inference-equivalence), fp32 softmax/residual in ``dtype``;
    fusions off (they need CUDA kernels), CPU initialisation. Per architecture
    (:attr:`ArchSpec.tconfig_fields`): Qwen2 ``add_qkv_bias=True``, Qwen3 ``qk_layernorm=True``.
    RoPE base and tying are GPTModel arguments: see :func:`gpt_model_kwargs_from_hf`.

    Args:
        hf_config: HF ``PretrainedConfig``.
        dtype: parameter dtype (``float32`` on CPU, ``bfloat16`` on GPU).
        tp, pp: tensor / pipeline parallel sizes.
        **overrides: any ``TransformerConfig`` field (e.g. ``perform_initialization=False``).
    Raises:
        ValueError: unsupported architecture/option (see :func:`get_arch`).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = get_arch(hf_config)
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
        # Fusions (review 2, N8), decided per field. Off here, the conversion's and the CPU's
        # values; the learner turns on what its platform runs (platform.transformer_fields):
        # bias_activation_fusion (SwiGLU) and apply_rope_fusion on CUDA, gradient_accumulation_fusion
        # with TE and APEX's wgrad kernel (platform.grad_accumulation_fusion). Off everywhere, on
        # purpose: masked_softmax_fusion (read only by megatron's DotProductAttention, which neither
        # spec builds: TE's attention and local_spec's SDPA do their own softmax) and
        # bias_dropout_fusion (these models have no linear biases and hidden_dropout is 0, so the
        # bias-dropout-add is a plain residual add: nothing to fuse, and the fused variant is a jit
        # function to compile); persist_layer_norm is APEX's LayerNorm kernel, not RMSNorm.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )
    kw.update(arch.tconfig_fields)
    kw.update(overrides)
    return TransformerConfig(**kw)


def gpt_model_kwargs_from_hf(hf_config, *, padded_vocab_size: int | None = None) -> dict:
    """``GPTModel`` keyword arguments (besides config and spec) for an HF config:
    ``vocab_size`` (``padded_vocab_size`` when given, e.g. from
    :func:`megatron_rlhf.convert.sharding.padded_vocab_size` for TP > 1), ``max_sequence_length``,
    ``position_embedding_type='rope'``, ``rotary_base``, ``share_embeddings_and_output_weights``,
    RoPE scaling (Llama 3.1), ``parallel_output=True`` (logits stay vocab-parallel under TP;
    :mod:`megatron_rlhf.learner.logprobs` never gathers them).

    Raises:
        ValueError: unsupported architecture, or ``padded_vocab_size < vocab_size``.
    """
    get_arch(hf_config)
    vocab = hf_config.vocab_size if padded_vocab_size is None else int(padded_vocab_size)
    if vocab < hf_config.vocab_size:
        raise ValueError(f"padded_vocab_size={vocab} < vocab_size={hf_config.vocab_size}")
    return dict(vocab_size=vocab,
                max_sequence_length=hf_config.max_position_embeddings,
                position_embedding_type="rope", rotary_percent=1.0,
                rotary_base=hf_rope_theta(hf_config),
                share_embeddings_and_output_weights=_tied(hf_config), parallel_output=True,
                **_rope_scaling(hf_config))
