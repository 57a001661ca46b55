"""Weight broadcast: every pipeline stage of a TP x PP x DP learner -> every vLLM worker process.

The same code on CPU (gloo) and GPU (NCCL): the backend, the buffers' device and the streams
come from :func:`megatron_rlhf.platform.get_platform` (``dist_backend``, ``buffer_device``,
``host_buffers``, ``side_stream``, ``sync_stream``); nothing else differs.

Groups. One process group per pipeline stage ``s`` (as slime's ``slime-pp_{s}`` groups):
rank 0 is the stage's *exporter* (the learner rank with ``pp = s, tp = 0, dp = 0``), ranks
``1 + i * g + r`` are TP rank ``r`` of vLLM engine ``i`` (``g`` = ``generators.tensor_parallel``),
so every worker process of every engine is in every stage's group. A group is a ``TCPStore`` on
the exporter's host (the exporter binds the listening socket itself and keeps it, so the address
is the exporter's and no other process can take the port) plus a ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` built on it, as vLLM's
``stateless_init_torch_distributed_process_group`` does: it lives outside
``torch.distributed``'s global state (Megatron's groups are untouched) and only its own methods
are called (``group.broadcast([t], opts)``; the functional API would map ranks through the
global group).

Layout. On its first publish an exporter plans its stage once from metadata alone
(:func:`megatron_rlhf.sync.wire.plan_layout` over ``MegatronLearner._stage_hf_entries``: the
HF names, dtypes and shapes the conversion rules give, no tensor gathered), in HF order, grouped
into buckets of whole tensors of at most ``bucket_bytes`` (a larger tensor gets a bucket of its
own); each bucket is sent in fixed-size chunks of at most ``bucket_bytes``. Offsets are 64-byte
aligned. The layout is reused for every later version (checked tensor by tensor), and every
version, the first included, is streamed into the staging one tensor at a time.

Per published version (:func:`stage_version`, in the learner's own thread: these are
collectives on Megatron's TP groups, which must never run from a second thread during a train
step, verl PR #7423): wait until the previous version's broadcast has finished (counted), TP
gathers, HF conversion and the pack into one staging buffer per bucket, all on the learner's
device (``MegatronLearner._stage_hf_tensors(device=None)`` + ``sync.wire.pack_tensors``), then
queue the broadcast. A background thread (:class:`StageExporter`) broadcasts the buckets chunk by
chunk on its own stream (CUDA), so the learner's next train step overlaps it. Where the staging
lives is decided once, at the first publish, from the memory plan
(:func:`megatron_rlhf.sync.staging.plan_staging`, logged once): on the learner's device when the
plan leaves room for the whole stage there (sent straight from it), else in pinned host chunks,
copied to two device chunk buffers on the way out (double-buffered). One version is in flight at
a time, so versions go out in publish order.

The generator package never imports the learner's: the exporter reaches the model only through
the ``MegatronLearner`` it runs on (``_stage_hf_entries``, ``_stage_hf_tensors``).

Send or supersede (:func:`decide`). A broadcast cannot be withdrawn once started (gloo and NCCL
wait for every rank), so the sender thread starts a staged version only when every receiver has
asked for it: each receiver adds 1 to a counter of that version in stage 0's store, and the last
one proposes SEND. When the learner stages a newer version first, it proposes SUPERSEDED for the
waiting one (nobody asked for it: the producer will never load it, e.g. the version published
after its last batch), which is then never sent; receivers that ask for it later learn the verdict
and return at once (the driver then pushes the newer version). The first proposal wins
(``compare_set`` in one store, stage 0's, so every stage and every receiver sees the same verdict).

Receivers (:func:`worker_receive`, run inside every vLLM worker process through
``LLM.collective_rpc``, a module-level function pickled by reference: in-process and in vLLM's
multiprocess executor) receive stage after stage, bucket after bucket (the next bucket's receive
is posted before the current one is loaded), into fresh buffers (vLLM's layer-wise reload keeps
views of the tensors of a layer until all its parts arrived), and yield views of them to ONE
``reload_weights(weights_iterator=...)`` call; the caller then resets the prefix cache.

Sources: vLLM ``vllm/distributed/utils.py`` (``stateless_init_torch_distributed_process_group``)
and ``vllm/distributed/weight_transfer/packed_tensor.py`` (packed, double-buffered broadcast);
slime ``update_weight_from_distributed.py`` (one group per PP stage, source = DP 0 / TP 0 rank,
world size 1 + engine GPUs); NeMo-RL's refit (packed broadcast into vLLM workers).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Iterator

from megatron_rlhf.sync.staging import StagingPlan, plan_staging
from megatron_rlhf.sync.wire import BucketMeta, StageLayout, pack_tensors, plan_layout, unpack_bucket

__all__ = ["open_group", "checksum", "exporter_force_host_staging",
           "exporter_address", "exporter_join", "stage_version", "exporter_status", "resend_latest",
           "worker_join", "worker_receive", "refresh_tied_lm_head", "StageExporter", "shard_name", "stage_folder",
           "exporter_raw_send", "worker_raw_receive_then_reload", "decide", "await_decision",
           "decision_store", "post_abort", "closed_groups", "BroadcastGroup", "SEND", "SUPERSEDED", "NOT_JOINED", "NOTHING_LOADED"]

log = logging.getLogger(__name__)


def checksum(items: Iterable[tuple[str, object]]) -> str:
    """SHA-256 over ``name`` and the raw bytes of each ``(name, tensor)`` in order (any dtype,
    any device): what the receivers report and what a test computes from ``export_weights()``."""
    import torch

    h = hashlib.sha256()
    for name, t in items:
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


# ------------------------------------------------------------------------------------ groups
def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
               listen_socket: socket.socket | None = None):
    """A process group of ``world_size`` ranks outside ``torch.distributed``'s global state:
    ``TCPStore`` at ``host:port`` (rank 0 serves it, on ``listen_socket`` when given) + a
    ``ProcessGroupGloo`` (``backend='gloo'``) or ``ProcessGroupNCCL`` (``'nccl'``) on a
    ``PrefixStore``. Blocks until every rank joined. Call the group's own methods.

    Raises:
        RuntimeError / torch.distributed.DistStoreError: a rank did not join within ``timeout_s``.
        ValueError: unknown backend.
    """
    from torch.distributed import PrefixStore, TCPStore

    td = timedelta(seconds=float(timeout_s))
    fd = listen_socket.fileno() if listen_socket is not None else None
    store = TCPStore(host, int(port), int(world_size), is_master=rank == 0, timeout=td,
                     wait_for_workers=False, master_listen_fd=fd)
    prefixed = PrefixStore(f"mrlhf-weight-broadcast-{host}-{port}", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        group = ProcessGroupGloo(prefixed, int(rank), int(world_size), td)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = td
        group = ProcessGroupNCCL(prefixed, int(rank), int(world_size), opts)
    else:
        raise ValueError(f"open_group(backend={backend!r}): expected 'gloo' or 'nccl'")
    # the store serves on listen_socket's descriptor without owning it: keep the socket object alive
    # with the group (closing it stops the store from accepting later clients, e.g. other stages'
    # exporters and the driver's abort note)
    return BroadcastGroup(group, prefixed, int(rank), int(world_size), listen_socket)


@dataclass
class BroadcastGroup:
    """A process group of :func:`open_group` and the store it was built on (kept alive with it).

    Attributes:
        works: this member's broadcasts not yet seen completed (pruned as they complete).
        aborted: :meth:`close` was called (the group takes no further operation).
        released: the process group and its store were dropped (no pending work was left).
    """

    pg: object
    store: object
    rank: int
    world_size: int
    listen_socket: object = None
    works: list = field(default_factory=list)
    aborted: bool = False
    released: bool = False

    def broadcast(self, tensor):
        """Broadcast ``tensor`` from rank 0 (in place on the others); returns the async work.

        Raises:
            RuntimeError: the group was closed (:meth:`close`)."""
        from torch.distributed import BroadcastOptions

        if self.aborted:
            raise RuntimeError("weight broadcast: this group was aborted (a failed push); it is re-formed")
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.pg.broadcast([tensor], opts)
        self.works = [w for w in self.works if not w.is_completed()]
        self.works.append(work)
        return work

    def pending(self) -> int:
        """Broadcasts of this member still pending."""
        self.works = [w for w in self.works if not w.is_completed()]
        return len(self.works)

    def close(self, timeout_s: float) -> None:
        """Abort and destroy the group (a failed push; the groups are re-formed): ``abort()`` on
        the process group (``ProcessGroupNCCL.abort``: its communicators are aborted, pending works
        end with an error and the NCCL watchdog no longer waits for them, so
        ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` cannot tear the process down an hour later; gloo's
        ``abort`` is a no-op), then, in a background thread, wait until no work of this member is
        pending and drop the process group, the store and the listening socket. On gloo a pending
        send or receive ends with "Connection closed by peer" as soon as its peer drops its own
        group (every member does this on re-form; a dead one's sockets are closed by its OS): a
        ``ProcessGroupGloo`` dropped with work pending would block in its destructor until the
        group timeout, so it is released only once that work ended (bounded by ``timeout_s``;
        then it stays referenced here, never destroyed with work pending). Idempotent.

        Sources: torch ``ProcessGroup.abort`` / ``distributed_c10d._abort_process_group`` (torch
        2.13, NCCL-only abort); vLLM ``stateless_init_torch_distributed_process_group`` (groups
        outside the global state are dropped by reference).
        """
        if self.aborted:
            return
        self.aborted = True
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - abort is best effort; the release below still waits
            pass
        _CLOSED.append(self)
        del _CLOSED[:-32]
        threading.Thread(target=self._release, args=(float(timeout_s),), daemon=True,
                         name="mrlhf-broadcast-release").start()

    def _release(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pending():
            return   # kept referenced: never destroyed with work pending
        self.works = []
        self.pg = self.store = None
        if self.listen_socket is not None:
            try:
                self.listen_socket.close()
            except OSError:   # the store's server closed the descriptor with it
                pass
            self.listen_socket = None
        self.released = True


_CLOSED: list = []   # the groups this process closed (the last 32; tests inspect them)


def closed_groups(_=None) -> list[dict]:
    """In any process: ``{'aborted', 'released', 'pending'}`` of each group it closed (the last 32)."""
    return [{"aborted": g.aborted, "released": g.released, "pending": 0 if g.released else g.pending()}
            for g in _CLOSED]


def _close_groups(groups, timeout_s: float) -> None:
    for g in groups:
        if g is not None:
            g.close(timeout_s)


def _client_store(host: str, port: int, timeout_s: float):
    """A client of the ``TCPStore`` of the group at ``host:port``, under the group's prefix."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(host, int(port), None, False, timedelta(seconds=float(timeout_s)))
    return PrefixStore(f"mrlhf-weight-broadcast-{host}-{port}", store)


def post_abort(host: str, port: int, version: int, message: str, timeout_s: float) -> None:
    """The driver, after a push of ``version`` failed, in stage 0's group at ``host:port``:
    supersede ``version`` unless it is already on the wire (so no exporter starts sending it to
    a dead receiver), and leave the abort note: receivers waiting for a verdict or for bytes raise
    at once, and the groups take no further push until they are re-formed."""
    store = _client_store(host, port, timeout_s)
    decide(decision_store(store), version, SUPERSEDED)
    store.set(_ABORT, message[:2000])


def _bcast(group: BroadcastGroup, tensor):
    return group.broadcast(tensor)


_ABORT = "mrlhf-abort"
NOT_JOINED = "has not joined the groups"       # a restarted worker (the pool re-forms the groups)
NOTHING_LOADED = "(nothing was loaded)"        # the receive failed before reload_weights: model intact
_DECISIONS = "mrlhf-version-decisions"
SEND, SUPERSEDED = b"send", b"superseded"


def _go_key(version: int) -> str:
    return f"v{int(version)}/go"


def decision_store(store):
    """The keys of the send-or-supersede decisions (:func:`decide`) inside a group's store."""
    from torch.distributed import PrefixStore

    return PrefixStore(_DECISIONS, store)


def decide(store, version: int, verdict: bytes) -> bytes:
    """Propose ``verdict`` (:data:`SEND` or :data:`SUPERSEDED`) for ``version``; returns the
    verdict that holds: the first proposal wins (``compare_set`` on a missing key is atomic in the
    store), so every exporter and every receiver sees the same one.

    Why a decision at all: a broadcast, once started, cannot be withdrawn (gloo and NCCL wait for
    every rank), so a version may only go on the wire when every receiver has asked for it. The
    last receiver to ask proposes SEND; an exporter staging a newer version proposes SUPERSEDED
    for the one still waiting (nobody asked: the producer will never load it, e.g. the version
    published after its last batch), so that publish never waits for receivers that do not come.
    """
    return bytes(store.compare_set(_go_key(version), "", verdict))


def await_decision(store, version: int, deadline: float | None, abort=None, cancelled=None) -> bytes:
    """Poll ``store`` until a verdict on ``version`` exists; return it.

    Args:
        deadline: ``time.monotonic()`` bound (None: none).
        abort: a group store to check for the exporter's abort note (receivers).
        cancelled: returns True when the caller gives up (exporter re-forming its group).
    Raises:
        TimeoutError: no verdict by ``deadline``. RuntimeError: the exporter aborted.
    """
    key, delay = _go_key(version), 0.0002
    while not store.check([key]):
        if cancelled is not None and cancelled():
            return SUPERSEDED
        if abort is not None and abort.check([_ABORT]):
            raise RuntimeError(f"the exporter aborted the broadcast: {abort.get(_ABORT).decode()}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no send/supersede decision on weight version {version}: not every receiver "
                               "asked for it (a generator worker is missing)")
        time.sleep(delay)
        delay = min(2 * delay, 0.005)
    return bytes(store.get(key))


def _wait_receives(group: BroadcastGroup, works: list) -> None:
    """Wait for receive ``works``; every second also look for the exporter's abort note in the
    group's store (set when its broadcast failed, e.g. another receiver died), so a receiver never
    waits out the whole group timeout for bytes that will not come.

    Raises:
        RuntimeError: the exporter aborted, or the receive itself failed.
    """
    for w in works:
        t_check = time.monotonic()
        while not w.is_completed():
            time.sleep(0.0005)
            if time.monotonic() - t_check > 1.0:
                t_check = time.monotonic()
                if group.store.check([_ABORT]):
                    raise RuntimeError(f"the exporter aborted the broadcast: {group.store.get(_ABORT).decode()}")
        w.wait()


# ------------------------------------------------------------------------------------ exporter
class StageExporter:
    """The exporting rank's side of one stage: the group, the layout, the staging buffers (one per
    bucket: on the learner's device for a broadcast that fits there, else pinned host chunks) and
    the background thread that broadcasts staged versions (see the module docstring).

    Attributes:
        stage: pipeline stage.
        error: the last failed broadcast (``None`` when the group is healthy).
        sent: ``(version, buckets sent, buckets)`` of the current / last broadcast.
    """

    def __init__(self, stage: int):
        from megatron_rlhf.platform import get_platform

        self.stage = int(stage)
        self.platform = get_platform()
        self.group = None
        self.listen: socket.socket | None = None
        self.layout: StageLayout | None = None
        self.staging: list = []          # one uint8 buffer per bucket of the layout
        self.staged_on_device = False    # staging on the learner's device (else host memory)
        self.planned_bytes: float | None = None   # the memory plan's bytes of this stage's GPU (exporter_join)
        self.force_host = False          # bench: host staging with device wire buffers, also on CPU
        self.staging_plan: StagingPlan | None = None   # decided once, at the first publish
        self.version: int | None = None
        self.error: str | None = None
        self.sent = (None, 0, 0)
        self.stage0_store = None     # the store of stage 0's group (verdicts, the driver's abort note)
        self.decisions = None        # decision_store of it (one verdict for every stage)
        self._undecided: int | None = None   # queued broadcast waiting for its verdict
        self._drop: int | None = None        # give up waiting for that verdict (group re-formed)
        self._bufs: list = []            # two device wire buffers (host staging only)
        self._stream = None              # the sender's dedicated stream (CUDA)
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=f"mrlhf-broadcast-stage{stage}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- group
    def address(self) -> tuple[str, int]:
        """Bind a listening socket on this host (kept until :meth:`join`); returns ``(host, port)``."""
        import ray

        if self.listen is not None:
            self.listen.close()
        host = ray.util.get_node_ip_address()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen(128)
        self.listen = s
        return host, int(s.getsockname()[1])

    def join(self, host: str, port: int, world_size: int, timeout_s: float,
             decisions_at: tuple[str, int] | None = None) -> None:
        """(Re)form the group as rank 0 (drops a staged version nobody asked for; waits for a
        running broadcast to end first). ``decisions_at``: ``(host, port)`` of stage 0's group,
        whose store holds the send/supersede verdicts (None: this group's own, stage 0)."""
        self._drop = self._undecided
        if not self._idle.wait(timeout_s):
            raise TimeoutError(f"stage {self.stage} exporter: the previous broadcast did not end within "
                               f"async.timeout_s={timeout_s:.0f} s; cannot re-form the group")
        _close_groups([self.group], timeout_s)
        self.group = self.decisions = self.stage0_store = None
        self.group = open_group(host, port, 0, world_size, self.platform.dist_backend, timeout_s, self.listen)
        self.listen = None   # the group keeps the socket now
        if decisions_at is None or tuple(decisions_at) == (host, int(port)):
            self.stage0_store = self.group.store
        else:
            self.stage0_store = _client_store(*decisions_at, timeout_s)
        self.decisions = decision_store(self.stage0_store)
        self.error = None

    def supersede_or_wait(self, timeout_s: float) -> float:
        """Before staging a newer version: a queued broadcast that no receiver has asked for yet is
        superseded (never sent); one that is on the wire is waited for. Returns the seconds waited.

        Raises:
            TimeoutError: still sending after ``timeout_s``.
        """
        v = self._undecided
        if v is not None and self.decisions is not None:
            decide(self.decisions, v, SUPERSEDED)   # the verdict the thread then reads (ours or SEND)
        return self.wait_idle(timeout_s)

    # ---------------------------------------------------------------- staging
    def wait_idle(self, timeout_s: float) -> float:
        """Wait for the broadcast in flight; returns the seconds waited.

        Raises:
            TimeoutError: still sending after ``timeout_s``.
        """
        t0 = time.perf_counter()
        if not self._idle.wait(timeout_s):
            v, k, n = self.sent
            raise TimeoutError(f"weight broadcast of version {v}, pipeline stage {self.stage}: still sending "
                               f"(bucket {k}/{n}) after async.timeout_s={timeout_s:.0f} s; a generator worker "
                               "is not receiving")
        return time.perf_counter() - t0

    def stage_tensors(self, items: Iterator[tuple[str, object]], entries, version: int, bucket_bytes: int,
                      write_dir: str | None = None) -> StageLayout:
        """Stream this stage's ``(hf_name, tensor)`` into the staging buffers and queue their
        broadcast, or with ``write_dir`` the writing of one safetensors file per bucket into it
        (the filesystem transport). Call :meth:`wait_idle` first.

        On the first call the layout is planned from ``entries()`` (``(hf_name, dtype, shape,
        nbytes)``, metadata only) and where the staging lives is decided once
        (:meth:`_decide_staging`, one log line); ``items`` is then consumed one tensor at a time on
        every call, the first included, so no more than one gathered tensor is held beyond the
        staging. Device staging: the tensors, gathered and converted on the device, are packed there
        (:func:`~megatron_rlhf.sync.wire.pack_tensors`, a device-side copy) and broadcast straight
        from those buffers; host staging (and the filesystem transport's writes): pinned host
        buffers in power-of-two chunks (``Platform.host_buffers``). On CPU both are host memory.
        Returns once the pack has finished on the device (the next train step may change the
        parameters).

        Raises:
            RuntimeError: the group is broken (an earlier broadcast failed) or missing.
            ValueError: the tensors differ from the planned layout (names, dtypes, shapes).
        """
        if write_dir is None and self.group is None:
            raise RuntimeError(f"stage {self.stage} exporter has not joined a broadcast group "
                               "(BroadcastTransport.setup)")
        if self.error is not None:
            raise RuntimeError(f"weight broadcast of pipeline stage {self.stage} failed earlier: {self.error}")
        if self.layout is None or self.layout.chunk_bytes != bucket_bytes:
            self.layout = plan_layout(self.stage, entries() if callable(entries) else entries, bucket_bytes)
            self.staging, self.staging_plan = [], None
        if write_dir is None and self.staging_plan is None:
            self.staging_plan = self._decide_staging()
        on_device = write_dir is None and self.staging_plan.place == "device"
        if not self.staging or on_device != self.staged_on_device:
            self._allocate(on_device, wire=write_dir is None and self.staging_plan.device_bytes > 0
                           and not on_device)
        self._copy_in(iter(items))
        self.version = int(version)
        self._enqueue((int(version), write_dir))
        return self.layout

    def _decide_staging(self) -> StagingPlan:
        """Where the staging lives, once per run (:func:`~megatron_rlhf.sync.staging.plan_staging`
        from the plan's bytes given at :meth:`join` and the device's total memory); logged once."""
        if self.force_host:
            plan = plan_staging(self.layout.nbytes, self.layout.chunk_bytes, planned_bytes=None,
                                device_total_bytes=None, is_cpu=False)
        else:
            plan = plan_staging(self.layout.nbytes, self.layout.chunk_bytes, planned_bytes=self.planned_bytes,
                                device_total_bytes=self.platform.device_memory_bytes(), is_cpu=self.platform.is_cpu)
        log.warning("pipeline stage %d exporter: %s", self.stage, plan.describe())
        return plan

    def _allocate(self, on_device: bool, wire: bool) -> None:
        sizes = [b.nbytes for b in self.layout.buckets]
        self.staging, self._bufs = [], []
        if on_device:   # one device buffer, a view per bucket
            whole = self.platform.empty_bytes(self.layout.nbytes, self.platform.buffer_device())
            self.staging = [whole[b.offset:b.offset + b.nbytes] for b in self.layout.buckets]
        else:
            self.staging = self.platform.host_buffers(sizes, chunk_bytes=self.layout.chunk_bytes)
            if wire:   # the wire is on the device: two chunk buffers there
                dev = self.platform.buffer_device()
                self._bufs = [self.platform.empty_bytes(min(self.layout.chunk_bytes, max(sizes)), dev)
                              for _ in range(2)]
        self.staged_on_device = on_device

    def _copy_in(self, items: Iterator[tuple[str, object]]) -> None:
        items = iter(items)
        for b, buf in zip(self.layout.buckets, self.staging):
            pack_tensors(buf, b.tensors, items, copy=self.platform.copy_bytes)
        for name, _ in items:
            raise ValueError(f"stage {self.stage}: tensor {name} is not in the planned layout; the model changed")
        self.platform.sync_stream()   # the pack (or D2H copy) ran on this thread's stream: done before training goes on

    def resend(self) -> int:
        """Queue the staged version again (after the group was re-formed); returns its version.

        Raises:
            RuntimeError: nothing staged yet.
        """
        if self.version is None:
            raise RuntimeError(f"stage {self.stage} exporter: no staged version to resend")
        self._enqueue((self.version, None))
        return self.version

    def _enqueue(self, job: tuple[int, str | None]) -> None:
        self._idle.clear()
        if job[1] is None:
            self._undecided, self._drop = job[0], None
        self._jobs.put(job)

    # ---------------------------------------------------------------- sender thread
    def _run(self) -> None:
        while True:
            version, write_dir = self._jobs.get()
            try:
                if write_dir is None:
                    verdict = await_decision(self.decisions, version, None,
                                             cancelled=lambda: self._drop == version)
                    self._undecided = None
                    if verdict == SEND:
                        self._send(version)
                else:
                    self._write(version, write_dir)
            except BaseException as e:  # noqa: BLE001 - reported by the next publish / status
                v, k, n = self.sent
                self.error = (f"version {v}, bucket {k + 1}/{n} of pipeline stage {self.stage}: "
                              f"{type(e).__name__}: {e}")
                if write_dir is None and self.group is not None:
                    try:   # tell the other receivers at once (they poll the store)
                        self.group.store.set(_ABORT, self.error[:2000])
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                if self._jobs.empty():
                    self._idle.set()

    def _send(self, version: int) -> None:
        """Broadcast the staged version chunk by chunk on the sender's dedicated stream: straight
        from the staging buffers when they are on the wire's device (device staging; CPU), else
        through two device chunk buffers (asynchronous H2D copies from pinned memory,
        double-buffered: chunk k + 1 is copied while chunk k is on the wire). Ends with that
        stream's synchronisation, not the device's."""
        layout, group, platform = self.layout, self.group, self.platform
        platform.bind_device(self._bufs[0] if self._bufs else self.staging[0])
        if self._stream is None:
            self._stream = platform.side_stream()
        n = len(layout.buckets)
        works = [None, None]
        k = 0
        with platform.on_stream(self._stream):
            for bi, (b, staged) in enumerate(zip(layout.buckets, self.staging)):
                self.sent = (version, bi, n)
                for off, size in layout.chunks(b):
                    i = k % 2
                    if works[i] is not None:
                        self._wait_sent(works[i])     # buffer i is free again
                    src = staged[off:off + size]
                    if not self._bufs:   # staging is on the wire's device: send it in place
                        buf = src
                    else:
                        buf = self._bufs[i][:size]
                        platform.copy_bytes(buf, src)
                    works[i] = _bcast(group, buf)
                    k += 1
            for w in works:
                if w is not None:
                    self._wait_sent(w)
        platform.sync_stream(self._stream)
        self.sent = (version, n, n)

    def _wait_sent(self, work) -> None:
        """Wait for a send; every second look for the driver's abort note in stage 0's store (a
        receiver died or gave up: a send to a live peer that stopped receiving would otherwise only
        end at the group timeout). Raises RuntimeError on the note (the work ends when the group is
        aborted and its peers drop theirs, see :meth:`BroadcastGroup.close`)."""
        t_check = time.monotonic()
        while not work.is_completed():
            time.sleep(0.0005)
            if time.monotonic() - t_check > 1.0:
                t_check = time.monotonic()
                if self.stage0_store is not None and self.stage0_store.check([_ABORT]):
                    raise RuntimeError(f"the push was aborted: {self.stage0_store.get(_ABORT).decode()}")
        work.wait()

    def _write(self, version: int, folder: str) -> None:
        """Write the staged version as ``stage<S>-<k>.safetensors`` files (one per bucket) into
        ``folder/.stage<S>`` and rename that to ``folder/stage<S>`` when complete; on failure
        ``folder/stage<S>.error`` holds the message."""
        import os
        import shutil
        from pathlib import Path

        from safetensors.torch import save_file

        final = Path(folder) / f"stage{self.stage:03d}"
        tmp = Path(folder) / f".stage{self.stage:03d}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            n = len(self.layout.buckets)
            for k, b in enumerate(self.layout.buckets):
                self.sent = (version, k, n)
                tensors = dict(unpack_bucket(self.staging[k], b))
                save_file(tensors, str(tmp / shard_name(self.stage, k)), metadata={"format": "pt"})
            os.rename(tmp, final)
            self.sent = (version, n, n)
        except BaseException as e:
            (Path(folder) / f"stage{self.stage:03d}.error").write_text(f"{type(e).__name__}: {e}")
            raise


def shard_name(stage: int, bucket: int) -> str:
    """File name of bucket ``bucket`` of pipeline stage ``stage`` (filesystem transport)."""
    return f"stage{stage:03d}-{bucket:05d}.safetensors"


def stage_folder(stage: int) -> str:
    """Sub-folder a stage's shards land in once complete (filesystem transport)."""
    return f"stage{stage:03d}"


# --------------------------------------------- learner-side functions (run on each learner rank)
def _exporter(learner) -> StageExporter | None:
    """This rank's exporter (created on first use), or None on ranks that do not export."""
    if learner.tp_rank != 0 or learner.dp_rank != 0:
        return None
    ex = getattr(learner, "_mrlhf_stage_exporter", None)
    if ex is None:
        ex = learner._mrlhf_stage_exporter = StageExporter(learner.pp_rank)
    return ex


def exporter_address(learner) -> dict | None:
    """On every learner rank: the exporter's ``{'stage', 'host', 'port', 'backend'}`` (None on others)."""
    ex = _exporter(learner)
    if ex is None:
        return None
    host, port = ex.address()
    return {"stage": ex.stage, "host": host, "port": port, "backend": ex.platform.dist_backend}


def exporter_join(learner, stages: list[dict], world_size: int, timeout_s: float,
                  planned_bytes: dict[int, float] | None = None) -> None:
    """On every learner rank: exporters join their stage's group as rank 0. ``planned_bytes``:
    the memory plan's resident bytes of one learner GPU per pipeline stage (``{stage: bytes}``,
    ``megatron_rlhf.memory_plan.learner_plan_bytes``); the exporter keeps its own stage's, from
    which it decides once where its staging lives (:func:`~megatron_rlhf.sync.staging.plan_staging`;
    None or no entry: host staging on a GPU)."""
    ex = _exporter(learner)
    if ex is not None:
        ex.planned_bytes = None if planned_bytes is None else planned_bytes.get(ex.stage)
        s = stages[ex.stage]
        ex.join(s["host"], s["port"], world_size, timeout_s, (stages[0]["host"], stages[0]["port"]))


def stage_version(learner, version: int, bucket_bytes: int, timeout_s: float,
                  write_dir: str | None = None) -> dict | None:
    """On every learner rank, in its own thread (collective over each TP group): wait for the
    previous broadcast (or write), TP-gather and stage this version, queue its broadcast (or,
    with ``write_dir``, the writing of its safetensors shards there, see ``StageExporter._write``).

    Returns:
        on exporters ``{'stage', 'layout', 'wait_s', 'stage_s'}`` (seconds waiting for the previous
        push / gathering + copying); None on other ranks.
    Raises:
        TimeoutError: the previous broadcast still runs after ``timeout_s``.
        RuntimeError: the group is broken (a receiver failed earlier).
    """
    if learner.dp_rank != 0:
        return None
    ex = _exporter(learner)
    wait_s = ex.supersede_or_wait(timeout_s) if ex is not None else 0.0
    t0 = time.perf_counter()
    items = learner._stage_hf_tensors(device=None)   # gathered + converted on the learner's device
    if ex is None:
        for _ in items:   # TP ranks > 0 only join the gathers
            pass
        return None
    layout = ex.stage_tensors(items, learner._stage_hf_entries, version, bucket_bytes, write_dir)
    place = ex.staging_plan.place if write_dir is None else "host"
    return {"stage": ex.stage, "layout": layout, "wait_s": wait_s, "stage_s": time.perf_counter() - t0,
            "staging": place}


def exporter_status(learner) -> dict | None:
    """On every learner rank: the exporter's ``{'stage', 'sent', 'error', 'idle'}`` (None on others)."""
    ex = _exporter(learner)
    if ex is None:
        return None
    return {"stage": ex.stage, "sent": ex.sent, "error": ex.error, "idle": ex._idle.is_set(),
            "staging": None if ex.staging_plan is None else ex.staging_plan.place}


def exporter_force_host_staging(learner) -> bool:
    """Bench (``bench/weight_sync.py``'s host-staged row), on every learner rank before the first
    publish: exporters stage in host memory and copy each chunk into one of two device wire
    buffers before its broadcast, the GPU's host-staged path, also on CPU. Returns whether this
    rank exports."""
    ex = _exporter(learner)
    if ex is None:
        return False
    ex.force_host, ex.staging_plan = True, None
    ex.layout = None   # re-plan (and re-decide) at the next publish
    return True


def resend_latest(learner) -> int | None:
    """On every learner rank: exporters queue their staged version again (after a re-form)."""
    ex = _exporter(learner)
    return None if ex is None else ex.resend()


# --------------------------------------------------------- vLLM-side functions (collective_rpc)
def worker_join(worker, stages: list[dict], rank_offset: int, world_size: int, timeout_s: float) -> int:
    """Inside a vLLM worker process: join every stage's group as rank ``rank_offset + worker.rank``
    (stage order; replaces earlier groups). Returns the group rank.

    Raises:
        RuntimeError: the learner's backend differs from this worker's platform (a GPU learner
            with CPU engines, or the reverse).
    """
    from megatron_rlhf.platform import get_platform

    backend = get_platform().dist_backend
    rank = int(rank_offset) + int(worker.rank)
    _close_groups(getattr(worker, "_mrlhf_broadcast_groups", None) or [], timeout_s)
    worker._mrlhf_broadcast_groups = None
    groups = []
    for s in stages:
        if s["backend"] != backend:
            raise RuntimeError(f"weight broadcast: learner stage {s['stage']} uses {s['backend']}, this vLLM "
                               f"worker {backend}; learners and generators must both be on GPU or both on CPU")
        groups.append(open_group(s["host"], s["port"], rank, world_size, backend, timeout_s))
    worker._mrlhf_broadcast_groups = groups
    worker._mrlhf_broadcast_rank = rank
    worker._mrlhf_broadcast_world = (int(world_size), float(timeout_s))
    return rank


def _ask_for(groups: list, version: int, rank: int, world: int, timeout_s: float) -> bool:
    """Tell the exporters this worker is ready for ``version`` (a counter in stage 0's store; the
    last of the ``world_size - 1`` receivers proposes SEND, see :func:`decide`) and wait for the
    verdict. Returns True to receive, False when the version was superseded (nothing is sent).

    Raises:
        RuntimeError: no verdict within the group timeout (another receiver never asked), or the
            exporter aborted.
    """
    if groups[0].store.check([_ABORT]):   # a failed push left these groups for good
        raise RuntimeError(f"weight broadcast: group rank {rank}: the groups were aborted "
                           f"({groups[0].store.get(_ABORT).decode()}) {NOTHING_LOADED}")
    store = decision_store(groups[0].store)
    asked = store.add(f"v{int(version)}/ready", 1)
    if asked == world - 1:
        decide(store, version, SEND)
    elif asked > world - 1:   # a second push of one version: it is never sent twice
        if store.check([_go_key(version)]) and bytes(store.get(_go_key(version))) == SUPERSEDED:
            return False
        raise RuntimeError(f"weight broadcast: group rank {rank} asked for weight version {version} a second "
                           f"time; each version is sent once (push only versions newer than the worker's) {NOTHING_LOADED}")
    try:
        verdict = await_decision(store, version, time.monotonic() + timeout_s, abort=groups[0].store)
    except (TimeoutError, RuntimeError) as e:
        raise RuntimeError(f"weight broadcast: group rank {rank} waiting for weight version {version}: {e} "
                           f"{NOTHING_LOADED}") from e
    return verdict == SEND


def _post(group, layout: StageLayout, bucket: BucketMeta, device):
    """Post the receive of every chunk of ``bucket`` into a fresh buffer."""
    from megatron_rlhf.platform import get_platform

    buf = get_platform().empty_bytes(bucket.nbytes, device)
    return buf, [_bcast(group, buf[o:o + n]) for o, n in layout.chunks(bucket)]


def worker_receive(worker, layouts: list[StageLayout], version: int, with_checksum: bool = False) -> dict:
    """Inside a vLLM worker process: ask for ``version`` (:func:`_ask_for`); unless it was
    superseded, receive it (every stage, bucket by bucket) into one
    ``worker.reload_weights(weights_iterator=...)`` call.

    Returns:
        ``{'bytes', 'tensors', 'rank', 'checksum', 'superseded'}``: tensor bytes received, tensors,
        group rank, (``with_checksum``) :func:`checksum` of the received ``(name, tensor)`` before
        loading, and whether the exporters superseded ``version`` (then nothing was received or
        loaded: push the newer version).
    Raises:
        RuntimeError: not joined, no verdict, or a receive failed (names stage, bucket and group rank).
    """
    from megatron_rlhf.platform import get_platform

    groups = getattr(worker, "_mrlhf_broadcast_groups", None)
    if not groups or len(groups) != len(layouts):
        raise RuntimeError(f"weight broadcast: this vLLM worker {NOT_JOINED} of every pipeline stage "
                           f"(BroadcastTransport.setup; a restarted worker joins when the pool re-forms them) "
                           f"{NOTHING_LOADED}")
    rank = worker._mrlhf_broadcast_rank
    t0 = time.perf_counter()
    if not _ask_for(groups, version, rank, *worker._mrlhf_broadcast_world):
        return {"bytes": 0, "tensors": 0, "rank": rank, "checksum": None, "superseded": True}
    t_ask = time.perf_counter()
    device = get_platform().buffer_device()
    h = hashlib.sha256() if with_checksum else None
    counts = {"bytes": 0, "tensors": 0}
    waited = [0.0]

    def tensors():
        for layout, group in zip(layouts, groups):
            n = len(layout.buckets)
            pending = _post(group, layout, layout.buckets[0], device)
            for bi, b in enumerate(layout.buckets):
                buf, works = pending
                t_wait = time.perf_counter()
                try:
                    _wait_receives(group, works)
                    waited[0] += time.perf_counter() - t_wait
                except RuntimeError as e:
                    raise RuntimeError(f"weight broadcast: group rank {rank} failed to receive bucket {bi + 1}/{n} "
                                       f"of pipeline stage {layout.stage}: {e}") from e
                if bi + 1 < n:   # post the next receive before this bucket is loaded
                    pending = _post(group, layout, layout.buckets[bi + 1], device)
                for m, (name, t) in zip(b.tensors, unpack_bucket(buf, b)):
                    if h is not None:
                        h.update(name.encode())
                        h.update(buf[m.offset:m.offset + m.nbytes].cpu().numpy())
                    counts["bytes"] += m.nbytes
                    counts["tensors"] += 1
                    yield name, t

    worker.reload_weights(weights_iterator=tensors())
    t_reload = time.perf_counter()
    refresh_tied_lm_head(worker)
    t_end = time.perf_counter()
    profile = {"ask_s": t_ask - t0, "recv_wait_s": waited[0], "reload_s": t_reload - t_ask - waited[0],
               "tied_lm_head_s": t_end - t_reload}   # seconds in this worker (bench/weight_sync.py)
    return {**counts, "rank": rank, "checksum": h.hexdigest() if h is not None else None, "superseded": False,
            "profile": profile}


def refresh_tied_lm_head(worker) -> bool:
    """Inside a vLLM worker, after ``reload_weights``: redo the tied output layer's
    post-load processing. With tied embeddings vLLM's ``lm_head`` shares the embedding's
    parameter but is never reloaded itself (its HF tensor does not exist), and on CPU its
    ``process_weights_after_loading`` keeps a pre-packed GEMM copy of the weight
    (``dispatch_cpu_unquantized_gemm``): without this the logits keep using the base model's
    output layer (the weight-sync probe check sees ~0.5 nats after one step). Returns whether a
    tied ``lm_head`` was refreshed (a no-op re-dispatch on GPU)."""
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    lm = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm is None or emb is None or getattr(lm, "weight", None) is None \
            or lm.weight.data_ptr() != emb.weight.data_ptr():
        return False
    method = getattr(lm, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm)
    return True


# --------------------------------------------------- floor measurement (bench/weight_sync.py)
def exporter_raw_send(learner, timeout_s: float) -> float | None:
    """Bench floor, on every learner rank: exporters broadcast their staged buffer once more, chunk
    by chunk, synchronously (no staging, no second thread); seconds (None on other ranks)."""
    ex = _exporter(learner)
    if ex is None:
        return None
    ex.wait_idle(timeout_s)
    t0 = time.perf_counter()
    lay = ex.layout
    for b, staged in zip(lay.buckets, ex.staging):
        for off, size in lay.chunks(b):
            buf = ex._bufs[0][:size] if ex._bufs else staged[off:off + size]
            if ex._bufs:
                buf.copy_(staged[off:off + size])
            _bcast(ex.group, buf).wait()
    ex.platform.synchronize()
    return time.perf_counter() - t0


def worker_raw_receive_then_reload(worker, layouts: list[StageLayout]) -> dict:
    """Bench floor, inside a vLLM worker: receive every chunk into memory (no loading meanwhile),
    then ``reload_weights`` from that memory. Returns ``{'receive_s', 'reload_s'}``."""
    from megatron_rlhf.platform import get_platform

    groups = worker._mrlhf_broadcast_groups
    device = get_platform().buffer_device()
    t0 = time.perf_counter()
    bufs = []
    for layout, group in zip(layouts, groups):
        for b in layout.buckets:
            buf = get_platform().empty_bytes(b.nbytes, device)
            for o, n in layout.chunks(b):
                _bcast(group, buf[o:o + n]).wait()
            bufs.append((b, buf))
    t1 = time.perf_counter()
    items = [item for b, buf in bufs for item in unpack_bucket(buf, b)]
    worker.reload_weights(weights_iterator=iter(items))
    refresh_tied_lm_head(worker)
    get_platform().synchronize()
    return {"receive_s": t1 - t0, "reload_s": time.perf_counter() - t1}
