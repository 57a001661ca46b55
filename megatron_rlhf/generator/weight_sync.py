"""Weight sync: one interface, three transports (learner's HF-named buckets -> every vLLM worker).

The controller publishes a learner version with :meth:`WeightTransport.publish` (runs on the
learner: export, plus the probe logprobs for the sync check) and the generator pool pushes a
published version to a worker with :meth:`WeightTransport.push` (runs on the worker: load in
place, reset the prefix cache). Algorithm code never branches on the transport.

* ``object_store`` -- ``learner.export_weights()`` lands in Ray's object store; each worker
  resolves it inside ``VLLMGenerator.update_weights`` (the bytes never pass through the driver).
* ``filesystem`` -- every pipeline stage's exporting learner rank writes its own safetensors
  shards (one per bucket) into ``<run>/weight_sync/.tmp-v<N>/stage<S>/`` in the background (no
  byte through the driver; the learner trains on meanwhile); the first push of a version waits
  for every stage, renames the folder to ``v<N>`` (atomic) and workers stream the files with
  ``safetensors.safe_open`` into one ``reload_weights`` call. Folders of versions older than the
  one every worker holds are deleted (:meth:`retire`).
* ``broadcast`` (``nccl`` is an alias) -- :mod:`megatron_rlhf.generator.broadcast_sync`: one
  process group per learner pipeline stage (its exporting rank + every vLLM worker process of
  every engine), gloo on CPU, NCCL on GPU; the learner stages each version in its own thread and
  broadcasts it in the background (overlapped with its next train step); workers receive
  bucket by bucket inside one ``reload_weights`` call. A broadcast reaches every member at once,
  so pushes go to the whole pool (:attr:`WeightTransport.collective`). A staged version goes on
  the wire only once every worker has asked for it; one nobody asked for before the next
  publish is superseded (never sent) and a push of it loads the newer one instead (as the
  producer's weight channel only ever offers the latest version).

Publishing blocks the learner only for what must run in its own thread (TP gathers, the HF
conversion and the pack into the staging buffers, on the learner's device for ``broadcast``, and
waiting for the previous version's broadcast or write): the loop records it as
``sync/learner_blocked_s``. With ``broadcast``, a publish that lands while a failed push's groups
wait to be re-formed (a generator died in it and the pool waits for Ray's restart) waits for the
re-form instead of failing (:meth:`BroadcastTransport.publish`).

Every push reports ``bytes`` and ``seconds``; the pool adds GB/s.

The weight-sync check (:func:`compare_probe`): after a push, each worker's teacher-forced
logprobs of a fixed probe sequence are compared with the learner's for that version (computed when
it was published); stale weights are otherwise a silent failure. The gate is on the mean |diff|,
calibrated by a probe of version 0 at start-up (:meth:`GeneratorPool.calibrate_check`), plus an
absolute bound on NeMo-RL's ``token_mult_prob_error``; the max is logged only.

Sources: vLLM docs "RLHF" / ``examples/offline_inference/rlhf_utils.py`` (stateless process group,
``collective_rpc``); Ray docs "Objects" (ObjectRefs as task arguments);
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
           "FilesystemTransport", "BroadcastTransport", "BroadcastPushError", "check_transport_layout", "make_transport", "compare_probe",
           "probe_gap", "ProbeGap",
           "on_learner_ranks", "is_learner_group"]


class WeightSyncError(RuntimeError):
    """A worker's weights differ from the learner's after a push (or a push failed)."""


@dataclass(frozen=True)
class PublishedWeights:
    """A weight version the learner has exported.

    Attributes:
        version: the learner's weight version (batches trained).
        payload: what a worker needs to load it; ``None`` for the initial weights every worker
            already holds. ``object_store``: Ray ObjectRef of ``list[dict[str, Tensor]]``;
            ``filesystem``: tuple of safetensors file paths; ``broadcast``: ObjectRef of the
            ``broadcast_sync.StageLayout`` list.
        export_s: seconds the learner spent exporting (0 for the initial weights).
        bytes: payload size in bytes when known at publish time (0 otherwise).
        probe_ref: Ray ObjectRef of the learner's ``token_logprobs([probe])`` ``[1, T]`` at this
            version (``None`` when the sync check is off).
        push_wait_s: seconds the exporters waited for the previous version's broadcast / write
            before staging this one (part of ``export_s``).
    """

    version: int
    payload: Any = None
    export_s: float = 0.0
    bytes: int = 0
    probe_ref: Any = None
    push_wait_s: float = 0.0


@dataclass(frozen=True)
class ProbeGap:
    """How far one worker's probe logprobs are from the learner's (positions 1..T-1).

    Attributes:
        mean_abs: mean |worker - learner| (nats): what the check gates on.
        max_abs: max |worker - learner| (nats): logged only (bf16 stacks differ by tenths of a
            nat at single tokens while agreeing on average).
        mult_prob_error: mean of exp(|worker - learner|), NeMo-RL's ``token_mult_prob_error``
            (1.0 = identical).
        tokens: positions compared.
    """

    mean_abs: float
    max_abs: float
    mult_prob_error: float
    tokens: int


def probe_gap(worker_lp, learner_lp, *, worker: int = 0) -> ProbeGap:
    """The :class:`ProbeGap` of ``worker_lp`` (``[T]`` vLLM prompt logprobs, position 0 = 0.0,
    nats) against ``learner_lp`` (``[T]`` or ``[1, T]`` learner token logprobs of the same tokens).

    ``mult_prob_error`` is NeMo-RL's ``token_mult_prob_error``
    (``nemo_rl/algorithms/loss_functions.py``: ``masked_mean(exp(|generation - train| * mask), mask)``)
    over the probe's positions.

    Raises:
        WeightSyncError: the lengths differ.
    """
    import torch

    ref = torch.as_tensor(learner_lp, dtype=torch.float64).reshape(-1)
    got = torch.as_tensor(worker_lp, dtype=torch.float64).reshape(-1)
    if ref.numel() != got.numel():
        raise WeightSyncError(f"weight-sync check: worker {worker} returned {got.numel()} probe logprobs, "
                              f"the learner {ref.numel()}")
    if ref.numel() < 2:
        return ProbeGap(0.0, 0.0, 1.0, 0)
    d = (got[1:] - ref[1:]).abs()
    return ProbeGap(float(d.mean()), float(d.max()), float(d.exp().mean()), int(d.numel()))


def compare_probe(worker_lp, learner_lp, *, tol: float, baseline: float | None,
                  max_mult_prob_error: float, worker: int, version: int) -> ProbeGap:
    """Check one worker's probe logprobs against the learner's at ``version``; return the gap.

    Two bounds (the calibrated gate; a max over ~200 tokens would fail two correct bf16 stacks,
    which differ by ~0.03 nats on average and by tenths at single tokens):

    * absolute: ``mult_prob_error`` (NeMo-RL's ``token_mult_prob_error``, mean of exp|diff|) at
      most ``max_mult_prob_error`` (``logging.warn_token_mult_prob_error``, 1.05 as NeMo-RL's
      recipe tests): the start-up probe of version 0 uses only this one (engines and learner hold
      the same base weights, so anything above is a numerics or conversion mismatch);
    * calibrated: ``mean_abs`` at most ``baseline + tol``, ``baseline`` = the mean |diff| the
      start-up probe measured (the numerics floor of this learner / engine pair), ``tol`` =
      ``generators.check_weight_sync_tol``. A stale, skipped or wrong push shows up as a jump of
      the mean above the floor (tests/test_generator_pool.py measures both sides).

    Args:
        worker_lp, learner_lp: as in :func:`probe_gap`.
        baseline: the start-up probe's mean |diff| (None: only the absolute bound).
    Raises:
        WeightSyncError: lengths differ, a bound is exceeded or a value is NaN (the worker does not
            hold the learner's weights of ``version``).
    """
    gap = probe_gap(worker_lp, learner_lp, worker=worker)
    what = None
    if not gap.mult_prob_error <= max_mult_prob_error:   # also catches NaN
        what = (f"token_mult_prob_error (mean exp|diff|) {gap.mult_prob_error:.4f} > "
                f"logging.warn_token_mult_prob_error={max_mult_prob_error:g}")
    elif baseline is not None and not gap.mean_abs <= baseline + tol:
        what = (f"mean |diff| {gap.mean_abs:.3g} nats > the start-up probe's {baseline:.3g} + "
                f"generators.check_weight_sync_tol={tol:g}")
    if what is not None:
        raise WeightSyncError(
            f"weight-sync check failed: generator worker {worker} after the push of weight version "
            f"{version}: probe logprobs vs the learner's: {what} (max |diff| {gap.max_abs:.3g} over "
            f"{gap.tokens} tokens); the worker is generating with other weights than the learner trained "
            "(skipped/failed push, stale prefix cache, reloaded base model)")
    return gap


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


class FilesystemTransport(WeightTransport):
    """Safetensors shards in a shared folder (``root/v<N>/stage<S>/``), written by each pipeline
    stage's exporting learner rank in parallel, in the background (no byte passes through the
    driver or a coordinator): :meth:`publish` stages the version on the exporters (TP gathers and
    a host copy, in the learner's own thread) and returns; the learner trains on while the files
    are written. The first push of a version waits until every stage renamed its complete
    sub-folder into ``root/.tmp-v<N>/``, then renames that to ``root/v<N>`` (atomic: readers never
    see a partial version) and hands the workers the file paths.

    Args:
        root: folder shared by the learner and every worker (created).
        bucket_bytes: bytes per shard file (a larger tensor gets a file of its own).
        timeout_s: bound of the wait for the writers (``async.timeout_s``).
    """

    name = "filesystem"

    def __init__(self, root: str | os.PathLike, bucket_bytes: int = 256 * 2**20, timeout_s: float = 1800.0):
        import threading

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self._group: bool | None = None
        self._ready: set[int] = set()
        self._lock = threading.Lock()

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _tmp(self, version: int) -> Path:
        return self.root / f".tmp-v{version:06d}"

    def publish(self, learner, version, timeout_s, probe=None):
        import ray

        from megatron_rlhf.generator import broadcast_sync as bs

        t0 = time.perf_counter()
        if self._group is None:
            self._group = is_learner_group(learner, timeout_s)
        for p in (self._dir(version), self._tmp(version)):   # a resumed run re-publishes a version
            shutil.rmtree(p, ignore_errors=True)
        self._tmp(version).mkdir(parents=True)
        ref = on_learner_ranks(learner, self._group, bs.stage_version, int(version), self.bucket_bytes,
                               float(timeout_s), str(self._tmp(version)))
        probe_ref = _probe_ref(learner, probe)
        staged = sorted((r for r in ray.get(ref, timeout=timeout_s) if r), key=lambda r: r["stage"])
        if not staged:
            raise WeightSyncError(f"no learner rank staged weight version {version}")
        paths = tuple(str(self._dir(version) / bs.stage_folder(r["stage"]) / bs.shard_name(r["stage"], k))
                      for r in staged for k in range(len(r["layout"].buckets)))
        return PublishedWeights(version=version, payload=paths, export_s=time.perf_counter() - t0,
                                bytes=sum(r["layout"].tensor_bytes for r in staged), probe_ref=probe_ref,
                                push_wait_s=max(r["wait_s"] for r in staged))

    def wait_written(self, weights: PublishedWeights, timeout_s: float) -> None:
        """Block until every stage finished writing ``weights`` and the version folder is in place.

        Raises:
            WeightSyncError: a stage failed to write (its message), or not all stages finished
                within ``timeout_s``.
        """
        v = weights.version
        with self._lock:
            if v in self._ready:
                return
            stages = sorted({Path(p).parent.name for p in weights.payload})
            tmp, deadline = self._tmp(v), time.monotonic() + timeout_s
            while not all((tmp / s).is_dir() for s in stages):
                errs = sorted(tmp.glob("stage*.error"))
                if errs:
                    raise WeightSyncError(f"weight version {v}: pipeline stage writer failed: "
                                          f"{errs[0].name}: {errs[0].read_text()}")
                if time.monotonic() > deadline:
                    missing = [s for s in stages if not (tmp / s).is_dir()]
                    raise WeightSyncError(f"weight version {v}: stages {missing} did not finish writing their "
                                          f"shards into {tmp} within async.timeout_s={timeout_s:.0f} s")
                time.sleep(0.05)
            os.rename(tmp, self._dir(v))
            self._ready.add(v)

    def push(self, worker, weights):
        self.wait_written(weights, self.timeout_s)
        return worker.update_weights.remote(list(weights.payload), weights.version)

    def retire(self, version):
        for p in list(self.root.glob("v*")) + list(self.root.glob(".tmp-v*")):
            num = p.name.rsplit("v", 1)[-1]
            if p.is_dir() and num.isdigit() and int(num) < version:
                shutil.rmtree(p, ignore_errors=True)
        self._ready = {v for v in self._ready if v >= version}

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def _call_single(learner, fn, *args):
    return [fn(learner, *args)]


def on_learner_ranks(learner, is_group: bool, fn, *args):
    """ObjectRef of ``[fn(rank, *args) for every learner rank]`` (rank order), ``fn`` a module-level
    function run on each ``MegatronLearner`` in its own actor thread: through
    ``LearnerGroup.call_on_ranks`` for a multi-rank learner (``is_group``), ``__ray_call__`` for a
    single one (see :func:`is_learner_group`)."""
    if is_group:
        return learner.call_on_ranks.remote(fn, *args)
    return learner.__ray_call__.remote(_call_single, fn, *args)


def _is_group(obj) -> bool:
    return hasattr(obj, "call_on_ranks")


def is_learner_group(learner, timeout_s: float) -> bool:
    """Whether the learner actor is a multi-rank ``LearnerGroup`` coordinator."""
    import ray

    return bool(ray.get(learner.__ray_call__.remote(_is_group), timeout=timeout_s))


class BroadcastTransport(WeightTransport):
    """Broadcast from every pipeline stage's exporting learner rank to every vLLM worker process
    (:mod:`megatron_rlhf.generator.broadcast_sync`; gloo on CPU, NCCL on GPU).

    :meth:`setup` forms one group per stage (exporter rank 0, TP rank r of engine i at
    ``1 + i * tensor_parallel + r``); :meth:`publish` runs the TP gathers and the device-side pack on
    the learner ranks (their own thread; waits for the previous version's broadcast first, and
    that wait is part of the blocked time) and returns while the broadcast runs in the background;
    the pool pushes a published version to all workers at once (:attr:`collective`,
    :meth:`push_all`). The exporters start sending a version only when every worker has asked for
    it; publishing a newer version supersedes a staged one nobody has asked for yet (it is never
    sent, and a later push of it loads the newer one: :meth:`push_all`), so a version the producer
    never loads (the one published after its last batch) cannot hold up the next publish (the
    end-of-run evaluation's). Versions go out in publish order. When Ray restarts a dead worker
    the groups are re-formed and the latest staged version is sent to every worker again
    (:meth:`recover`).

    Args:
        engine_tensor_parallel: vLLM TP ranks per engine (each joins every group).
        bucket_bytes: bytes per bucket / wire chunk.
        with_checksum: workers also return a SHA-256 of the bytes they received (tests, debugging).
        learner_plan_bytes: the memory plan's resident bytes of one learner GPU per pipeline stage,
            ``{stage: bytes}`` (``megatron_rlhf.memory_plan.learner_plan_bytes``: what
            ``tools/plan_memory.py`` counts without the staging); each stage's exporter decides from
            its entry, once, at its first publish, whether its staging lives on the device
            (``megatron_rlhf.sync.staging.plan_staging`` against its GPU's total memory). None, or
            no entry for a stage: host staging on a GPU (the choice that cannot run it out of memory).
    """

    name = "broadcast"
    collective = True

    def __init__(self, engine_tensor_parallel: int = 1, bucket_bytes: int = 256 * 2**20,
                 with_checksum: bool = False, learner_plan_bytes: dict[int, float] | None = None):
        self.tp = int(engine_tensor_parallel)
        self.bucket_bytes = int(bucket_bytes)
        self.learner_plan_bytes = (None if learner_plan_bytes is None
                                   else {int(k): float(v) for k, v in learner_plan_bytes.items()})
        self.with_checksum = bool(with_checksum)
        import threading

        self._pending: list[PublishedWeights] = []
        self._published = threading.Condition()   # publish() -> push_all() of a superseded version
        self._forming = threading.Lock()   # publish() (learner loop) waits while recover() re-forms the groups
        self.learner, self.workers, self._stages, self._group = None, [], [], False
        self._broken: str | None = None   # a failed push: groups must be re-formed (setup/recover)
        self._given_up: str | None = None  # the pool will not re-form them (abandon)
        self._broken_at = 0.0                # time.monotonic() of the failed push (mark_broken)
        self._health = threading.Condition()   # setup() / abandon() -> publish() waiting on a re-form
        self._layouts, self._layouts_ref = None, None

    def setup(self, learner, workers: list, timeout_s: float) -> None:
        """(Re)form every stage's group over the exporters and every worker in ``workers``.

        Raises:
            WeightSyncError: a member did not join within ``timeout_s`` (names who did not).
        """
        import ray

        from megatron_rlhf.generator import broadcast_sync as bs

        self.learner, self.workers = learner, list(workers)
        self._group = is_learner_group(learner, timeout_s)
        addrs = ray.get(on_learner_ranks(learner, self._group, bs.exporter_address), timeout=timeout_s)
        self._stages = sorted((a for a in addrs if a), key=lambda a: a["stage"])
        world = 1 + len(self.workers) * self.tp
        refs = {on_learner_ranks(learner, self._group, bs.exporter_join, self._stages, world, timeout_s,
                                 self.learner_plan_bytes): "the learner's exporters"}
        for i, w in enumerate(self.workers):
            refs[w.join_weight_broadcast.remote(self._stages, 1 + i * self.tp, world, timeout_s)] = \
                f"generator engine {i} (group ranks {1 + i * self.tp}..{(i + 1) * self.tp})"
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s + 5)
        missing = [who for r, who in refs.items() if r not in ready]
        if missing:
            raise WeightSyncError(f"weight broadcast groups of pipeline stages {[s['stage'] for s in self._stages]}: "
                                  f"{', '.join(missing)} did not join within async.timeout_s={timeout_s:.0f} s")
        ray.get(list(refs))
        with self._published:
            self._pending.clear()
        with self._health:
            self._broken = self._given_up = None
            self._health.notify_all()

    def mark_broken(self, why: str) -> None:
        """A push failed: the groups take no publish until they are re-formed (:meth:`setup`)."""
        with self._health:
            self._broken, self._broken_at = why, time.monotonic()

    def abandon(self, why: str) -> None:
        """The pool will not re-form the groups (a worker died beyond ``generators.max_restarts``,
        or a push failed for another reason than a death): a publish waiting for the re-form
        raises at once instead of waiting out ``async.timeout_s``."""
        with self._health:
            self._given_up = why
            self._health.notify_all()

    def _wait_healthy(self, version: int, deadline: float, timeout_s: float) -> None:
        """While a failed push's groups are broken, wait for the pool to re-form them (Ray restarts
        the dead worker, :meth:`recover`).

        The wait lasts as long as the pool may take, each part under its own bound: after the
        break, the pool's settle (at most 5 s), Ray's restart of the dead engine (``timeout_s``),
        then :meth:`recover`'s restart of the engines whose receive was cut off and the re-form
        (``timeout_s`` for both), so ``3 * timeout_s + 10`` s from the break, or ``deadline`` if
        later. The pool calls :meth:`abandon` when one of its bounds runs out, which ends the wait
        at once. (A publish bounded by ``timeout_s`` from its own start ended the run whenever the
        two restarts, one after the other, took longer than that: vLLM engines on a loaded CPU in
        CI, and a 70B engine loading its weights on GPU.)

        Raises:
            WeightSyncError: the pool gave up (:meth:`abandon`), or no re-form by the bound above.
        """
        with self._health:
            while self._broken is not None and self._given_up is None:
                until = max(deadline, self._broken_at + 3 * timeout_s + 10.0)
                left = until - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(
                        f"weight broadcast: cannot publish version {version}: the groups are broken since a "
                        f"failed push ({self._broken}) and were not re-formed within 3 x async.timeout_s + 10 s "
                        f"= {3 * timeout_s + 10:.0f} s of it (the pool re-forms them once Ray restarted the "
                        "worker)")
                self._health.wait(min(left, 1.0))
            if self._given_up is not None:
                raise WeightSyncError(f"weight broadcast: cannot publish version {version}: the groups are "
                                      f"broken and will not be re-formed ({self._given_up})")

    def publish(self, learner, version, timeout_s, probe=None):
        """Stage ``version`` on the exporters (see the class doc). A publish that lands while a
        failed push's groups are broken (a generator died in it and the pool is waiting for Ray
        to restart it) waits for the re-form (bounded as :meth:`_wait_healthy` says) and then
        stages, bounded by ``timeout_s``; one
        whose staging failed because the push in flight broke meanwhile stages again after the
        re-form.

        Raises:
            WeightSyncError: not re-formed within ``timeout_s``, or the pool gave up on them.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            self._wait_healthy(version, deadline, timeout_s)
            # the re-form's resend holds the lock for at most timeout_s after the groups are healthy
            if not self._forming.acquire(timeout=max(timeout_s, deadline - time.monotonic())):
                raise WeightSyncError(f"weight broadcast: cannot publish version {version}, the groups were "
                                      f"being re-formed for more than async.timeout_s={timeout_s:.0f} s")
            try:
                if self._broken is None:
                    return self._publish(learner, version, timeout_s, probe, t0)
            except Exception as e:  # noqa: BLE001 - re-raised unless the groups broke under it
                if not self._broke_in_flight(e, deadline):
                    raise
            finally:
                self._forming.release()

    def _broke_in_flight(self, err: BaseException, deadline: float) -> bool:
        """Whether a failed staging is due to the push in flight failing (the exporter's broadcast
        was aborted: the groups are, or within a few seconds will be, marked broken)."""
        if "failed earlier" not in str(err) and "was aborted" not in str(err):
            return False
        until = min(deadline, time.monotonic() + 30.0)   # the pool marks them within its settle time
        while self._broken is None and self._given_up is None and time.monotonic() < until:
            time.sleep(0.1)
        return self._broken is not None

    def _publish(self, learner, version, timeout_s, probe, t0):
        import ray

        from megatron_rlhf.generator import broadcast_sync as bs

        ref = on_learner_ranks(learner, self._group, bs.stage_version, int(version), self.bucket_bytes, float(timeout_s))
        probe_ref = _probe_ref(learner, probe)
        staged = sorted((r for r in ray.get(ref, timeout=timeout_s) if r), key=lambda r: r["stage"])
        layouts = tuple(r["layout"] for r in staged)
        if layouts != self._layouts:   # computed once per layout; one object-store copy for all pushes
            self._layouts, self._layouts_ref = layouts, ray.put(list(layouts))
        w = PublishedWeights(version=version, payload=self._layouts_ref, export_s=time.perf_counter() - t0,
                             bytes=sum(lay.tensor_bytes for lay in layouts), probe_ref=probe_ref,
                             push_wait_s=max((r["wait_s"] for r in staged), default=0.0))
        with self._published:
            self._pending.append(w)
            self._published.notify_all()
        return w

    def push(self, worker, weights):
        return worker.update_weights_broadcast.remote(weights.payload, weights.version, self.with_checksum)

    def push_all(self, workers: list, weights: PublishedWeights, timeout_s: float) -> list[dict]:
        """Load ``weights`` on every worker at once, or, when the exporters superseded that version
        (a newer one was published before every worker asked for it), the newest published version
        instead. Results in worker order; ``result['weights']`` is the :class:`PublishedWeights`
        actually loaded (``version`` >= ``weights.version``).

        Raises:
            BroadcastPushError: a worker died, failed or did not finish within ``timeout_s``; the
                message names the pipeline stage(s), the engine and its workers (group ranks).
            WeightSyncError: superseded, but the newer version was not published within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            results = self._push_all_once(workers, weights, deadline, timeout_s)
            if not all(r.get("superseded") for r in results):
                for r in results:
                    r["weights"] = weights
                return results
            weights = self._newer_than(weights.version, deadline)

    def _newer_than(self, version: int, deadline: float) -> PublishedWeights:
        """The newest published version above ``version`` (waits for its publish to return)."""
        with self._published:
            while True:
                newer = [w for w in self._pending if w.version > version]
                if newer:
                    return max(newer, key=lambda w: w.version)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(f"weight broadcast: version {version} was superseded by a newer "
                                          "publish that did not return within async.timeout_s")
                self._published.wait(left)

    def _push_all_once(self, workers: list, weights: PublishedWeights, deadline: float,
                       timeout_s: float) -> list[dict]:
        import ray
        from ray.exceptions import RayActorError

        from megatron_rlhf.generator import broadcast_sync as bs

        refs = [self.push(w, weights) for w in workers]
        index = {r: i for i, r in enumerate(refs)}
        results: dict[int, dict] = {}
        left = list(refs)
        while left:
            ready, left = ray.wait(left, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            i = index[ready[0]]
            try:
                results[i] = ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 - named below
                self.mark_broken(f"version {weights.version}: generator engine {i} failed")   # before the abort note
                self._abort(weights.version, f"version {weights.version}: generator engine {i} failed: "
                                             f"{type(e).__name__}")
                errs = {i: e, **self._settle(left, index, min(5.0, max(0.0, deadline - time.monotonic())))}
                # died in the push, or Ray had already restarted it (a fresh process outside the groups)
                dead = sorted(j for j, x in errs.items() if isinstance(x, RayActorError) or bs.NOT_JOINED in str(x))
                first = dead[0] if dead else i   # a death is the cause; the others were aborted
                others = {j: str(x).splitlines()[-1][:300] for j, x in errs.items() if j != first}
                why = self._describe(weights, first, errs[first], others)
                self.mark_broken(why)
                raise BroadcastPushError(why, engine=first, died=bool(dead)) from errs[first]
        if left:
            stuck = sorted(index[r] for r in left)
            self.mark_broken(f"engine(s) {stuck} did not finish receiving version {weights.version}")
            self._abort(weights.version, self._broken)
            raise BroadcastPushError(
                f"weight broadcast of version {weights.version}: generator engine(s) {stuck} "
                f"({', '.join(self._ranks(i) for i in stuck)}) did not finish receiving pipeline stages "
                f"{[s['stage'] for s in self._stages]} within async.timeout_s={timeout_s:.0f} s "
                f"(stalled receiver); engines done: {sorted(results)}", engine=stuck[0], died=False)
        return [results[i] for i in range(len(workers))]

    def _abort(self, version: int, message: str) -> None:
        """Supersede ``version`` unless already sent, release the receivers still waiting in stage
        0's group (for the verdict or for bytes): ``broadcast_sync.post_abort``."""
        from megatron_rlhf.generator import broadcast_sync as bs

        try:
            bs.post_abort(self._stages[0]["host"], self._stages[0]["port"], version, message, 10.0)
        except Exception:  # noqa: BLE001 - best effort; they time out on their own otherwise
            pass

    def _ranks(self, i: int) -> str:
        return f"engine {i}: vLLM TP workers 0..{self.tp - 1} = group ranks {1 + i * self.tp}..{(i + 1) * self.tp}"

    @staticmethod
    def _settle(left, index, wait_s: float) -> dict[int, BaseException]:
        """Errors of the other workers' receives that end within ``wait_s``."""
        import ray

        out = {}
        ready, _ = ray.wait(left, num_returns=len(left), timeout=wait_s) if left else ([], [])
        for r in ready:
            try:
                ray.get(r)
            except Exception as e:  # noqa: BLE001
                out[index[r]] = e
        return out

    def _describe(self, weights, i: int, err: BaseException, others: dict[int, str]) -> str:
        what = "died" if "Actor" in type(err).__name__ else "failed"
        msg = (f"weight broadcast of version {weights.version} (pipeline stages "
               f"{[s['stage'] for s in self._stages]}): generator {self._ranks(i)} {what} while receiving: "
               f"{type(err).__name__}: {str(err).splitlines()[-1][:300] if str(err) else ''}")
        for j, e in sorted(others.items()):
            msg += f"; engine {j}: {e}"
        return msg

    def recover(self, workers: list, timeout_s: float) -> PublishedWeights | None:
        """After Ray restarted a worker: restart the workers whose receive was cut off (their model is
        half reloaded), re-form every group over ``workers`` and broadcast the latest staged
        version to all of them again. Returns it (None when nothing was staged).

        Raises:
            WeightSyncError / BroadcastPushError: the group could not be re-formed or the resend failed.
        """
        with self._forming:
            return self._recover(workers, timeout_s)

    def _recover(self, workers: list, timeout_s: float) -> PublishedWeights | None:
        import ray

        from megatron_rlhf.generator import broadcast_sync as bs

        known = {w.version: w for w in self._pending}   # their learner probe logprobs (sync check)
        # a worker whose receive was cut off (the exporter aborted when another one died) holds a
        # half-reloaded model: restart it too (Ray brings it back with the base weights)
        deadline = time.monotonic() + timeout_s
        for w in workers:
            if _call_when_up(w, _engine_broken, deadline):
                ray.kill(w, no_restart=False)
        for w in workers:   # every worker is up again, on a fresh process where it was killed
            while _call_when_up(w, _engine_broken, deadline):
                if time.monotonic() > deadline:
                    raise WeightSyncError("weight broadcast: a restarted generator worker did not come back")
                time.sleep(0.5)
        self.setup(self.learner, workers, timeout_s)
        if self._layouts is None:
            return None
        versions = {v for v in ray.get(on_learner_ranks(self.learner, self._group, bs.resend_latest), timeout=timeout_s)
                    if v is not None}
        if len(versions) != 1:
            raise WeightSyncError(f"weight broadcast: stages hold different staged versions {sorted(versions)}")
        v = versions.pop()
        latest = known.get(v) or PublishedWeights(version=v, payload=self._layouts_ref,
                                                  bytes=sum(lay.tensor_bytes for lay in self._layouts))
        self.push_all(workers, latest, timeout_s)
        return latest

    def retire(self, version):
        with self._published:   # the pool's thread; publish() appends from the learner loop's
            self._pending = [w for w in self._pending if w.version > version]


def _engine_broken(gen) -> bool:
    return getattr(gen, "_broken", None) is not None


def _call_when_up(actor, fn, deadline: float):
    """``actor.__ray_call__(fn)``, retried while Ray restarts the actor, until ``deadline``.

    Raises:
        WeightSyncError: the actor is not back by the deadline.
    """
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    while True:
        try:
            return ray.get(actor.__ray_call__.remote(fn), timeout=max(1.0, deadline - time.monotonic()))
        except (ActorUnavailableError, GetTimeoutError) as e:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weight broadcast: a generator worker did not come back: {e}") from e
            time.sleep(0.5)


class BroadcastPushError(WeightSyncError):
    """A broadcast push failed on a worker (``engine``; ``died``: its process is gone)."""

    def __init__(self, msg: str, *, engine: int, died: bool):
        super().__init__(msg)
        self.engine, self.died = engine, died


def check_transport_layout(generator_cfg, learner_cfg, *, gpu_memory_gib: float = 0.0) -> None:
    """Pre-flight check (before any actor starts) that ``generators.transport`` can serve the layout.

    ``broadcast`` (alias ``nccl``) serves every learner TP x PP x DP layout and any engine TP:
    one group per pipeline stage of ``1 + num_workers * tensor_parallel`` ranks. What it allocates
    on each exporting learner rank (TP 0 / DP 0 of each stage) is one staging copy of its stage
    (``megatron_rlhf.sync.staging``: on the device when the memory plan leaves room for it, counted
    as ``staging`` by ``tools/plan_memory.py``, else in pinned host memory) plus, with host
    staging on a GPU, two device wire buffers of ``generators.weight_sync_bucket_mb`` each; every
    vLLM worker receives into buffers of up to one bucket at a time (two posted). This check
    refuses a bucket size whose two buffers alone would take more than a tenth of a GPU.

    Raises:
        ValueError: those two buffers would take more than a tenth of a GPU (``gpu_memory_gib`` > 0,
            from ``placement.gpu_memory_gib`` on GPU clusters); names the key and the fix.
    """
    if generator_cfg.transport not in ("broadcast", "nccl") or gpu_memory_gib <= 0:
        return
    need_gib = 2 * generator_cfg.weight_sync_bucket_mb / 1024
    if need_gib > gpu_memory_gib / 10:
        raise ValueError(f"config key 'generators.weight_sync_bucket_mb' = {generator_cfg.weight_sync_bucket_mb:g}: "
                         f"the broadcast transport keeps two wire buffers of that size ({need_gib:.1f} GiB) on each "
                         f"exporting learner GPU of {gpu_memory_gib:g} GiB (host staging) and receives into buckets of "
                         f"it on each generator GPU; use at most {gpu_memory_gib * 1024 / 20:.0f} MiB")


def make_transport(generator_cfg, run_dir: str | os.PathLike, timeout_s: float = 1800.0,
                   learner_plan_bytes: dict[int, float] | None = None) -> WeightTransport:
    """The transport ``generators.transport`` names (``filesystem`` writes under
    ``<run_dir>/weight_sync``; ``nccl`` is ``broadcast``; ``learner_plan_bytes``: see
    :class:`BroadcastTransport`)."""
    if generator_cfg.transport == "object_store":
        return ObjectStoreTransport()
    if generator_cfg.transport == "filesystem":
        return FilesystemTransport(Path(run_dir) / "weight_sync", int(generator_cfg.weight_sync_bucket_mb * 2**20),
                                   timeout_s)
    if generator_cfg.transport in ("broadcast", "nccl"):   # nccl: the former name
        return BroadcastTransport(generator_cfg.tensor_parallel, int(generator_cfg.weight_sync_bucket_mb * 2**20),
                                  learner_plan_bytes=learner_plan_bytes)
    raise ValueError(f"generators.transport = {generator_cfg.transport!r}: unknown transport")
