"""The conversions behind ``tools/convert/``: HF -> Megatron, Megatron -> HF, reshard.

All three stream one tensor (one layer of one parameter) at a time: HF weights are read through
``safetensors.safe_open`` memory maps, megatron checkpoints through DCP box reads
(:class:`~megatron_rlhf.convert.dist_ckpt.DistCheckpointReader`), and outputs are written as
tensors are produced (:func:`~megatron_rlhf.convert.dist_ckpt.write_dist_checkpoint`,
:class:`~megatron_rlhf.convert.hf_io.ShardedSafetensorsWriter`), so converting a 70B model never
holds two copies of it (peak: one HF safetensors shard when exporting). No ``torch.distributed``
process group is needed.

Converted checkpoint folder (``hf_to_megatron`` and ``reshard`` output)::

    OUT/policy/                 megatron dist_checkpointing (torch_dist) model checkpoint
    OUT/mrlhf_checkpoint.json   layout: tp, pp, padded_vocab_size, model_type, dtype, source, ...
    OUT/config.json, tokenizer files, chat template, generation_config.json   (from the HF folder)

Every output is written into a temporary sibling folder and renamed into place, so a failed
conversion never leaves a half-written ``OUT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rlhf.convert.dist_ckpt import (LAYOUT_FILE, MODEL_SUBDIR, DistCheckpointReader,
                                             TensorEntry, checkpoint_key, find_base_model_dir,
                                             resolve_checkpoint, write_dist_checkpoint)
from megatron_rlhf.convert.hf_io import (HFSafetensorsFolder, ShardedSafetensorsWriter,
                                         apply_umask_permissions, copy_non_weight_files, parse_size)
from megatron_rlhf.convert.mapping import (_dims, _expand, _tied, expected_hf_shapes, fuse_rule,
                                           get_arch, mcore_shape, split_rule, torch_dtype,
                                           validate_parallel_layout)
from megatron_rlhf.convert.sharding import padded_vocab_size

__all__ = ["ConversionSummary", "hf_to_megatron", "megatron_to_hf", "reshard", "load_hf_config"]

FORMAT = "megatron_rlhf.dist_ckpt/1"
#: HF tensors that carry no weights of the model (RoPE buffers of old checkpoints)
_IGNORABLE_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class ConversionSummary:
    """What a conversion did (or would do, with ``dry_run``).

    Attributes:
        action: ``hf_to_megatron``, ``megatron_to_hf`` or ``reshard``.
        source, out: input and output folders (``out`` is None for a dry run).
        model_type: HF model type; tp, pp: layout of the output (HF export: of the input).
        vocab_size, padded_vocab_size: HF vocab and megatron rows (output side for
            hf_to_megatron/reshard, input side for megatron_to_hf).
        dtype: dtype of the written tensors.
        parameters: model parameters (HF count: tied embeddings once, no padding).
        bytes: tensor bytes written (or that would be written).
        tensors_in, tensors_out: tensors read / written (megatron tensors count one per layer).
        seconds: wall time.
    """

    action: str
    source: str
    out: str | None
    dry_run: bool
    model_type: str
    tp: int
    pp: int
    vocab_size: int
    padded_vocab_size: int
    dtype: str
    parameters: int
    bytes: int
    tensors_in: int
    tensors_out: int
    seconds: float

    def __str__(self) -> str:
        rows = [("action", self.action + (" (dry run: nothing written)" if self.dry_run else "")),
                ("source", self.source), ("output", self.out or "-"),
                ("model_type", self.model_type), ("layout", f"TP={self.tp} PP={self.pp}"),
                ("vocab", f"{self.vocab_size} (padded {self.padded_vocab_size})"),
                ("dtype", self.dtype), ("parameters", f"{self.parameters:,}"),
                ("bytes", f"{self.bytes:,} ({self.bytes / 2**30:.3f} GiB)"),
                ("tensors mapped", f"{self.tensors_in} in -> {self.tensors_out} out"),
                ("time", f"{self.seconds:.1f} s")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_dict(self) -> dict:
        return asdict(self)


def load_hf_config(model_dir: str | os.PathLike):
    """``transformers.AutoConfig`` of a folder (local files only).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: unsupported architecture (:func:`megatron_rlhf.convert.mapping.get_arch`).
    """
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF model folder)")
    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    get_arch(cfg)
    return cfg


@contextlib.contextmanager
def _atomic_dir(out: Path):
    """Yield a temporary sibling of ``out``; rename it to ``out`` on success, delete on error."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; pass a new output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        apply_umask_permissions(tmp)  # mkdtemp makes it 0700, safetensors files 0600
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _progress(total: int, desc: str, enabled: bool):
    """A tensor-count bar on a terminal; to a log or a pipe a plain line every 30 s."""
    from megatron_rlhf.utils.progress import progress

    return progress(total, desc, "tensor", enabled=enabled)


def _layer_of(mname: str) -> int | None:
    m = _LAYER_RE.match(mname)
    return int(m.group(1)) if m else None


def _model_entries(cfg, padded_vocab: int, produce_fn) -> list[TensorEntry]:
    """One :class:`TensorEntry` per megatron tensor (per layer) of ``cfg``'s model;
    ``produce_fn(rule, mname, hf_names, layer)`` returns the full tensor when called."""
    arch = get_arch(cfg)
    shapes = expected_hf_shapes(cfg)
    entries = []
    for rule, mname, hnames in _expand(arch.rules, cfg.num_hidden_layers, _tied(cfg)):
        key, per_layer = checkpoint_key(rule)
        layer = _layer_of(mname) if per_layer else None
        hshapes = [shapes[h] for h in hnames]
        entries.append(TensorEntry(
            key=key, layer=layer, num_layers=cfg.num_hidden_layers,
            shape=mcore_shape(rule, hshapes, padded_vocab_size=padded_vocab), rule=rule,
            produce=(lambda r=rule, m=mname, h=hnames, i=layer: produce_fn(r, m, h, i)),
            hf_numel=sum(int(torch.Size(s).numel()) for s in hshapes)))
    return entries


def _check_hf_folder(reader: HFSafetensorsFolder, cfg) -> None:
    """Every tensor the table needs is present with the config's shape; no unknown tensors.

    Raises:
        KeyError / ValueError: naming the tensor.
    """
    expected = expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in reader:
            raise KeyError(f"{reader.path}: HF tensor {name!r} missing (model_type="
                           f"{cfg.model_type}, {cfg.num_hidden_layers} layers)")
        if reader.shape(name) != shape:
            raise ValueError(f"{reader.path}: HF tensor {name!r} has shape {reader.shape(name)}, "
                             f"the config implies {shape}")
    for name in reader.names():
        if name in expected or _IGNORABLE_HF.search(name):
            continue
        if name == "lm_head.weight" and _tied(cfg):
            continue  # some tied checkpoints store the shared matrix twice
        raise ValueError(f"{reader.path}: HF tensor {name!r} has no mapping for model_type="
                         f"{cfg.model_type}; refusing to drop weights (is the config right?)")


def _write_layout(folder: Path, **layout) -> None:
    (folder / LAYOUT_FILE).write_text(json.dumps({"format": FORMAT, **layout}, indent=2) + "\n")


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike | None, *, tp: int = 1,
                   pp: int = 1, dtype: str | None = None, dry_run: bool = False,
                   progress: bool = True) -> ConversionSummary:
    """Convert an HF folder to a megatron dist checkpoint for a TP x PP layout (see module doc).

    Args:
        hf_dir: HF model folder (config.json + safetensors).
        out_dir: output folder (must not exist or be empty); ignored with ``dry_run``.
        tp, pp: target layout: validated against heads / KV groups / FFN / layers; the vocab is
            zero-padded to a multiple of ``tp``; tensors are chunked as the TP ranks hold them.
            Any other layout whose TP divides the padded vocab loads the result too.
        dtype: stored dtype (``float32``/``bfloat16``/``float16``); None keeps the HF dtype.
        dry_run: validate and summarise without writing.
        progress: show a tqdm bar.
    Raises:
        ValueError: unsupported architecture, layout that does not divide, or an HF tensor with a
            wrong shape or without mapping (names it). KeyError: a missing HF tensor.
        FileExistsError: ``out_dir`` is not empty.
    """
    t0 = time.perf_counter()
    cfg = load_hf_config(hf_dir)
    validate_parallel_layout(cfg, tp, pp)
    reader = HFSafetensorsFolder(hf_dir)
    _check_hf_folder(reader, cfg)
    np_, ng, hn = _dims(cfg)
    vpad = padded_vocab_size(cfg.vocab_size, tp)
    out_dtype = torch_dtype(dtype) if dtype else reader.dtype("model.embed_tokens.weight")
    entries = _model_entries(
        cfg, vpad, lambda rule, m, hnames, i: fuse_rule(rule, [reader.get(h) for h in hnames],
                                                        np_, ng, hn, vpad))
    elem = torch.empty((), dtype=out_dtype).element_size()
    planned = sum(int(torch.Size(e.shape).numel()) * elem for e in entries)
    summary = ConversionSummary(
        action="hf_to_megatron", source=str(hf_dir), out=None if dry_run else str(out_dir),
        dry_run=dry_run, model_type=cfg.model_type, tp=tp, pp=pp, vocab_size=cfg.vocab_size,
        padded_vocab_size=vpad, dtype=str(out_dtype).removeprefix("torch."),
        parameters=sum(e.hf_numel for e in entries), bytes=planned,
        tensors_in=sum(len(e.rule.hf) for e in entries), tensors_out=len(entries), seconds=0.0)
    if dry_run:
        summary.seconds = time.perf_counter() - t0
        return summary
    with _atomic_dir(Path(out_dir)) as tmp, _progress(len(entries), "hf->megatron", progress) as bar:
        summary.bytes = write_dist_checkpoint(tmp / MODEL_SUBDIR, entries,
                                              num_layers=cfg.num_hidden_layers, dtype=out_dtype,
                                              tp=tp, progress=lambda e: bar.update(1))
        copy_non_weight_files(hf_dir, tmp)
        _write_layout(tmp, backend="torch_dist", model_type=cfg.model_type,
                      arch=get_arch(cfg).name, tp=tp, pp=pp, num_layers=cfg.num_hidden_layers,
                      vocab_size=cfg.vocab_size, padded_vocab_size=vpad, dtype=summary.dtype,
                      parameters=summary.parameters, source=str(Path(hf_dir).resolve()),
                      model_dir=str(Path(hf_dir).resolve()), created_by="hf_to_megatron")
    summary.seconds = time.perf_counter() - t0
    return summary


def _check_dist_tensors(reader: DistCheckpointReader, cfg, entries: list[TensorEntry]) -> int:
    """The checkpoint holds exactly the table's tensors with the config's shapes (vocab rows
    may be padded); returns its padded vocab. Raises KeyError/ValueError naming the key."""
    seen = set()
    vpad = None
    for e in entries:
        if e.key in seen:
            continue
        seen.add(e.key)
        if e.key not in reader:
            raise KeyError(f"{reader.path}: tensor {e.key!r} missing (model_type={cfg.model_type})")
        stored = reader.shape(e.key)
        want = (e.num_layers, *e.shape) if e.layer is not None else tuple(e.shape)
        vocab_dim = 0 if e.layer is None else 1
        if e.rule.tp == "vocab":
            if stored[vocab_dim] < cfg.vocab_size:
                raise ValueError(f"{reader.path}: {e.key!r} has {stored[vocab_dim]} rows < "
                                 f"vocab_size {cfg.vocab_size}")
            vpad = stored[vocab_dim] if vpad is None else vpad
            want = tuple(stored[vocab_dim] if d == vocab_dim else s for d, s in enumerate(want))
        if stored != want:
            raise ValueError(f"{reader.path}: tensor {e.key!r} has shape {stored}, the base "
                             f"config implies {want} (wrong --base?)")
    unknown = sorted(set(reader.tensor_keys()) - seen)
    if unknown:
        raise ValueError(f"{reader.path}: checkpoint tensors {unknown[:5]} have no HF mapping for "
                         f"model_type={cfg.model_type}; refusing to drop them")
    return vpad if vpad is not None else cfg.vocab_size


def _source_model(ckpt, base):
    resolved = resolve_checkpoint(ckpt)
    base_dir = find_base_model_dir(resolved, base)
    cfg = load_hf_config(base_dir)
    reader = DistCheckpointReader(resolved.model_dir)
    return resolved, base_dir, cfg, reader


def megatron_to_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike | None, *,
                   base: str | os.PathLike | None = None, dtype: str | None = None,
                   max_shard_size: str | int = "5GB", dry_run: bool = False,
                   progress: bool = True) -> ConversionSummary:
    """Export a megatron checkpoint to an HF folder that transformers and vLLM load.

    Args:
        ckpt: a trainer ``checkpoints/step_N`` folder, a learner checkpoint, a converted
            checkpoint or a bare dist checkpoint (:func:`~megatron_rlhf.convert.dist_ckpt.resolve_checkpoint`).
        out_dir: new HF folder: safetensors (sharded above ``max_shard_size``) + config,
            tokenizer, chat template and generation config copied from the base model.
        base: base HF folder; default: found from the checkpoint
            (:func:`~megatron_rlhf.convert.dist_ckpt.find_base_model_dir`).
        dtype: exported dtype; None keeps the checkpoint's (config.json is updated to match).
        dry_run: validate and summarise without writing.
    Raises:
        FileNotFoundError: no checkpoint / no base folder (asks for ``--base``).
        KeyError / ValueError: a checkpoint tensor missing, of the wrong shape or unmapped
            (names it); unsupported architecture.
    """
    t0 = time.perf_counter()
    resolved, base_dir, cfg, reader = _source_model(ckpt, base)
    entries = _model_entries(cfg, None, None)
    vpad = _check_dist_tensors(reader, cfg, entries)
    stored = reader.dtype("embedding.word_embeddings.weight")
    out_dtype = torch_dtype(dtype) if dtype else stored
    shapes = expected_hf_shapes(cfg)
    plan = [(h, shapes[h], out_dtype) for e in entries for h in _hf_names(e, cfg)]
    elem = torch.empty((), dtype=out_dtype).element_size()
    summary = ConversionSummary(
        action="megatron_to_hf", source=str(resolved.model_dir),
        out=None if dry_run else str(out_dir), dry_run=dry_run, model_type=cfg.model_type,
        tp=int(resolved.layout.get("tp", 1)), pp=int(resolved.layout.get("pp", 1)),
        vocab_size=cfg.vocab_size, padded_vocab_size=vpad,
        dtype=str(out_dtype).removeprefix("torch."),
        parameters=sum(int(torch.Size(s).numel()) for _, s, _ in plan),
        bytes=sum(int(torch.Size(s).numel()) * elem for _, s, _ in plan),
        tensors_in=len(entries), tensors_out=len(plan), seconds=0.0)
    if dry_run:
        summary.seconds = time.perf_counter() - t0
        return summary
    with _atomic_dir(Path(out_dir)) as tmp, _progress(len(entries), "megatron->hf", progress) as bar:
        writer = ShardedSafetensorsWriter(tmp, plan, parse_size(max_shard_size))
        for e in entries:
            full = reader.read(e.key, e.layer)
            for name, t in zip(_hf_names(e, cfg), split_rule(e.rule, full, cfg)):
                writer.add(name, t.to(out_dtype))
            bar.update(1)
        writer.finish()
        summary.bytes = writer.bytes_written
        copy_non_weight_files(base_dir, tmp, dtype=out_dtype)
    summary.seconds = time.perf_counter() - t0
    return summary


def _hf_names(e: TensorEntry, cfg) -> list[str]:
    return [h.format(i=e.layer) for h in e.rule.hf]


def reshard(ckpt: str | os.PathLike, out_dir: str | os.PathLike | None, *, tp: int, pp: int,
            base: str | os.PathLike | None = None, dry_run: bool = False,
            progress: bool = True) -> ConversionSummary:
    """Rewrite a megatron model checkpoint for another TP x PP layout (converted format, see
    module doc): vocab rows re-padded to a multiple of ``tp`` (padding rows stay zero), tensors
    re-chunked as the new TP ranks hold them, layout recorded. Values are copied bit for bit.

    Only the model is resharded (a learner checkpoint's optimizer state is not).

    Args:
        ckpt: any checkpoint :func:`megatron_to_hf` accepts.
        out_dir: new folder; ignored with ``dry_run``.
        tp, pp: the new layout (validated against heads / groups / FFN / layers).
        base: base HF folder (default: found from the checkpoint).
    Raises:
        as :func:`megatron_to_hf`, plus ValueError when the layout does not divide the model.
    """
    t0 = time.perf_counter()
    resolved, base_dir, cfg, reader = _source_model(ckpt, base)
    validate_parallel_layout(cfg, tp, pp)
    _check_dist_tensors(reader, cfg, _model_entries(cfg, None, None))
    vpad = padded_vocab_size(cfg.vocab_size, tp)
    stored = reader.dtype("embedding.word_embeddings.weight")

    def produce(rule, mname, hnames, layer):
        key, _ = checkpoint_key(rule)
        t = reader.read(key, layer)
        if rule.tp == "vocab":  # strip the old padding, pad for the new TP
            t = fuse_rule(rule, [t[: cfg.vocab_size]], 1, 1, 1, vpad)
        return t

    entries = _model_entries(cfg, vpad, produce)
    elem = torch.empty((), dtype=stored).element_size()
    summary = ConversionSummary(
        action="reshard", source=str(resolved.model_dir), out=None if dry_run else str(out_dir),
        dry_run=dry_run, model_type=cfg.model_type, tp=tp, pp=pp, vocab_size=cfg.vocab_size,
        padded_vocab_size=vpad, dtype=str(stored).removeprefix("torch."),
        parameters=sum(e.hf_numel for e in entries),
        bytes=sum(int(torch.Size(e.shape).numel()) * elem for e in entries),
        tensors_in=len(entries), tensors_out=len(entries), seconds=0.0)
    if dry_run:
        summary.seconds = time.perf_counter() - t0
        return summary
    with _atomic_dir(Path(out_dir)) as tmp, _progress(len(entries), "reshard", progress) as bar:
        summary.bytes = write_dist_checkpoint(tmp / MODEL_SUBDIR, entries,
                                              num_layers=cfg.num_hidden_layers, dtype=stored,
                                              tp=tp, progress=lambda e: bar.update(1))
        copy_non_weight_files(base_dir, tmp)
        _write_layout(tmp, backend="torch_dist", model_type=cfg.model_type,
                      arch=get_arch(cfg).name, tp=tp, pp=pp, num_layers=cfg.num_hidden_layers,
                      vocab_size=cfg.vocab_size, padded_vocab_size=vpad, dtype=summary.dtype,
                      parameters=summary.parameters, source=str(Path(resolved.model_dir).resolve()),
                      model_dir=str(Path(base_dir).resolve()), created_by="reshard")
    summary.seconds = time.perf_counter() - t0
    return summary
