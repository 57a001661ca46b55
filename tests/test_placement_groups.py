"""Ray placement groups on a fake 3-node GPU cluster (``ray.cluster_utils.Cluster``): learner rank
r lands on node r // gpus_per_node (TP groups inside a node), each engine's GPUs on one generator
node, the reward model on a generator node; a layout the cluster cannot hold fails before any
placement group or actor exists, naming the shortfall.

The nodes declare GPUs and the role resources exactly as slurm/ray_cluster.sh does
(``mrlhf_learner`` / ``mrlhf_generator`` = the node's GPUs); nothing touches a real GPU: the test
runs plain Ray tasks with the options the trainer gives its actors and asks where they ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.config import ConfigError, load_config
from megatron_rlhf.placement import ActorPlacement, BundleLayout, check_cluster_fits

REPO = Path(__file__).resolve().parents[1]
GPUS = 4   # per fake node: the recipes' 8-GPU layouts scaled by 1/2


@pytest.fixture(scope="module")
def cluster():
    """Head + 1 worker = learner nodes, 1 worker = generator node; yields their node ids."""
    import ray
    from ray.cluster_utils import Cluster

    def args(role):
        return {"num_cpus": GPUS, "num_gpus": GPUS, "resources": {f"mrlhf_{role}": GPUS}}

    c = Cluster(initialize_head=True, head_node_args={**args("learner"), "include_dashboard": False})
    # Cluster writes its address to /tmp/ray/ray_current_cluster, where a plain ray.init() of a
    # test on the other xdist worker would find it and join this fake cluster (seen: "When
    # connecting to an existing cluster, num_cpus and num_gpus must not be provided")
    ray._common.utils.reset_ray_address()
    learner_b = c.add_node(**args("learner"))
    gen = c.add_node(**args("generator"))
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING")
    yield {"learner": {c.head_node.node_id, learner_b.node_id}, "generator": gen.node_id}
    ray.shutdown()
    c.shutdown()


def _layout(recipe: str, tmp_path, *overrides: str, reward_models: int = 0) -> BundleLayout:
    cfg = load_config(REPO / "configs" / recipe, [f"model.source={tmp_path}", f"placement.gpus_per_node={GPUS}",
                                                  *overrides])
    return BundleLayout.from_config(cfg, reward_models=reward_models)


def _where(placement: ActorPlacement, learners: int, engines: int, rms: int):
    import ray

    @ray.remote
    def node():
        return ray.get_runtime_context().get_node_id()

    refs = ([node.options(**placement.learner_options(r)).remote() for r in range(learners)],
            [node.options(**placement.engine_options(i)).remote() for i in range(engines)],
            [node.options(**placement.reward_options(j)).remote() for j in range(rms)])
    return [ray.get(r, timeout=120) for r in refs]


@pytest.mark.timeout(300)
def test_scaled_70b_layout_puts_each_pipeline_stage_tp_group_on_its_own_node(cluster, tmp_path):
    # 70B recipe (TP8 x PP2) scaled: learner TP=4 x PP=2 on 2 nodes of 4 GPUs, 2 engines of TP=2 on 1 node
    layout = _layout("online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml", tmp_path, "learner.tensor_parallel=4",
                     "learner.pipeline_parallel=2", "learner.data_parallel=1", "placement.learner_nodes=2",
                     "placement.generator_nodes=1",
                     "generators.num_workers=2", "generators.tensor_parallel=2")
    assert layout.learner == (4, 4) and layout.engines == (2, 2)
    p = ActorPlacement(layout, timeout_s=60)
    try:
        learners, engines, _ = _where(p, 8, 2, 0)
    finally:
        p.remove()
    assert len(set(learners[:4])) == 1 and len(set(learners[4:])) == 1      # rank r on node r // 4
    assert {learners[0], learners[4]} == cluster["learner"]                  # two distinct learner nodes
    assert set(engines) == {cluster["generator"]}


@pytest.mark.timeout(300)
def test_scaled_8b_layout_keeps_learners_on_one_node_and_engines_and_reward_model_on_the_generator_node(
        cluster, tmp_path):
    # 8B recipe scaled: learner TP=2 x DP=2 on 1 node, 3 single-GPU engines + the reward model on 1 node
    layout = _layout("online-dpo-llama3.1-8b-2n8g.yaml", tmp_path, "learner.tensor_parallel=2",
                     "learner.data_parallel=2", "generators.num_workers=3", reward_models=1)
    assert layout.learner == (4,) and layout.engines == (1, 1, 1)
    p = ActorPlacement(layout, timeout_s=60)
    try:
        learners, engines, rms = _where(p, 4, 3, 1)
    finally:
        p.remove()
    assert len(set(learners)) == 1 and learners[0] in cluster["learner"]
    assert set(engines) == set(rms) == {cluster["generator"]}


@pytest.mark.timeout(300)
def test_layouts_the_cluster_cannot_hold_fail_before_any_placement_group_naming_the_shortfall(cluster, tmp_path):
    from ray.util import placement_group_table

    before = len(placement_group_table())
    shortfalls = [  # (pipeline stages, learner nodes, generator nodes, engines of TP 2, the error)
        (3, 3, 1, 2, r"learner group \(12 ranks\) needs 3 node\(s\) with 4 GPUs each .* has 2: short by 1 node"),
        (2, 2, 2, 3, r"3 vLLM engine\(s\) of generators.tensor_parallel=2 .* need 6 GPUs .* "
                     r"only 2 engine\(s\) fit, short by 2 GPU"),
    ]
    for pp, learner_nodes, generator_nodes, engines, message in shortfalls:
        layout = _layout("online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml", tmp_path, "learner.tensor_parallel=4",
                         f"learner.pipeline_parallel={pp}", "learner.data_parallel=1",
                         f"placement.learner_nodes={learner_nodes}", f"placement.generator_nodes={generator_nodes}",
                         f"generators.num_workers={engines}", "generators.tensor_parallel=2")
        with pytest.raises(ConfigError, match=message):
            ActorPlacement(layout, timeout_s=30)
    assert len(placement_group_table()) == before   # nothing was reserved


def test_paper_assignment_without_role_resources_shares_nodes_between_roles():
    nodes = [{"GPU": 4.0, "CPU": 8.0}, {"GPU": 4.0, "CPU": 8.0}]
    got = check_cluster_fits(BundleLayout(gpus_per_node=4, learner=(4,), engines=(2, 2)), nodes,
                             role_resources=False)
    assert got["learner"] == [0] and got["engines"] == [1, 1]
    with pytest.raises(ConfigError, match="only 2 engine"):
        check_cluster_fits(BundleLayout(gpus_per_node=4, learner=(4,), engines=(2, 2, 2)), nodes,
                           role_resources=False)
