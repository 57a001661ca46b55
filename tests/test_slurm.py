"""The project's sbatch script against a real one-node SLURM (slurmctld + slurmd on this machine).

Proves, with the real train.py on a tiny random Llama (tests/slurm/start_slurm.sh starts SLURM),
in one job of two legs: ``slurm/cpu-ci-1n0g.sbatch`` starts Ray inside the job; ``scancel
--signal=TERM --batch`` at step 2 reaches train.py through the batch shell's trap; the job writes
a checkpoint and exits 0; after ``scontrol requeue`` + ``scontrol update StartTime=now`` the same
job resumes from that checkpoint (step numbers continue); then a signal to every step of the job
(``scancel --full`` and the Ray head's step) is ridden out: checkpoint, exit 0, per-node logs, no
Ray process left.

When it runs (otherwise skipped with the reason): as root, with ``MRLHF_SLURM_TESTS=1`` (then
start_slurm.sh may apt-get install slurmctld slurmd slurm-client munge tini, about 10 s), or
without the variable when those packages are already installed. CI (.ci/run) sets the variable.
Ray in the job stays on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, RAY_AUTH_MODE=disabled,
head IP 127.0.0.1, free ports), as cpu-stack.md requires for tests on this machine.

Run it alone (takes 2-4 minutes on 2 cores):
    MRLHF_SLURM_TESTS=1 .venv/bin/pytest -q tests/test_slurm.py -m integration
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import checkpoint_steps, metrics_steps

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[1]
SCRIPT = "slurm/cpu-ci-1n0g.sbatch"
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE"}


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the test SLURM runs slurmctld/slurmd as root (SlurmUser=root)"
    installed = all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged", "tini"))
    if os.environ.get("MRLHF_SLURM_TESTS") != "1" and not installed:
        return "set MRLHF_SLURM_TESTS=1 (as root) to install and start a one-node SLURM for this test"
    if not installed and not shutil.which("apt-get"):
        return "SLURM packages are not installed and apt-get is unavailable"
    from megatron_rlhf.config import Config

    if "placement" not in Config.__dataclass_fields__:
        return "megatron_rlhf.config.Config has no 'placement' section yet (configs/ci_slurm.yaml needs it)"
    return None


def _join_host_reason() -> str | None:
    """Why the other Ray nodes cannot join the head on loopback here (None: they can). They join at
    the host name (MRLHF_RAY_JOIN_HOST): Ray replaces a literal 127.0.0.1 in `ray start --address`
    by the machine's external address, and the head listens on 127.0.0.1 only."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError as e:
        return f"the host name {socket.gethostname()!r} does not resolve ({e}); a multi-node Ray needs it"
    if ip != "127.0.0.1":
        return (f"the host name {socket.gethostname()!r} resolves to {ip}, not 127.0.0.1: the second Ray "
                "node would join the head over a non-loopback address")
    return None




@contextlib.contextmanager
def running_slurm(state: Path, nodes: int = 1):
    """A running SLURM on this machine (tests/slurm/start_slurm.sh) of ``nodes`` nodes, 2 CPUs each,
    stopped on exit; yields the environment for sbatch/scontrol and the jobs. Skips the test (with
    the reason) where SLURM cannot run. With ``nodes > 1`` the nodes share this host (one slurmd
    each): Ray's per-node agent ports are left to Ray (0), since two nodes cannot share a port."""
    reason = _skip_reason() or (_join_host_reason() if nodes > 1 else None)
    if reason:
        pytest.skip(reason)
    with _slurm_turn():
        yield from _running_slurm(state, nodes)


@contextlib.contextmanager
def _slurm_turn():
    """One test SLURM on the machine at a time (pytest-xdist runs two modules at once; both SLURM
    modules may install packages with apt-get and share munged): a machine-wide ``flock``."""
    import fcntl

    with open("/tmp/mrlhf_test_slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fixed_ports(n: int, low: int = 20000, high: int = 32000) -> list[int]:
    """``n`` distinct loopback ports free now, from ``[low, high)``: below Linux's ephemeral range
    (``ip_local_port_range``, 32768-60999 by default) and above Ray's worker ports (10002-19999).
    These ports are held by the module's jobs for 10+ minutes; an ephemeral one (what binding port
    0 hands out) was taken meanwhile by another process's outgoing connection in a full run
    (``ray_client_server``: "Address already in use" for the second job)."""
    import random
    import socket

    picked: list[int] = []
    for port in random.Random(os.getpid()).sample(range(low, high), high - low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == n:
            return picked
    raise RuntimeError(f"no {n} free ports in [{low}, {high})")


def _running_slurm(state: Path, nodes: int):
    ports = iter(_fixed_ports(nodes + 7))   # distinct: SLURM's and Ray's
    env = dict(os.environ, SLURM_CPUS="2", SLURM_NODES=str(nodes), SLURM_CTLD_PORT=str(next(ports)),
               SLURM_SLURMD_PORT=",".join(str(next(ports)) for _ in range(nodes)))
    res = subprocess.run(["bash", str(REPO / "tests/slurm/start_slurm.sh"), str(state)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"start_slurm.sh failed:\n{res.stdout}\n{res.stderr}"
    ray_tmp = Path(f"/tmp/mrlhf_slurm_ray_{os.getpid()}_{nodes}")   # short: Ray's socket paths have a length limit
    agent_ports = (f"--dashboard-agent-listen-port={next(ports)} --dashboard-agent-grpc-port={next(ports)}"
                   if nodes == 1 else "--dashboard-agent-listen-port=0 --dashboard-agent-grpc-port=0")
    env.update({
        "SLURM_CONF": str(state / "slurm.conf"),
        # Ray inside the job: loopback only, no token auth, its own ports and temp dir
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "MRLHF_RAY_HEAD_IP": "127.0.0.1", "MRLHF_RAY_PORT": str(next(ports)),
        "MRLHF_RAY_TMPDIR": str(ray_tmp),
        "MRLHF_RAY_START_ARGS": f"{agent_ports} --dashboard-port={next(ports)} "
                                f"--ray-client-server-port={next(ports)}",
        "MRLHF_SELF_REQUEUE": "0",   # the test requeues by hand, as the scenario does
        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
    })
    if nodes > 1:   # the other nodes join at the host name (127.0.0.1 here), see ray_cluster.sh
        env["MRLHF_RAY_JOIN_HOST"] = socket.gethostname()
    env.pop("RAY_ADDRESS", None)
    try:
        yield env
    finally:
        subprocess.run(["bash", str(REPO / "tests/slurm/stop_slurm.sh"), str(state)], env=env,
                       capture_output=True, text=True, timeout=120)
        # a job that failed (or a test that timed out) may leave its Ray head behind, outside
        # SLURM's process tracking (its own session): it would hold ports and a core for hours
        subprocess.run(["pkill", "-9", "-f", str(ray_tmp)], capture_output=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """A running one-node SLURM; yields the environment for sbatch/scontrol and the job."""
    with running_slurm(tmp_path_factory.mktemp("slurm_state")) as env:
        yield env


def _job(env, jid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _step(env, jid: str, name: str) -> str:
    """The id (JOB.STEP) of the job's running step named ``name`` (ray_cluster.sh names its steps)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", jid, "-o", "%i %j"], env=env, capture_output=True,
                         text=True, check=True).stdout
    ids = [i for i, n in (line.split(None, 1) for line in out.splitlines() if line.strip()) if n.strip() == name]
    assert len(ids) == 1, f"want one step named {name} in job {jid}, squeue -s says:\n{out}"
    return ids[0]


def _wait(env, jid: str, states: set[str], timeout_s: float, log: Path | None = None) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = _job(env, jid)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    subprocess.run(["scancel", jid], env=env)
    raise AssertionError(f"job {jid} not in {states} after {timeout_s:.0f} s: {_job(env, jid)}\n{tail}")


def _submit(env, out_dir: Path, model_dir: Path, name: str, *extra: str) -> str:
    cmd = ["sbatch", "--parsable", f"--output={out_dir}/slurm-%j.out", SCRIPT,
           f"model.source={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}",
           "tasks.0.reward=tests.plugins:char_parity", *extra]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def _ray_processes(ray_tmp: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", ray_tmp], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.timeout(1500)
def test_sbatch_term_checkpoints_exits_0_requeue_resumes_and_a_whole_step_sigterm_is_ridden_out(
        slurm_env, tiny_llama_dir, tmp_path):
    """One job, two legs (one job start less than a test per leg: each start imports the stack on the
    node, starts Ray, builds an engine and a learner).

    Leg 1: ``scancel --signal=TERM --batch`` once step 2 is logged reaches train.py through the
    batch shell's trap: checkpoint, exit 0. Leg 2: ``scontrol requeue`` + ``StartTime=now``: the
    same job resumes from that checkpoint (step numbers continue); once it has trained a step,
    ``scancel --signal=TERM --full`` (every process of the batch step: the batch shell, train.py,
    the log's tee, the srun clients) and ``scancel --signal=TERM JOB.S`` (S: the step named
    ray-head) are ridden out: the Ray step ignores it (its guard), the srun clients never see it
    (own session), train.py finishes its step and writes a checkpoint (made slow, 12 s, by the
    test hook, so a process that died of the signal would show), exit 0, no Ray process left.
    (A whole run through the sbatch script to its end is tests/test_recipe_rehearsal.py's, on 2 nodes.)"""
    env = dict(slurm_env, MRLHF_TEST_SLOW_SAVE_S="12")
    runs = tmp_path / "runs"
    runs.mkdir()
    # a tiny-model step takes about 0.2 s on an idle machine: 50 steps leave each signal time to
    # land before the run could end on its own
    num_steps = 50
    jid = _submit(env, runs, tiny_llama_dir, "preempt", f"run.num_steps={num_steps}", "checkpoint.interval=0",
                  "checkpoint.export_hf=false")
    run, log = runs / "preempt", runs / f"slurm-{jid}.out"
    driver = run / "logs" / f"driver-{jid}.log"

    deadline = time.time() + 600
    while not any(s >= 2 for s in metrics_steps(run)):
        assert time.time() < deadline, f"no step 2 after 600 s: {_job(env, jid)}"
        assert _job(env, jid).get("JobState") not in DONE_STATES, log.read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", "--batch", jid], env=env, check=True)
    info = _wait(env, jid, DONE_STATES, 300, log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log.read_text()[-3000:])
    steps_before = metrics_steps(run)
    ckpt = checkpoint_steps(run)[-1]
    assert 2 <= ckpt < num_steps, (ckpt, steps_before)
    assert steps_before[-1] == ckpt, "the checkpoint holds every logged step"
    assert "forwarding to the trainer" in driver.read_text()

    subprocess.run(["scontrol", "requeue", jid], env=env, check=True)
    time.sleep(1)
    subprocess.run(["scontrol", "update", f"jobid={jid}", "StartTime=now"], env=env, check=True)
    _wait(env, jid, {"RUNNING"} | DONE_STATES, 120, log)
    deadline = time.time() + 600
    while len(metrics_steps(run)) <= len(steps_before):
        assert time.time() < deadline, f"no step after the resume in 600 s: {_job(env, jid)}"
        assert _job(env, jid).get("JobState") not in DONE_STATES, log.read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", "--full", jid], env=env, check=True)
    subprocess.run(["scancel", "--signal=TERM", _step(env, jid, "ray-head")], env=env, check=True)
    info = _wait(env, jid, DONE_STATES, 600, log)
    leg2 = driver.read_text().split(f"job {jid} restart 1 ", 1)[-1]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, leg2[-3000:])
    assert info.get("Restarts") == "1"
    steps = metrics_steps(run)
    assert steps[:len(steps_before)] == steps_before
    assert steps[len(steps_before):] == list(range(ckpt + 1, steps[-1] + 1)) and steps[-1] < num_steps, steps
    assert checkpoint_steps(run)[-1] == steps[-1], "the ridden-out signal checkpointed the last step"
    text = log.read_text()
    assert "restart 1" in text and f"step_{ckpt}" in text, text[-3000:]
    assert "signal SIGTERM: finishing this step" in leg2, leg2[-3000:]
    ray_log = "".join(p.read_text() for p in (run / "logs").glob(f"ray-*-{jid}.log"))
    assert "SIGTERM ignored" in ray_log, ray_log[-2000:]
    assert (run / "config.yaml").is_file() and list((run / "logs").glob(f"ray-*-{jid}.log")), "one Ray log per node"
    time.sleep(3)
    assert not _ray_processes(env["MRLHF_RAY_TMPDIR"]), "Ray processes left after the job"


def _fake_slurm_bin(tmp_path: Path, nodes: str) -> Path:
    """``srun``/``scontrol`` stand-ins on ``PATH`` (no SLURM needed): ``scontrol show hostnames``
    prints ``nodes`` (space-separated); the fake srun logs its arguments to ``$FAKE_SRUN_LOG``,
    answers a ``ray start`` step (``PY -m ...``) by exiting at once, and runs any other step once
    per ``-w`` node with ``SLURMD_NODENAME`` set and, on node ``gpu-b``, without ``PYTHONPATH``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    listing = "\\n".join(nodes.split())
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "{listing}\\n"\n')
    (bin_dir / "srun").write_text(r'''#!/usr/bin/env bash
nodes=; chdir=.
while [ $# -gt 0 ]; do case $1 in -w) nodes=$2; shift 2;; --chdir=*) chdir=${1#--chdir=}; shift;;
  -*) shift;; *) break;; esac; done
echo "srun $*" >> "$FAKE_SRUN_LOG"
case $1 in *ray|*python*) [ "$2" = "-m" ] && exit 0;; esac   # a `ray start` step: exits at once
for n in ${nodes//,/ }; do
  if [ "$n" = gpu-b ]; then (cd "$chdir" && env -u PYTHONPATH SLURMD_NODENAME=$n "$@")
  else (cd "$chdir" && SLURMD_NODENAME=$n "$@"); fi
done
''')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    return bin_dir


@pytest.mark.timeout(240)
def test_ray_cluster_preflight_fails_in_seconds_naming_the_node_that_cannot_import_the_package(tmp_path):
    """Issue 21 item 1: before any Ray node starts, ``ray_cluster.sh`` runs ``$PY -c "import
    megatron_rlhf"`` from ``/`` on every node of the allocation; the node that cannot import it
    fails the job at once, by name (exit 2, no ``ray start``). ``srun``/``scontrol`` are stand-ins
    on ``PATH`` (no SLURM needed): the fake srun runs the step once per ``-w`` node with
    ``SLURMD_NODENAME`` set and, on node ``gpu-b``, without ``PYTHONPATH`` (a node where the
    checkout is not on the path). The good node's line shows the folder the package came from:
    this checkout, through the ``PYTHONPATH`` the script exports (not the working directory). The
    pre-flight imports torch, vllm and megatron.core as well (tens of seconds on 2 loaded cores)."""
    import sys

    bin_dir = _fake_slurm_bin(tmp_path, "gpu-a gpu-b")
    py = getattr(sys, "_base_executable", sys.executable)   # cannot import the project on its own
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    import site

    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_ID="77",
               MRLHF_PYTHON=py, PYTHONPATH=site.getsitepackages()[0], FAKE_SRUN_LOG=str(tmp_path / "srun.log"),
               MRLHF_GPUS_PER_NODE="0", MRLHF_CPUS_PER_NODE="2", MRLHF_SHARE_NODES="0", MRLHF_RAY_HEAD_IP="127.0.0.1")
    t0 = time.monotonic()
    res = subprocess.run(["bash", "slurm/ray_cluster.sh", "configs/ci_tiny.yaml", f"run.output_dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert f"pre-flight gpu-a: ok, megatron_rlhf from {REPO}; python {py}; torch " in text, text
    assert "cuda_available=False; vllm " in text and "megatron-core " in text, text
    assert "pre-flight gpu-b: FAILED" in text and "No module named 'megatron_rlhf'" in text, text
    assert "ray_cluster.sh: pre-flight failed on gpu-b: the package" in text, text
    assert "start" not in (tmp_path / "srun.log").read_text(), "a Ray node was started after a failed pre-flight"
    assert time.monotonic() - t0 < 180   # imports only: no `ray start`, no join timeout (300 s)


@pytest.mark.timeout(240)
def test_ray_cluster_prefers_venv_gpu_for_the_preflight_and_ray_and_preflight_prints_torch_cuda_and_driver(tmp_path):
    """Review 2, N2: after ``tools/setup_gpu.sh`` a checkout holds ``.venv-gpu`` (maybe beside a
    ``.venv``); with no ``MRLHF_PYTHON`` the job must use ``.venv-gpu/bin/python`` for the config
    load, the pre-flight and ``ray start`` (its ``ray`` beside it). A copy of the repo (symlinks) gets
    a ``.venv-gpu`` and a ``.venv`` made from this machine's venv; the fake srun answers the Ray
    steps by exiting, so the job ends (exit 1) right after the pre-flight, with no training. A fake
    ``nvidia-smi`` on PATH prints a driver version: the pre-flight line names it; declaring GPUs that
    torch (CPU build here) cannot see fails the pre-flight, naming the driver."""
    import sys

    venv = Path(sys.prefix)
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("megatron_rlhf", "configs", "slurm", "train.py", "tests"):
        (repo / name).symlink_to(REPO / name)
    (repo / ".venv").symlink_to(venv)
    gpu = repo / ".venv-gpu"                    # a venv of its own prefix on the same packages
    (gpu / "bin").mkdir(parents=True)
    shutil.copy(venv / "pyvenv.cfg", gpu / "pyvenv.cfg")
    (gpu / "lib").symlink_to(venv / "lib")
    (gpu / "bin" / "python").symlink_to(Path(os.path.realpath(sys.executable)))
    (gpu / "bin" / "ray").symlink_to(venv / "bin" / "ray")
    bin_dir = _fake_slurm_bin(tmp_path, "gpu-a")
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho 570.86.15\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "MRLHF_PYTHON")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="gpu-a", SLURM_JOB_ID="78",
               MRLHF_REPO=str(repo), FAKE_SRUN_LOG=str(tmp_path / "srun.log"), MRLHF_GPUS_PER_NODE="0",
               MRLHF_CPUS_PER_NODE="2", MRLHF_RAY_HEAD_IP="127.0.0.1", MRLHF_RAY_JOIN_TIMEOUT_S="60")
    cmd = ["bash", "slurm/ray_cluster.sh", "configs/ci_tiny.yaml", f"run.output_dir={tmp_path / 'runs'}"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    text = res.stdout + res.stderr
    want = str(gpu / "bin" / "python")
    assert f"pre-flight gpu-a: ok, megatron_rlhf from {repo}; python {want}; torch " in text, text
    assert "cuda_available=False" in text and "; driver 570.86.15" in text, text
    srun = (tmp_path / "srun.log").read_text()
    assert f"{want} -m megatron_rlhf.runtime guard" in srun and f"{gpu / 'bin' / 'ray'} start --head" in srun, srun
    assert res.returncode == 1 and "exited before the run started" in text, text   # the fake Ray step

    # GPUs declared on a 2-node job (one GPU node cannot hold both roles), none visible to torch:
    # refused by name, before vllm and megatron are imported
    two = _fake_slurm_bin(tmp_path / "two", "gpu-a gpu-c")
    shutil.copy(bin_dir / "nvidia-smi", two / "nvidia-smi")
    env.update(PATH=f"{two}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="gpu-[a,c]", MRLHF_GPUS_PER_NODE="8",
               MRLHF_SHARE_NODES="0", FAKE_SRUN_LOG=str(tmp_path / "two" / "srun.log"))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    text = res.stdout + res.stderr
    assert res.returncode == 2 and "pre-flight gpu-a: FAILED" in text and "pre-flight gpu-c: FAILED" in text, text
    assert "sees no GPU but 8 are declared per node (driver: 570.86.15)" in text, text
    assert "start" not in (tmp_path / "two" / "srun.log").read_text(), "a Ray node was started after a failed pre-flight"
