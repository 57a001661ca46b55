"""A multi-node job cannot hang silently: every learner process group gets the collective timeout
(MRLHF_DIST_TIMEOUT_S), and a GPU (always multi-node) layout must name its network interface
instead of leaving gloo on loopback."""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_rlhf.config import ConfigError
from megatron_rlhf.placement import PlacementConfig, check_layout


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _check_collective_timeouts() -> None:
    """With ``MRLHF_DIST_TIMEOUT_S=150``: the default group gets 150 s, megatron's groups 3 min."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rlhf.learner import parallel
    from megatron_rlhf.platform import get_platform

    get_platform().install(function_mode=False)
    g = parallel.acquire(backend="gloo")
    try:
        assert _timeout(dist.group.WORLD) == datetime.timedelta(seconds=150)
        minutes = datetime.timedelta(minutes=3)   # megatron takes whole minutes: 150 s -> 3 min
        groups = [g.pg_collection.tp, g.pg_collection.pp, g.pg_collection.dp, ps.get_data_parallel_group_gloo()]
        assert all(_timeout(pg) == minutes for pg in groups)
    finally:
        parallel.release()


@pytest.mark.timeout(120)
def test_every_learner_process_group_gets_the_collective_timeout(monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    import torch.distributed as dist

    from megatron_rlhf.learner import parallel

    monkeypatch.setenv("MRLHF_DIST_TIMEOUT_S", "150")
    if dist.is_initialized():   # an earlier module's group in this xdist worker: check in a fresh process
        repo = Path(__file__).resolve().parents[1]
        res = subprocess.run([sys.executable, "-c", "from tests.test_multinode_safety import "
                              "_check_collective_timeouts as c; c()"], cwd=repo, capture_output=True, text=True,
                             timeout=100)
        assert res.returncode == 0, res.stderr[-3000:]
    else:
        _check_collective_timeouts()
    monkeypatch.setenv("MRLHF_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MRLHF_DIST_TIMEOUT_S"):
        parallel.collective_timeout()


@pytest.mark.timeout(30)
def test_gpu_layout_without_network_interface_is_refused_and_the_recipes_name_one():
    from megatron_rlhf.config import load_config

    kw = dict(learner_world_size=8, learner_tensor_parallel=2, num_engines=8, engine_tensor_parallel=1)
    with pytest.raises(ConfigError, match="placement.network_interface"):
        check_layout(PlacementConfig(learner_nodes=1, generator_nodes=1, gpus_per_node=8), **kw)
    for name in ("ib0", "auto"):
        check_layout(PlacementConfig(learner_nodes=1, generator_nodes=1, gpus_per_node=8, network_interface=name), **kw)
    # the config check (load_config -> check_layout) refuses it before anything starts
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "configs" / "online-dpo-llama3.1-8b-2n8g.yaml"
    assert load_config(recipe, ["model.source=smollm2"]).placement.network_interface == "auto"
    with pytest.raises(ConfigError, match="placement.network_interface"):
        load_config(recipe, ["model.source=smollm2", "placement.network_interface="])


@pytest.mark.timeout(30)
def test_process_env_uses_the_jobs_interface_and_passes_the_timeout_on(monkeypatch):
    from megatron_rlhf.runtime import process_env

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("MRLHF_NET_IFNAME", raising=False)
    assert process_env()["GLOO_SOCKET_IFNAME"] == "lo"          # local runs: loopback
    monkeypatch.setenv("MRLHF_NET_IFNAME", "ib0")
    monkeypatch.setenv("MRLHF_DIST_TIMEOUT_S", "900")
    env = process_env()
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["MRLHF_DIST_TIMEOUT_S"] == "900"
