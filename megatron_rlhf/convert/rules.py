"""What an architecture's mapping table is made of: :class:`ParamRule` (one megatron parameter and
its HF tensors) and :class:`ArchSpec` (one architecture), plus :func:`align_names` (local-spec <->
Transformer-Engine-spec norm names). The tables (``convert/llama.py``, ``mistral.py``, ``qwen2.py``,
``qwen3.py``) and the machinery (``convert/mapping.py``) import this module; it imports nothing of
the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ParamRule", "ArchSpec", "align_names"]


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter and the HF tensor(s) it is made of.

    Attributes:
        mcore: megatron name (local-spec layout); ``{i}`` = global layer index.
        hf: HF names in fusion order (``{i}`` = layer index).
        kind: ``copy`` (one tensor as is), ``qkv`` (q, k, v interleaved per query group; weights
            ``[rows, h]`` or biases ``[rows]``), ``gate_up`` (gate and up concatenated on dim 0).
        tp: how tensor parallelism splits it: ``replicated``, ``column`` (dim 0), ``row`` (dim 1),
            ``vocab`` (dim 0, padded to the padded vocab size).
        untied_only: present only when input and output embeddings are not tied.
        hf_shapes: symbolic shape of each HF tensor, comma-separated dimension symbols:
            ``V`` vocab, ``h`` hidden, ``f`` ffn, ``q`` = np*hn, ``kv`` = ng*hn, ``hn`` head dim
            (see :func:`model_dims`); used to refuse mismatched checkpoints before converting.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"
    tp: str = "replicated"
    untied_only: bool = False
    hf_shapes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    """An architecture: its HF ``model_type`` values, its ordered mapping table (global rules
    with no ``{i}`` and per-layer rules with ``{i}``), the ``TransformerConfig`` fields it sets
    on top of the Llama defaults, and a validator of the HF config.

    Attributes:
        name: short name (``llama``, ``mistral``, ``qwen2``, ``qwen3``).
        model_types: HF ``config.model_type`` values this table handles.
        rules: the mapping table.
        tconfig_fields: extra ``TransformerConfig`` keyword arguments (e.g. ``add_qkv_bias``).
        validate: ``validate(hf_config)`` raising ``ValueError`` (naming the field) for options
            the table cannot represent; None: no extra check.
    """

    name: str
    model_types: tuple[str, ...]
    rules: tuple[ParamRule, ...]
    tconfig_fields: Mapping[str, Any] = field(default_factory=dict)
    validate: Callable[[Any], None] | None = None


# local-spec name suffix -> Transformer Engine spec name suffix (same tensor)
_TE_ALIASES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
               ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


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
