"""Sharded weight I/O of one learner rank: load its TP/PP shards from an HF folder, and stream the
full HF-named tensors of its pipeline stage out (gathered over its TP group), one tensor at a time.

No function here ever holds more than one full tensor (plus one bucket / shard file) beyond the
model itself, so loading, weight sync and HF export scale to models that fill the learner:

* :func:`load_hf_weights`: every rank reads only the HF tensors of its own layers
  (:class:`~megatron_rlhf.convert.sharding.HFCheckpointReader`), fuses and shards them.
* :func:`iter_stage_hf_tensors`: on every TP rank of a stage (a collective over the TP group: all
  TP ranks must call it together); TP rank 0 receives each tensor's shards
  (``torch.distributed.gather``), un-shards and converts to HF names on the model's device and
  yields them there or on the host; the other TP ranks yield nothing.
* :func:`stage_hf_entries`: the ``(hf_name, dtype, shape, nbytes)`` of what
  :func:`iter_stage_hf_tensors` yields, from metadata alone (the conversion rules run on ``meta``
  tensors: no gather, no memory), so the broadcast transport plans its wire layout
  (:func:`megatron_rlhf.sync.wire.plan_layout`) before it gathers anything.
* :func:`measure_pack`: times the broadcast transport's pack (:func:`megatron_rlhf.sync.wire.pack_tensors`)
  against a memcpy, with the staging on the device or in (pinned) host memory.
* :func:`buckets`: groups ``(name, tensor)`` into dicts of at most ``bucket_bytes``.
* :func:`write_hf_shards` / :func:`finalize_hf_folder`: safetensors shard files per stage, then
  the HF names (``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index).

Name handling: megatron names carry *local* layer indices on a pipeline stage; the global index
is ``layer.layer_number - 1`` (megatron's ``TransformerLayer.layer_number`` is global, 1-based).
Under PP with tied embeddings the last stage holds a copy of the word embeddings as
``output_layer.weight`` (megatron keeps the copies equal by reducing their grads over the
embedding group); it loads from the embedding and is never exported (HF tied checkpoints have no
``lm_head.weight``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megatron_rlhf.convert.hf_io import apply_umask_permissions, copy_non_weight_files
from megatron_rlhf.convert.rules import ParamRule, align_names
from megatron_rlhf.convert.sharding import (HFCheckpointReader, fuse_hf, iter_rules, shard,
                                            split_to_hf, unshard)
from megatron_rlhf.sync.wire import entry, pack_tensors, plan_layout

__all__ = ["LocalTensor", "local_tensors", "load_hf_weights", "mark_tensor_parallel", "iter_stage_hf_tensors",
           "stage_hf_entries", "buckets", "measure_pack",
           "write_hf_shards", "prepare_hf_dir", "finalize_hf_folder"]



@dataclass(frozen=True)
class LocalTensor:
    """One tensor of this rank's model and where it sits in the full model.

    Attributes:
        name: the model's own (local) state-dict name.
        tensor: the live parameter/buffer (this rank's TP shard).
        rule: mapping rule (:class:`~megatron_rlhf.convert.llama.ParamRule`).
        mcore: global megatron name (local-spec naming, global layer index).
        hf_names: HF tensors it is made of.
        tied_copy: the last stage's copy of tied word embeddings (load only, never exported).
    """

    name: str
    tensor: torch.Tensor
    rule: ParamRule
    mcore: str
    hf_names: tuple[str, ...]
    tied_copy: bool = False


def _named_tensors(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # unwrap megatron DDP
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _layer_offset(model) -> int:
    model = getattr(model, "module", model)
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return int(layers[0].layer_number) - 1 if layers is not None and len(layers) else 0


def local_tensors(model, hf_config) -> list[LocalTensor]:
    """This rank's tensors with their rules, in HF checkpoint order (the tied copy last).

    Args:
        model: GPTModel (or megatron DDP of one) of this rank.
        hf_config: HF config of the model.
    Raises:
        KeyError: a model tensor has no rule (names it), i.e. the model and table disagree.
    """
    table = {m: (k, r, tuple(h)) for k, (r, m, h) in enumerate(iter_rules(hf_config))}
    offset = _layer_offset(model)
    tensors = _named_tensors(model)
    global_names = {}
    for name in tensors:
        g = name
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + offset)
            g = ".".join(parts)
        global_names[g] = name
    aligned = align_names(global_names, table.keys())  # TE-spec norm names -> table names
    out = []
    for g, name in aligned.items():
        if g in table:
            k, rule, hf = table[g]
            out.append((k, LocalTensor(name, tensors[name], rule, g, hf)))
        elif g == "output_layer.weight" and "embedding.word_embeddings.weight" in table:
            k, rule, hf = table["embedding.word_embeddings.weight"]  # tied copy on the last stage
            out.append((len(table), LocalTensor(name, tensors[name], rule, g, hf, tied_copy=True)))
        else:
            raise KeyError(f"model tensor {name!r} (global {g!r}) has no conversion rule for "
                           f"model_type={hf_config.model_type!r}")
    return [t for _, t in sorted(out, key=lambda x: x[0])]


@torch.no_grad()
def load_hf_weights(model, model_dir: str | Path, hf_config, *, tp_rank: int = 0, tp: int = 1,
                    padded_vocab: int | None = None) -> int:
    """Copy this rank's shards of the HF checkpoint in ``model_dir`` into ``model``.

    Args:
        model: GPTModel of this rank (TP rank ``tp_rank`` of ``tp``; any pipeline stage).
        model_dir: HF folder with safetensors weights.
        hf_config: its config.
        padded_vocab: vocab rows of the model (:func:`~megatron_rlhf.convert.sharding.padded_vocab_size`).
    Returns:
        number of tensors loaded.
    Raises:
        KeyError: an HF tensor is missing; ValueError: a shard's shape differs from the model's.
    """
    reader = HFCheckpointReader(model_dir)
    n = 0
    for lt in local_tensors(model, hf_config):
        full = fuse_hf(lt.rule, [reader.get(h) for h in lt.hf_names], hf_config,
                       padded_vocab=padded_vocab)
        part = shard(lt.rule, full, tp_rank, tp)
        if tuple(part.shape) != tuple(lt.tensor.shape):
            raise ValueError(f"load_hf_weights: {lt.name} (from {list(lt.hf_names)}) has shard "
                             f"shape {tuple(part.shape)}, model expects {tuple(lt.tensor.shape)} "
                             f"(TP rank {tp_rank} of {tp})")
        lt.tensor.copy_(part)
        n += 1
    return n


def mark_tensor_parallel(model, hf_config) -> int:
    """Tag TP-split parameters with megatron's ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` attributes (``tensor_parallel.set_tensor_model_parallel_attributes``).

    Megatron sets them only while it randomly initialises weights; a model built with
    ``perform_initialization=False`` (weights loaded afterwards) lacks them, and then the
    optimizer's grad-norm (and so clipping) treats every TP shard on TP ranks > 0 as a duplicate
    and drops it. Replicated tensors are left untouched. Returns the number of tensors tagged.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    n = 0
    for lt in local_tensors(model, hf_config):
        dim = {"column": 0, "vocab": 0, "row": 1}.get(lt.rule.tp)
        if dim is not None and isinstance(lt.tensor, torch.nn.Parameter) \
                and not getattr(lt.tensor, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(lt.tensor, True, dim, 1)
            n += 1
    return n


def _source(lt: LocalTensor, what: str) -> torch.Tensor:
    if what == "param":
        return lt.tensor.detach()
    g = getattr(lt.tensor, "main_grad", None)
    g = g if g is not None else lt.tensor.grad
    return torch.zeros_like(lt.tensor) if g is None else g.detach()


@torch.no_grad()
def iter_stage_hf_tensors(model, hf_config, *, tp_group=None, what: str = "param",
                          device: str | torch.device | None = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this pipeline stage, gathered over the TP group (see module doc).

    The gather, the un-sharding and the HF split run on the model's device; ``device="cpu"``
    copies each finished HF tensor to the host (object store, safetensors files), ``device=None``
    keeps it on the model's device (the broadcast transport packs it there: :func:`pack_tensors`).

    Args:
        model: this rank's GPTModel (or DDP of one).
        hf_config: HF config.
        tp_group: the TP process group (None or size 1: no communication).
        what: ``param`` (weights) or ``grad`` (megatron DDP's ``main_grad`` after a backward,
            else ``.grad``; zeros when absent) - gradients convert like weights because the
            HF <-> megatron maps are linear re-arrangements.
        device: where the yielded tensors live (None: the model's device).
    Yields:
        on TP rank 0: ``(hf_name, contiguous tensor)`` never sharing storage with the model;
        on other TP ranks: nothing (they only send their shards).
    Raises:
        ValueError: ``what`` is not param/grad.
    """
    import torch.distributed as dist

    if what not in ("param", "grad"):
        raise ValueError(f"iter_stage_hf_tensors(what={what!r}): expected 'param' or 'grad'")
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    me = 0 if tp_group is None else dist.get_rank(tp_group)
    for lt in local_tensors(model, hf_config):
        if lt.tied_copy:
            continue
        local = _source(lt, what)
        if tp > 1 and lt.rule.tp != "replicated":
            local = local.contiguous()
            parts = [torch.empty_like(local) for _ in range(tp)] if me == 0 else None
            dist.gather(local, parts, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
            if me != 0:
                continue
            full = unshard(lt.rule, parts)   # on the device: no host round trip
        elif me != 0:
            continue
        else:
            full = local
        for hf_name, t in split_to_hf(lt.rule, lt.hf_names, full, hf_config):
            out = t.detach() if device is None else t.detach().to(device)
            if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                out = out.clone()  # never hand out views of live parameters
            yield hf_name, out.contiguous()


@torch.no_grad()
def stage_hf_entries(model, hf_config, *, tp: int = 1) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(hf_name, dtype, shape, nbytes)`` of every tensor :func:`iter_stage_hf_tensors` yields on
    TP rank 0 (same order), from metadata alone: each local shard is replaced by a ``meta`` tensor
    of its shape and dtype and run through the same un-sharding and HF split, so nothing is
    gathered or allocated (what the broadcast exporter plans its layout from, N1 of
    ``gpu-path-review-2``).

    Args:
        model: this rank's GPTModel (or DDP of one).
        hf_config: HF config.
        tp: the TP group's size (the shards of TP-split tensors are this rank's shape).
    Raises:
        ValueError: ``tp < 1``, or a dtype the wire format does not carry.
    """
    if tp < 1:
        raise ValueError(f"stage_hf_entries(tp={tp}): must be >= 1 (learner.tensor_parallel)")
    out = []
    for lt in local_tensors(model, hf_config):
        if lt.tied_copy:
            continue
        local = torch.empty(tuple(lt.tensor.shape), dtype=lt.tensor.dtype, device="meta")
        full = unshard(lt.rule, [local] * tp) if tp > 1 and lt.rule.tp != "replicated" else local
        for hf_name, t in split_to_hf(lt.rule, lt.hf_names, full, hf_config):
            out.append(entry(hf_name, t.dtype, t.shape))
    return out


def measure_pack(model, hf_config, *, bucket_mb=(64, 256, 1024), repeats: int = 3,
                 staging: str = "device") -> list[dict]:
    """GB/s of the broadcast transport's pack against a same-device memcpy of the same bytes, per
    bucket size (``bench/weight_sync.py``, ``bench/gpu_check.py``'s ``pack-*`` rows).

    The pack is what an exporter does per publish outside the wire: HF conversion of every tensor
    of ``model`` (TP 1: no gather) on its device and
    :func:`~megatron_rlhf.sync.wire.pack_tensors` at the layout of
    :func:`~megatron_rlhf.sync.wire.plan_layout` for ``bucket_mb`` MiB buckets (a larger tensor
    gets a bucket of its own). ``staging="device"``: into two alternating device bucket buffers.
    ``staging="host"``: the path a stage too large for the device takes
    (``megatron_rlhf.sync.staging``): into a staging buffer in (pinned, on a GPU) host memory with
    the platform's asynchronous copy, then each chunk back into one of two alternating device wire
    buffers, as the sender does before each broadcast (the broadcast itself is not timed). On
    CPU "pinned" is plain host memory and both copies are host memcpys. The memcpy is
    ``dst.copy_(src)`` of device buffers of the same bucket sizes, the same number of times.
    Best of ``repeats`` each, after one warm-up, timed with the platform's stream synchronisation.

    Args:
        model: a GPTModel (one rank, any device).
        hf_config: its HF config.
        bucket_mb: bucket sizes (MiB).
        repeats: timed repetitions per size (>= 1).
        staging: ``device`` or ``host``.
    Returns:
        one dict per bucket size with exactly the keys ``bucket_mb``, ``staging``, ``bytes`` (tensor
        bytes packed), ``pack_GBps``, ``memcpy_GBps`` and ``ratio`` (pack / memcpy).
    Raises:
        ValueError: ``repeats < 1``, a bucket size <= 0, or ``staging`` not device/host.
    """
    import time

    from megatron_rlhf.platform import get_platform

    if repeats < 1 or any(b <= 0 for b in bucket_mb):
        raise ValueError(f"measure_pack(bucket_mb={bucket_mb}, repeats={repeats}): need sizes > 0, repeats >= 1")
    if staging not in ("device", "host"):
        raise ValueError(f"measure_pack(staging={staging!r}): expected 'device' or 'host'")
    platform = get_platform()
    device = next(iter(_named_tensors(model).values())).device
    entries = stage_hf_entries(model, hf_config)
    out = []
    for mb in bucket_mb:
        layout = plan_layout(0, entries, int(mb * 2**20))
        largest = layout.largest_bucket
        wire = min(largest, layout.chunk_bytes)
        bufs = [platform.empty_bytes(largest if staging == "device" else wire, device) for _ in range(2)]
        host = (platform.host_buffers([b.nbytes for b in layout.buckets], chunk_bytes=layout.chunk_bytes)
                if staging == "host" else None)

        def pack():
            items = iter_stage_hf_tensors(model, hf_config, device=None)
            if host is None:
                for k, b in enumerate(layout.buckets):
                    pack_tensors(bufs[k % 2], b.tensors, items)
            else:
                for b, hbuf in zip(layout.buckets, host):
                    pack_tensors(hbuf, b.tensors, items, copy=platform.copy_bytes)
                platform.sync_stream()   # the D2H packs are done before the host bytes are read
                k = 0
                for b, hbuf in zip(layout.buckets, host):
                    for off, size in layout.chunks(b):
                        platform.copy_bytes(bufs[k % 2][:size], hbuf[off:off + size])
                        k += 1
            platform.sync_stream()

        src = platform.empty_bytes(largest, device)
        src.fill_(1)
        dst = [platform.empty_bytes(largest, device) for _ in range(2)]

        def memcpy():
            for k, b in enumerate(layout.buckets):
                dst[k % 2][:b.nbytes].copy_(src[:b.nbytes])
            platform.sync_stream()

        best = {}
        for name, fn in (("pack", pack), ("memcpy", memcpy)):
            fn()   # warm-up (allocations, first touch)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
        nbytes = layout.tensor_bytes
        moved = sum(b.nbytes for b in layout.buckets)
        pack_gbps, memcpy_gbps = nbytes / best["pack"] / 1e9, moved / best["memcpy"] / 1e9
        out.append({"bucket_mb": mb, "staging": staging, "bytes": nbytes, "pack_GBps": pack_gbps,
                    "memcpy_GBps": memcpy_gbps, "ratio": pack_gbps / memcpy_gbps})
        del bufs, src, dst, host
    return out


def buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Group ``(name, tensor)`` into dicts of at most ``bucket_bytes`` (a larger tensor gets its
    own bucket), lazily: the caller can ship each bucket before the next is built."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def write_hf_shards(items: Iterable[tuple[str, torch.Tensor]], folder: str | Path, prefix: str,
                    max_shard_bytes: int) -> list[dict]:
    """Write ``items`` as safetensors files ``<folder>/<prefix>-<k>.safetensors`` of at most
    ``max_shard_bytes`` each (one bucket in memory at a time).

    Returns:
        ``[{"file": name, "names": [...], "bytes": int}]`` in write order.
    Raises:
        AtomicWriteError: a file could not be written (names it and the cause: no space,
            read-only, name too long), instead of safetensors' ``SafetensorError``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from megatron_rlhf.utils.atomic import write_error

    out = []
    for k, bucket in enumerate(buckets(items, max_shard_bytes)):
        fname = f"{prefix}-{k:05d}.safetensors"
        try:
            save_file(bucket, str(Path(folder) / fname), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:
            raise write_error(Path(folder) / fname, e) from e
        out.append({"file": fname, "names": list(bucket),
                    "bytes": sum(t.numel() * t.element_size() for t in bucket.values())})
    return out


def prepare_hf_dir(out_dir: str | Path) -> Path:
    """Create and return an empty temporary sibling of ``out_dir`` for :func:`finalize_hf_folder`.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export_hf: {out} exists and is not empty; pass a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def finalize_hf_folder(tmp: str | Path, out_dir: str | Path, base_model_dir: str | Path,
                       shards: list[dict], dtype=None) -> None:
    """Turn ``tmp`` (shard files from :func:`write_hf_shards`, in HF order) into the HF folder
    ``out_dir``: rename to ``model.safetensors`` (one shard) or ``model-0000k-of-0000n.safetensors``
    plus ``model.safetensors.index.json``, copy every non-weight file of ``base_model_dir``
    (config, tokenizer, chat template, generation config), then rename ``tmp`` to ``out_dir``
    (atomic on one filesystem). ``tmp`` is removed on failure. ``dtype`` (the dtype the shards
    were written in, e.g. ``torch.bfloat16`` for a bf16 learner) is written into ``config.json``
    so that a deployment loads the folder in the dtype it holds, not the base model's.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    tmp, out, base = Path(tmp), Path(out_dir), Path(base_model_dir)
    try:
        n = len(shards)
        weight_map, total = {}, 0
        for i, s in enumerate(shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(tmp / s["file"], tmp / final)
            weight_map.update({name: final for name in s["names"]})
            total += s["bytes"]
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        copy_non_weight_files(base, tmp, dtype=dtype)
        if out.exists():
            if any(out.iterdir()):
                raise FileExistsError(f"export_hf: {out} exists and is not empty; pass a new folder")
            out.rmdir()
        apply_umask_permissions(tmp)  # mkdtemp makes it 0700, safetensors files 0600
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
