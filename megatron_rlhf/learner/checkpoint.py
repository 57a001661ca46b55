"""Learner checkpoints and HF export.

Layout of a learner checkpoint folder::

    path/policy/        megatron dist_checkpointing (torch_dist): the policy GPTModel's
                        sharded_state_dict (TE-layout names; reshardable to any TP/PP)
    path/reference/     same for the frozen reference, only when no ``reference_root`` is given
    path/reference.json with a ``reference_root`` (the trainer's ``checkpoints/`` folder):
                        ``{"version": K, "dir": "<path relative to this folder>"}``; the frozen
                        reference is then saved once per reference version K (0: the starting
                        weights; K: the policy at weight version K after a reference sync) into
                        ``<reference_root>/reference_vK/`` and shared by every step checkpoint
                        that uses it (``trainer/checkpoint.py`` keeps it while one of them is kept)
    path/critic/        same for the PPO critic (only when ``learner.critic`` is not None;
                        :mod:`megatron_rlhf.learner.critic`)
    path/policy_optimizer/  only with ``learner.distributed_optimizer``: the policy's
                        DistributedOptimizer ``sharded_state_dict`` (fp32 master weights, Adam
                        moments, param groups with the step) through ``dist_checkpointing``
    path/critic_optimizer/  the same for the critic's optimizer
    path/learner_state.pt   torch.save (rank 0): optimizer state dict (None with the distributed
                        optimizer: it is in ``policy_optimizer``), LR-scheduler state, RNG
                        states, weight_version, layout (tp, pp, dp, model_type, dtype,
                        distributed_optimizer, this rank's coordinates), and under ``critic`` the
                        critic's optimizer / LR-scheduler state (if any)
    path/learner_state.rank<r>.pt   the same for rank r > 0 of a multi-process learner (its
                        optimizer shard, or only RNG and scheduler with the distributed optimizer).

The distributed optimizer's state is saved as Megatron-LM's ``megatron/training/checkpointing.py``
does by default (``_build_sharded_state_dict_metadata``: sharding type ``dp_reshardable``, fully
parallel: each DP rank writes and reads its own bucket ranges). That format reshards over data
parallelism only: a checkpoint resumes with another ``learner.data_parallel`` (same TP and PP),
while a TP or PP change with the distributed optimizer is refused (megatron's ``fully_reshardable``
type would allow it by gathering every bucket on DP rank 0 at save time; not used here).

Every rank of a learner group calls save/load together: ``dist_checkpointing`` is collective
(each rank writes/reads its own shards).

Asynchronous saves (``checkpoint.async_save``; :class:`AsyncCheckpointWriter`): every
``dist_checkpointing.save`` gets ``async_sharded_save=True`` and returns megatron's ``AsyncRequest``
(planning, the collective metadata exchange and ``common.pt`` happen before it returns); the state
file becomes one more request (its tensors copied to host memory first). The requests go to
megatron's ``AsyncCallsQueue`` as one request (``TemporalAsyncCaller``: one ``fork``-ed writer
process, as Megatron-LM's ``megatron/training/async_utils.py`` does by default, writing them in
order: megatron's writers share one results queue per process, :func:`_write_in_order`), and
:meth:`AsyncCheckpointWriter.finalize` runs their finalize functions (``.metadata`` and
``metadata.json`` written, the shared reference renamed into place) once every rank's writers are
done. What is written is the state at the save call: on GPU megatron's ``preload_fn`` copies each
tensor to host memory before the fork; on CPU (tensors already on the host, only views are cloned
by ``FileSystemWriterAsync``) the fork's copy-on-write snapshot holds the state of the save call,
so an optimizer step right after it cannot change what is written (NeMo-RL #3312: async saves that
wrote other weights than the step's; checked by ``tests/test_learner_dist_optimizer.py``). The
persistent worker (``AsyncCallsQueue(persistent=True)``, ``spawn``) is not used: it would pass CPU
tensors through shared memory, and the writer would read the live parameters.

dist_checkpointing's torch_dist writer forks writer processes and creates a ``spawn``
multiprocessing Manager queue once per process (``filesystem_async._get_write_results_queue``);
the spawned manager re-imports ``__main__``, which is safe from pytest, a Ray worker or any script
whose main module has an ``if __name__ == "__main__":`` guard. It needs ``psutil`` (else it hangs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from megatron_rlhf.convert.hf_io import apply_umask_permissions

__all__ = ["save_learner_checkpoint", "load_learner_checkpoint", "write_hf_folder", "AsyncCheckpointWriter",
           "STATE_FILE", "REFERENCE_FILE", "state_file", "distributed_optimizer_state",
           "reference_folder_name"]

STATE_FILE = "learner_state.pt"
REFERENCE_FILE = "reference.json"
_WEIGHT_PATTERNS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json",
                    ".pt", ".pth", ".gguf")


def state_file(path: Path, rank: int) -> Path:
    """The per-rank state file of a learner checkpoint (``learner_state.pt`` for rank 0)."""
    return path / (STATE_FILE if rank == 0 else f"learner_state.rank{rank:05d}.pt")


def _rank(learner) -> int:
    groups = getattr(learner, "groups", None)
    return int(getattr(groups, "rank", 0))


#: ``metadata`` of ``DistributedOptimizer.sharded_state_dict``: Megatron-LM's default for the
#: distributed optimizer (see module doc; ``_build_sharded_state_dict_metadata`` in
#: ``megatron/training/checkpointing.py``, unchanged from core 0.16 to 0.19). Newer releases also
#: read ``dp_cp_group`` from it (added by :func:`_metadata`); 0.16 ignores the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable",
                      "chained_optim_avoid_prefix": True, "singleton_local_shards": False}
OPTIMIZER_FORMAT = "dist_checkpointing:dp_reshardable"


def _metadata(groups) -> dict:
    meta = dict(OPTIMIZER_METADATA)
    dp_cp = getattr(getattr(groups, "pg_collection", None), "dp_cp", None)
    if dp_cp is not None:
        meta["dp_cp_group"] = dp_cp
    return meta


def _distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizer(s) inside megatron's (possibly chained) optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def _prime_empty_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its (empty) Adam state, through its own
    ``load_state_dict`` with step 0, before ``sharded_state_dict(is_loading=True)``.

    Why: with torch's Adam (no Apex/TE fused Adam: CPU, or a GPU without them)
    ``DistributedOptimizer.state_dict()`` reads the step from the per-parameter state and asserts
    one exists (megatron-core 0.16.1 to 0.19 ``distrib_optimizer.py``), so a fresh optimizer
    cannot build its loading state dict; Megatron-LM never hits it because it loads into TE's
    FusedAdam, whose step lives in the param groups. ``load_state_dict`` allocates the moments with
    ``torch.empty``; they are zeroed here, so the primed state is exactly a fresh Adam state (step 0,
    zero moments) and training on after a save at step 0 is unchanged. On load the checkpoint
    overwrites it."""
    for opt in _distributed_optimizers(optimizer):
        if len(opt.optimizer.state):
            continue
        groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0}
                  for g in opt.optimizer.state_dict()["param_groups"]]
        with torch.no_grad():
            opt.load_state_dict({"optimizer": {"param_groups": groups}})
            for st in opt.optimizer.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "step":
                        v.zero_()
    _unshare_steps(optimizer)


def _save_optimizer(optimizer, model, groups, folder: Path, async_save: bool = False):
    """The distributed optimizer's sharded state (collective: every rank writes its DP shard);
    with ``async_save`` megatron's ``AsyncRequest`` (nothing written yet but ``common.pt``)."""
    from megatron.core import dist_checkpointing

    folder.mkdir(parents=True, exist_ok=True)
    meta = _metadata(groups)
    _prime_empty_state(optimizer)   # a save before the first step
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict(metadata=meta), is_loading=False,
                                           metadata=meta)
    return dist_checkpointing.save(sharded, str(folder), async_sharded_save=async_save)


def _load_optimizer(optimizer, model, groups, folder: Path) -> None:
    """Inverse of :func:`_save_optimizer` into a freshly built optimizer (after the model is
    loaded): ``sharded_state_dict(is_loading=True)`` allocates the Adam state, dist_checkpointing
    fills this rank's ranges, ``load_state_dict`` copies them into the master weights and moments."""
    from megatron.core import dist_checkpointing

    if not (folder / "metadata.json").is_file():
        raise FileNotFoundError(f"{folder}: no distributed-optimizer state (saved with "
                                "learner.distributed_optimizer=false?)")
    meta = _metadata(groups)
    _prime_empty_state(optimizer)
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict(metadata=meta), is_loading=True,
                                           metadata=meta)
    state = dist_checkpointing.load(sharded, str(folder))
    with torch.no_grad():   # fp32 params: the master weights are views of the model's leaf params
        optimizer.load_state_dict(state)
        _reapply_common_state(optimizer, state)
        _unshare_steps(optimizer)


def _unshare_steps(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor.

    Why: on the torch-Adam path ``DistributedOptimizer.load_state_dict`` puts *one* step tensor
    into every parameter's state (``s["step"] = step`` in a loop; megatron-core 0.16.1 to 0.19),
    and ``torch.optim.Adam`` increments each parameter's step in place, so after a load the shared
    step advanced once per parameter per update (bias correction wrong from the first resumed
    step). Found by this module's test: the resumed update differed by ~0.4 lr."""
    for opt in _distributed_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def _reapply_common_state(optimizer, state) -> None:
    """Load the param groups (with the Adam step) once more, after the parameter state.

    Why: with torch's Adam, ``load_parameter_state_from_dp_reshardable`` copies every per-parameter
    state entry of the *loading* optimizer back, including its ``step`` captured when the loading
    state dict was built (0 for a fresh optimizer), over the step ``load_state_dict`` just took
    from the checkpoint's param groups (megatron-core 0.16.1 to 0.19 ``distrib_optimizer.py``;
    TE's FusedAdam keeps the step in the param groups and is unaffected). Without this the resumed
    run's bias correction restarts and the next update differs. Idempotent on the TE path."""
    opts = _distributed_optimizers(optimizer)
    parts = [state] if len(getattr(optimizer, "chained_optimizers", [optimizer])) == 1 else \
        [v for _, v in sorted(state.items())]
    for opt, part in zip(opts, parts):
        opt.load_state_dict({k: v for k, v in part.items() if k in ("optimizer", "grad_scaler")})


def distributed_optimizer_state(optimizer, model) -> dict[str, dict]:
    """This rank's distributed-optimizer state by parameter name of ``model`` (for checks:
    ``bench/gpu_check.py``, tests).

    Returns:
        ``{name: {"start": int, "param": Tensor, "exp_avg": Tensor, "exp_avg_sq": Tensor}}``:
        flat fp32 copies of the elements ``[start, start + n)`` of the flattened parameter that
        this DP rank owns (fp32 master weight and Adam moments); parameters this rank owns no part
        of are absent. Source: megatron-core ``DistributedOptimizer._get_model_param_range_map``
        and ``_get_main_param_and_optimizer_states`` (0.16 to 0.19).
    Raises:
        ValueError: ``optimizer`` holds no DistributedOptimizer.
    """
    opts = _distributed_optimizers(optimizer)
    if not opts:
        raise ValueError("distributed_optimizer_state: not a distributed optimizer "
                         "(learner.distributed_optimizer=false)")
    out = {}
    for name, p in model.named_parameters():
        opt = next((o for o in opts if p in o.model_param_gbuf_map), None)
        if opt is None:
            continue
        st = opt._get_main_param_and_optimizer_states(p)
        out[name] = {"start": opt._get_model_param_range_map(p)["param"].start,
                     **{k: st[k].detach().float().clone().flatten().cpu()
                        for k in ("param", "exp_avg", "exp_avg_sq")}}
    return out


def _coords(learner) -> dict:
    return {"tp_rank": int(getattr(learner, "tp_rank", 0)), "pp_rank": int(getattr(learner, "pp_rank", 0)),
            "dp_rank": int(getattr(learner, "dp_rank", 0))}


def _source_rank(learner, layout: dict) -> int:
    """The checkpoint rank whose state file (RNG, scheduler) this rank restores: the same rank
    when the layout is unchanged; after a data-parallel change the rank with this rank's TP/PP
    coordinates and DP rank ``min(dp_rank, old_dp - 1)`` (megatron's rank order tp-cp-ep-dp-pp)."""
    g = learner.groups
    if layout["dp"] == g.dp:
        return _rank(learner)
    c = _coords(learner)
    dp = min(c["dp_rank"], layout["dp"] - 1)
    return c["tp_rank"] + g.tp * (dp + layout["dp"] * c["pp_rank"])


def _check_layout(learner, layout: dict, path: Path) -> None:
    """Refuse a checkpoint this learner cannot resume from (see module doc)."""
    g, dist_opt = learner.groups, bool(getattr(learner, "use_distributed_optimizer", False))
    mine = {"tp": g.tp, "pp": g.pp, "model_type": learner.hf_config.model_type}
    saved_dist = layout.get("optimizer_format") == OPTIMIZER_FORMAT
    if any(layout.get(k) != v for k, v in mine.items()):
        raise ValueError(f"{path}: checkpoint layout {layout} does not match the learner "
                         f"{dict(mine, dp=g.dp)} (the optimizer state resumes only with the same "
                         "learner.tensor_parallel and learner.pipeline_parallel)")
    if saved_dist != dist_opt:
        raise ValueError(f"{path}: checkpoint saved with learner.distributed_optimizer={saved_dist}, "
                         f"this learner has {dist_opt}; resume with the same setting")
    if layout.get("dp") != g.dp and not dist_opt:
        raise ValueError(f"{path}: checkpoint has learner.data_parallel={layout.get('dp')}, this learner "
                         f"{g.dp}; a data-parallel change needs learner.distributed_optimizer=true "
                         "(megatron's dp_reshardable optimizer format)")


def _save_model(model, folder: Path, async_save: bool = False):
    """``model``'s sharded state dict into ``folder``; with ``async_save`` the ``AsyncRequest``."""
    from megatron.core import dist_checkpointing

    folder.mkdir(parents=True, exist_ok=True)
    return dist_checkpointing.save(model.sharded_state_dict(), str(folder), async_sharded_save=async_save)


def _load_model(model, folder: Path) -> None:
    from megatron.core import dist_checkpointing

    if not (folder / "metadata.json").is_file():
        raise FileNotFoundError(f"{folder}: not a megatron dist checkpoint (no metadata.json)")
    state = dist_checkpointing.load(model.sharded_state_dict(), str(folder))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{folder}: checkpoint does not match the model: missing {missing[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}")


def reference_folder_name(version: int) -> str:
    """The shared folder of the frozen reference of reference version ``version``."""
    return f"reference_v{int(version):08d}"


def _barrier(learner) -> None:
    if learner.groups.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _save_shared_reference(learner, root: Path, requests: list | None = None) -> Path:
    """Save the frozen reference into ``root/reference_vK`` unless an earlier checkpoint of the
    run already did (K = ``learner.reference_version``). Atomic: written to ``root/.tmp-reference_vK``
    (all ranks, collective), then renamed by rank 0. Returns the folder. With ``requests`` (an
    async save) the write's ``AsyncRequest`` is appended to it and the rename is its last finalize
    function (after megatron's, which write the metadata and end with a barrier)."""
    final = root / reference_folder_name(getattr(learner, "reference_version", 0))
    if (final / "metadata.json").is_file():
        return final
    tmp = root / f".tmp-{final.name}"
    if _rank(learner) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(learner)
    request = _save_model(learner.reference, tmp, async_save=requests is not None)

    def publish() -> None:
        if _rank(learner) == 0:
            os.rename(tmp, final)
        _barrier(learner)

    if requests is not None:
        request.add_finalize_fn(publish)
        requests.append(request)
        return final
    _barrier(learner)
    publish()
    return final


def _critic(learner):
    """The learner's PPO critic, or None (attribute ``critic``; absent on older learners)."""
    return getattr(learner, "critic", None)


def _load_state(learner, path: Path) -> dict:
    """The state file this rank restores: its own, or after a data-parallel change the one of
    :func:`_source_rank` (the saving layout is read from this rank's file, else rank 0's)."""
    def read(rank: int) -> dict:
        sfile = state_file(path, rank)
        if not sfile.is_file():
            raise FileNotFoundError(f"{path}: no {sfile.name}; not a learner checkpoint (or one "
                                    "written by a learner with fewer ranks)")
        return torch.load(sfile, map_location="cpu", weights_only=False)

    own = state_file(path, _rank(learner))
    state = read(_rank(learner) if own.is_file() else 0)
    src = _source_rank(learner, state["layout"])
    return state if src == _rank(learner) and own.is_file() else read(src)


def save_learner_checkpoint(learner, path: Path, reference_root: Path | None = None,
                            async_save: bool = False) -> list:
    """Write ``learner``'s models (and critic, if any), optimizer, scheduler, RNG and version
    under ``path`` (see module doc). ``path`` may exist; it should be empty (the caller makes the
    save atomic). With ``reference_root`` the frozen reference goes to the shared
    ``reference_root/reference_vK`` (written only when absent) and ``path/reference.json`` points
    at it; without, to ``path/reference``.

    Returns:
        ``[]`` (everything is written), or with ``async_save`` megatron's ``AsyncRequest`` list
        to schedule (:class:`AsyncCheckpointWriter`): until they are finalized ``path`` holds
        only ``common.pt`` files and ``reference.json``. The state at this call is what they
        write (module doc).
    """
    critic = _critic(learner)
    dist_opt = bool(getattr(learner, "use_distributed_optimizer", False))
    requests: list = []
    path.mkdir(parents=True, exist_ok=True)
    requests.append(_save_model(learner.policy, path / "policy", async_save))
    if reference_root is None:
        requests.append(_save_model(learner.reference, path / "reference", async_save))
    else:
        ref = _save_shared_reference(learner, Path(reference_root), requests if async_save else None)
        if _rank(learner) == 0:
            import json

            (path / REFERENCE_FILE).write_text(json.dumps(
                {"version": int(getattr(learner, "reference_version", 0)),
                 "dir": os.path.relpath(ref, path)}))
    if critic is not None:
        requests.append(_save_model(critic.model, path / "critic", async_save))
    if dist_opt:
        requests.append(_save_optimizer(learner.optimizer, learner.policy, learner.groups,
                                        path / "policy_optimizer", async_save))
        if critic is not None:
            requests.append(_save_optimizer(critic.optimizer, critic.model, learner.groups,
                                            path / "critic_optimizer", async_save))
    state = {"weight_version": learner.weight_version,
             "reference_version": int(getattr(learner, "reference_version", 0)),
             "optimizer": None if dist_opt else learner.optimizer.state_dict(),
             "scheduler": learner.scheduler.state_dict(),
             "rng": learner._rng_state(),
             "layout": {"tp": learner.groups.tp, "pp": learner.groups.pp, "dp": learner.groups.dp,
                        "model_type": learner.hf_config.model_type, "dtype": str(learner.dtype),
                        # base HF folder (config, tokenizer) for tools/convert/megatron_to_hf.py
                        "model_dir": os.path.abspath(learner.model_dir),
                        "optimizer_format": OPTIMIZER_FORMAT if dist_opt else "torch",
                        "coords": _coords(learner)}}
    if critic is not None:
        state["critic"] = critic.state_for_checkpoint()
    if async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        # a host copy now (the optimizer state without the distributed optimizer is live tensors)
        requests.append(AsyncRequest(torch.save, (_host_copy(state), state_file(path, _rank(learner))), []))
        return [r for r in requests if r is not None]
    torch.save(state, state_file(path, _rank(learner)))
    _barrier(learner)  # every rank's files exist before any rank returns
    return []


def _host_copy(obj):
    """``obj`` with every tensor replaced by a host-memory copy (dicts, lists, tuples walked)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a namedtuple
        return type(obj)(*(_host_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


def _noop() -> None:
    """The writer of a request with nothing to write on this rank."""


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """In a forked writer: make it lead a process group of its own and fork a watchdog into it
    that kills the whole group (the writer and megatron's write workers, which the writer forks in
    ``write_preloaded_data_multiproc``) once ``parent_pid`` (the learner) or the writer is gone.

    Why: after ``kill -9`` of a run during an async save (session 8, the exact-resume test) Ray
    killed the learner and its direct child, the writer, but a write worker was left for ever,
    blocked on a futex (its queue's reader was gone) holding 400 MB. The watchdog is a child of
    the writer, which Ray does not track, so it outlives both and cleans up."""
    import signal

    os.setpgid(0, 0)
    writer = os.getpid()
    if os.fork() != 0:
        return
    try:   # the watchdog: nothing but polling
        while True:
            time.sleep(poll_s)
            if os.getppid() != writer or not os.path.exists(f"/proc/{parent_pid}"):
                os.killpg(writer, signal.SIGKILL)   # the writer's group: writer, workers, this one
    finally:
        os._exit(0)


def _write_in_order(writers: list, times, delay_s: float, parent_pid: int) -> None:
    """Run in the one forked writer process of a checkpoint: each ``(fn, args, kwargs)`` of
    ``writers`` in turn, its start and end (Unix seconds) in the shared array ``times[2i],
    times[2i+1]``; ``delay_s`` (tests only, :func:`megatron_rlhf.utils.faults.slow_writer_s`)
    of sleep at the start of the first write (counted in its time).

    In order, never side by side: megatron's torch_dist writers of one process all put their
    results into one process-wide queue (``filesystem_async._get_write_results_queue``), and each
    finalize takes the next result from it, so two writers finishing out of order would give a
    folder the other folder's write results (its metadata then lacks its own tensors:
    ``KeyError: MetadataIndex`` on load, seen in session 7). The process ends when
    ``parent_pid`` (the learner) is gone (:func:`_exit_with_parent`)."""
    _exit_with_parent(parent_pid)
    for i, (fn, args, kwargs) in enumerate(writers):
        times[2 * i] = time.time()
        if i == 0 and delay_s > 0:
            time.sleep(delay_s)
        fn(*args, **kwargs)
        times[2 * i + 1] = time.time()


class AsyncCheckpointWriter:
    """One learner rank's asynchronous checkpoint writes (megatron-core ``AsyncCallsQueue``).

    :meth:`schedule` forks one writer for one checkpoint's ``AsyncRequest`` list (written in
    order, as one request to megatron) and returns at once; :meth:`finalize` (collective: every
    rank calls it) checks whether every rank's writers are done and, if so (or always with ``blocking``), runs megatron's finalize functions. At most one
    checkpoint is in flight: :meth:`schedule` first finalizes the previous one. Source: Megatron-LM
    ``megatron/training/async_utils.py`` (``schedule_async_save``, ``maybe_finalize_async_save``)
    and ``training.py`` (non-blocking finalize every iteration, blocking before the next save and
    at the end).
    """

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.path: str | None = None
        self._times = None
        self._scheduled_at = 0.0

    @property
    def pending(self) -> str | None:
        """The folder of the checkpoint being written, or None."""
        return self.path

    def schedule(self, path: str, requests: list) -> None:
        """Start writing ``requests`` (:func:`save_learner_checkpoint` with ``async_save``) of the
        checkpoint folder ``path``: one forked process writes them in order (:func:`_write_in_order`
        says why not side by side); a pending checkpoint is finalized first."""
        import multiprocessing as mp

        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        from megatron_rlhf.utils.faults import slow_writer_s

        self.finalize(blocking=True)
        self._times = mp.get_context("fork").Array("d", 2 * len(requests), lock=False)
        self._scheduled_at = time.time()
        writers, finalize_fns = [], []
        for r in requests:
            finalize_fns.extend(r.finalize_fns)
            if r.async_fn is None:   # nothing to write on this rank (e.g. a replica)
                writers.append((_noop, (), {}))
                continue
            args = list(r.async_fn_args)
            if r.preload_fn is not None:   # megatron's host staging, as TemporalAsyncCaller does it
                args[1] = r.preload_fn()
            writers.append((r.async_fn, tuple(args), dict(r.async_fn_kwargs)))
        self.queue.schedule_async_request(AsyncRequest(
            partial(_write_in_order, writers, self._times, slow_writer_s(), os.getpid()), (), finalize_fns))
        self.path = path

    def finalize(self, blocking: bool = True) -> dict | None:
        """Finish the pending checkpoint if its writers are done on every rank (collective).

        Args:
            blocking: wait for the writers (else return at once when one is still writing).
        Returns:
            None when nothing was pending; ``{"done": False, "path"}`` while writing; else
            ``{"done": True, "path", "write_s", "write_start", "write_end"}``: the writers'
            seconds from the first start to the last end on this rank, and those Unix times.
        Raises:
            megatron's ``CheckpointingException``: a writer failed (on every rank).
        """
        if self.path is None:
            return None
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        if self.queue.get_num_unfinalized_calls():
            return {"done": False, "path": self.path}
        t, path = list(self._times), self.path
        self.path = None
        if any(a > 0 and b == 0 for a, b in zip(t[0::2], t[1::2])):
            raise RuntimeError(f"the asynchronous checkpoint writer of {path} exited before it "
                               "finished (killed, or it raised: see the learner's log)")
        starts = [x for x in t[0::2] if x > 0] or [self._scheduled_at]
        ends = [x for x in t[1::2] if x > 0] or [time.time()]
        self._times = None
        return {"done": True, "path": path, "write_start": min(starts), "write_end": max(ends),
                "write_s": max(ends) - min(starts)}

    def close(self) -> None:
        """Wait for a pending checkpoint's writers and finalize it (idempotent)."""
        if self.path is not None:
            self.finalize(blocking=True)


def reference_path(path: Path) -> Path:
    """The frozen reference's folder of the learner checkpoint ``path``: the shared folder named in
    ``path/reference.json``, else ``path/reference``.

    Raises:
        FileNotFoundError: ``reference.json`` names a folder that is not a complete dist checkpoint.
    """
    import json

    marker = path / REFERENCE_FILE
    if not marker.is_file():
        return path / "reference"
    ref = (path / json.loads(marker.read_text())["dir"]).resolve()
    if not (ref / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: its reference {ref} (from {marker.name}) is missing or "
                                "incomplete; the checkpoint folder was copied without it?")
    return ref


def load_learner_checkpoint(learner, path: Path) -> int:
    """Restore what :func:`save_learner_checkpoint` wrote into ``learner``; returns the weight
    version.

    Raises:
        FileNotFoundError: ``path/learner_state.pt`` or a model folder (or the shared reference
            folder it names) is missing.
        ValueError: the checkpoint's TP/PP or model type differs from the learner's, its DP
            differs without the distributed optimizer (the one format that reshards over DP),
            ``learner.distributed_optimizer`` differs from the saving run's, or the learner has a
            critic (algorithm.loss=ppo) and the checkpoint has none.
    """
    state = _load_state(learner, path)
    layout = state["layout"]
    _check_layout(learner, layout, path)
    dist_opt = layout.get("optimizer_format") == OPTIMIZER_FORMAT
    critic = _critic(learner)
    if critic is not None and ("critic" not in state or not (path / "critic" / "metadata.json").is_file()):
        raise ValueError(f"{path}: checkpoint has no PPO critic (saved by a learner without one, "
                         "e.g. algorithm.loss != ppo) but this learner has a critic; resume a ppo "
                         "run from a ppo checkpoint, or start it from the HF weights instead")
    _load_model(learner.policy, path / "policy")
    _load_model(learner.reference, reference_path(path))
    if hasattr(learner, "reference_version"):
        learner.reference_version = int(state.get("reference_version", 0))
    if critic is not None:
        _load_model(critic.model, path / "critic")
        critic.load(state["critic"])   # scheduler (and optimizer without the distributed one)
        if dist_opt:
            _load_optimizer(critic.optimizer, critic.model, learner.groups, path / "critic_optimizer")
    if dist_opt:
        _load_optimizer(learner.optimizer, learner.policy, learner.groups, path / "policy_optimizer")
    else:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner._set_rng_state(state["rng"])
    return int(state["weight_version"])


def write_hf_folder(hf_tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike,
                    base_model_dir: str | os.PathLike, max_shard_size: str = "5GB") -> None:
    """Write an HF model folder: ``hf_tensors`` as safetensors (sharded with an index by
    ``huggingface_hub.split_torch_state_dict_into_shards`` when above ``max_shard_size``) plus all
    non-weight files of ``base_model_dir`` (config.json, tokenizer files, chat template,
    generation_config.json). Atomic: written to a temporary sibling, then renamed.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    out, base = Path(out_dir), Path(base_model_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export_hf: {out} exists and is not empty; pass a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in base.iterdir():
            if f.is_file() and not f.name.startswith(".") and not f.name.endswith(_WEIGHT_PATTERNS):
                shutil.copy2(f, tmp / f.name)
        split = split_torch_state_dict_into_shards(hf_tensors, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: hf_tensors[n] for n in names}, str(tmp / filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            import json

            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if out.exists():
            out.rmdir()
        apply_umask_permissions(tmp)  # mkdtemp makes it 0700, safetensors files 0600
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
