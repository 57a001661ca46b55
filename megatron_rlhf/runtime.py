"""Process environment for every process of a run (driver, Ray actors, tests).

Nothing here runs at import: callers apply it explicitly (``apply_process_env()``), and the
same mapping goes to Ray actors through ``runtime_env={"env_vars": process_env()}``.
"""

from __future__ import annotations

import os

__all__ = ["process_env", "apply_process_env", "pin_to_core"]


def process_env(tmp_dir: str | None = None) -> dict[str, str]:
    """Environment variables every process of a CPU/GPU run needs.

    * Ray on loopback only, no token auth, no usage stats (cpu-stack.md, Ray traps).
    * gloo on loopback; one OpenMP thread per process unless the caller set one.
    * vLLM in-process engine (2-5 s start instead of ~20 s), no hub access.
    * ``tmp_dir``: where vLLM puts its sockets and caches (tests pass a temp folder).
    """
    env = {
        # loopback-only Ray for local runs; a multi-node job (ray_cluster.sh) sets its own values
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        # loopback unless a job named the interface (ray_cluster.sh from placement.network_interface)
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("MRLHF_NET_IFNAME") or "lo",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "VLLM_CONFIGURE_LOGGING": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": os.environ.get(
            "PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning,ignore::UserWarning"),
    }
    if os.environ.get("MRLHF_DIST_TIMEOUT_S"):   # collective timeout of every learner process group
        env["MRLHF_DIST_TIMEOUT_S"] = os.environ["MRLHF_DIST_TIMEOUT_S"]
    if tmp_dir:
        env.update({"TMPDIR": tmp_dir, "VLLM_RPC_BASE_PATH": tmp_dir,
                    "VLLM_CACHE_ROOT": os.path.join(tmp_dir, "vllm_cache")})
    return env


def apply_process_env(tmp_dir: str | None = None) -> dict[str, str]:
    """Set :func:`process_env` in ``os.environ`` (existing values of the vLLM/TMP keys win)."""
    env = process_env(tmp_dir)
    for k, v in env.items():
        if k in ("TMPDIR", "VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT") and k in os.environ:
            env[k] = os.environ[k]
            continue
        os.environ[k] = v
    return env


def pin_to_core(core: int) -> None:
    """Pin this process to CPU ``core`` (modulo the cores available) and use one torch thread.

    No-op when ``core < 0`` or the OS has no affinity API. Used on CPU so that generator and
    learner each own one core and their overlap is real and measurable.
    """
    if core < 0 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    target = {cores[core % len(cores)]}
    # sched_setaffinity(0) binds only the calling thread: bind every existing thread of the
    # process too (Ray's and gRPC's threads started before this call); later threads inherit it.
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), target)
        except OSError:  # a thread that exited meanwhile
            pass
    import torch

    torch.set_num_threads(1)
