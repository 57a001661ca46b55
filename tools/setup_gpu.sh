#!/usr/bin/env bash
# Create or update the GPU environment (the GPU twin of tools/setup_cpu.sh): one command,
# idempotent (re-running is a no-op while requirements/gpu.txt and pyproject.toml are unchanged).
#
#   bash tools/setup_gpu.sh                 # venv in .venv-gpu/ of this checkout
#   VENV=/shared/envs/mrlhf PYTHON=python3.12 bash tools/setup_gpu.sh
#
# Steps (requirements/gpu.txt says where each pin comes from):
#   1. a venv ($VENV, default .venv-gpu) from $PYTHON (default python3; Python >= 3.11);
#   2. pip install -r requirements/gpu.txt (torch 2.13.0 CUDA 13, vllm 0.32.0, megatron-core 0.16.1, ...);
#   3. Transformer Engine with --no-build-isolation, after torch (its PyTorch extension is built
#      against the installed torch; needs nvcc and cuDNN headers, i.e. a CUDA devel image), the
#      requirement read from gpu.txt's `pip install --no-build-isolation "..."` line;
#      MRLHF_SKIP_TE=1 skips it (the learner then uses the device-agnostic non-TE spec);
#   4. checks: torch sees CUDA (warning only: build nodes may have no GPU), `import
#      transformer_engine.pytorch` and megatron's own TE extension (HAVE_TE), `import vllm`;
#   5. `pip freeze` into $VENV.freeze.txt beside the venv (what this node image holds), then the
#      stamp $VENV/.mrlhf-requirements.sha256.
# The package itself is NOT pip-installed: runs import it from this checkout (train.py's folder;
# Ray workers get it on PYTHONPATH from trainer/setup.py:init_ray and slurm/ray_cluster.sh), so a
# plain checkout on the cluster's shared file system is enough.
set -euo pipefail
# shellcheck source=tools/setup_args.sh
source "$(dirname "$0")/setup_args.sh" "$0" "$@"   # --help; no other arguments
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
REQ=requirements/gpu.txt
TE_REQ=$(sed -n 's/^#[[:space:]]*pip install --no-build-isolation "\([^"]*\)".*/\1/p' "$REQ" | head -1)
if [ -z "$TE_REQ" ]; then
  echo "[setup_gpu] $REQ has no 'pip install --no-build-isolation \"transformer-engine[...]==X\"' line" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.mrlhf-requirements.sha256
want=$( (cat "$REQ" pyproject.toml; echo "skip_te=${MRLHF_SKIP_TE:-0}") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup_gpu] $VENV is up to date ($stamp)" >&2
  exit 0
fi
echo "[setup_gpu] installing the GPU stack into $VENV (TE: $TE_REQ)" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQ"
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
