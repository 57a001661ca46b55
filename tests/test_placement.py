"""placement section validation, and the checked-in slurm/*.sbatch scripts match what
slurm/submit.py renders from their recipes (so a recipe edit without a re-render is caught)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rlhf.config import ConfigError
from megatron_rlhf.placement import PlacementConfig, check_layout

REPO = Path(__file__).resolve().parents[1]
RECIPES = {  # checked-in script -> (recipe, job name)
    "online-dpo-llama3.1-8b-2n8g.sbatch": "online-dpo-llama3.1-8b-2n8g.yaml",
    "online-dpo-llama3.1-70b-8n8g-tp8pp2.sbatch": "online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml",
    "online-dpo-qwen2.5-7b-math-chat-2n8g.sbatch": "online-dpo-qwen2.5-7b-math-chat-2n8g.yaml",
    "cpu-ci-1n0g.sbatch": "ci_slurm.yaml",
}


def _submit_module():
    spec = importlib.util.spec_from_file_location("mrlhf_submit", REPO / "slurm" / "submit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _placement_of(recipe: Path) -> dict:
    """The recipe's merged ``placement`` mapping (its ``defaults:`` chain, child keys win)."""
    data = yaml.safe_load(recipe.read_text())
    merged: dict = {}
    parents = data.get("defaults") or []
    for p in [parents] if isinstance(parents, str) else parents:
        merged.update(_placement_of(recipe.parent / p))
    merged.update(data.get("placement") or {})
    return merged


@pytest.mark.timeout(30)
def test_placement_rejects_shared_gpu_nodes_bad_time_and_reserved_sbatch_flags():
    with pytest.raises(ConfigError, match="placement.share_nodes"):
        PlacementConfig(gpus_per_node=8, share_nodes=True)
    with pytest.raises(ConfigError, match="placement.time_limit"):
        PlacementConfig(time_limit="1 day")
    with pytest.raises(ConfigError, match="placement.extra_sbatch"):
        PlacementConfig(extra_sbatch=["--nodes=3"])
    with pytest.raises(ConfigError, match="placement.signal_lead_s"):
        PlacementConfig(signal_lead_s=5)
    assert PlacementConfig(learner_nodes=4, generator_nodes=4, gpus_per_node=8).num_nodes == 8
    assert PlacementConfig(share_nodes=True).num_nodes == 1


@pytest.mark.timeout(30)
def test_check_layout_wants_learner_ranks_equal_learner_gpus_and_engines_within_generator_gpus():
    p = PlacementConfig(learner_nodes=1, generator_nodes=1, gpus_per_node=8, network_interface="ib0")
    check_layout(p, learner_world_size=8, learner_tensor_parallel=2, num_engines=8, engine_tensor_parallel=1)
    with pytest.raises(ConfigError, match="equal to the learner GPUs"):
        check_layout(p, learner_world_size=4, learner_tensor_parallel=2, num_engines=8, engine_tensor_parallel=1)
    with pytest.raises(ConfigError, match="generators.num_workers"):
        check_layout(p, learner_world_size=8, learner_tensor_parallel=2, num_engines=3, engine_tensor_parallel=4)
    with pytest.raises(ConfigError, match="must not span nodes"):
        check_layout(p, learner_world_size=8, learner_tensor_parallel=16, num_engines=1, engine_tensor_parallel=1)
    # CPU nodes: ranks are processes, nothing to check
    check_layout(PlacementConfig(share_nodes=True), learner_world_size=1, learner_tensor_parallel=1,
                 num_engines=1, engine_tensor_parallel=1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", sorted(RECIPES))
def test_checked_in_sbatch_script_is_submit_py_render_of_its_recipe(script):
    submit = _submit_module()
    recipe = REPO / "configs" / RECIPES[script]
    name = script.removesuffix(".sbatch")
    text = submit.render_sbatch(job_name=name, config_path=f"configs/{recipe.name}",
                                placement=PlacementConfig(**_placement_of(recipe)),
                                name_flag=name != recipe.stem)
    assert (REPO / "slurm" / script).read_text() == text, f"re-render slurm/{script} (see its header)"


@pytest.mark.timeout(60)
def test_sbatch_and_shell_scripts_parse():
    for f in [*(REPO / "slurm").glob("*.sbatch"), *(REPO / "slurm").glob("*.sh"), *(REPO / "tests/slurm").glob("*.sh")]:
        res = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert res.returncode == 0, (f, res.stderr)


@pytest.mark.timeout(30)
def test_rendered_script_execs_ray_cluster_with_config_and_baked_overrides():
    submit = _submit_module()
    text = submit.render_sbatch(job_name="x", config_path="configs/x.yaml",
                                placement=PlacementConfig(learner_nodes=2, generator_nodes=3, gpus_per_node=8,
                                                          network_interface="ib0", partition="gpu"),
                                overrides=["run.name=a b"], repo="/repo")
    for line in ("#SBATCH --nodes=5", "#SBATCH --gpus-per-node=8", "#SBATCH --signal=B:TERM@300",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --partition=gpu",
                 "export MRLHF_LEARNER_NODES=2 MRLHF_GENERATOR_NODES=3 MRLHF_SHARE_NODES=0",
                 "export MRLHF_NET_IFNAME=${MRLHF_NET_IFNAME:-ib0}", "export MRLHF_REPO=${MRLHF_REPO:-/repo}",
                 """exec bash "$MRLHF_REPO/slurm/ray_cluster.sh" configs/x.yaml 'run.name=a b' "$@\""""):
        assert line in text.splitlines(), line
