"""Recipe rehearsal (issue 13): the 8B cluster recipe itself, submitted the way users submit it, on a
real two-node SLURM on this machine.

``configs/online-dpo-llama3.1-8b-2n8g.yaml`` goes through ``slurm/submit.py`` (which renders the
sbatch script from the recipe's ``placement`` section and calls sbatch) and
``slurm/ray_cluster.sh``'s multi-node path: the head on the first node of the allocation with the
``mrlhf_learner`` resource, a second Ray node started with ``srun -w <node 2>`` with
``mrlhf_generator``, and ``train.py`` on the head. Only the size is scaled by overrides: a tiny
random Llama for ``model.source``, TP=2 learner (the recipe's TP, DP 4 -> 1), 2 vLLM engines
(8 -> 2), float32 and CPU nodes (2 CPUs each), 3 steps of 2 prompts x 4 samples of 8 tokens. The
recipe's own choices stay: ``generators.transport=broadcast`` (gloo here, NCCL on GPUs), the
distributed optimizer, sequence parallelism, bucket size, one-step async, the checkpoint at the end.
The weight-sync probe check is on, as ``base_cluster.yaml`` has it (with the fp32 tolerance here).

Proves: the job completes (exit 0) with both Ray nodes joined, every learner rank on the learner
node and every engine on the generator node (``logs/actor_nodes-*.json``), metrics rows with
staleness 0, 1, 1, a broadcast push with bytes, GB/s, learner-blocked time and a probe check
within tolerance, a final checkpoint, one Ray log per node, and no Ray process left. Three steps,
not the issue's two: with one-step async, batch 2 is generated before the first push lands, so the
first batch that carries a push's bytes and its probe check is batch 3.

The SLURM: tests/slurm/start_slurm.sh with SLURM_NODES=2 (two slurmd on this host, each its own
node, see that script), via test_slurm.running_slurm; skipped where that cannot run (see
test_slurm._skip_reason). Ray stays on loopback (the second node joins at the host name, which
resolves to 127.0.0.1; see ray_cluster.sh MRLHF_RAY_JOIN_HOST).

Also here, without SLURM: ``configs/smoke-1n8g.yaml`` (the one-node GPU smoke run) scaled by
overrides only, run with ``python train.py`` from a plain copy of the repository (see
``test_smoke_1n8g_recipe_scaled_runs_from_a_plain_checkout_with_tp2_broadcast_and_probe_check``).

Run it alone (about 2-4 minutes on an idle 2-core machine):
    MRLHF_SLURM_TESTS=1 .venv/bin/pytest -q tests/test_recipe_rehearsal.py -m integration
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import check_staleness
from tests.test_slurm import DONE_STATES, REPO, _ray_processes, _wait, running_slurm

pytestmark = [pytest.mark.integration]
RECIPE = "configs/online-dpo-llama3.1-8b-2n8g.yaml"
SCALE = [   # the recipe's layout and lengths scaled to two 2-CPU nodes; everything else as the recipe has it
    "model.dtype=float32",                      # CPU: fp32 learner and engines
    "learner.data_parallel=1",                  # TP=2 x DP=4 -> TP=2 x DP=1 (TP as the recipe)
    "generators.num_workers=2",                 # 8 engines -> 2
    "generators.max_new_tokens=8", "generators.max_model_len=512", "generators.prompts_per_request=2",
    "generators.kv_cache_gib=0.0625",
    "generators.check_weight_sync_tol=0.001",   # fp32: the tight tolerance (the recipe's 5e-2 is for bf16)
    "algorithm.samples_per_prompt=4", "algorithm.prompts_per_step=2",
    "tasks.0.reward=tests.plugins:char_parity",   # random weights never solve GSM8K: a 50/50 reward
    "run.num_steps=3", "async.timeout_s=300",   # 3: see the module docstring
    # every batch generated (the one after a push carries its bytes and probe check): with the
    # surplus carry a batch may be filled by the previous batch's groups alone
    "algorithm.carry_surplus=false",
    # the eval stays on as the recipe has it (before step 1 and after the last step, on the
    # broadcast-fed engines), on a few prompts
    "eval.num_prompts=4", "eval.samples=1",
    "placement.gpus_per_node=0", "placement.cpus_per_node=2", "placement.time_limit=00:20:00",
]


@pytest.fixture(scope="module")
def two_node_slurm(tmp_path_factory):
    with running_slurm(tmp_path_factory.mktemp("slurm2_state"), nodes=2) as env:
        yield env


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_8b_recipe_runs_on_two_slurm_nodes_with_role_placement_broadcast_and_probe_check(two_node_slurm, tiny_llama_dir,
                                                                                          tmp_path):
    env = dict(two_node_slurm, MRLHF_NET_IFNAME="lo")   # the recipe's `auto` would pick eth0's interface
    run_dir = tmp_path / "runs" / "rehearsal"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "slurm/submit.py", "--config", RECIPE,
                          f"model.source={tiny_llama_dir}", f"run.output_dir={run_dir.parent}", "run.name=rehearsal",
                          *SCALE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    jid = re.search(r"submitted job (\d+)", res.stdout).group(1)
    driver_log = run_dir / "logs" / f"driver-{jid}.log"
    info = _wait(env, jid, DONE_STATES, 540, driver_log)
    text = driver_log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    print(f"rehearsal job {jid}: {time.monotonic() - t0:.0f} s from submit to COMPLETED")

    # the allocation: two SLURM nodes, learner node first, one Ray node each, with the role resources
    nodes = info["NodeList"]
    assert "learner nodes 1, generator nodes 1, shared=0" in text and "2/2 nodes joined" in text, text[-3000:]
    assert "'mrlhf_learner': 2.0" in text and "'mrlhf_generator': 2.0" in text, text[-3000:]
    ray_logs = sorted(p.name for p in (run_dir / "logs").glob(f"ray-*-{jid}.log"))
    assert len(ray_logs) == 2, (nodes, ray_logs)

    # the recipe ran as the recipe, scaled
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["generators"]["transport"] == "broadcast" and cfg["generators"]["check_weight_sync"] is True
    assert cfg["learner"]["tensor_parallel"] == 2 and cfg["learner"]["distributed_optimizer"] is True
    assert cfg["generators"]["num_workers"] == 2 and cfg["placement"]["learner_nodes"] == 1

    # placement by role resources: learner ranks on the head (learner) node, engines on the other
    (placed_file,) = (run_dir / "logs").glob(f"actor_nodes-{jid}-r0.json")
    placed = json.loads(placed_file.read_text())
    roles = {nid: n["role_resources"] for nid, n in placed["nodes"].items()}
    assert len(roles) == 2, placed
    learner_node = {nid for nid, r in roles.items() if "mrlhf_learner" in r}
    generator_node = {nid for nid, r in roles.items() if "mrlhf_generator" in r}
    assert len(learner_node) == len(generator_node) == 1 and learner_node != generator_node, placed
    assert len(placed["learner_ranks"]) == 2 and set(placed["learner_ranks"]) == learner_node, placed
    assert len(placed["generators"]) == 2 and set(placed["generators"]) == generator_node, placed
    assert placed["nodes"][placed["trainer"]]["head"] and {placed["trainer"]} == learner_node, placed

    # one-step async, a broadcast push checked by the probe
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    check_staleness(rows, [0, 1, 1])
    assert rows[2]["sync/bytes"] > 0 and rows[2]["sync/GBps"] > 0, rows[2]   # batch 3 came after the push of v1
    assert 0 <= rows[2]["sync/check_max_abs_diff"] < 1e-3, rows[2]           # the probe check ran on it
    # v1 and v2 for generation, v3 for the end-of-run eval: the learner stages every one
    assert all(r["sync/learner_blocked_s"] > 0 for r in rows), rows
    assert (run_dir / "checkpoints" / "step_3").is_dir()
    # the held-out eval before step 1 and after step 3, the last on version 3 (pushed by broadcast
    # although no batch consumes it: the end-of-run eval never waits out async.timeout_s)
    assert rows[0]["eval/step"] == 0 and rows[2]["eval/step"] == 3, (rows[0], rows[2])
    assert rows[2]["eval/weight_version"] == 3, rows[2]

    time.sleep(3)
    assert not _ray_processes(env["MRLHF_RAY_TMPDIR"]), "Ray processes left after the job"


@pytest.mark.timeout(240)
def test_a_ray_node_that_fails_to_start_fails_the_job_at_once_naming_the_node(two_node_slurm, tiny_llama_dir, tmp_path):
    """`ray start` exits at once on both nodes (an unknown flag): the join wait notices the exited
    srun steps and fails the job naming the node, instead of blocking in ray.init (minutes of Ray's
    own retries with no GCS listening) and then waiting out placement.ray_join_timeout_s (600 s
    here, longer than this test may run)."""
    env = dict(two_node_slurm, MRLHF_NET_IFNAME="lo",
               MRLHF_RAY_START_ARGS=two_node_slurm["MRLHF_RAY_START_ARGS"] + " --no-such-ray-start-flag")
    run_dir = tmp_path / "runs" / "bad_ray"
    res = subprocess.run([sys.executable, "slurm/submit.py", "--config", RECIPE,
                          f"model.source={tiny_llama_dir}", f"run.output_dir={run_dir.parent}", "run.name=bad_ray",
                          *SCALE, "placement.ray_join_timeout_s=600"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    jid = re.search(r"submitted job (\d+)", res.stdout).group(1)
    log = run_dir / "logs" / f"driver-{jid}.log"
    info = _wait(env, jid, DONE_STATES, 180, log)
    text = log.read_text()
    assert info["JobState"] == "FAILED", (info, text[-3000:])
    assert re.search(r"the Ray step on [\w.-]+(, [\w.-]+)* exited before the run started", text), text[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()


# ------------------------------------------------------------------ configs/smoke-1n8g.yaml (issue 21)
SMOKE = "configs/smoke-1n8g.yaml"
SMOKE_SCALE = [   # one 8-GPU node -> 2 cores: everything else as the recipe has it
    "model.dtype=float32",                      # CPU: fp32 learner and engines
    "learner.data_parallel=1",                  # TP=2 x DP=2 -> TP=2 x DP=1 (TP and SP as the recipe)
    "generators.num_workers=1",                 # 4 engines -> 1
    "generators.max_new_tokens=8", "generators.max_model_len=512", "generators.prompts_per_request=2",
    "generators.kv_cache_gib=0.0625",
    "generators.check_weight_sync_tol=0.001",   # fp32: the tight tolerance (the recipe's is for bf16)
    "algorithm.samples_per_prompt=4", "algorithm.prompts_per_step=2",
    "tasks.0.reward=tests.plugins:char_parity",   # random weights never solve GSM8K: a 50/50 reward
    "run.num_steps=3", "async.timeout_s=300",   # 3: the first batch after a push is batch 3
    "algorithm.carry_surplus=false",   # every batch generated (see SCALE)
    "eval.num_prompts=4", "eval.samples=1",
]


def test_smoke_recipe_without_model_source_stops_naming_the_key():
    from megatron_rlhf.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model\.source.*an existing folder: a local Hugging Face model"):
        load_config(REPO / SMOKE)


@pytest.mark.timeout(60)
def test_smoke_recipe_on_a_cpu_that_cannot_compute_bf16_is_refused_before_anything_starts(tiny_llama_dir, tmp_path,
                                                                                           monkeypatch, capsys):
    """The smoke recipe (bf16) on a machine that sees no CUDA device: where the CPU computes bf16
    (``platform.cpu_bf16_support``: native or emulated) the pre-flight lets it through, saying so
    when emulated (tests/test_weight_broadcast.py runs it there); where it cannot, it is refused at
    once naming model.dtype, and nothing is written to the run folder."""
    import torch

    import megatron_rlhf.platform as platform
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.preflight import check_device
    from megatron_rlhf.trainer.run import Run

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = load_config(REPO / SMOKE, [f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}"])
    monkeypatch.setattr(platform, "cpu_bf16_support", lambda: "emulated")
    check_device(cfg)
    assert "bf16 is computed by widening to fp32" in capsys.readouterr().out
    monkeypatch.setattr(platform, "cpu_bf16_support", lambda: "native")
    check_device(cfg)
    assert "widening" not in capsys.readouterr().out
    monkeypatch.setattr(platform, "cpu_bf16_support", lambda: None)
    with pytest.raises(ConfigError, match=r"'model\.dtype' = 'bfloat16' on a machine without a GPU.*float32"):
        setup.prepare(Run(cfg, lambda *a: None))
    assert not (tmp_path / "smoke-1n8g").exists()


@pytest.mark.timeout(30)
def test_a_cpu_layout_with_more_processes_than_cores_says_they_share_cores_and_a_gpu_config_says_nothing(monkeypatch):
    """Learner ranks (TP x PP x DP) + vLLM workers (engines x TP) beyond the cores: one line, naming
    both counts and the cores; at or below the cores, or on a GPU cluster config: nothing."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.platform import engine_args
    from megatron_rlhf.trainer.preflight import cpu_core_sharing

    cfg = load_config(REPO / "configs/cpu_demo.yaml", ["learner.tensor_parallel=2", "generators.num_workers=2"])
    assert cpu_core_sharing(cfg, cores=4) is None   # 2 ranks + 2 workers on 4 cores
    line = cpu_core_sharing(cfg, cores=2)
    assert line is not None and "2 learner rank(s) + 2 vLLM worker(s) on 2 CPU core(s)" in line and "not hung" in line
    monkeypatch.setattr(engine_args, "config_device", lambda c: "cuda")   # a GPU cluster, or CUDA visible
    assert cpu_core_sharing(cfg, cores=1) is None


@pytest.mark.timeout(30)
def test_cpu_bf16_support_reads_the_cpu_flags():
    """``native`` with AVX512-BF16 or AMX-BF16, ``emulated`` with AVX2 alone, None without AVX2."""
    from megatron_rlhf.platform import cpu_bf16_support

    assert cpu_bf16_support("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n") == "native"
    assert cpu_bf16_support("flags : sse2 avx2 amx_bf16 amx_tile\n") == "native"
    assert cpu_bf16_support("processor : 0\nflags : fpu sse2 avx avx2 fma\n") == "emulated"
    assert cpu_bf16_support("flags : fpu sse2 sse4_2\n") is None


def test_the_gpu_check_lets_a_bf16_recipe_through_where_cuda_is_visible(tiny_llama_dir, tmp_path, monkeypatch):
    """The other branch of ``preflight.check_device``: a visible CUDA device (faked here) lets the
    bf16 smoke recipe past the check; fp32 and SLURM GPU recipes (the driver may sit on a CPU node) are never refused by it."""
    import torch

    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainer.preflight import check_device

    cfg = load_config(REPO / SMOKE, [f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_device(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_device(load_config(REPO / SMOKE, [f"model.source={tiny_llama_dir}", "model.dtype=float32"]))
    check_device(load_config(REPO / "configs" / "online-dpo-llama3.1-8b-2n8g.yaml", [f"model.source={tiny_llama_dir}"]))


@pytest.mark.skipif(os.environ.get("MRLHF_SMOKE_REHEARSAL") != "1",
                    reason="passed once (278 s at load ~30); gated to keep issue 21 inside its CI budget "
                           "(the plain-checkout ci_tiny test covers item 1): MRLHF_SMOKE_REHEARSAL=1 runs it")
@pytest.mark.timeout(420)
def test_smoke_1n8g_recipe_scaled_runs_from_a_plain_checkout_with_tp2_broadcast_and_probe_check(tiny_llama_dir,
                                                                                                 tmp_path):
    """The smoke recipe, scaled by overrides only (SMOKE_SCALE), run the way its header says
    (``python train.py`` on one node, no SLURM) from a copy of the repository that no Python can
    import the package from (issue 21 item 1: ``tests.test_cli_args._uninstalled_checkout``: the
    venv's base interpreter, only the venv's site-packages on PYTHONPATH, its own ``ray``). The Ray
    workers import the package only through the PYTHONPATH ``setup.init_ray`` gives them (without
    it: ``Failed to execute the setup hook method ... No module named 'megatron_rlhf'``,
    ``LearnerDiedError`` at start-up). Proves: exit 0; TP=2 learner (2 ranks) with sequence
    parallelism and the distributed optimizer; staleness 0, 1, 1; a broadcast push with bytes and
    its probe check within the fp32 tolerance on batch 3; the checkpoint at the end; the eval
    before step 1 and after step 3. README "Cluster runs" quotes this run's output lines."""
    from tests.test_cli_args import _uninstalled_checkout

    copy, env, py = _uninstalled_checkout(tmp_path)
    for mod, ok in (("megatron_rlhf", False), ("ray", True)):   # the set-up holds
        res = subprocess.run([py, "-c", f"import {mod}"], cwd="/", env=env, capture_output=True, text=True,
                             timeout=120)
        assert (res.returncode == 0) == ok, (mod, res.stderr[-2000:])
    out = tmp_path / "runs"
    t0 = time.monotonic()
    res = subprocess.run([py, "train.py", "--config", SMOKE, f"model.source={tiny_llama_dir}",
                          f"run.output_dir={out}", *SMOKE_SCALE], cwd=copy, env=env, capture_output=True,
                         text=True, timeout=400)
    text = res.stdout + res.stderr
    (tmp_path / "smoke.log").write_text(text)
    print(f"smoke rehearsal: {time.monotonic() - t0:.0f} s; log {tmp_path / 'smoke.log'}")
    assert res.returncode == 0, text[-6000:]
    assert "setup hook" not in text, text[-6000:]
    run_dir = out / "smoke-1n8g"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["learner"]["tensor_parallel"] == 2 and cfg["learner"]["sequence_parallel"] is True
    assert cfg["learner"]["distributed_optimizer"] is True and cfg["generators"]["transport"] == "broadcast"
    assert cfg["generators"]["check_weight_sync"] is True
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    check_staleness(rows, [0, 1, 1])
    assert rows[2]["sync/bytes"] > 0 and rows[2]["sync/GBps"] > 0, rows[2]
    checks = {k: v for k, v in rows[2].items() if k.startswith("sync/check") and "diff" in k}
    assert checks and all(0 <= v < 1e-3 for v in checks.values()), rows[2]   # the probe check ran on it
    assert (run_dir / "checkpoints" / "step_3").is_dir()
    assert rows[0]["eval/step"] == 0 and rows[2]["eval/step"] == 3, (rows[0], rows[2])
