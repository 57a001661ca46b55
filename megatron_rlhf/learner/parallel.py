"""torch.distributed + megatron parallel_state for a learner process, refcounted.

torch.distributed and megatron's ``parallel_state`` are process-global; several learners may
live in one process (tests build a second learner to load a checkpoint). :func:`acquire` sets up
the process group and the TP x PP x DP model-parallel groups on first use and returns a
:class:`ParallelGroups` handle carrying the groups explicitly (a megatron
``ProcessGroupCollection``); :func:`release` tears them down when the last handle is released,
and only if this module created them.
"""

from __future__ import annotations

import math
import socket
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelGroups", "acquire", "release", "free_port", "gather_dp", "collective_timeout",
           "DIST_TIMEOUT_ENV"]

DIST_TIMEOUT_ENV = "MRLHF_DIST_TIMEOUT_S"
"""Environment variable with the collective timeout in seconds (``slurm/ray_cluster.sh`` exports
``placement.dist_timeout_s`` under this name; Ray workers inherit it)."""

_LOCK = threading.Lock()
_STATE: dict = {"refs": 0, "owns_pg": False, "owns_mp": False, "groups": None}


@dataclass(frozen=True)
class ParallelGroups:
    """The parallel layout of this process and its groups.

    Attributes:
        tp, pp, dp: tensor / pipeline / data parallel sizes (``tp * pp * dp == world_size``).
        rank, world_size: global rank and size of the default process group.
        pg_collection: megatron ``ProcessGroupCollection`` (``.tp``, ``.pp``, ``.dp``, ...),
            passed to GPTModel, DDP and the optimizer instead of reading globals.
        backend: ``gloo`` or ``nccl``.
    """

    tp: int
    pp: int
    dp: int
    rank: int
    world_size: int
    pg_collection: Any
    backend: str

    @property
    def is_first_stage(self) -> bool:
        return self.pg_collection.pp.rank() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pg_collection.pp.rank() == self.pp - 1


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released; a race is possible but unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout():
    """The timeout of every process group of a learner: ``$MRLHF_DIST_TIMEOUT_S`` seconds, else
    1800 s (torch's gloo default; NCCL's default is 600 s). A collective that waits longer (a
    dead or hung rank) raises instead of hanging the run.

    Returns:
        ``datetime.timedelta``.
    Raises:
        ValueError: the variable is not a number of seconds >= 1.
    """
    import datetime
    import os

    raw = os.environ.get(DIST_TIMEOUT_ENV, "1800")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds >= 1:
        raise ValueError(f"{DIST_TIMEOUT_ENV}={raw!r}: expected seconds >= 1 "
                         "(placement.dist_timeout_s)")
    return datetime.timedelta(seconds=seconds)


def acquire(*, backend: str, tp: int = 1, pp: int = 1, rank: int = 0, world_size: int = 1,
            init_method: str | None = None) -> ParallelGroups:
    """Initialise (first call) or reuse (later calls) the process group and megatron groups.

    Args:
        backend: ``gloo`` (CPU) or ``nccl`` (GPU).
        tp, pp: tensor / pipeline parallel sizes; ``dp = world_size // (tp * pp)``.
        rank, world_size: this process in the learner group (1 process for now).
        init_method: e.g. ``tcp://127.0.0.1:PORT``; default a free loopback port (world 1 only).

    Every group gets :func:`collective_timeout`: the default group through
    ``init_process_group(timeout=...)``, megatron's TP/PP/DP/... groups (and their gloo twins)
    through ``initialize_model_parallel(distributed_timeout_minutes=...)`` (whole minutes,
    rounded up: megatron's unit).
    Returns:
        a :class:`ParallelGroups` handle; call :func:`release` once per :func:`acquire`.
    Raises:
        ValueError: ``world_size`` is not a multiple of ``tp * pp``, or groups already exist with
            a different layout.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not a multiple of tp*pp={tp * pp} "
                         "(learner.tensor_parallel * learner.pipeline_parallel)")
    timeout = collective_timeout()
    with _LOCK:
        if not dist.is_initialized():
            if init_method is None:
                if world_size != 1:
                    raise ValueError("acquire: init_method is required when world_size > 1")
                init_method = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timeout)
            _STATE["owns_pg"] = True
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                distributed_timeout_minutes=max(1, math.ceil(timeout.total_seconds() / 60)))
            _STATE["owns_mp"] = True
        elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise ValueError(f"megatron parallel_state already initialised with TP="
                             f"{ps.get_tensor_model_parallel_world_size()} PP="
                             f"{ps.get_pipeline_model_parallel_world_size()}, requested TP={tp} PP={pp}")
        _STATE["refs"] += 1
        if _STATE["groups"] is None:
            _STATE["groups"] = ParallelGroups(
                tp=tp, pp=pp, dp=dist.get_world_size() // (tp * pp), rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(), backend=backend)
        return _STATE["groups"]


def release() -> None:
    """Drop one reference; the last one destroys what :func:`acquire` created (megatron groups,
    then the default process group). Extra calls are no-ops."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with _LOCK:
        if _STATE["refs"] == 0:
            return
        _STATE["refs"] -= 1
        if _STATE["refs"]:
            return
        if _STATE["owns_mp"]:
            ps.destroy_model_parallel()
        if _STATE["owns_pg"] and dist.is_initialized():
            dist.destroy_process_group()
        _STATE.update(owns_pg=False, owns_mp=False, groups=None)


def gather_dp(groups, obj) -> list:
    """``obj`` of every data-parallel rank of this (TP rank, PP stage), in DP rank order
    (``all_gather_object`` over the DP group; ``[obj]`` without DP). Collective over the DP group.

    Args:
        groups: the ``acquire`` result of this rank (``dp``, ``pg_collection.dp``).
        obj: any picklable object.
    """
    if groups.dp == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * groups.dp
    dist.all_gather_object(out, obj, group=groups.pg_collection.dp)
    return out
