#!/usr/bin/env bash
# Create or update the GPU environment (the GPU twin of tools/setup_cpu.sh): one command,
# idempotent (re-running is a no-op while the pin file and pyproject.toml are unchanged).
#
#   bash tools/setup_gpu.sh                 # venv in .venv-gpu/ of this checkout, CUDA 13 pins
#   bash tools/setup_gpu.sh --cuda 12       # the CUDA 12.8 pins, for drivers older than R580
#   VENV=/shared/envs/mrlhf PYTHON=python3.12 bash tools/setup_gpu.sh
#
# Pin sets (--cuda 13 is the default; each file says where its pins come from and what was checked):
#   --cuda 13  requirements/gpu.txt       torch 2.13.0 (CUDA 13), vllm 0.32.0, TE core_cu13;
#                                         NVIDIA driver >= 580.65.06 (R580)
#   --cuda 12  requirements/gpu-cu12.txt  torch 2.13.0+cu128 (PyTorch index), vllm 0.32.0+cu128,
#                                         TE core_cu12; driver >= 525.60.13, full support from 570.26
# Driver check, before anything is installed: on a node with nvidia-smi, a driver
# (nvidia-smi --query-gpu=driver_version) older than the pin set's floor is refused (exit 3, naming
# the driver, the floor and the fix: --cuda 12, or upgrade the driver); no nvidia-smi (a build node)
# skips the check. A venv keeps the pin set it was made with: switching needs another VENV.
#
# Steps:
#   1. a venv ($VENV, default .venv-gpu) from $PYTHON (default python3; Python >= 3.11);
#   2. pip install -r the pin set's file (torch 2.13.0, vllm 0.32.0, megatron-core 0.16.1, ...),
#      with the PyTorch index its header names (CUDA 12 only);
#   3. Transformer Engine with --no-build-isolation, after torch (its PyTorch extension is built
#      against the installed torch; needs nvcc and cuDNN headers, i.e. a CUDA devel image), the
#      requirement read from the pin file's `pip install --no-build-isolation "..."` line;
#      MRLHF_SKIP_TE=1 skips it (the learner then uses the device-agnostic non-TE spec);
#   4. checks: torch sees CUDA (warning only: build nodes may have no GPU), `import
#      transformer_engine.pytorch` and megatron's own TE extension (HAVE_TE), `import vllm`;
#   5. `pip freeze` into $VENV.freeze.txt beside the venv (what this node image holds), then the
#      stamp $VENV/.mrlhf-requirements.sha256.
# The package itself is NOT pip-installed: runs import it from this checkout (train.py's folder;
# Ray workers get it on PYTHONPATH from trainer/setup.py:init_ray and slurm/ray_cluster.sh), so a
# plain checkout on the cluster's shared file system is enough.
set -euo pipefail
CUDA=13
HELP=()
while [ $# -gt 0 ]; do
  case $1 in
    --cuda) [ $# -ge 2 ] || { echo "[setup_gpu] --cuda needs a value: 12 or 13" >&2; exit 2; }
            CUDA=$2; shift 2 ;;
    --cuda=*) CUDA=${1#--cuda=}; shift ;;
    -h|--help) HELP=("$1"); shift ;;
    *) echo "[setup_gpu] unknown argument '$1': this script takes --cuda 12|13 and --help (its other settings are environment variables, see: bash $0 --help)" >&2
       exit 2 ;;
  esac
done
# shellcheck source=tools/setup_args.sh
source "$(dirname "$0")/setup_args.sh" "$0" "${HELP[@]}"   # --help prints this header
cd "$(dirname "$0")/.."
case $CUDA in
  13) REQ=requirements/gpu.txt ;;
  12) REQ=requirements/gpu-cu12.txt ;;
  *) echo "[setup_gpu] --cuda $CUDA: the pin sets are 13 (requirements/gpu.txt) and 12 (requirements/gpu-cu12.txt)" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
header() { sed -n "s/^#[[:space:]]*$1:[[:space:]]*\([^[:space:]]*\).*/\1/p" "$REQ" | head -1; }
TE_REQ=$(sed -n 's/^#[[:space:]]*pip install --no-build-isolation "\([^"]*\)".*/\1/p' "$REQ" | head -1)
if [ -z "$TE_REQ" ]; then
  echo "[setup_gpu] $REQ has no 'pip install --no-build-isolation \"transformer-engine[...]==X\"' line" >&2
  exit 2
fi
FLOOR=$(header driver-floor)
FULL=$(header driver-full)
TORCH_INDEX=$(header torch-index)
if [ -z "$FLOOR" ]; then echo "[setup_gpu] $REQ has no '# driver-floor: X' line" >&2; exit 2; fi

# The driver check comes before anything is installed (review 2, N4: a CUDA 13 torch on an R535-R570
# driver installs fine and then sees no GPU). `sort -V` orders driver versions like 570.86.15.
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }
if command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d '[:space:]') || DRIVER=
  if [ -z "$DRIVER" ]; then
    echo "[setup_gpu] warning: nvidia-smi is present but reports no driver version; the driver was not checked" >&2
  elif older "$DRIVER" "$FLOOR"; then
    if [ "$CUDA" = 13 ]; then fix="run: bash tools/setup_gpu.sh --cuda 12 (CUDA 12.8 pins, driver >= 525.60.13), or upgrade the NVIDIA driver to R580 (>= $FLOOR)"
    else fix="upgrade the NVIDIA driver (>= $FLOOR; R570 or newer for full CUDA 12.8 support)"; fi
    echo "[setup_gpu] refused: NVIDIA driver $DRIVER on this node is older than $FLOOR, which the CUDA $CUDA pin set ($REQ) needs; torch would see no GPU. Fix: $fix" >&2
    exit 3
  elif [ -n "$FULL" ] && older "$DRIVER" "$FULL"; then
    echo "[setup_gpu] warning: NVIDIA driver $DRIVER is older than $FULL (CUDA $CUDA's own driver): CUDA runs through minor version compatibility, and a kernel JIT-compiled from PTX may fail; upgrade to >= $FULL if one does ($REQ)" >&2
  else
    echo "[setup_gpu] NVIDIA driver $DRIVER >= $FLOOR (CUDA $CUDA pin set)" >&2
  fi
else
  echo "[setup_gpu] no nvidia-smi: driver not checked (a build node); the CUDA $CUDA pin set needs driver >= $FLOOR on the GPU nodes" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# one pin set per venv: pip keeps a torch 2.13.0+cu128 for gpu.txt's torch==2.13.0 (a local version
# satisfies the public pin), so switching sets in place would mix CUDA builds
if [ -f "$VENV/.mrlhf-cuda" ] && [ "$(cat "$VENV/.mrlhf-cuda")" != "$CUDA" ]; then
  echo "[setup_gpu] $VENV holds the CUDA $(cat "$VENV/.mrlhf-cuda") pin set; for --cuda $CUDA use another VENV=... or delete $VENV" >&2
  exit 2
fi
echo "$CUDA" > "$VENV/.mrlhf-cuda"
stamp=$VENV/.mrlhf-requirements.sha256
want=$( (cat "$REQ" pyproject.toml; echo "skip_te=${MRLHF_SKIP_TE:-0}") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup_gpu] $VENV is up to date ($stamp)" >&2
  exit 0
fi
echo "[setup_gpu] installing the CUDA $CUDA GPU stack ($REQ) into $VENV (TE: $TE_REQ)" >&2
INDEX=(); [ -n "$TORCH_INDEX" ] && INDEX=(--extra-index-url "$TORCH_INDEX")
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQ" "${INDEX[@]}"
if [ "${MRLHF_SKIP_TE:-0}" != 1 ]; then
  # build tools TE's setup needs once isolation is off (they are not in gpu.txt)
  "$VENV/bin/python" -m pip install -q wheel setuptools ninja pybind11
  "$VENV/bin/python" -m pip install -q --no-build-isolation "$TE_REQ"
fi
"$VENV/bin/python" - <<'EOF'
import sys, warnings
import torch
print(f"[setup_gpu] torch {torch.__version__} (CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}",
      file=sys.stderr)
if not torch.cuda.is_available():
    warnings.warn("no GPU visible here (fine on a build node; run bench/gpu_check.py on a GPU node)")
import vllm, megatron.core
print(f"[setup_gpu] vllm {vllm.__version__}, megatron-core {megatron.core.__version__}", file=sys.stderr)
EOF
if [ "${MRLHF_SKIP_TE:-0}" != 1 ]; then
  "$VENV/bin/python" -c "import transformer_engine.pytorch
from megatron.core.extensions import transformer_engine as mte
assert mte.HAVE_TE, 'transformer_engine imports but megatron.core.extensions.transformer_engine.HAVE_TE is False (version skew)'
print('[setup_gpu] transformer_engine.pytorch and megatron HAVE_TE ok')" >&2
fi
"$VENV/bin/python" -m pip freeze > "$VENV.freeze.txt"
echo "$want" > "$stamp"
echo "[setup_gpu] done; pip freeze in $VENV.freeze.txt" >&2
