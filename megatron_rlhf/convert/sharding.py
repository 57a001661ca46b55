"""Tensor-parallel sharding of megatron tensors and per-tensor HF <-> megatron conversion.

Companion of :mod:`megatron_rlhf.convert.mapping` (whose :class:`~megatron_rlhf.convert.rules.ParamRule`
table records how each tensor is split under TP). Everything here works one tensor at a time, so a
learner rank can load its shards from an HF folder and export HF tensors stage by stage without
ever holding a full copy of the model:

* :func:`iter_rules`: ``(rule, megatron name, HF names)`` for every megatron tensor, HF order.
* :func:`fuse_hf` / :func:`split_to_hf`: one megatron tensor <-> its HF tensors (QKV interleave,
  gate/up fusion, vocab padding/truncation).
* :func:`shard` / :func:`unshard`: full megatron tensor <-> the ``tp`` shards megatron's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` hold.
* :func:`padded_vocab_size`: the vocab rounded up so it splits evenly over TP ranks.
* :class:`HFCheckpointReader`: lazy per-tensor reads from an HF safetensors folder.

TP layouts (megatron-core 0.16.1, ``tensor_parallel/layers.py``, ``transformer/mlp.py``):

* ``column``: output dim 0 split into ``tp`` contiguous chunks. ``linear_qkv`` interleaves Q/K/V
  per query group, so rank r holds query groups ``[r*ng/tp, (r+1)*ng/tp)`` (needs ``ng % tp == 0``).
  ``linear_fc1`` (SwiGLU, ``kind='gate_up'``) is the exception: each rank's local output is
  ``[gate_r; up_r]`` because the GLU splits the *local* output in two
  (megatron's ``apply_swiglu_sharded_factory`` makes the same split for checkpoints).
* ``row``: input dim 1 split into contiguous chunks.
* ``vocab``: dim 0 (vocab rows, padded to :func:`padded_vocab_size`) split into contiguous chunks.
* ``replicated``: every rank holds the full tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from megatron_rlhf.convert import mapping
from megatron_rlhf.convert.mapping import ParamRule, get_arch

__all__ = ["iter_rules", "fuse_hf", "split_to_hf", "shard", "unshard", "padded_vocab_size",
           "HFCheckpointReader"]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp`` (megatron's ``VocabParallelEmbedding``
    needs an even split). Equal to ``vocab_size`` when it already divides, so TP=1 never pads.
    Padded rows are zero and their logits are masked out of every softmax by the learner."""
    return -(-int(vocab_size) // int(tp)) * int(tp)


def iter_rules(hf_config) -> Iterator[tuple[ParamRule, str, list[str]]]:
    """``(rule, megatron name with global layer index, HF names)`` for every megatron tensor of
    the model, in HF checkpoint order (embedding, layers 0..L-1, final norm, untied LM head).

    Raises:
        ValueError: unsupported architecture (:func:`megatron_rlhf.convert.mapping.get_arch`).
    """
    arch = get_arch(hf_config)
    # mapping._expand is the one place that knows the table's ordering; reuse it, do not copy it
    yield from mapping._expand(arch.rules, hf_config.num_hidden_layers, mapping._tied(hf_config))


def fuse_hf(rule: ParamRule, hf_tensors: Sequence[torch.Tensor], hf_config, *,
            padded_vocab: int | None = None) -> torch.Tensor:
    """Build one full megatron tensor from its HF tensors (same result as the matching entry of
    :func:`megatron_rlhf.convert.mapping.hf_to_mcore`).

    Args:
        rule: the tensor's mapping rule.
        hf_tensors: the tensors named by ``rule.hf`` in that order (q, k, v / gate, up / one).
        hf_config: HF config (head counts for the QKV interleave).
        padded_vocab: vocab rules are zero-padded to this many rows (None: no padding).
    Returns:
        a new contiguous tensor: ``qkv [(np+2ng)*hn, h]``, ``gate_up [2*ffn, h]``, else the copy.
    """
    if rule.kind == "qkv":
        np_, ng, hn = mapping._dims(hf_config)
        t = mapping._fuse_qkv(*hf_tensors, np_, ng, hn)
    elif rule.kind == "gate_up":
        t = torch.cat(list(hf_tensors), dim=0)
    else:
        t = hf_tensors[0].clone()
    if rule.tp == "vocab":
        t = mapping._pad_vocab(t, padded_vocab)
    return t.contiguous()


def split_to_hf(rule: ParamRule, hf_names: Sequence[str], full: torch.Tensor, hf_config
                ) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`fuse_hf`: one full megatron tensor -> ``[(hf_name, tensor)]``.

    Vocab rules are truncated to ``hf_config.vocab_size`` rows. Returned tensors are contiguous;
    ``copy`` rules may return ``full`` itself (or a view of it), so clone before mutating.
    """
    if rule.tp == "vocab":
        full = full[: hf_config.vocab_size]
    if rule.kind == "qkv":
        np_, ng, hn = mapping._dims(hf_config)
        parts = mapping._split_qkv(full, np_, ng, hn)
    elif rule.kind == "gate_up":
        parts = tuple(p.contiguous() for p in torch.chunk(full, 2, dim=0))
    else:
        parts = (full.contiguous(),)
    return list(zip(hf_names, parts))


def _split_dim(rule: ParamRule) -> int | None:
    return {"replicated": None, "column": 0, "vocab": 0, "row": 1}[rule.tp]


def shard(rule: ParamRule, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of a full megatron tensor (contiguous; a copy unless replicated).

    Args:
        rule: the tensor's rule (``rule.tp`` and ``rule.kind`` decide the split).
        full: full megatron tensor (vocab rules already padded to a multiple of ``tp``).
        tp_rank, tp: TP rank and size.
    Raises:
        ValueError: the split dimension is not divisible by ``tp``.
    """
    dim = _split_dim(rule)
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"{rule.mcore}: dim {dim} of shape {tuple(full.shape)} does not split "
                         f"over tensor_parallel={tp}")
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]]).contiguous()
    return full.chunk(tp, dim=dim)[tp_rank].contiguous()


def unshard(rule: ParamRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from all TP ranks' shards (in TP rank order).

    Replicated tensors return ``shards[0]``; the others a new contiguous tensor.
    """
    dim = _split_dim(rule)
    if dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=dim)


class HFCheckpointReader:
    """Lazy tensor access to an HF folder's safetensors files (single file or sharded with
    ``model.safetensors.index.json``): only the tensors asked for are read.

    Args:
        model_dir: HF folder.
    Raises:
        FileNotFoundError: no ``*.safetensors`` file in the folder.
    """

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
                 if index.is_file() else sorted(p.name for p in d.glob("*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{d}: no *.safetensors weights (save the model with "
                                    "save_pretrained(..., safe_serialization=True))")
        self._handles = [safe_open(str(d / f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (CPU, stored dtype). Raises KeyError naming it when absent."""
        if name not in self._where:
            raise KeyError(f"HF tensor {name!r} not found in the checkpoint")
        return self._where[name].get_tensor(name)
