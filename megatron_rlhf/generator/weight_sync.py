"""Weight sync: one interface, three transports (learner's HF-named buckets -> every vLLM worker).

The controller publishes a learner version with :meth:`WeightTransport.publish` (runs on the
learner: export, plus the probe logprobs for the sync check) and the generator pool pushes a
published version to a worker with :meth:`WeightTransport.push` (runs on the worker: load in
place, reset the prefix cache). Algorithm code never branches on the transport.

* ``object_store`` -- ``learner.export_weights()`` lands in Ray's object store; each worker
  resolves it inside ``VLLMGenerator.update_weights`` (the bytes never pass through the driver).
* ``filesystem`` -- the learner writes safetensors shards (one per bucket) into
  ``<run>/weight_sync/v<N>/`` (written to a temporary folder, then renamed: atomic); workers
  stream them with ``safetensors.safe_open`` into one ``reload_weights`` call. Folders of
  versions older than the one every worker holds are deleted (:meth:`retire`).
* ``nccl`` -- GPU only (:mod:`megatron_rlhf.generator.nccl_sync`): a vLLM
  ``StatelessProcessGroup`` + ``PyNcclCommunicator`` spanning the exporting learner rank (rank 0)
  and every vLLM worker process; the learner stages each bucket on its GPU and broadcasts from a
  background thread (overlapped with its next train step); workers receive bucket by bucket
  inside one ``reload_weights`` call. A broadcast reaches every member at once, so pushes go to
  the whole pool (:attr:`WeightTransport.collective` is True) and every published version is
  received, in order.

Every push reports ``bytes`` and ``seconds``; the pool adds GB/s.

The weight-sync check (:func:`compare_probe`): after a push, each worker's teacher-forced
logprobs of a fixed probe sequence must equal the learner's for that version (computed when it
was published) within a tolerance; stale weights are otherwise a silent failure.

Sources: vLLM docs "RLHF" / ``examples/offline_inference/rlhf_utils.py`` (stateless process group,
PyNcclCommunicator, ``collective_rpc``); Ray docs "Objects" (ObjectRefs as task arguments);
safetensors docs (``safe_open``, ``save_file``).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PublishedWeights", "WeightSyncError", "WeightTransport", "ObjectStoreTransport",
           "FilesystemTransport", "NcclTransport", "make_transport", "compare_probe",
           "write_safetensors_shards"]


class WeightSyncError(RuntimeError):
    """A worker's weights differ from the learner's after a push (or a push failed)."""


@dataclass(frozen=True)
class PublishedWeights:
    """A weight version the learner has exported.

    Attributes:
        version: the learner's weight version (batches trained).
        payload: what a worker needs to load it; ``None`` for the initial weights every worker
            already holds. ``object_store``: Ray ObjectRef of ``list[dict[str, Tensor]]``;
            ``filesystem``: tuple of safetensors file paths; ``nccl``: bucket metadata
            (``nccl_sync.BucketMeta`` list).
        export_s: seconds the learner spent exporting (0 for the initial weights).
        bytes: payload size in bytes when known at publish time (0 otherwise).
        probe_ref: Ray ObjectRef of the learner's ``token_logprobs([probe])`` ``[1, T]`` at this
            version (``None`` when the sync check is off).
    """

    version: int
    payload: Any = None
    export_s: float = 0.0
    bytes: int = 0
    probe_ref: Any = None


def compare_probe(worker_lp: list[float], learner_lp, tol: float, *, worker: int, version: int) -> float:
    """Max |worker - learner| logprob over the probe's positions 1..T-1; raise beyond ``tol``.

    Args:
        worker_lp: ``[T]`` vLLM prompt logprobs (position 0 = 0.0), nats.
        learner_lp: ``[T]`` or ``[1, T]`` learner token logprobs of the same tokens (tensor/list).
        tol: allowed max abs difference (nats).
        worker, version: for the message.
    Returns:
        the max abs difference.
    Raises:
        WeightSyncError: lengths differ, or the difference exceeds ``tol`` (the worker does not
            hold the learner's weights of ``version``).
    """
    import torch

    ref = torch.as_tensor(learner_lp, dtype=torch.float64).reshape(-1)
    got = torch.as_tensor(worker_lp, dtype=torch.float64).reshape(-1)
    if ref.numel() != got.numel():
        raise WeightSyncError(f"weight-sync check: worker {worker} returned {got.numel()} probe logprobs, "
                              f"the learner {ref.numel()}")
    diff = float((got[1:] - ref[1:]).abs().max()) if ref.numel() > 1 else 0.0
    if not diff <= tol:  # also catches NaN
        raise WeightSyncError(
            f"weight-sync check failed: generator worker {worker} after the push of weight version "
            f"{version} gives probe logprobs up to {diff:.3g} nats away from the learner's "
            f"(generators.check_weight_sync_tol={tol:g}); the worker is generating with other weights "
            "than the learner trained (skipped/failed push, stale prefix cache, reloaded base model)")
    return diff


def _probe_ref(learner, probe: list[int] | None):
    return None if probe is None else learner.token_logprobs.remote([list(probe)])


class WeightTransport:
    """Base: how a published version gets from the learner to one worker.

    Attributes:
        name: transport name (``generators.transport``).
        collective: True when a push must go to every worker at once (NCCL broadcast).
    """

    name = "base"
    collective = False

    def publish(self, learner, version: int, timeout_s: float, probe: list[int] | None = None) -> PublishedWeights:
        """Export the learner's current weights as ``version`` (blocks until the learner finished
        exporting, at most ``timeout_s``). ``probe``: token ids whose learner logprobs are taken
        right after the export (same weights). Raises ``TimeoutError``."""
        raise NotImplementedError

    def push(self, worker, weights: PublishedWeights):
        """Start loading ``weights`` on ``worker`` (a ``VLLMGenerator`` actor); returns the
        ObjectRef of its ``{'bytes', 'seconds', 'tensors'}`` result."""
        raise NotImplementedError

    def retire(self, version: int) -> None:
        """Every worker holds ``version`` or newer: release payloads of older versions."""

    def close(self) -> None:
        """Release everything (end of run)."""


class ObjectStoreTransport(WeightTransport):
    """Buckets through Ray's object store (``learner.export_weights`` -> ``update_weights``)."""

    name = "object_store"

    def publish(self, learner, version, timeout_s, probe=None):
        import ray

        t0 = time.perf_counter()
        ref = learner.export_weights.remote()
        probe_ref = _probe_ref(learner, probe)   # queued behind the export: same weights
        ready, _ = ray.wait([ref], timeout=timeout_s, fetch_local=False)
        if not ready:
            raise TimeoutError(f"learner export of weight version {version} took more than "
                               f"async.timeout_s={timeout_s:.0f} s")
        return PublishedWeights(version=version, payload=ref, export_s=time.perf_counter() - t0,
                                probe_ref=probe_ref)

    def push(self, worker, weights):
        # a top-level ObjectRef argument is resolved by Ray in the worker process (object store ->
        # worker, never through the driver)
        return worker.update_weights.remote(weights.payload, weights.version)


def write_safetensors_shards(learner, out_dir: str, bucket_bytes: int = 256 * 2**20) -> tuple[list[str], int]:
    """Runs ON the learner actor (``learner.__ray_call__``; a ``MegatronLearner`` or a
    ``LearnerGroup`` coordinator): write ``export_weights(bucket_bytes)`` (dicts, or ObjectRefs of
    dicts fetched one at a time) as ``model-0000i-of-0000n.safetensors`` files into ``out_dir`` (a temporary sibling folder
    renamed at the end, so readers never see a partial version).

    Returns:
        ``(paths, bytes)``: the shard files (``[]`` on a rank that exports nothing) and their
        tensor bytes.
    Raises:
        FileExistsError: ``out_dir`` exists (a version is written once).
    """
    from safetensors.torch import save_file

    buckets = learner.export_weights(bucket_bytes)   # dicts (one rank) or ObjectRefs of dicts (a group)
    if not buckets:
        return [], 0
    final = Path(out_dir)
    if final.exists():
        raise FileExistsError(f"weight-sync folder {final} already exists")
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n, total, names = len(buckets), 0, []
    for i, b in enumerate(buckets):
        if not isinstance(b, dict):   # a LearnerGroup's bucket: fetch one at a time
            import ray

            b = ray.get(b)
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in b.items()}, str(tmp / name), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in b.values())
        names.append(name)
    os.rename(tmp, final)
    return [str(final / nm) for nm in names], total


class FilesystemTransport(WeightTransport):
    """Safetensors shards in a shared folder (``root/v<N>/``); see the module docstring.

    Args:
        root: folder shared by the learner and every worker (created).
        bucket_bytes: bytes per shard file.
    """

    name = "filesystem"

    def __init__(self, root: str | os.PathLike, bucket_bytes: int = 256 * 2**20):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = int(bucket_bytes)

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def publish(self, learner, version, timeout_s, probe=None):
        import ray

        t0 = time.perf_counter()
        out = self._dir(version)
        if out.exists():   # a resumed run re-publishes a version: rewrite it
            shutil.rmtree(out)
        ref = learner.__ray_call__.remote(write_safetensors_shards, str(out), self.bucket_bytes)
        probe_ref = _probe_ref(learner, probe)
        paths, nbytes = ray.get(ref, timeout=timeout_s)
        if not paths:
            raise WeightSyncError(f"the learner wrote no safetensors shard for weight version {version}")
        return PublishedWeights(version=version, payload=tuple(paths), export_s=time.perf_counter() - t0,
                                bytes=int(nbytes), probe_ref=probe_ref)

    def push(self, worker, weights):
        return worker.update_weights.remote(list(weights.payload), weights.version)

    def retire(self, version):
        for p in self.root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and int(p.name[1:]) < version:
                shutil.rmtree(p, ignore_errors=True)

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


class NcclTransport(WeightTransport):
    """NCCL broadcast from the learner's exporting rank to every vLLM worker (GPU only).

    :meth:`setup` forms the group (learner rank 0, worker engine i's TP ranks after it);
    :meth:`publish` stages the learner's buckets on its GPU and starts the background broadcast
    (FIFO of staged versions, so the learner never waits for the generators); the pool pushes
    every published version, in order, to all workers at once (:attr:`collective`). A restarted
    worker cannot join an existing communicator: with this transport a generator death stops the
    run (``GeneratorDiedError``) and the run resumes from its last checkpoint.

    Args:
        engine_tensor_parallel: vLLM TP ranks per engine (each joins the group).
        bucket_bytes: bytes per broadcast bucket.
    Raises:
        RuntimeError: no CUDA GPU in this process (``generators.transport=nccl`` on CPU).
    """

    name = "nccl"
    collective = True

    def __init__(self, engine_tensor_parallel: int = 1, bucket_bytes: int = 256 * 2**20):
        from megatron_rlhf.platform import get_platform

        if get_platform().is_cpu:
            raise RuntimeError("generators.transport = 'nccl' needs CUDA GPUs on the learner and the "
                               "generators (no GPU is visible here); use 'object_store' or 'filesystem'")
        self.tp = int(engine_tensor_parallel)
        self.bucket_bytes = int(bucket_bytes)
        self._pending: list[PublishedWeights] = []
        self.learner = None

    def setup(self, learner, workers: list, timeout_s: float) -> None:
        """(Re)form the broadcast group over ``learner`` (rank 0) and every worker in ``workers``.

        Raises:
            TimeoutError / ray.exceptions.RayActorError: a member did not join in ``timeout_s``.
        """
        import ray

        from megatron_rlhf.generator import nccl_sync

        self.learner = learner
        host = ray.util.get_node_ip_address()
        port = nccl_sync.free_port()
        world = 1 + len(workers) * self.tp
        refs = [learner.__ray_call__.remote(nccl_sync.learner_join, host, port, world)]
        refs += [w.init_weight_group.remote(host, port, 1 + i * self.tp, world) for i, w in enumerate(workers)]
        ray.get(refs, timeout=timeout_s)
        self._pending.clear()

    def publish(self, learner, version, timeout_s, probe=None):
        import ray

        from megatron_rlhf.generator import nccl_sync

        t0 = time.perf_counter()
        meta_ref = learner.__ray_call__.remote(nccl_sync.learner_stage_and_send, version, self.bucket_bytes)
        probe_ref = _probe_ref(learner, probe)
        meta = ray.get(meta_ref, timeout=timeout_s)
        w = PublishedWeights(version=version, payload=meta, export_s=time.perf_counter() - t0,
                             bytes=sum(b.nbytes for b in meta), probe_ref=probe_ref)
        self._pending.append(w)
        return w

    def chain(self, held_version: int, target: PublishedWeights) -> list[PublishedWeights]:
        """Every staged version in ``(held_version, target.version]``, oldest first: the learner
        broadcasts them in this order, so the workers must receive all of them."""
        out = [w for w in self._pending if held_version < w.version <= target.version]
        return out or [target]

    def push(self, worker, weights):
        return worker.update_weights_nccl.remote(weights.payload, weights.version)

    def retire(self, version):
        self._pending = [w for w in self._pending if w.version > version]


def make_transport(generator_cfg, run_dir: str | os.PathLike) -> WeightTransport:
    """The transport ``generators.transport`` names (``filesystem`` writes under
    ``<run_dir>/weight_sync``). Raises ``RuntimeError`` for ``nccl`` without CUDA."""
    if generator_cfg.transport == "object_store":
        return ObjectStoreTransport()
    if generator_cfg.transport == "filesystem":
        return FilesystemTransport(Path(run_dir) / "weight_sync")
    if generator_cfg.transport == "nccl":
        return NcclTransport(generator_cfg.tensor_parallel)
    raise ValueError(f"generators.transport = {generator_cfg.transport!r}: unknown transport")
