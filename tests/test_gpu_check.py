"""bench/gpu_check.py --dry-run: the one-GPU check's code at tiny shapes on CPU, in a subprocess where
ray, vllm and transformer_engine cannot be imported: each row is printed and appended to --out as
soon as it is measured, the disk it used is recorded and removed, and the time budget skips what no
longer fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["env", "prepare-tiny", "logprobs-tiny", "train-tiny", "pack-tiny", "pack-host-tiny", "checkpoint"]


def _cmd(*args):
    return [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", *args]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(400)
def test_dry_run_writes_each_row_while_running_stays_in_the_disk_bound_and_passes(tmp_path):
    out, work = tmp_path / "rows.jsonl", tmp_path / "work"
    proc = subprocess.Popen(_cmd("--out", str(out), "--workdir", str(work)), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_while_running = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if seen_while_running is None and "prepare-tiny" in line and line.startswith("["):
            # the prepare row is printed: it is already in --out, and the check is still running
            seen_while_running = ([r["section"] for r in _rows(out)], proc.poll())
    assert proc.wait(timeout=380) == 0, "".join(lines)[-4000:]
    assert seen_while_running == (["env", "prepare-tiny"], None), seen_while_running
    rows = _rows(out)
    assert [r["section"] for r in rows] == SECTIONS
    by = {r["section"]: r for r in rows}
    for name in SECTIONS:
        if name == "pack-tiny" and by[name]["status"] == "skipped":   # until learner/weights.py has it
            assert "measure_pack" in by[name]["reason"]
            continue
        assert by[name]["status"] == "ok", by[name]
    assert by["env"]["transformer_engine"] is False and by["env"]["device"] == "CPU (dry run)"
    assert by["prepare-tiny"]["core_attention"] == "SDPACoreAttention"
    assert 0 <= by["logprobs-tiny"]["mean_abs_diff"] <= 0.05 and by["logprobs-tiny"]["tokens"] > 0
    # the tiny preset carries Llama-3.1 rope_scaling (review 2, N15): megatron's frequencies are transformers'
    assert by["logprobs-tiny"]["rope_type"] == "llama3", by["logprobs-tiny"]
    assert by["logprobs-tiny"]["rope_inv_freq_max_rel_diff"] <= 1e-5, by["logprobs-tiny"]
    assert by["train-tiny"]["tokens_per_s"] > 0 and by["train-tiny"]["plan_GiB"] > 0
    # review 2, N14: the host-staged publish beside the device pack, over the same bytes
    dev, host = by["pack-tiny"]["buckets"], by["pack-host-tiny"]["buckets"]
    assert [r["staging"] for r in host] == ["host"] and host[0]["pack_GBps"] > 0
    assert host[0]["bytes"] == dev[0]["bytes"] and {r["staging"] for r in dev} == {"device"}
    ck = by["checkpoint"]
    assert ck["restore_max_abs"] == 0 and ck["next_step_max_abs"] <= 1e-6 and ck["update_max_abs"] > 0
    assert 0 < ck["ckpt_GB"] <= ck["peak_disk_GB"] <= rows[-1]["max_disk_GB"] <= 10
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert sorted(p.name for p in work.iterdir()) == []   # weights and checkpoint removed
    assert "every section that ran passed" in lines[-1]


@pytest.mark.timeout(120)
def test_budget_skips_every_section_that_no_longer_fits_and_says_so(tmp_path):
    out = tmp_path / "rows.jsonl"
    res = subprocess.run(_cmd("--out", str(out), "--budget-min", "0.001"), env=_env(),
                         capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _rows(out)
    assert [r["section"] for r in rows] == SECTIONS and rows[0]["status"] == "ok"
    assert all(r["status"] == "skipped" for r in rows[1:])
    assert "budget" in rows[1]["reason"] and "--budget-min" in rows[1]["reason"]
    assert "prepare-tiny skipped" in rows[2]["reason"]


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


@pytest.mark.timeout(60)
def test_layer_submodules_reads_the_attention_of_both_the_local_block_spec_and_a_te_shaped_layer_spec():
    """Review 2, N3: TE's spec is a ``ModuleSpec(TransformerLayer)`` (no ``layer_specs``); the local
    spec is a ``ModuleSpec(TransformerBlock)``. ``prepare``'s spec access must read the core attention
    of both. The TE-shaped spec is built from megatron's own spec classes with a stand-in for TE's
    attention class (TE itself cannot be imported on CPU)."""
    sys.path.insert(0, str(REPO))
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from bench.gpu_check import layer_submodules

    class TEDotProductAttention:   # the name gpu_check reports on a TE node
        pass

    te_spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules(
            linear_qkv=None, core_attention=TEDotProductAttention))))
    assert not hasattr(te_spec.submodules, "layer_specs")   # the shape that broke the old access
    block_spec = ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(layer_specs=[te_spec]))
    for spec in (te_spec, block_spec):
        assert layer_submodules(spec).self_attention.submodules.core_attention.__name__ == "TEDotProductAttention"
