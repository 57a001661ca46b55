#!/usr/bin/env bash
# Stop what tests/slurm/start_slurm.sh STATE_DIR started: cancel its jobs, then stop each slurmd,
# slurmctld and (if that script started it) munged, each by its PID file, never by name.
# Usage: bash tests/slurm/stop_slurm.sh STATE_DIR [--purge]   (--purge also deletes STATE_DIR)
set -uo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 STATE_DIR [--purge]" >&2; exit 64; fi
STATE=$1
export SLURM_CONF="$STATE/slurm.conf"
if [ -s "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
  scancel --full --quiet 2>/dev/null || true   # this cluster's jobs only (its own slurmctld)
  for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
fi
stop_pid() {  # $1 = pid file: TERM, wait up to 5 s, then KILL
  [ -s "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}
for f in "$STATE"/slurmd-*.pid; do stop_pid "$f"; done   # one per node; its tini parent exits with it
stop_pid "$STATE/slurmctld.pid"
stop_pid "$STATE/munged.pid"      # present only when start_slurm.sh started munged
if [ "${2:-}" = --purge ]; then rm -rf "$STATE"; fi
exit 0
