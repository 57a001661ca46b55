"""bench/gpu_check.py --dry-run: the one-GPU check's code path at tiny shapes on CPU, in a subprocess
where ray, vllm and transformer_engine cannot be imported; bf16 and fp32 learners, timed steps,
a distributed-optimizer checkpoint round trip, and the table it prints on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_gpu_check_dry_run_passes_without_ray_vllm_or_te_and_prints_the_table(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", "--json",
                          "--workdir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("gpu_check "))
    assert "CPU (dry run)" in lines[header] and lines[header + 1].split()[:3] == ["model", "dtype", "params_M"]
    (row,) = json.loads(lines[-1])
    assert row["ok"] and row["model"] == "tiny" and row["dtype"] == "bfloat16"
    assert row["ckpt_restore_max_abs"] == 0 and row["ckpt_next_step_max_abs"] <= 1e-6
    assert 0 < row["logprob_mean_abs"] <= 0.02 and row["tokens_per_s"] > 0 and row["plan_GiB"] > 0


@pytest.mark.timeout(60)
def test_a_blocked_import_fails_inside_the_dry_run_subprocess(tmp_path):
    """The dry run's import blocker is real: importing ray there raises ModuleNotFoundError."""
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import _BLOCKER

    script = tmp_path / "probe.py"
    script.write_text("import ray\n")
    code = _BLOCKER.replace(repr(str(REPO / "bench" / "gpu_check.py")), repr(str(script)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr and "blocked" in res.stderr
