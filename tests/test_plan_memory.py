"""tools/plan_memory.py against a hand calculation for Llama-3.1-8B (the 2n8g recipe's layout)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("plan_memory", REPO / "tools" / "plan_memory.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory"] = mod
    spec.loader.exec_module(mod)
    return mod


pm = _tool()

# ---- Hand calculation: Llama-3.1-8B, learner TP=2 PP=1 DP=4, distributed optimizer, micro-batch 2
# sequences x 2048 tokens, no recompute, sequence parallel; h=4096, L=32, 32 heads / 8 KV heads,
# d=128, f=14336, V=128256 (already a multiple of 128*2 = 256, so no padding).
LAYER_SHARDED = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336   # 218,103,808
LAYER_REPLICATED = 2 * 4096                                                      # two RMSNorm weights
EMB_SHARD = 128256 * 4096 // 2                                                    # 262,668,288
P_GPU = 32 * (LAYER_SHARDED // 2 + LAYER_REPLICATED) + 2 * EMB_SHARD + 4096       # + final norm
P_TOTAL = 32 * (LAYER_SHARDED + LAYER_REPLICATED) + 2 * 128256 * 4096 + 4096
A_LAYER = 2048 * 2 // 2 * (8 * 4096 + 4 * 4096 + 4 * 1024 + 6 * 14336)           # s*b/t*(8h+4hq+4hkv+6f)
HAND = {
    "weights": 2 * P_GPU,                 # bf16
    "grads": 4 * P_GPU,                   # fp32 main grads
    "optimizer": 12 * P_GPU // 4,         # fp32 master + Adam m, v, sharded over DP=4
    "reference": 2 * P_GPU,               # frozen bf16 copy
    "activations": 32 * A_LAYER,          # PP=1: one micro-batch in flight, 32 layers
    "logits": 6 * 2048 * 2 * 128256 // 2,  # bf16 logits + fp32 copy, vocab split over TP
}


@pytest.mark.timeout(30)
def test_hand_calculation_constants_are_what_the_paper_formulas_give():
    # the numbers written out, so a reader can check them with a calculator
    assert P_TOTAL == 8_030_261_248          # Llama-3.1-8B's published 8.03 B parameters
    assert P_GPU == 4_015_263_744
    assert A_LAYER == 285_212_672
    assert sum(HAND.values()) == 54_870_716_416  # 51.10 GiB before overhead


@pytest.mark.timeout(30)
def test_learner_estimate_matches_hand_calculation_for_8b_tp2_dp4():
    lay = pm.LearnerLayout(tp=2, pp=1, dp=4, micro_batch=2, seq_len=2048)
    m = pm.learner_memory(pm.PRESETS["llama3.1-8b"], lay)
    assert m["params"] == P_GPU
    for key, want in HAND.items():
        assert m[key] == pytest.approx(want, rel=1e-12), key
    assert m["total"] == pytest.approx(sum(HAND.values()), rel=1e-12)


@pytest.mark.timeout(30)
def test_distributed_optimizer_off_costs_18_bytes_per_param_and_recompute_keeps_layer_inputs():
    shape = pm.PRESETS["llama3.1-8b"]
    off = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, distributed_optimizer=False))
    assert off["weights"] + off["grads"] + off["optimizer"] == 18 * P_GPU
    full = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, recompute="full"))
    assert full["activations"] == pytest.approx(32 * 2 * 2048 * 2 * 4096 / 2 + A_LAYER)


@pytest.mark.timeout(30)
def test_pipeline_stage_zero_holds_pp_microbatches_and_last_stage_the_logits():
    shape = pm.PRESETS["llama3.1-70b"]
    lay = pm.LearnerLayout(tp=8, pp=2, dp=2, micro_batch=1, seq_len=2048)
    a = pm.layer_activation_bytes(shape, lay)
    m = pm.learner_memory(shape, lay)
    assert m["stage"] == 0 and m["activations"] == pytest.approx(2 * 40 * a) and m["logits"] == 0


@pytest.mark.timeout(30)
def test_generator_kv_cache_and_weights_for_8b_engine():
    g = pm.generator_memory(pm.PRESETS["llama3.1-8b"], pm.GeneratorLayout(tp=1, max_model_len=2048, concurrent_seqs=128))
    assert g["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2          # K+V, 32 layers, 8 KV heads, bf16
    assert g["kv_cache"] == 128 * 2048 * 131072                      # 32 GiB
    assert g["weights"] == 2 * P_TOTAL
    # TP=16 > 8 KV heads: vLLM replicates KV heads, one per GPU
    g16 = pm.generator_memory(pm.PRESETS["llama3.1-70b"], pm.GeneratorLayout(tp=16))
    assert g16["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2


@pytest.mark.timeout(30)
def test_hf_config_json_gives_the_preset_shape(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert pm.load_shape(str(tmp_path)) == pm.PRESETS["qwen2.5-7b"]


@pytest.mark.timeout(60)
def test_cli_exits_2_when_the_layout_exceeds_the_gpu_and_0_when_it_fits(capsys):
    ok = ["--model", "llama3.1-8b", "--tp", "2", "--dp", "4", "--micro-batch", "2", "--seq-len", "2048",
          "--gen-concurrent-seqs", "128"]
    assert pm.main(ok) == 0
    assert pm.main(ok + ["--gpu-mem-gib", "40"]) == 2          # 54.1 GiB learner > 40
    assert pm.main(["--model", "llama3.1-70b", "--tp", "8", "--seq-len", "2048", "--only", "learner"]) == 2
    assert "EXCEEDS" in capsys.readouterr().out
    assert pm.main(["--model", "no-such-model"]) == 1


@pytest.mark.timeout(30)
def test_selective_recompute_of_the_mlp_drops_its_6f_term_and_core_attn_alone_saves_nothing():
    shape = pm.PRESETS["llama3.1-8b"]
    mlp = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, recompute="selective",
                                                    recompute_modules=("core_attn", "mlp")))
    assert mlp["activations"] == pytest.approx(32 * 2048 * 2 // 2 * (8 * 4096 + 4 * 4096 + 4 * 1024))
    attn = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, recompute="selective"))
    assert attn["activations"] == pytest.approx(32 * A_LAYER)   # flash attention keeps no s*s scores


def test_unfused_attention_adds_the_score_matrix_term_and_selective_core_attn_drops_it():
    """Unfused attention (megatron DotProductAttention / SDPA math) keeps b * a/t * s^2 * 6 bytes
    per layer (fp32 softmax + bf16 probabilities); fused (TE, SDPA flash) keeps none."""
    shape = pm.PRESETS["llama3.1-8b"]
    fused = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2))
    unfused = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, attention="unfused"))
    assert unfused["activations"] - fused["activations"] == pytest.approx(32 * 2 * 16 * 2048 ** 2 * 6)
    sel = pm.learner_memory(shape, pm.LearnerLayout(tp=2, dp=4, micro_batch=2, attention="unfused",
                                                    recompute="selective"))
    assert sel["activations"] == pytest.approx(fused["activations"])
    with pytest.raises(ValueError, match="fused or unfused"):
        pm.learner_memory(shape, pm.LearnerLayout(attention="math"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", ["online-dpo-llama3.1-8b-2n8g", "online-dpo-qwen2.5-7b-math-chat-2n8g",
                                    "online-dpo-llama3.1-70b-8n8g-tp8pp2"])
def test_recipe_header_totals_are_what_plan_memory_gives_for_the_recipe_layout(recipe):
    """The 'Expected per-GPU memory' block of each cluster recipe equals plan_memory's estimate of
    the layout the recipe sets (model shape from the preset its header names)."""
    import re

    from megatron_rlhf.config import load_config

    path = REPO / "configs" / f"{recipe}.yaml"
    text = path.read_text()
    preset = re.search(r"plan_memory\.py --model (\S+)", text).group(1)
    want = float(re.search(r"total\s+([\d.]+) of 80 GiB", text).group(1))
    cfg = load_config(path, ["model.source=smollm2"])   # the real folder is not on this machine
    lay, gen, mem = _layouts(cfg)
    got = pm.plan(pm.PRESETS[preset], lay, gen, gpu_mem_gib=mem, bucket_mb=cfg.generators.weight_sync_bucket_mb)
    assert cfg.learner.distributed_optimizer
    # the header's total is the resident state; the weight-sync staging comes on top (counted in total)
    assert got["learner"]["resident"] == pytest.approx(want, abs=0.006) and got["fits"]
    st = got["learner"]["staging"]
    assert got["learner"]["total"] == pytest.approx(want + st["device_gib"], abs=0.006)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", ["online-dpo-llama3.1-8b-2n8g", "online-dpo-qwen2.5-7b-math-chat-2n8g",
                                    "online-dpo-llama3.1-70b-8n8g-tp8pp2", "smoke-1n8g"])
def test_recipe_header_names_the_weight_sync_staging_plan_memory_decides_for_the_recipe_layout(recipe):
    """Each GPU recipe's header has plan_memory's staging line for its layout: the place (device or
    host), the GiB it adds on the exporting GPU, the stage copy and the numbers of the decision, so
    a reader knows which publish path the run takes (the run decides from the same plan)."""
    import re

    from megatron_rlhf.config import load_config

    path = REPO / "configs" / f"{recipe}.yaml"
    text = path.read_text()
    preset = re.search(r"plan_memory\.py --model (\S+)", text).group(1)
    m = re.search(r"\+ staging\s+([\d.]+) GiB\s+(device|host): ([\d.]+) GiB stage copy "
                  r"\(([\d.]+) \+ ([\d.]+) GiB (<=|>) 90% of (\d+) GiB\)", text)
    assert m, f"{path.name}: no '+ staging ... GiB device|host: ... GiB stage copy (...)' line in the header"
    cfg = load_config(path, ["model.source=smollm2"])   # the real folder is not on this machine
    got = pm.plan(pm.PRESETS[preset], pm.learner_layout_from_config(cfg), None,
                  gpu_mem_gib=cfg.placement.gpu_memory_gib, bucket_mb=cfg.generators.weight_sync_bucket_mb)
    st, row = got["learner"]["staging"], got["learner"]
    assert m.group(2) == st["place"]
    assert float(m.group(1)) == pytest.approx(st["device_gib"], abs=0.006)
    assert float(m.group(3)) == pytest.approx(st["stage_gib"], abs=0.006)
    assert float(m.group(4)) == pytest.approx(row["resident"], abs=0.05)
    assert float(m.group(5)) == pytest.approx(st["stage_gib"], abs=0.05)
    assert (m.group(6) == "<=") == (st["place"] == "device") and float(m.group(7)) == cfg.placement.gpu_memory_gib


@pytest.mark.timeout(30)
def test_staging_is_counted_on_the_device_when_the_plan_has_room_and_on_the_host_when_not(capsys):
    # 70B TP=8 PP=2: stage 0's full HF tensors are 35.3 B params (65.7 GiB bf16) -> host staging,
    # the device holds two wire buffers; 8B TP=2 DP=4 (54.1 GiB resident): the 15 GiB copy fits in 72 GiB
    shape70 = pm.PRESETS["llama3.1-70b"]
    assert pm.stage_hf_bytes(shape70, 2, 0) == 2 * (40 * sum(shape70.layer_params()) + 128256 * 8192)
    p70 = pm.plan(shape70, pm.LearnerLayout(tp=8, pp=2, dp=2), None, bucket_mb=256)["learner"]
    assert p70["staging"]["place"] == "host" and p70["staging"]["device_gib"] == 0.5
    assert p70["staging"]["stage_gib"] == pytest.approx(65.708, abs=1e-3)
    assert p70["total"] == pytest.approx(p70["resident"] + 0.5)
    p8 = pm.plan(pm.PRESETS["llama3.1-8b"], pm.LearnerLayout(tp=2, dp=4, micro_batch=2), None)["learner"]
    assert p8["staging"]["place"] == "device"
    assert p8["staging"]["device_gib"] == pytest.approx(2 * P_TOTAL / 2**30)
    assert pm.main(["--model", "llama3.1-70b", "--tp", "8", "--pp", "2", "--dp", "2", "--only", "learner", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["learner"]["staging"]["place"] == "host" and out["learner"]["staging"]["device_gib"] == 0.5


def _layouts(cfg):
    """``layouts_from_config`` without reading the model folder."""
    ln, gn = cfg.learner, cfg.generators
    lay = pm.LearnerLayout(tp=ln.tensor_parallel, pp=ln.pipeline_parallel, dp=ln.data_parallel,
                           micro_batch=ln.micro_batch_size, seq_len=gn.max_model_len,
                           distributed_optimizer=ln.distributed_optimizer, sequence_parallel=ln.sequence_parallel,
                           recompute=ln.recompute, recompute_modules=tuple(ln.recompute_modules))
    gen = pm.GeneratorLayout(tp=gn.tensor_parallel, max_model_len=gn.max_model_len, concurrent_seqs=gn.max_num_seqs,
                             max_batched_tokens=gn.max_num_batched_tokens,
                             gpu_memory_utilization=gn.gpu_memory_utilization)
    return lay, gen, cfg.placement.gpu_memory_gib


@pytest.mark.timeout(60)
def test_a_recipe_is_planned_without_its_weights_when_the_shape_is_given(capsys):
    """A fresh-user finding: ``--config <GPU recipe>`` needs ``model.source`` (a cluster path) on
    the host; ``--model <preset>`` gives the shape instead, and without it the refusal says so."""
    from dataclasses import asdict

    recipe = str(REPO / "configs" / "online-dpo-llama3.1-8b-2n8g.yaml")
    assert pm.main(["--config", recipe]) == 1
    assert "to plan without the weights here, give the shape: --model" in capsys.readouterr().err
    assert pm.main(["--config", recipe, "--model", "llama3.1-8b", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["shape"] == asdict(pm.PRESETS["llama3.1-8b"]) and got["learner"]["fits"] and got["generator"]["fits"]
