#!/usr/bin/env bash
# Start a Ray cluster inside a SLURM allocation, run train.py on it once, stop Ray, exit.
#
#   exec bash "$MRLHF_REPO/slurm/ray_cluster.sh" CONFIG [key=value ...]
#
# Called (with `exec`, so that this shell IS the batch shell that SLURM signals) by the sbatch
# scripts in slurm/, which slurm/submit.py renders from a config; you do not run it by hand.
# What it does, in order:
#   1. resolves the run folder from the config (`python -c load_config(...).run_dir`) and sends its
#      own output to <run>/logs/driver-<job>.log (appending: a requeued job keeps the first log);
#   2. exports the NCCL / torch.distributed environment (below) so every Ray worker inherits it;
#   3. pre-flight: `srun` on every node runs `$PY -c "import megatron_rlhf"` from `/` (the repo is
#      on PYTHONPATH, exported here, so a plain checkout on a shared file system works without a
#      `pip install`), then imports torch, vllm and megatron.core, and prints one line per node:
#      the python, torch (its CUDA build) and `torch.cuda.is_available()`, vllm, megatron-core and
#      the NVIDIA driver (`nvidia-smi --query-gpu=driver_version`, "no driver" without nvidia-smi);
#      a node that cannot import, or that declares GPUs (MRLHF_GPUS_PER_NODE) torch cannot see,
#      fails the job at once, by name;
#      then starts the Ray head on the first node and one Ray worker per other node, each with `srun
#      --overlap --nodes=1 --ntasks=1 -w NODE ray start --block`, declaring the node's GPUs and CPUs
#      and a role resource (`mrlhf_learner` on the first MRLHF_LEARNER_NODES nodes, `mrlhf_generator`
#      on the next MRLHF_GENERATOR_NODES nodes; both on every node when a single node does both, CPU
#      only); amount = GPUs of the node (CPUs when it has none). Actors that request
#      `resources={"mrlhf_learner": 1}` therefore land on learner nodes only, so learners and vLLM
#      engines never share a GPU. One log per node: <run>/logs/ray-<node>-<job>.log. Each `ray start`
#      runs under `python -m megatron_rlhf.runtime guard`, in a session of its own, with SIGTERM and
#      SIGINT ignored, and each srun client in a session of its own (`setsid`: srun ends its step when
#      it gets SIGTERM): a signal SLURM sends to every step of the job (`scancel --signal=TERM
#      [--full]`, `#SBATCH --signal=TERM@N` without `B:`) does not stop Ray under the checkpoint;
#   4. waits until all nodes have joined (MRLHF_RAY_JOIN_TIMEOUT_S, default 300 s), then runs
#      `MRLHF_TRAIN_CMD --config CONFIG key=value ...` (default `python train.py`) with
#      RAY_ADDRESS=<head ip>:<port>, as `cmd & wait` (a bash trap runs only after the foreground
#      command ends, so a foreground trainer would never see the signal in time);
#   5. on SIGTERM/SIGINT (SLURM's warning signal from `--signal=B:TERM@N`, or `scancel --signal=TERM
#      --batch`) forwards the signal to the trainer, which finishes or abandons its step, writes a
#      checkpoint and exits 0; then, unless MRLHF_SELF_REQUEUE=0, asks SLURM to requeue this job
#      (`scontrol requeue $SLURM_JOB_ID`: a job that exits 0 is COMPLETED and would not run again,
#      `--requeue` alone only covers node failure and preemption). The requeued job starts this
#      script again and train.py resumes from the latest complete checkpoint of the run folder;
#   6. stops the Ray steps (SIGUSR1 to their srun, forwarded to the guard, which stops Ray; SIGKILL
#      after 30 s) and exits with the trainer's exit code.
# A signal to the whole batch step (`scancel --full`) reaches the trainer directly as well: it
# checkpoints once; the log's tee ignores the signal so the trainer's output is not cut.
#
# Environment (all optional; the sbatch scripts set the MRLHF_*_NODES/GPUS ones from the config):
#   MRLHF_REPO                repo root (default: the folder above this script)
#   MRLHF_PYTHON              python with the project's dependencies (default: the first of
#                             $MRLHF_REPO/.venv-gpu/bin/python (tools/setup_gpu.sh),
#                             $MRLHF_REPO/.venv/bin/python (tools/setup_cpu.sh), python3 on PATH);
#                             `ray` is taken from the same folder
#   MRLHF_TRAIN_CMD           trainer command, word-split (default: "$MRLHF_PYTHON train.py")
#   MRLHF_LEARNER_NODES       nodes for learners (default 1)
#   MRLHF_GENERATOR_NODES     nodes for vLLM engines (default: the remaining nodes)
#   MRLHF_SHARE_NODES         1: every node runs both roles (CPU only; implied by a one-node job)
#   MRLHF_GPUS_PER_NODE       GPUs Ray declares per node (default: SLURM_GPUS_ON_NODE, else 0)
#   MRLHF_CPUS_PER_NODE       CPUs Ray declares per node (default: SLURM_CPUS_ON_NODE, else nproc)
#   MRLHF_RAY_PORT            GCS port of the head (default 6379)
#   MRLHF_RAY_HEAD_IP         head address (default: the IPv4 address of MRLHF_NET_IFNAME, else the
#                             first address of `hostname -I`); tests set 127.0.0.1
#   MRLHF_RAY_JOIN_HOST       host the other nodes' `ray start --address` reach the head at (default:
#                             MRLHF_RAY_HEAD_IP). Ray replaces a literal 127.0.0.1/localhost there by
#                             the node's external address, so the two-node test on one machine
#                             (tests/test_recipe_rehearsal.py) passes the host name, which resolves
#                             to 127.0.0.1
#   MRLHF_RAY_TMPDIR          Ray's temp dir on the head (default /tmp/ray_mrlhf_<job>)
#   MRLHF_RAY_START_ARGS      extra `ray start` arguments for every node, word-split
#   MRLHF_RAY_JOIN_TIMEOUT_S  seconds to wait for all nodes to join (default 300)
#   MRLHF_RAY_START_RETRIES   times a node's `ray start` that fails within 300 s of its start is
#                             started again (default 2; `ray start` gives up when its raylet has not
#                             registered within a fixed 30 s, which a loaded node can exceed)
#   MRLHF_NET_IFNAME          network interface for NCCL and gloo bootstrap (NCCL_SOCKET_IFNAME,
#                             GLOO_SOCKET_IFNAME); "auto" = the one holding this node's address;
#                             unset = NCCL's own choice and gloo on loopback (one node only)
#   MRLHF_DIST_TIMEOUT_S      torch.distributed collective timeout the learner should use (default 1800)
#   MRLHF_SELF_REQUEUE        1 (default): requeue this job after a SIGTERM-triggered checkpoint
# NCCL defaults exported unless already set (NCCL docs, "Environment Variables"; PyTorch
# "torch.distributed" env vars): TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (a timed-out collective aborts
# the process instead of hanging), NCCL_IB_TIMEOUT=22, NCCL_IB_RETRY_CNT=10 (long fabrics),
# NCCL_DEBUG=WARN, TORCH_NCCL_DUMP_ON_TIMEOUT=1.
set -uo pipefail

if [ $# -lt 1 ]; then echo "usage: ray_cluster.sh CONFIG [key=value ...]" >&2; exit 64; fi
CONFIG=$1; shift
OVERRIDES=("$@")

REPO=${MRLHF_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO" || { echo "ray_cluster.sh: cannot cd to MRLHF_REPO=$REPO" >&2; exit 1; }
# .venv-gpu first: tools/setup_gpu.sh makes it on a GPU cluster, where a .venv (the CPU stack) may
# sit beside it in the same checkout (review 2, N2: the recipes ran the system python3)
if [ -n "${MRLHF_PYTHON:-}" ]; then PY=$MRLHF_PYTHON
elif [ -x "$REPO/.venv-gpu/bin/python" ]; then PY=$REPO/.venv-gpu/bin/python
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3); fi
RAY_BIN=$(dirname "$PY")/ray
[ -x "$RAY_BIN" ] || RAY_BIN=$(command -v ray || echo ray)
read -r -a TRAIN_CMD <<<"${MRLHF_TRAIN_CMD:-$PY train.py}"
# A plain checkout is enough (no `pip install -e .`): this repo goes first on every process's path,
# the Ray nodes and their workers included (srun passes the environment on; issue 21 item 1)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
JOB=${SLURM_JOB_ID:-local}
RESTARTS=${SLURM_RESTART_COUNT:-0}

# 1. Run folder and logs -------------------------------------------------------------------
RUN_DIR=$("$PY" -c 'import sys
from megatron_rlhf.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).run_dir)' "$CONFIG" "${OVERRIDES[@]}") || {
  echo "ray_cluster.sh: could not load config $CONFIG ${OVERRIDES[*]} (see error above)" >&2; exit 2; }
LOG_DIR=$RUN_DIR/logs
mkdir -p "$LOG_DIR"
echo "ray_cluster.sh: job $JOB (restart $RESTARTS): logs in $LOG_DIR"
# tee ignores SIGTERM/SIGINT: a signal to the whole batch step must not cut the trainer's output
exec > >(trap '' TERM INT; exec tee -a "$LOG_DIR/driver-$JOB.log") 2>&1
echo "=== $(date -Is) job $JOB restart $RESTARTS on $(hostname -s): config $CONFIG ${OVERRIDES[*]}"

# 2. Network / NCCL environment (inherited by srun steps, hence by every Ray worker) --------
if [ "${MRLHF_NET_IFNAME:-}" = auto ]; then  # placement.network_interface: auto -> this node's address
  NODE_IP=$(hostname -I | awk '{print $1}')
  MRLHF_NET_IFNAME=$(ip -4 -o addr show | awk -v ip="$NODE_IP" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -1)
  if [ -z "$MRLHF_NET_IFNAME" ]; then
    echo "ray_cluster.sh: placement.network_interface=auto found no interface holding $NODE_IP; set it by name" >&2
    exit 2
  fi
  export MRLHF_NET_IFNAME
  echo "network interface (auto): $MRLHF_NET_IFNAME ($NODE_IP)"
fi
if [ -n "${MRLHF_NET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$MRLHF_NET_IFNAME}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$MRLHF_NET_IFNAME}
fi
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-10}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export MRLHF_DIST_TIMEOUT_S=${MRLHF_DIST_TIMEOUT_S:-1800}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}

# 3. Nodes, roles, Ray head and workers -----------------------------------------------------
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  NODES=("$(hostname -s)")
fi
NNODES=${#NODES[@]}
HEAD=${NODES[0]}
LEARNER_NODES=${MRLHF_LEARNER_NODES:-1}
if [ "$NNODES" -eq 1 ]; then GEN_DEFAULT=0; else GEN_DEFAULT=$((NNODES - LEARNER_NODES)); fi
GENERATOR_NODES=${MRLHF_GENERATOR_NODES:-$GEN_DEFAULT}
GPUS=${MRLHF_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
CPUS=${MRLHF_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
PORT=${MRLHF_RAY_PORT:-6379}
SLOTS=$GPUS; [ "$GPUS" -gt 0 ] || SLOTS=$CPUS
SHARED=${MRLHF_SHARE_NODES:-0}
[ "$NNODES" -eq 1 ] && SHARED=1
if [ "$SHARED" = 1 ]; then
  if [ "$GPUS" -gt 0 ]; then
    echo "ray_cluster.sh: learners and generators on the same GPU node(s) would share GPUs; allocate learner + generator nodes (placement.*)" >&2
    exit 2
  fi
elif [ $((LEARNER_NODES + GENERATOR_NODES)) -ne "$NNODES" ]; then
  echo "ray_cluster.sh: learner nodes ($LEARNER_NODES) + generator nodes ($GENERATOR_NODES) != allocated nodes ($NNODES); fix placement.* or --nodes" >&2
  exit 2
fi
role_resources() {  # $1 = node index -> JSON for `ray start --resources`
  if [ "$SHARED" = 1 ]; then echo "{\"mrlhf_learner\": $SLOTS, \"mrlhf_generator\": $SLOTS}"
  elif [ "$1" -lt "$LEARNER_NODES" ]; then echo "{\"mrlhf_learner\": $SLOTS}"
  else echo "{\"mrlhf_generator\": $SLOTS}"; fi
}
if [ -n "${MRLHF_RAY_HEAD_IP:-}" ]; then HEAD_IP=$MRLHF_RAY_HEAD_IP
elif [ -n "${MRLHF_NET_IFNAME:-}" ]; then
  HEAD_IP=$(ip -4 -o addr show dev "$MRLHF_NET_IFNAME" | awk '{print $4}' | cut -d/ -f1 | head -1)
else HEAD_IP=$(hostname -I | awk '{print $1}'); fi
export RAY_ADDRESS=$HEAD_IP:$PORT
JOIN_ADDRESS=${MRLHF_RAY_JOIN_HOST:-$HEAD_IP}:$PORT
read -r -a EXTRA <<<"${MRLHF_RAY_START_ARGS:-}"
GPU_STEP=(); [ "$GPUS" -gt 0 ] && GPU_STEP=(--gpus-per-node="$GPUS")
echo "nodes: ${NODES[*]} (learner nodes $LEARNER_NODES, generator nodes $GENERATOR_NODES, shared=$SHARED); $GPUS GPUs, $CPUS CPUs per node; RAY_ADDRESS=$RAY_ADDRESS"

# Pre-flight: every node imports the package with $PY from / (no help from the working
# directory), as its Ray workers will, then the GPU stack (torch, vllm, megatron.core: a node image
# without them fails here, not minutes later in a Ray actor); a node that cannot, or whose torch
# sees no GPU while the job declares some, fails the job here, by name. The imports take 10-60 s.
PREFLIGHT_PY='import os, sys
import megatron_rlhf
where = os.path.dirname(megatron_rlhf.__path__[0])
import torch
cuda = torch.cuda.is_available()
gpus = int(sys.argv[1])
if gpus > 0 and not cuda:
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU but {gpus} are declared "
             f"per node (driver: {sys.argv[2]}); see tools/setup_gpu.sh --help for the driver each pin set needs")
import vllm, megatron.core
print(f"megatron_rlhf from {where}; python {sys.executable}; torch {torch.__version__} (CUDA {torch.version.cuda}) "
      f"cuda_available={cuda}; vllm {vllm.__version__}; megatron-core {megatron.core.__version__}; driver {sys.argv[2]}")'
PREFLIGHT_SH='node=${SLURMD_NODENAME:-$(hostname -s)}
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
driver=${driver:-no driver}
if out=$(timeout 300 "$0" -W ignore -c "$2" "$1" "$driver" 2>&1)
then echo "pre-flight $node: ok, $(printf "%s" "$out" | tail -n 1)"
else echo "pre-flight $node: FAILED: $0 (PYTHONPATH=${PYTHONPATH:-}): $(printf "%s" "$out" | tail -n 1)"; fi'
PREFLIGHT=$(srun --overlap --job-name=mrlhf-preflight --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
  -w "$(IFS=,; echo "${NODES[*]}")" --chdir=/ --kill-on-bad-exit=0 bash -c "$PREFLIGHT_SH" "$PY" "$GPUS" "$PREFLIGHT_PY" 2>&1)
echo "$PREFLIGHT"
if grep -q 'FAILED' <<<"$PREFLIGHT" || [ "$(grep -c ': ok, ' <<<"$PREFLIGHT")" -ne "$NNODES" ]; then
  BAD=$(sed -n 's/^pre-flight \([^:]*\): FAILED.*/\1/p' <<<"$PREFLIGHT" | paste -sd ' ')
  echo "ray_cluster.sh: pre-flight failed on ${BAD:-some node (no answer)}: the package and torch, vllm, megatron.core must be importable there, and torch must see the node's GPUs (check MRLHF_REPO=$REPO is on the nodes' shared file system and MRLHF_PYTHON=$PY; bash tools/setup_gpu.sh makes .venv-gpu)" >&2
  exit 2
fi

SRUN_PIDS=()
# Step names (`squeue -s`, `sacct`): mrlhf-preflight, ray-head, ray-worker.
# `setsid`: the srun clients live in a session of their own, so a signal to the whole batch step
# (`scancel --full`) does not reach them (srun ends its step on SIGTERM: "forcing job termination")
setsid srun --overlap --job-name=ray-head --nodes=1 --ntasks=1 -w "$HEAD" "${GPU_STEP[@]}" --kill-on-bad-exit=0 \
     --output="$LOG_DIR/ray-$HEAD-$JOB.log" --open-mode=append \
  "$PY" -m megatron_rlhf.runtime guard --start-retries "${MRLHF_RAY_START_RETRIES:-2}" -- "$RAY_BIN" start --head --block --node-ip-address="$HEAD_IP" --port="$PORT" \
     --num-cpus="$CPUS" --num-gpus="$GPUS" --resources="$(role_resources 0)" \
     --include-dashboard=false --disable-usage-stats \
     --temp-dir="${MRLHF_RAY_TMPDIR:-/tmp/ray_mrlhf_$JOB}" "${EXTRA[@]}" &
SRUN_PIDS+=($!)
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 on the joining nodes: with it set to 0 (how this repo's tests
# keep a one-node Ray on loopback) `ray start --address` aborts ("Multi-node Ray clusters are not
# supported"); 1 is Ray's own default on Linux. The head keeps the caller's value: with 0 a
# loopback MRLHF_RAY_HEAD_IP stays 127.0.0.1 instead of being replaced by the node's external address.
for ((i = 1; i < NNODES; i++)); do
  setsid srun --overlap --job-name=ray-worker --nodes=1 --ntasks=1 -w "${NODES[$i]}" "${GPU_STEP[@]}" --kill-on-bad-exit=0 \
       --output="$LOG_DIR/ray-${NODES[$i]}-$JOB.log" --open-mode=append \
    env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 \
    "$PY" -m megatron_rlhf.runtime guard --start-retries "${MRLHF_RAY_START_RETRIES:-2}" -- "$RAY_BIN" start --block --address="$JOIN_ADDRESS" --num-cpus="$CPUS" --num-gpus="$GPUS" \
       --resources="$(role_resources "$i")" --disable-usage-stats "${EXTRA[@]}" &
  SRUN_PIDS+=($!)
done

stop_ray() {
  local pid
  # SIGUSR1, which srun forwards to the guard: it stops `ray start` (SIGTERM is ignored there)
  for pid in "${SRUN_PIDS[@]}"; do kill -USR1 "$pid" 2>/dev/null; done
  for _ in $(seq 60); do
    local alive=0
    for pid in "${SRUN_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for pid in "${SRUN_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait "${SRUN_PIDS[@]}" 2>/dev/null
  echo "=== $(date -Is) ray stopped"
}

# 4. Wait for all nodes, in one Python process (each ray.init costs seconds) ----------------
"$PY" - "$NNODES" "${MRLHF_RAY_JOIN_TIMEOUT_S:-300}" "$JOB" "${NODES[@]}" -- "${SRUN_PIDS[@]}" <<'EOF'
import os, socket, sys, time
import ray
want, timeout, job = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
sep = sys.argv.index("--")
steps = dict(zip(sys.argv[4:sep], map(int, sys.argv[sep + 1:])))   # node -> pid of its srun client
host, port = os.environ["RAY_ADDRESS"].rsplit(":", 1)


def exited(pid: int) -> bool:
    """The srun client has ended (gone, or a zombie not yet reaped by the batch shell)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except ProcessLookupError:
        return True
    except OSError:   # no /proc: trust os.kill
        return False


def check_steps() -> None:
    dead = [node for node, pid in steps.items() if exited(pid)]
    if dead:
        sys.exit(f"ray_cluster.sh: the Ray step on {', '.join(dead)} exited before the run started "
                 f"(see ray-<node>-{job}.log in the run's logs folder)")


deadline = time.time() + timeout
while True:  # the head may not listen yet: retry the connection until the deadline
    check_steps()
    try:
        # ray.init with no GCS listening blocks for minutes (its own retries), during which neither
        # a dead Ray step nor the deadline would be noticed: wait for the GCS port first
        socket.create_connection((host, int(port)), timeout=2.0).close()
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
        break
    except Exception as e:  # ConnectionError and friends while the GCS starts
        if time.time() > deadline:
            sys.exit(f"ray_cluster.sh: no Ray head at {os.environ['RAY_ADDRESS']} after {timeout:.0f} s: {e}")
        time.sleep(1.0)
while True:
    check_steps()
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        print(f"ray: {len(alive)}/{want} nodes joined; resources {ray.cluster_resources()}", flush=True)
        break
    if time.time() > deadline:
        sys.exit(f"ray_cluster.sh: only {len(alive)}/{want} Ray nodes joined after {timeout:.0f} s")
    time.sleep(1.0)
EOF
rc=$?
if [ "$rc" -ne 0 ]; then stop_ray; exit "$rc"; fi

# 5. The trainer, with the signal forwarded -------------------------------------------------
GOT_TERM=0
INTERRUPTED=0
on_signal() {
  GOT_TERM=1; INTERRUPTED=1
  echo "=== $(date -Is) ray_cluster.sh: got $1, forwarding to the trainer (pid $TRAIN_PID)"
  kill -"$1" "$TRAIN_PID" 2>/dev/null
}
export MRLHF_SLURM_JOB_ID=$JOB MRLHF_SLURM_RESTART_COUNT=$RESTARTS
"${TRAIN_CMD[@]}" --config "$CONFIG" "${OVERRIDES[@]}" &
TRAIN_PID=$!
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
while :; do
  INTERRUPTED=0
  wait "$TRAIN_PID"; rc=$?
  # `wait` returns >128 when a trapped signal interrupts it; the trainer is still running then.
  if [ "$rc" -gt 128 ] && [ "$INTERRUPTED" = 1 ]; then continue; fi
  break
done
trap - TERM INT
echo "=== $(date -Is) trainer exited with $rc"

# 6. Requeue (after a signal) and stop Ray -----------------------------------------------------
stop_ray
if [ "$GOT_TERM" = 1 ] && [ "$rc" -eq 0 ] && [ "${MRLHF_SELF_REQUEUE:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "=== $(date -Is) checkpoint written after SIGTERM: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed; resubmit to resume" >&2
fi
exit "$rc"
