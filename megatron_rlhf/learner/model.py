"""Build a megatron-core GPTModel from a Hugging Face folder (config, platform spec, weights).

    hf_config = load_hf_config(model_dir)
    tcfg = transformer_config_from_hf(hf_config, dtype="float32")
    model = build_gpt_model(hf_config, tcfg, platform=get_platform())
    load_mcore_state(model, hf_to_mcore(load_hf_state_dict(model_dir), hf_config))

Weights are full (TP=PP=1) tensors keyed by global layer index; sharding for TP/PP slots in at
:func:`load_mcore_state` / :func:`full_mcore_state` (today they raise for TP/PP > 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.convert.mapping import align_names, gpt_model_kwargs_from_hf

__all__ = ["check_divisible", "load_hf_config", "load_hf_state_dict", "build_gpt_model", "load_mcore_state",
           "full_mcore_state", "HF_WEIGHT_FILES", "LearnerModelSpec", "learner_model_spec"]

HF_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json")


def check_divisible(hf_config, *, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Check that the model splits over the learner layout: attention heads, KV heads and FFN
    width by ``tensor_parallel``, layers by ``pipeline_parallel`` (megatron shards them evenly).

    Raises:
        ValueError: names the model field, the learner key and the divisors to choose from.
    """
    h = hf_config
    kv = getattr(h, "num_key_value_heads", None) or h.num_attention_heads
    tp_dims = (("num_attention_heads", h.num_attention_heads), ("num_key_value_heads", kv),
               ("intermediate_size", h.intermediate_size))
    for dims, k, key in ((tp_dims, tensor_parallel, "tensor_parallel"),
                         ((("num_hidden_layers", h.num_hidden_layers),), pipeline_parallel, "pipeline_parallel")):
        for what, n in dims:
            if n % k:
                valid = [d for d in range(1, 17) if all(m % d == 0 for _, m in dims)]
                fields = ", ".join(f"{w}={m}" for w, m in dims)
                raise ValueError(f"model {what}={n} is not divisible by learner.{key}={k}; choose a "
                                 f"value that divides {fields}: one of {valid}")


@dataclass(frozen=True)
class LearnerModelSpec:
    """What a learner's GPTModels are built from.

    Attributes:
        config: megatron ``TransformerConfig`` (this layout's TP/PP, sequence parallelism, dtype,
            recomputation, the platform's fields).
        layer_spec: the ``ModuleSpec`` for ``GPTModel(transformer_layer_spec=...)``.
        sequence_parallel: megatron sequence parallelism is on (``learner.sequence_parallel``
            and TP > 1).
    """

    config: object
    layer_spec: object
    sequence_parallel: bool


def learner_model_spec(hf_config, learner_cfg, *, dtype, cuda: bool, te: bool,
                       wgrad_kernel: bool = False) -> LearnerModelSpec:
    """The exact ``TransformerConfig`` and layer spec of a learner, from the platform facts.

    The learner calls it with its platform's facts (``cuda = not platform.is_cpu``,
    ``te = platform.transformer_engine``); a CPU test calls it with ``cuda=True, te=False`` to
    build the GPU learner's model without Transformer Engine (only
    :data:`megatron_rlhf.platform.CUDA_ONLY_FIELDS` then need CUDA to run).

    Fields: :func:`megatron_rlhf.convert.transformer_config_from_hf` of the HF config at
    ``learner.tensor_parallel`` / ``pipeline_parallel``, no initialisation (weights are loaded),
    sequence parallelism when TP > 1, PP > 1: ``variable_seq_lengths`` (p2p sends each
    micro-batch's shape first, so length-grouped micro-batches can differ; megatron's config check
    then also asks for the ``alltoall`` MoE dispatcher, no effect on a dense model),
    :func:`megatron_rlhf.platform.recompute_fields`, :func:`megatron_rlhf.platform.transformer_fields`.

    Args:
        hf_config: HF ``PretrainedConfig``.
        learner_cfg: ``LearnerConfig``.
        dtype: parameter dtype (``torch.dtype`` or its name).
        cuda, te: CUDA available; megatron's TE extension live (``te`` needs ``cuda``).
        wgrad_kernel: APEX's ``fused_weight_gradient_mlp_cuda`` imports
            (``platform.fused_wgrad_kernel``; with ``cuda`` and ``te`` it turns on
            ``gradient_accumulation_fusion``: :func:`megatron_rlhf.platform.grad_accumulation_fusion`).
    Raises:
        ValueError: unsupported architecture, ``te`` without ``cuda``, refused recomputation.
    """
    from megatron_rlhf.convert.mapping import transformer_config_from_hf
    from megatron_rlhf.platform import layer_spec, recompute_fields, transformer_fields

    tp, pp = learner_cfg.tensor_parallel, learner_cfg.pipeline_parallel
    sp = bool(learner_cfg.sequence_parallel and tp > 1)
    fields = dict(perform_initialization=False, sequence_parallel=sp)
    if pp > 1:
        fields.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    fields.update(recompute_fields(learner_cfg.recompute, learner_cfg.recompute_modules, te=te))
    fields.update(transformer_fields(cuda=cuda, te=te, wgrad_kernel=wgrad_kernel))
    config = transformer_config_from_hf(hf_config, dtype=dtype, tp=tp, pp=pp, **fields)
    return LearnerModelSpec(config=config, layer_spec=layer_spec(config, te=te), sequence_parallel=sp)


def load_hf_config(model_dir: str | Path):
    """``transformers.AutoConfig`` of an HF folder (offline, local files only)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's safetensors files (single file or sharded with an index).

    Returns:
        HF names -> CPU tensors in the stored dtype.
    Raises:
        FileNotFoundError: the folder has no ``*.safetensors`` file.
    """
    from safetensors.torch import load_file

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights (save the model with "
                                "save_pretrained(..., safe_serialization=True))")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(d / f), device="cpu"))
    return out


def build_gpt_model(hf_config, transformer_config, *, platform, pg_collection=None,
                    pre_process: bool = True, post_process: bool = True,
                    vocab_size: int | None = None, layer_spec=None):
    """An (uninitialised unless ``transformer_config.perform_initialization``) GPTModel for an HF
    config, with the platform's layer spec, on the platform's device.

    Args:
        hf_config: HF config (vocab, positions, RoPE base, tying come from it).
        transformer_config: from :func:`megatron_rlhf.convert.transformer_config_from_hf`.
        platform: :class:`megatron_rlhf.platform.Platform`.
        pg_collection: megatron ``ProcessGroupCollection`` (None: megatron's global groups).
        pre_process, post_process: first / last pipeline stage flags.
        vocab_size: embedding/output rows (None: ``hf_config.vocab_size``); tensor parallelism
            pads it to a multiple of TP (:func:`megatron_rlhf.convert.sharding.padded_vocab_size`).
        layer_spec: the ``ModuleSpec`` (None: ``platform.layer_spec(transformer_config)``).
    Returns:
        ``megatron.core.models.gpt.GPTModel``.
    """
    from megatron.core.models.gpt import GPTModel

    kwargs = gpt_model_kwargs_from_hf(hf_config)
    if vocab_size is not None:
        kwargs["vocab_size"] = int(vocab_size)
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    model = GPTModel(config=transformer_config,
                     transformer_layer_spec=(platform.layer_spec(transformer_config)
                                             if layer_spec is None else layer_spec),
                     pre_process=pre_process, post_process=post_process, **kwargs)
    return model.to(platform.device)


def _params_and_buffers(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _check_unsharded(model) -> None:
    cfg = model.config
    if cfg.tensor_model_parallel_size != 1 or cfg.pipeline_model_parallel_size != 1:
        raise NotImplementedError("full-tensor load/export needs TP=PP=1 for now "
                                  f"(got TP={cfg.tensor_model_parallel_size}, "
                                  f"PP={cfg.pipeline_model_parallel_size})")


@torch.no_grad()
def load_mcore_state(model, mcore_state: dict[str, torch.Tensor]) -> None:
    """Copy full megatron tensors (from :func:`megatron_rlhf.convert.hf_to_mcore`) into ``model``.

    Names are aligned to the model's spec (local vs TE norm names); every model tensor must be
    given with the same shape; dtype is converted to the parameter's.

    Raises:
        KeyError: model tensors missing from ``mcore_state`` or unexpected extra tensors.
        ValueError: a shape differs (names it).
    """
    _check_unsharded(model)
    target = _params_and_buffers(model)
    src = align_names(mcore_state, target.keys())
    missing = sorted(set(target) - set(src))
    extra = sorted(set(src) - set(target))
    if missing or extra:
        raise KeyError(f"load_mcore_state: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, dst in target.items():
        if tuple(dst.shape) != tuple(src[name].shape):
            raise ValueError(f"load_mcore_state: {name} has shape {tuple(src[name].shape)}, "
                             f"model expects {tuple(dst.shape)}")
        dst.copy_(src[name])


def full_mcore_state(model) -> dict[str, torch.Tensor]:
    """The model's full tensors by megatron name (detached views of the live parameters;
    clone before modifying the model if you keep them)."""
    _check_unsharded(model)
    return {k: v.detach() for k, v in _params_and_buffers(model).items()}
