"""Megatron ``dist_checkpointing`` (torch_dist backend) checkpoints, read and written one tensor
at a time, without building a model or starting ``torch.distributed``.

On disk (megatron-core 0.16.1, ``dist_checkpointing/strategies/torch.py``) a model checkpoint is
a PyTorch Distributed Checkpoint (DCP) folder: ``.metadata`` (global shape, dtype and saved
chunks of every key), ``__R_T.distcp`` data files, plus megatron's ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (non-sharded state; ``{}`` for a
GPTModel). Keys are *layout-agnostic*:

* per-layer tensors are stacked on a leading layer axis with the TE-spec names:
  ``decoder.layers.self_attention.linear_qkv.weight [L, (np+2ng)*hn, h]``,
  ``decoder.layers.self_attention.linear_qkv.layer_norm_weight [L, h]`` (= ``input_layernorm``),
  ``decoder.layers.mlp.linear_fc1.weight [L, 2f, h]`` (``[gate; up]``), ...; layer i of any
  PP stage is row i (global index);
* every tensor has its *full* (TP=1) global shape; a TP rank's shard is a box in it (QKV groups
  and gate/up halves are laid out so that each rank's box is contiguous, see
  :mod:`megatron_rlhf.convert.sharding`);
* only the vocab dimension depends on TP: embedding / output rows are padded to a multiple of TP
  (:func:`megatron_rlhf.convert.sharding.padded_vocab_size`);
* megatron ``Linear`` modules also store an ``_extra_state`` object per layer
  (``decoder.layers.<module>._extra_state/shard_<i>_<L>``; ``None`` for the local spec).

So any TP x PP model loads a checkpoint whose padded vocab it can split, via
``dist_checkpointing.load(model.sharded_state_dict(), dir)``. :func:`write_dist_checkpoint`
writes the same format from full tensors produced lazily (one layer tensor in memory at a time),
chunked along the TP split of a chosen layout so each rank of that layout reads exactly its
chunks; :class:`DistCheckpointReader` reads any box (one layer of a key) of any such checkpoint,
including those the learner saves through megatron.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from megatron_rlhf.convert.mapping import _TE_ALIASES, ParamRule

__all__ = ["DistCheckpointReader", "TensorEntry", "write_dist_checkpoint", "checkpoint_key",
           "extra_state_keys", "resolve_checkpoint", "ResolvedCheckpoint", "find_base_model_dir",
           "read_layout", "load_model_from_checkpoint", "LAYOUT_FILE", "MODEL_SUBDIR",
           "MEGATRON_METADATA"]

#: our layout record next to a converted checkpoint's model folder
LAYOUT_FILE = "mrlhf_checkpoint.json"
#: the model's dist checkpoint inside a converted (or learner) checkpoint folder
MODEL_SUBDIR = "policy"
#: megatron's ``metadata.json`` for a torch_dist checkpoint (``dist_checkpointing/core.py``)
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
#: megatron Linear modules of a GPT layer that carry an ``_extra_state`` entry
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")


def checkpoint_key(rule: ParamRule) -> tuple[str, bool]:
    """The dist-checkpoint key of a mapping rule and whether it has a leading layer axis.

    ``decoder.layers.{i}.input_layernorm.weight`` -> (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``, True);
    ``embedding.word_embeddings.weight`` -> (same, False). Source: megatron
    ``TransformerBlock.sharded_state_dict`` (layer axis) and the local spec's
    ``sharded_state_dict_keys_map`` (TE names).
    """
    if "{i}" not in rule.mcore:
        return rule.mcore, False
    suffix = "." + rule.mcore.split("{i}.", 1)[1]
    for local, te in _TE_ALIASES.items():
        if suffix.endswith(local):
            suffix = suffix[: -len(local)] + te
            break
    return "decoder.layers" + suffix, True


def extra_state_keys(num_layers: int) -> list[str]:
    """The ``_extra_state`` object keys megatron expects for ``num_layers`` GPT layers."""
    return [f"decoder.layers.{m}._extra_state/shard_{i}_{num_layers}"
            for i in range(num_layers) for m in EXTRA_STATE_MODULES]


# ---------------------------------------------------------------------------------- reading
class DistCheckpointReader:
    """Random access to the tensors of a torch_dist checkpoint folder.

    Args:
        path: the folder holding ``.metadata`` and ``metadata.json``.
    Raises:
        FileNotFoundError: not a dist checkpoint (names the missing file).
        ValueError: a backend other than torch_dist (e.g. zarr).
    """

    def __init__(self, path: str | os.PathLike):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        meta = self.path / "metadata.json"
        if not meta.is_file() or not (self.path / ".metadata").is_file():
            raise FileNotFoundError(f"{self.path}: not a megatron dist checkpoint (needs "
                                    "metadata.json and .metadata)")
        backend = json.loads(meta.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{self.path}: sharded_backend={backend!r}; only torch_dist is supported")
        self._reader = FileSystemReader(str(self.path))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def tensor_keys(self) -> list[str]:
        """Keys of all tensors (sorted; ``_extra_state`` objects excluded)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return sorted(k for k, v in self.metadata.state_dict_metadata.items()
                      if isinstance(v, TensorStorageMetadata))

    def _md(self, key: str):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.path}: tensor {key!r} is not in the checkpoint")
        return md

    def __contains__(self, key: str) -> bool:
        try:
            self._md(key)
            return True
        except KeyError:
            return False

    def shape(self, key: str) -> tuple[int, ...]:
        """Global shape of ``key`` (KeyError naming it if absent)."""
        return tuple(self._md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of ``key``."""
        return self._md(key).properties.dtype

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """Read ``key`` (``layer=None``) or one row ``[layer]`` of its leading layer axis.

        Returns:
            a new tensor in the stored dtype: the full global shape, or ``shape[1:]`` for a layer.
        Raises:
            KeyError: unknown key. IndexError: layer out of range.
            RuntimeError: the saved chunks do not cover the requested box (corrupt checkpoint).
        """
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self._md(key)
        size = tuple(md.size)
        if layer is None:
            offsets, sizes = (0,) * len(size), size
        else:
            if not 0 <= layer < size[0]:
                raise IndexError(f"{key}: layer {layer} out of range [0, {size[0]})")
            offsets, sizes = (layer,) + (0,) * (len(size) - 1), (1,) + size[1:]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        covered = sum(int(torch.Size(i.lengths).numel()) for i in items)
        if covered != dest.numel():
            raise RuntimeError(f"{self.path}: saved chunks of {key!r} cover {covered} of "
                               f"{dest.numel()} elements of the requested box")
        self._reader.read_data(LoadPlan(items), _BoxLoadPlanner(dest)).wait()
        return dest[0] if layer is not None else dest


class _BoxLoadPlanner:
    """The two LoadPlanner callbacks ``FileSystemReader.read_data`` uses, writing into ``dest``
    (``ReadItem.dest_offsets`` are relative to the requested box)."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest

    def resolve_tensor(self, read_item):
        from torch.distributed._shard._utils import narrow_tensor_by_index

        return narrow_tensor_by_index(self.dest, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass

    def load_bytes(self, read_item, value) -> None:
        pass


# ---------------------------------------------------------------------------------- writing
@dataclass
class TensorEntry:
    """One megatron tensor (one layer of a stacked key, or a global tensor) to write.

    Attributes:
        key: dist-checkpoint key (:func:`checkpoint_key`).
        layer: layer index on the leading axis, or None for a global tensor.
        num_layers: size of the leading layer axis (ignored when ``layer`` is None).
        shape: the (per-layer) full tensor shape.
        rule: its mapping rule (``tp``/``kind`` decide the chunking).
        produce: returns the full (per-layer) tensor; called once, when it is written.
        hf_numel: number of HF parameters it holds (for summaries; padding excluded).
    """

    key: str
    layer: int | None
    num_layers: int
    shape: tuple[int, ...]
    rule: ParamRule
    produce: Callable[[], torch.Tensor]
    hf_numel: int = 0
    boxes: list = field(default_factory=list)


def _tp_boxes(rule: ParamRule, shape: tuple[int, ...], tp: int) -> list[tuple[tuple, tuple]]:
    """Chunks (offsets, sizes) of a full tensor as TP ranks of size ``tp`` hold them: column /
    vocab: dim 0 in ``tp`` parts (``gate_up``: ``2*tp`` parts, gate then up, as megatron's
    ``apply_swiglu_sharded_factory``); row: dim 1 in ``tp`` parts; replicated: one chunk."""
    dim = {"replicated": None, "column": 0, "vocab": 0, "row": 1}[rule.tp]
    parts = 2 * tp if rule.kind == "gate_up" else tp
    if dim is None or parts == 1 or dim >= len(shape):
        return [((0,) * len(shape), tuple(shape))]
    if shape[dim] % parts:
        raise ValueError(f"{rule.mcore}: dim {dim} of shape {tuple(shape)} does not split into "
                         f"{parts} tensor-parallel chunks")
    step = shape[dim] // parts
    boxes = []
    for k in range(parts):
        off, siz = [0] * len(shape), list(shape)
        off[dim], siz[dim] = k * step, step
        boxes.append((tuple(off), tuple(siz)))
    return boxes


class _LazySavePlanner:
    """Factory of a DCP ``DefaultSavePlanner`` whose plan is given and whose data are produced
    on demand (``resolve_data``), so only the tensor being written is in memory."""

    @staticmethod
    def make(items, resolve):
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import SavePlan

        class Planner(DefaultSavePlanner):
            def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
                self.state_dict, self.is_coordinator = {}, is_coordinator

            def create_local_plan(self):
                self.plan = SavePlan(list(items))
                return self.plan

            def resolve_data(self, write_item):
                return resolve(write_item)

        return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def write_dist_checkpoint(out_dir: str | os.PathLike, entries: Iterable[TensorEntry], *,
                          num_layers: int, dtype: torch.dtype, tp: int = 1,
                          progress: Callable[[TensorEntry], None] | None = None) -> int:
    """Write a megatron torch_dist model checkpoint from lazily produced full tensors.

    Args:
        out_dir: the checkpoint folder (created; must be empty).
        entries: every tensor of the model (see :class:`TensorEntry`); produced in order.
        num_layers: number of transformer layers (for the ``_extra_state`` objects).
        dtype: stored dtype (tensors are cast).
        tp: chunk tensors as TP ranks of this size hold them (any TP still loads the result).
        progress: called after each entry is fully written.
    Returns:
        bytes of tensor data written.
    Raises:
        ValueError: a produced tensor's shape differs from ``entry.shape`` (names the key).
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty")
    entries = list(entries)
    items, owner = [], {}
    for idx, e in enumerate(entries):
        prefix = () if e.layer is None else (e.layer,)
        gshape = tuple(e.shape) if e.layer is None else (e.num_layers, *e.shape)
        e.boxes = _tp_boxes(e.rule, tuple(e.shape), tp)
        for off, siz in e.boxes:
            goff = torch.Size(prefix + off)
            gsiz = torch.Size(((1,) if prefix else ()) + siz)
            item = WriteItem(index=MetadataIndex(e.key, goff), type=WriteItemType.SHARD,
                             tensor_data=TensorWriteData(
                                 chunk=ChunkStorageMetadata(offsets=goff, sizes=gsiz),
                                 properties=TensorProperties(dtype=dtype), size=torch.Size(gshape)))
            items.append(item)
            owner[(e.key, goff)] = (idx, off, siz)
    none_bytes = io.BytesIO()
    torch.save([None], none_bytes)  # megatron stores [obj.data for each ShardedObject]
    for key in extra_state_keys(num_layers):
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))

    state = {"idx": -1, "tensor": None, "left": 0, "bytes": 0}

    def resolve(item):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(none_bytes.getvalue())
        idx, off, siz = owner[(item.index.fqn, item.index.offset)]
        e = entries[idx]
        if state["idx"] != idx:  # chunks of one entry are consecutive in the plan
            t = e.produce()
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"tensor {e.key} (layer {e.layer}) has shape {tuple(t.shape)}, "
                                 f"expected {tuple(e.shape)}")
            state.update(idx=idx, tensor=t.to(dtype), left=len(e.boxes))
        chunk = state["tensor"]
        for d, (o, s) in enumerate(zip(off, siz)):
            chunk = chunk.narrow(d, o, s)
        if e.layer is not None:
            chunk = chunk.unsqueeze(0)
        chunk = chunk.contiguous()  # the DCP loader copies views out of larger storages
        state["left"] -= 1
        state["bytes"] += chunk.numel() * chunk.element_size()
        if state["left"] == 0:
            state["tensor"] = None
            if progress is not None:
                progress(e)
        return chunk

    writer = FileSystemWriter(str(out), single_file_per_rank=True, sync_files=False,
                              thread_count=1, per_thread_copy_ahead=0)
    dcp_save({}, storage_writer=writer, planner=_LazySavePlanner.make(items, resolve), no_dist=True)
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    torch.save({}, out / "common.pt")
    return state["bytes"]


# ---------------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class ResolvedCheckpoint:
    """Where the pieces of a checkpoint are.

    Attributes:
        kind: ``converted`` (our ``hf_to_megatron``/``reshard`` output), ``learner`` (a
            ``MegatronLearner.save_checkpoint`` folder), ``trainer_step`` (a trainer
            ``checkpoints/step_N`` folder) or ``dist`` (a bare dist checkpoint).
        root: the folder given.
        model_dir: the model's dist checkpoint folder.
        layout: recorded layout (``tp``, ``pp``, ``padded_vocab_size``, ``model_dir`` ...), may be
            empty.
    """

    kind: str
    root: Path
    model_dir: Path
    layout: dict


def _is_dist(p: Path) -> bool:
    return (p / "metadata.json").is_file() and (p / ".metadata").is_file()


def _learner_layout(learner_dir: Path) -> dict:
    state = learner_dir / "learner_state.pt"
    if not state.is_file():
        return {}
    # mmap: the optimizer state is not read into memory
    s = torch.load(state, map_location="cpu", weights_only=False, mmap=True)
    return dict(s.get("layout", {}))


def resolve_checkpoint(path: str | os.PathLike) -> ResolvedCheckpoint:
    """Find the model checkpoint inside ``path``: a trainer ``step_N`` folder (``learner/policy``),
    a learner checkpoint (``policy``), a converted checkpoint (``policy`` + ``mrlhf_checkpoint.json``)
    or a bare dist checkpoint.

    Raises:
        FileNotFoundError: none of these (names what was looked for).
    """
    root = Path(path)
    if (root / LAYOUT_FILE).is_file() and _is_dist(root / MODEL_SUBDIR):
        return ResolvedCheckpoint("converted", root, root / MODEL_SUBDIR,
                                  json.loads((root / LAYOUT_FILE).read_text()))
    if _is_dist(root / "learner" / "policy"):
        return ResolvedCheckpoint("trainer_step", root, root / "learner" / "policy",
                                  _learner_layout(root / "learner"))
    if _is_dist(root / "policy"):
        return ResolvedCheckpoint("learner", root, root / "policy", _learner_layout(root))
    if _is_dist(root):
        return ResolvedCheckpoint("dist", root, root, {})
    raise FileNotFoundError(f"{root}: no megatron checkpoint found (looked for {LAYOUT_FILE} + "
                            "policy/, learner/policy/, policy/, or metadata.json + .metadata)")


def _run_config_model_dir(step_dir: Path) -> Path | None:
    """``model.source`` of the run's ``config.yaml`` (``runs/<name>/checkpoints/step_N`` ->
    ``runs/<name>/config.yaml``); ``smollm2`` resolves to its cached HF folder."""
    cfg_file = step_dir.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        return None
    import yaml

    model = (yaml.safe_load(cfg_file.read_text()) or {}).get("model") or {}
    source = model.get("source")
    if source == "smollm2":
        from megatron_rlhf.convert.gguf import ensure_smollm2_hf

        return Path(ensure_smollm2_hf(os.path.expanduser(model.get("cache_dir",
                                                                    "~/.cache/megatron_rlhf"))))
    return Path(os.path.expanduser(source)) if source else None


def find_base_model_dir(ckpt: ResolvedCheckpoint, base: str | os.PathLike | None = None) -> Path:
    """The HF folder whose config/tokenizer describe the checkpoint's model.

    Order: ``base`` if given; a converted checkpoint's own folder (it holds config and
    tokenizer); the ``model_dir`` the learner recorded in ``learner_state.pt``; the run's
    ``config.yaml`` (``model.source``) for trainer step folders.

    Raises:
        FileNotFoundError: none found or the folder has no config.json (asks for ``--base``).
    """
    candidates = []
    if base is not None:
        candidates.append(Path(base))
    else:
        if ckpt.kind == "converted":
            candidates.append(ckpt.root)
        if ckpt.layout.get("model_dir"):
            candidates.append(Path(ckpt.layout["model_dir"]))
        if ckpt.kind == "trainer_step":
            found = _run_config_model_dir(ckpt.root)
            if found is not None:
                candidates.append(found)
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    tried = ", ".join(str(c) for c in candidates) or "nothing recorded"
    raise FileNotFoundError(f"{ckpt.root}: cannot find the base HF model folder (tried: {tried}); "
                            "pass --base DIR (the HF folder the run started from)")


def read_layout(ckpt_dir: str | os.PathLike) -> dict:
    """Layout recorded with a checkpoint (``tp``, ``pp``, ``padded_vocab_size``, ...); ``{}``
    for bare dist checkpoints. See :func:`resolve_checkpoint`."""
    return dict(resolve_checkpoint(ckpt_dir).layout)


def load_model_from_checkpoint(model, ckpt: str | os.PathLike) -> None:
    """Load a converted / learner / trainer / bare dist checkpoint into a megatron GPTModel of
    any TP x PP layout (this rank's shards), through ``dist_checkpointing.load``.

    The model's vocab must equal the checkpoint's padded vocab (``read_layout(ckpt)
    ['padded_vocab_size']``, or the embedding rows); :func:`megatron_rlhf.convert.pipeline.reshard`
    re-pads for another TP. Needs ``torch.distributed`` and megatron's parallel state set up.

    Raises:
        ValueError: vocab rows differ (names both sizes and the fix).
        RuntimeError: model tensors missing from the checkpoint.
    """
    from megatron.core import dist_checkpointing

    resolved = resolve_checkpoint(ckpt)
    reader = DistCheckpointReader(resolved.model_dir)
    sharded = model.sharded_state_dict()
    emb = sharded.get("embedding.word_embeddings.weight")
    key = "embedding.word_embeddings.weight"
    if emb is not None and key in reader and emb.global_shape[0] != reader.shape(key)[0]:
        raise ValueError(f"{resolved.model_dir}: checkpoint vocab has {reader.shape(key)[0]} rows, "
                         f"the model {emb.global_shape[0]}; reshard the checkpoint for this TP "
                         "(tools/convert/reshard.py) or build the model with that vocab size")
    state = dist_checkpointing.load(sharded, str(resolved.model_dir))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{resolved.model_dir}: checkpoint does not match the model: missing "
                           f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
