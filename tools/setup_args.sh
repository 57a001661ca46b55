# Argument handling shared by tools/setup_cpu.sh and tools/setup_gpu.sh, sourced as
#   source "$(dirname "$0")/setup_args.sh" "$0" "$@"
# -h/--help prints the calling script's header comment (its lines 2 up to `set -euo pipefail`) and
# exits 0; any other argument exits 2 naming it: the scripts take none, their settings are
# environment variables (each header lists them).
_setup_script=$1
shift
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo pipefail/p' "$_setup_script" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "[$(basename "$_setup_script" .sh)] unknown argument '$1': this script takes none (its settings are environment variables, see: bash $_setup_script --help)" >&2
     exit 2 ;;
esac
unset _setup_script
