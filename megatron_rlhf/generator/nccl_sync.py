"""NCCL weight broadcast, learner -> vLLM workers (GPU only; never imported on CPU).

The group is a vLLM ``StatelessProcessGroup`` (a TCP store rendezvous that leaves
``torch.distributed``'s global state alone, so megatron's own groups are untouched) with a
``PyNcclCommunicator`` on it: rank 0 is the learner's exporting rank, ranks
``1 + i*g .. 1 + i*g + g-1`` are the g tensor-parallel workers of vLLM engine i.

* Learner side (run on the learner actor with ``learner.__ray_call__``): :func:`learner_join`,
  then per published version :func:`learner_stage_and_send`, which copies each bucket of
  HF-named tensors into one flat GPU buffer and hands it to a background sender thread
  (a FIFO: versions go out in publish order, each bucket broadcast on a side CUDA stream), and
  returns the bucket metadata at once -- the learner's next train step overlaps the broadcast.
* vLLM side (run inside every vLLM worker through ``LLM.collective_rpc(callable)``, which also
  reaches the worker processes of a TP engine): :func:`worker_join`, then
  :func:`worker_receive_and_reload`, which receives bucket by bucket *inside* one
  ``reload_weights(weights_iterator=...)`` call (vLLM finalises a fused layer when all of its
  parts arrived, so all buckets of a version go through one call) and returns the bytes received.

Not exercised on the CPU test machine (no GPU, no NCCL); the CPU transports share every other
piece of the path. Patterns follow vLLM's ``examples/offline_inference/rlhf_utils.py``
(``stateless_init_process_group``) and OpenRLHF / verl's ``init_process_group`` +
``update_weight`` worker extensions.
"""

from __future__ import annotations

import queue
import socket
import threading
from dataclasses import dataclass

__all__ = ["BucketMeta", "free_port", "learner_join", "learner_stage_and_send", "worker_join",
           "worker_receive_and_reload"]


@dataclass(frozen=True)
class BucketMeta:
    """One broadcast bucket: a flat ``uint8`` buffer of ``nbytes`` holding ``tensors``.

    Attributes:
        nbytes: buffer size in bytes.
        tensors: ``(hf_name, dtype name e.g. 'bfloat16', shape, byte offset, byte size)`` each.
        version: learner weight version it belongs to.
    """

    nbytes: int
    tensors: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    version: int


def free_port() -> int:
    """A free TCP port on this host (for the group's rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _communicator(host: str, port: int, rank: int, world_size: int):
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(pg, device=torch.cuda.current_device())


class _Sender:
    """Learner-side FIFO of staged versions and the thread that broadcasts them."""

    def __init__(self, comm):
        import torch

        self.comm = comm
        self.stream = torch.cuda.Stream()
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mrlhf-nccl-send", daemon=True)
        self.thread.start()

    def _run(self):
        import torch

        while True:
            job = self.jobs.get()
            if job is None:
                return
            ready_event, buffers = job
            try:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready_event)   # staging copies finished
                    for buf in buffers:
                        self.comm.broadcast(buf, src=0, stream=self.stream)
                self.stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - reported on the next stage call
                self.error = e
                return

    def close(self):
        self.jobs.put(None)


def _require_single_rank(learner) -> None:
    if not hasattr(learner, "_stage_hf_tensors"):
        raise RuntimeError("NCCL weight sync needs a single-rank MegatronLearner as the exporting rank; "
                           f"got {type(learner).__name__} (a multi-rank learner group): use "
                           "generators.transport=object_store or filesystem with learner TP/PP/DP > 1")


def learner_join(learner, host: str, port: int, world_size: int) -> None:
    """On the learner actor: join the broadcast group as rank 0 (replaces an older group).

    Raises:
        RuntimeError: ``learner`` is a multi-rank group (only a single-rank learner exports here).
    """
    _require_single_rank(learner)
    old = getattr(learner, "_mrlhf_nccl_sender", None)
    if old is not None:
        old.close()
    learner._mrlhf_nccl_sender = _Sender(_communicator(host, port, 0, world_size))


def learner_stage_and_send(learner, version: int, bucket_bytes: int) -> list[BucketMeta]:
    """On the learner actor: stage the policy's HF-named tensors in flat GPU buckets and queue
    their broadcast; returns the metadata the workers need to receive them.

    Raises:
        RuntimeError: no group (call :func:`learner_join` first) or the previous broadcast failed.
    """
    import torch

    sender = getattr(learner, "_mrlhf_nccl_sender", None)
    if sender is None:
        raise RuntimeError("NCCL weight sync: the learner has not joined a group (NcclTransport.setup)")
    if sender.error is not None:
        raise RuntimeError(f"NCCL weight sync: an earlier broadcast failed: {sender.error!r}")
    _require_single_rank(learner)
    dev = torch.device("cuda", torch.cuda.current_device())
    metas, buffers, cur, cur_bytes = [], [], [], 0

    def flush():
        nonlocal cur, cur_bytes
        if not cur:
            return
        buf = torch.empty(cur_bytes, dtype=torch.uint8, device=dev)
        entries, off = [], 0
        for name, t in cur:
            nb = t.numel() * t.element_size()
            buf[off:off + nb].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, nb))
            off += nb
        metas.append(BucketMeta(nbytes=cur_bytes, tensors=tuple(entries), version=int(version)))
        buffers.append(buf)
        cur, cur_bytes = [], 0

    for name, t in learner._stage_hf_tensors():
        t = t.to(dev, non_blocking=True).contiguous()
        nb = t.numel() * t.element_size()
        if cur and cur_bytes + nb > bucket_bytes:
            flush()
        cur.append((name, t))
        cur_bytes += nb
    flush()
    ready = torch.cuda.Event()
    ready.record()
    sender.jobs.put((ready, buffers))
    return metas


def worker_join(worker, host: str, port: int, rank_offset: int, world_size: int) -> None:
    """Inside a vLLM worker (``collective_rpc``): join the group as ``rank_offset + worker.rank``."""
    worker._mrlhf_nccl_comm = _communicator(host, port, rank_offset + int(worker.rank), world_size)


def worker_receive_and_reload(worker, metas: list[BucketMeta]) -> int:
    """Inside a vLLM worker: receive every bucket of one version and load it in place with one
    ``reload_weights`` call (tensors yielded as views of the received buffer). Returns bytes."""
    import torch

    comm = getattr(worker, "_mrlhf_nccl_comm", None)
    if comm is None:
        raise RuntimeError("NCCL weight sync: this vLLM worker has not joined a group")
    total = 0

    def tensors():
        nonlocal total
        stream = torch.cuda.current_stream()
        for m in metas:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device="cuda")
            comm.broadcast(buf, src=0, stream=stream)
            stream.synchronize()
            total += m.nbytes
            for name, dtype, shape, off, nb in m.tensors:
                yield name, buf[off:off + nb].view(getattr(torch, dtype)).view(shape)

    worker.reload_weights(weights_iterator=tensors())
    return total
