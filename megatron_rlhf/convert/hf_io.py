"""Streaming access to Hugging Face model folders: lazy safetensors reads, sharded writes.

* :class:`HFSafetensorsFolder` reads one tensor at a time through ``safetensors.safe_open``
  (memory-mapped), and reports names, shapes and dtypes without reading data, so a 70B
  checkpoint can be validated and converted with one tensor in memory.
* :class:`ShardedSafetensorsWriter` writes tensors in a planned order into
  ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (plus
  ``model.safetensors.index.json``), keeping only the current shard in memory. The naming and
  index format are those of ``huggingface_hub.split_torch_state_dict_into_shards``
  (what ``save_pretrained`` writes), so transformers and vLLM load the folder.
* :func:`copy_non_weight_files` copies config, tokenizer, chat template and generation config.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["HFSafetensorsFolder", "ShardedSafetensorsWriter", "copy_non_weight_files", "apply_umask_permissions",
           "parse_size", "SAFETENSORS_DTYPES", "WEIGHT_SUFFIXES"]

#: safetensors dtype strings -> torch dtypes (the ones LLM checkpoints use)
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}
#: file suffixes that hold weights (never copied between folders)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt",
                   ".pth", ".gguf", ".distcp")


class HFSafetensorsFolder:
    """Lazy, per-tensor view of an HF folder's safetensors weights (one file, or shards listed
    in ``model.safetensors.index.json``).

    Args:
        model_dir: HF model folder.
    Raises:
        FileNotFoundError: no ``*.safetensors`` file (names the folder; ``.bin`` checkpoints must
            be re-saved with ``save_pretrained(..., safe_serialization=True)``).
    """

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.path = Path(model_dir)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weights (re-save the model "
                                    "with save_pretrained(..., safe_serialization=True))")
        self._handles = {f: safe_open(str(self.path / f), framework="pt", device="cpu")
                         for f in files}
        self._where = {k: h for h in self._handles.values() for k in h.keys()}

    def names(self) -> list[str]:
        """All tensor names (sorted)."""
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` from the file header (no data read). KeyError naming it if absent."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """torch dtype of ``name`` from the file header. ValueError for exotic dtypes."""
        s = self._slice(name).get_dtype()
        if s not in SAFETENSORS_DTYPES:
            raise ValueError(f"HF tensor {name!r} has dtype {s}, not one of {sorted(SAFETENSORS_DTYPES)}")
        return SAFETENSORS_DTYPES[s]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (CPU, stored dtype, read from the memory map)."""
        if name not in self._where:
            raise KeyError(f"HF tensor {name!r} not found in {self.path}")
        return self._where[name].get_tensor(name)

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"HF tensor {name!r} not found in {self.path}")
        return self._where[name].get_slice(name)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def apply_umask_permissions(folder: str | Path) -> None:
    """Give ``folder`` and the files directly in it the permissions a plain ``mkdir`` / ``open``
    would (0777 / 0666 minus the process umask).

    ``tempfile.mkdtemp`` makes folders 0700 and ``safetensors.torch.save_file`` makes files 0600, so
    a folder written into a temporary sibling and renamed (every export here) would otherwise be
    unreadable by other users of a shared cluster (a serving job, a colleague's evaluation).
    """
    folder = Path(folder)
    umask = _umask()
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)


def parse_size(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int -> bytes (decimal units as huggingface_hub's
    ``max_shard_size``; ``*iB`` binary). Raises ValueError for other strings."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            try:
                return int(float(s[: -len(u)]) * mult)
            except ValueError:
                break
    if s.isdigit():
        return int(s)
    raise ValueError(f"size {size!r}: expected e.g. '5GB', '500MB' or a number of bytes")


class ShardedSafetensorsWriter:
    """Write a planned sequence of tensors as HF safetensors shards, one shard in memory at a time.

    Args:
        out_dir: destination folder (exists).
        plan: ``[(name, shape, dtype)]`` in the order tensors will be added.
        max_shard_bytes: start a new shard before a tensor that would exceed this (a larger
            tensor gets its own shard), as ``save_pretrained(max_shard_size=...)``.
    Raises (from :meth:`add`):
        ValueError: a tensor arrives out of plan order or with another shape/dtype (names it).
    """

    def __init__(self, out_dir: str | Path, plan: Sequence[tuple[str, tuple, torch.dtype]],
                 max_shard_bytes: int = 5 * 10**9):
        self.out = Path(out_dir)
        self.plan = [(n, tuple(s), d) for n, s, d in plan]
        shards: list[list[int]] = [[]]
        size = 0
        for k, (_, shape, dtype) in enumerate(self.plan):
            nbytes = _nbytes(shape, dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(k)
            size += nbytes
        n = len(shards)
        self._files = (["model.safetensors"] if n == 1 else
                       [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self._shard_of = {k: s for s, idx in enumerate(shards) for k in idx}
        self._shards = shards
        self._pending: dict[str, torch.Tensor] = {}
        self._next = 0
        self.bytes_written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add the next planned tensor; writes its shard when the shard is complete."""
        from safetensors.torch import save_file

        if self._next >= len(self.plan):
            raise ValueError(f"tensor {name!r} is beyond the planned {len(self.plan)} tensors")
        pname, pshape, pdtype = self.plan[self._next]
        if name != pname or tuple(tensor.shape) != pshape or tensor.dtype != pdtype:
            raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} does not match "
                             f"the plan's next entry {pname!r} {pshape} {pdtype}")
        self._pending[name] = tensor.contiguous()
        shard = self._shard_of[self._next]
        self._next += 1
        if self._next == len(self.plan) or self._shard_of[self._next] != shard:
            path = self.out / self._files[shard]
            save_file(self._pending, str(path), metadata={"format": "pt"})
            os.chmod(path, 0o666 & ~_umask())  # safetensors creates files 0600
            self.bytes_written += sum(_nbytes(t.shape, t.dtype) for t in self._pending.values())
            self._pending = {}

    def finish(self) -> list[str]:
        """Write the index (when sharded). Returns the weight file names.

        Raises:
            ValueError: not every planned tensor was added.
        """
        if self._next != len(self.plan):
            raise ValueError(f"only {self._next} of {len(self.plan)} planned tensors were written; "
                             f"missing {self.plan[self._next][0]!r}")
        if len(self._files) > 1:
            total = sum(_nbytes(s, d) for _, s, d in self.plan)
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: self._files[self._shard_of[k]]
                                    for k, (n, _, _) in enumerate(self.plan)}}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return list(self._files)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def copy_non_weight_files(src: str | Path, dst: str | Path, *, dtype: torch.dtype | None = None
                          ) -> list[str]:
    """Copy every non-weight file of ``src`` (config.json, tokenizer files, chat template,
    generation_config.json, ...) into ``dst``; hidden files and weight files are skipped.

    Args:
        dtype: when given, ``config.json``'s ``dtype`` / ``torch_dtype`` field is set to it (so
            ``from_pretrained(dtype="auto")`` matches the exported weights).
    Returns:
        the copied file names.
    Raises:
        FileNotFoundError: ``src`` has no ``config.json``.
    """
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (pass the base HF model folder)")
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES) \
                and f.name != "mrlhf_checkpoint.json":
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    if dtype is not None:
        cfg = json.loads((dst / "config.json").read_text())
        name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = name
        if "dtype" not in cfg and "torch_dtype" not in cfg:
            cfg["dtype"] = name
        (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return copied
