"""The weights' wire format: how one pipeline stage's HF-named tensors are laid out in bucket
buffers, and how they are packed into and read back out of them.

The layout is planned from ``(name, dtype, shape)`` alone (:func:`plan_layout`, :func:`entry`),
never from a list of tensors: an exporter knows its stage's HF names and shapes from the
conversion rules before it gathers a single tensor (``learner.weights.stage_hf_entries``), so even
its first publish streams the tensors one at a time into the staging buffer, as every later one
does. The receiver gets the same :class:`StageLayout` and takes views out of each bucket it
receives (:func:`unpack_bucket`). Dtypes travel by name (``bfloat16`` stays ``bfloat16``: bytes
are copied, never converted).

Layout: buckets of whole tensors of at most ``bucket_bytes`` (a larger tensor gets a bucket of its
own), in the given (HF) order; each bucket is sent in chunks of at most ``bucket_bytes``; offsets
are 64-byte aligned.

Sources: vLLM ``vllm/distributed/weight_transfer/packed_tensor.py`` (``pack_tensors``: linearise
each tensor to uint8 into one contiguous buffer); slime ``update_weight_from_distributed``
(fixed-size buckets); NeMo-RL's packed broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = ["TensorMeta", "BucketMeta", "StageLayout", "ALIGN", "DTYPE_BYTES", "entry", "plan_layout",
           "pack_tensors", "unpack_bucket"]

ALIGN = 64
"""Byte alignment of every tensor and bucket offset."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
"""Bytes per element of the dtypes a stage may hold (torch dtype names without ``torch.``)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorMeta:
    """One HF tensor inside a bucket: ``offset`` is bytes from the bucket start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """Whole tensors sent together: ``offset`` / ``nbytes`` in the stage's staging buffer."""

    offset: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class StageLayout:
    """Everything a receiver needs to take one stage's tensors off the wire.

    Attributes:
        stage: pipeline stage (= the group it is broadcast on).
        buckets: in send order (HF order within the stage).
        nbytes: staging buffer size (bytes).
        chunk_bytes: wire unit: each bucket goes out in chunks of at most this many bytes.
    """

    stage: int
    buckets: tuple[BucketMeta, ...]
    nbytes: int
    chunk_bytes: int

    def chunks(self, bucket: BucketMeta) -> list[tuple[int, int]]:
        """``(offset in the bucket, bytes)`` of each chunk of ``bucket``."""
        return [(o, min(self.chunk_bytes, bucket.nbytes - o)) for o in range(0, bucket.nbytes, self.chunk_bytes)]

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b.tensors)

    @property
    def largest_bucket(self) -> int:
        """Bytes of the largest bucket."""
        return max(b.nbytes for b in self.buckets)


def entry(name: str, dtype: str, shape: Iterable[int]) -> tuple[str, str, tuple[int, ...], int]:
    """The ``(name, dtype, shape, nbytes)`` :func:`plan_layout` takes, from metadata only.

    Args:
        dtype: torch dtype name (``bfloat16``; a ``torch.`` prefix is dropped).
    Raises:
        ValueError: a dtype not in :data:`DTYPE_BYTES`.
    """
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"weight wire format: tensor {name!r} has dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)}")
    shape = tuple(int(s) for s in shape)
    n = DTYPE_BYTES[dtype]
    for s in shape:
        n *= s
    return name, dtype, shape, n


def plan_layout(stage: int, entries: Iterable[tuple[str, str, tuple[int, ...], int]],
                bucket_bytes: int) -> StageLayout:
    """Group ``(hf_name, dtype name, shape, nbytes)`` (in send order; :func:`entry`) into buckets
    of whole tensors of at most ``bucket_bytes`` (a larger tensor gets its own bucket, sent in
    chunks). Metadata only: no tensor is needed.

    Raises:
        ValueError: ``bucket_bytes < 1`` or no tensor.
    """
    if bucket_bytes < 1:
        raise ValueError(f"plan_layout(bucket_bytes={bucket_bytes}): must be >= 1")
    out: list[BucketMeta] = []
    cur: list[TensorMeta] = []
    size, start = 0, 0
    for name, dtype, shape, nbytes in entries:
        off = _align(size)
        if cur and off + nbytes > bucket_bytes:
            out.append(BucketMeta(start, size, tuple(cur)))
            start, cur, off = _align(start + size), [], 0
        cur.append(TensorMeta(name, dtype, tuple(int(s) for s in shape), off, int(nbytes)))
        size = off + int(nbytes)
    if cur:
        out.append(BucketMeta(start, size, tuple(cur)))
        start = _align(start + size)
    if not out:
        raise ValueError(f"plan_layout: pipeline stage {stage} has no tensor to send")
    return StageLayout(stage=stage, buckets=tuple(out), nbytes=start, chunk_bytes=int(bucket_bytes))


def pack_tensors(buf, metas: Iterable[TensorMeta], items: Iterator[tuple[str, object]], copy=None) -> int:
    """Pack ``items`` into the ``uint8`` buffer ``buf`` at the planned places, on ``buf``'s
    device (a device-side copy when the tensors live there too: no host staging). Consumes one
    tensor per meta and keeps none: the caller's iterator may produce them one at a time.

    Args:
        buf: ``uint8 [nbytes]`` bucket (or staging) buffer.
        metas: per tensor, in order, :class:`TensorMeta` with offsets relative to ``buf``.
        items: ``(hf_name, tensor)`` in the same order (``learner.weights.iter_stage_hf_tensors``).
        copy: ``copy(dst, src)`` (default ``dst.copy_(src)``; the exporter passes the platform's
            asynchronous copy when ``buf`` is pinned host memory).
    Returns:
        bytes packed.
    Raises:
        ValueError: a tensor's name, dtype or shape differs from its meta, or the counts differ.
    """
    import torch

    n = 0
    for m in metas:
        try:
            name, t = next(items)
        except StopIteration:
            raise ValueError(f"pack_tensors: fewer tensors than planned (missing {m.name}); the model changed") from None
        dtype = str(t.dtype).removeprefix("torch.")
        if name != m.name or dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
            raise ValueError(f"pack_tensors: tensor {name} {dtype} {tuple(t.shape)} differs from the planned "
                             f"layout ({m.name} {m.dtype} {tuple(m.shape)}); the model changed")
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        dst = buf[m.offset:m.offset + m.nbytes]
        copy(dst, src) if copy is not None else dst.copy_(src)
        n += m.nbytes
        del t, src, dst   # hold no tensor of the stream past its copy
    return n


def unpack_bucket(buf, bucket: BucketMeta) -> Iterator[tuple[str, object]]:
    """``(hf_name, tensor)`` views of ``buf`` (the ``uint8`` bytes of ``bucket``), in its dtype
    and shape (no copy, no conversion).

    Raises:
        ValueError: ``buf`` is shorter than ``bucket``.
    """
    import torch

    if buf.numel() < bucket.nbytes:
        raise ValueError(f"unpack_bucket: buffer of {buf.numel()} bytes, bucket needs {bucket.nbytes}")
    for m in bucket.tensors:
        yield m.name, buf[m.offset:m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)
