#!/usr/bin/env bash
# Start a one-node SLURM cluster (munged + slurmctld + slurmd) as root, without systemd, for the
# project's SLURM integration test (tests/test_slurm.py). Modelled on the verified probe in
# ../shared/notes/probes/slurm/ (see cpu-stack.md "A real one-node SLURM").
#
# Usage:  bash tests/slurm/start_slurm.sh STATE_DIR
# Env:    SLURM_CPUS (default: nproc), SLURM_MEM_MB (default 16000), SLURM_CTLD_PORT (6817),
#         SLURM_SLURMD_PORT (6818), SLURM_NO_INSTALL=1 (fail instead of apt-get installing).
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
sed -e "s|@HOST@|$HOST|g" -e "s|@STATE@|$STATE|g" -e "s|@CPUS@|$CPUS|g" -e "s|@MEM@|$MEM_MB|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
    "$HERE/slurm.conf.in" > "$CONF"
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
rm -f "$STATE/slurmd.pid"
setsid tini -s -- slurmd -D -f "$CONF" -N "$HOST" >"$STATE/log/slurmd.stdout" 2>&1 </dev/null &
for _ in $(seq 50); do [ -s "$STATE/slurmd.pid" ] && break; sleep 0.1; done

# 5. Wait until the node is idle.
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true)
  [ "$state" = idle ] && break
  sleep 0.2
done
if [ "$state" != idle ]; then
  echo "slurm node state '$state' (expected idle); logs in $STATE/log" >&2
  tail -20 "$STATE"/log/*.log >&2 || true
  exit 1
fi
echo "slurm up in $(( ($(date +%s%N) - t0) / 1000000 )) ms" >&2
echo "export SLURM_CONF=$CONF"
