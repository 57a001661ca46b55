#!/usr/bin/env bash
# Start a SLURM cluster on this machine (munged + slurmctld + one slurmd per node) as root, without
# systemd, for the project's SLURM integration tests (tests/test_slurm.py, one node;
# tests/test_recipe_rehearsal.py, two nodes). Modelled on the verified probe in
# ../shared/notes/probes/slurm/ (see cpu-stack.md "A real one-node SLURM").
#
# Usage:  bash tests/slurm/start_slurm.sh STATE_DIR
# Env:    SLURM_CPUS (per node; default: nproc), SLURM_MEM_MB (per node; default 16000),
#         SLURM_CTLD_PORT (6817), SLURM_SLURMD_PORT (6818; with several nodes a comma-separated
#         port per node, missing ones count up from the last), SLURM_NO_INSTALL=1 (fail instead of
#         apt-get installing), SLURM_NODES (default 1).
# Nodes:  SLURM_NODES=1: one node named `hostname -s`. SLURM_NODES=N>1: nodes <host>-1 .. <host>-N,
#         all on this host (NodeHostname = this host, NodeAddr 127.0.0.1, a slurmd port each), one
#         `slurmd -N <node>` each: a real N-node allocation (SLURM_JOB_NODELIST, `srun -w NODE`)
#         whose nodes share this machine's CPUs. Debian's slurmd is not built with
#         --enable-multiple-slurmd, but `-N` + per-node `Port=` + `%n` in the slurmd paths is
#         enough for batch jobs and `srun -w` steps (verified with 22.05.8).
# Prints: `export SLURM_CONF=STATE_DIR/slurm.conf` on success (client commands need it).
# Stop:   bash tests/slurm/stop_slurm.sh STATE_DIR
# Needs root (daemons run as root, munged as user munge) and, unless the packages are already
# installed, apt-get with a reachable Debian mirror.
set -euo pipefail
if [ $# -ne 1 ]; then echo "usage: $0 STATE_DIR" >&2; exit 64; fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
STATE=$(cd "$1" && pwd)
CPUS=${SLURM_CPUS:-$(nproc)}
MEM_MB=${SLURM_MEM_MB:-16000}
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_SLURMD_PORT:-6818}
HOST=$(hostname -s)
NNODES=${SLURM_NODES:-1}
IFS=, read -r -a PORTS <<<"$SLURMD_PORT"
if [ "$NNODES" -eq 1 ]; then NODE_NAMES=("$HOST")
else NODE_NAMES=(); for ((i = 1; i <= NNODES; i++)); do NODE_NAMES+=("$HOST-$i"); done; fi
t0=$(date +%s%N)
if [ "$(id -u)" != 0 ]; then echo "start_slurm.sh: needs root (SlurmUser=root)" >&2; exit 1; fi

# 1. Packages: Debian 12 gives slurm 22.05.8 and munge 0.5.15 (about 10 s). tini reaps the
#    orphans that slurmstepd/srun leave (PID 1 in a container does not reap them promptly).
need_install=0
for c in slurmctld slurmd sbatch munged tini; do command -v "$c" >/dev/null || need_install=1; done
if [ "$need_install" = 1 ]; then
  if [ "${SLURM_NO_INSTALL:-0}" = 1 ]; then echo "slurm packages missing and SLURM_NO_INSTALL=1" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge tini >/dev/null
fi

# 2. Config, rendered into the state folder.
mkdir -p "$STATE"/{ctld,spool,log}
CONF="$STATE/slurm.conf"
mkdir -p "$STATE/spool"
node_lines() {  # the NodeName and PartitionName lines of the config
  local i port
  if [ "$NNODES" -eq 1 ]; then
    echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
  else
    for ((i = 0; i < NNODES; i++)); do
      port=${PORTS[$i]:-$(( ${PORTS[-1]} + i - ${#PORTS[@]} + 1 ))}
      echo "NodeName=${NODE_NAMES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
    done
  fi
  echo "PartitionName=ci Nodes=$(IFS=,; echo "${NODE_NAMES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
}
while IFS= read -r line; do
  if [ "$line" = "@NODES@" ]; then node_lines; else echo "$line"; fi
done < <(sed -e "s|@HOST@|$HOST|g" -e "s|@STATE@|$STATE|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
              -e "s|@SLURMD_PORT@|${PORTS[0]}|g" "$HERE/slurm.conf.in") > "$CONF"
export SLURM_CONF="$CONF"

# 3. munged (runs as user munge). The package's postinst usually creates the key; make one if not.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  # remember that we started it, so stop_slurm.sh stops only what this script started
  cp /run/munge/munged.pid "$STATE/munged.pid" 2>/dev/null || true
fi
munge -n | unmunge >/dev/null || { echo "munged is not working" >&2; exit 1; }

# 4. slurmctld (daemonizes itself), then slurmd in the foreground under `setsid tini -s --`
#    (child subreaper): without it, a job that used srun lingers in COMPLETING on an unreaped zombie.
slurmctld -f "$CONF"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
for node in "${NODE_NAMES[@]}"; do
  rm -f "$STATE/slurmd-$node.pid"
  setsid tini -s -- slurmd -D -f "$CONF" -N "$node" >"$STATE/log/slurmd-$node.stdout" 2>&1 </dev/null &
done
for node in "${NODE_NAMES[@]}"; do
  for _ in $(seq 50); do [ -s "$STATE/slurmd-$node.pid" ] && break; sleep 0.1; done
done

# 5. Wait until every node is idle.
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [ "$state" = "idle " ] && [ "$(sinfo -h -N -o %N 2>/dev/null | wc -l)" -eq "$NNODES" ] && break
  sleep 0.2
done
if [ "$state" != "idle " ]; then
  echo "slurm node states '$state' (expected idle); logs in $STATE/log" >&2
  tail -20 "$STATE"/log/*.log >&2 || true
  exit 1
fi
echo "slurm up ($NNODES node(s): ${NODE_NAMES[*]}) in $(( ($(date +%s%N) - t0) / 1000000 )) ms" >&2
echo "export SLURM_CONF=$CONF"
