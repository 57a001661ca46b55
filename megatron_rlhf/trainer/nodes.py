"""Where the actors of a run landed: ``<run>/logs/actor_nodes-<job>-r<restart>.json``.

On a cluster started by ``slurm/ray_cluster.sh`` every node declares a role resource
(``mrlhf_learner`` / ``mrlhf_generator``) and actors ask for theirs; this record says which Ray node
each learner rank, vLLM engine and reward model actually runs on, with every node's address, its
role resources and whether it is the head (where the trainer runs), so a misplaced actor shows in
the run folder. Written once per start of the run, after every actor has started. ``<job>`` and
``<restart>`` come from ``MRLHF_SLURM_JOB_ID`` / ``MRLHF_SLURM_RESTART_COUNT`` (set by
``ray_cluster.sh``; ``local`` / 0 outside SLURM).

Source: Ray docs, ``ray.get_runtime_context().get_node_id()`` and ``ray.nodes()``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["actor_nodes", "write_actor_nodes"]


def _node_id(*_) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def actor_nodes(learner, generators: list, reward_models: dict, timeout_s: float) -> dict:
    """Ray node id of every actor, and the live nodes' descriptions.

    Args:
        learner: the learner actor (a ``MegatronLearner`` or a ``LearnerGroup`` coordinator).
        generators: the ``VLLMGenerator`` actors, in engine order.
        reward_models: ``{folder: reward-model actor}``.
        timeout_s: upper bound of the wait for the actors' answers (seconds).
    Returns:
        ``{"nodes": {node_id: {"address", "head", "role_resources"}}, "learner_ranks": [node_id per
        rank], "generators": [node_id per engine], "reward_models": {folder: node_id},
        "trainer": node_id of the driver}``.
    Raises:
        ray.exceptions.GetTimeoutError: an actor did not answer within ``timeout_s``.
    """
    import ray

    from megatron_rlhf.generator.weight_sync import is_learner_group, on_learner_ranks

    ranks = on_learner_ranks(learner, is_learner_group(learner, timeout_s), _node_id)
    engines = [g.__ray_call__.remote(_node_id) for g in generators]
    rms = {k: a.__ray_call__.remote(_node_id) for k, a in reward_models.items()}
    nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"],
                           "head": "node:__internal_head__" in n["Resources"],
                           "role_resources": {k: v for k, v in n["Resources"].items() if k.startswith("mrlhf_")}}
             for n in ray.nodes() if n.get("Alive")}
    return {"nodes": nodes, "learner_ranks": ray.get(ranks, timeout=timeout_s),
            "generators": ray.get(engines, timeout=timeout_s),
            "reward_models": dict(zip(rms, ray.get(list(rms.values()), timeout=timeout_s))),
            "trainer": ray.get_runtime_context().get_node_id()}


def write_actor_nodes(run_dir: Path, record: dict) -> Path:
    """Write ``record`` (:func:`actor_nodes`) to ``<run_dir>/logs/actor_nodes-<job>-r<restart>.json``."""
    job = os.environ.get("MRLHF_SLURM_JOB_ID", "local")
    restart = os.environ.get("MRLHF_SLURM_RESTART_COUNT", "0")
    path = Path(run_dir) / "logs" / f"actor_nodes-{job}-r{restart}.json"
    from megatron_rlhf.utils.atomic import write_text

    write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path
