"""The GPU learner's model without Transformer Engine, per cluster recipe, on CPU/gloo.

For every recipe in ``configs/`` that sets ``learner.tensor_parallel > 1`` or a GPU placement, the
exact ``TransformerConfig`` and layer spec its GPU learner builds with TE absent
(:func:`megatron_rlhf.learner.model.learner_model_spec` with ``cuda=True, te=False``) are built at
a scaled-down size of the recipe's architecture (2 layers, head_dim 8, the recipe's query/KV head
ratio, heads divisible by its TP), and one forward/backward runs at the recipe's TP with sequence
parallelism over gloo processes, through the learner's micro-batch code, in the recipe's dtype
(bf16). The one difference from the GPU build is :data:`megatron_rlhf.platform.CUDA_ONLY_FIELDS`
(``bias_activation_fusion``: megatron's ``torch.compile``/Triton SwiGLU), and the test asserts
that it is the only one. Not covered: pipeline parallelism (the 70B's PP=2; PP is run by
tests/test_learner_parallel.py), data parallelism, the optimizer.

``configs/base_cluster.yaml`` is the recipes' shared base, not a runnable recipe (the loader refuses
its TP x PP x DP = 1 against 8 GPUs); its learner keys reach this test through every recipe that
inherits it, which the test checks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rlhf.config import _read_yaml

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "gpu_spec_worker.py"

#: query heads per KV head of the recipes' models (config.json of each), by name fragment
_GQA = {"llama3.170b": ("llama", 8), "llama3.18b": ("llama", 4), "qwen2.57b": ("qwen2", 7),
        "qwen3": ("qwen3", 2), "qwen2": ("qwen2", 7), "llama": ("llama", 4)}


def cluster_recipes() -> list[tuple[str, dict]]:
    """Recipes whose learner is TP > 1 or placed on GPUs, with their merged raw config."""
    out = []
    for p in sorted((REPO / "configs").glob("*.yaml")):
        raw = _read_yaml(p)   # merged over its defaults: chain, as the loader reads it
        if p.name == "base_cluster.yaml":
            continue
        tp = (raw.get("learner") or {}).get("tensor_parallel", 1)
        gpus = (raw.get("placement") or {}).get("gpus_per_node", 0)
        if tp > 1 or gpus > 0:
            out.append((str(p.relative_to(REPO)), raw))
    return out


def _tiny_hf_folder(out: Path, source: str, tp: int) -> Path:
    """A random HF model of the recipe's architecture, scaled down (see module doc)."""
    import torch
    import transformers

    key = "".join(c for c in Path(str(source)).name.lower() if c.isalnum() or c == ".").replace("-", "")
    key = key.replace("instruct", "")
    arch, ratio = next((v for k, v in _GQA.items() if k.replace(".", "") in key.replace(".", "")), ("llama", 4))
    kv = tp
    heads, head_dim = kv * ratio, 8
    hidden = heads * head_dim
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    kw = dict(vocab_size=250, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
              max_position_embeddings=16384, rms_norm_eps=1e-5,
              initializer_range=0.2 * (64 / hidden) ** 0.5,   # logits of a few nats at any width
              tie_word_embeddings=False)
    if arch == "llama" and "3.1" in str(source):
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    torch.manual_seed(0)
    model_cls(cfg_cls(**kw)).save_pretrained(out, safe_serialization=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_tp(tp: int, jobs: list[dict], tmp: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    job_file, out = tmp / f"jobs_tp{tp}.json", tmp / f"out_tp{tp}.json"
    job_file.write_text(json.dumps(jobs))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(tp), str(port), str(out), str(job_file)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(tp)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return json.loads(out.read_text())


def test_every_recipe_inherits_base_cluster_and_is_selected():
    recipes = dict(cluster_recipes())
    inheriting = [p for p in sorted((REPO / "configs").glob("*.yaml"))
                  if "base_cluster.yaml" in str(yaml.safe_load(p.read_text()).get("defaults", ""))]
    assert inheriting and all(str(p.relative_to(REPO)) in recipes for p in inheriting)
    assert any(r["learner"].get("tensor_parallel", 1) > 1 for r in recipes.values())


@pytest.mark.timeout(600)
def test_gpu_learner_spec_without_te_runs_forward_backward_at_each_recipes_tp_with_sequence_parallel(tmp_path):
    by_tp: dict[int, list[dict]] = {}
    for recipe, raw in cluster_recipes():
        ln = raw.get("learner") or {}
        tp = int(ln.get("tensor_parallel", 1))
        folder = _tiny_hf_folder(tmp_path / Path(recipe).stem, (raw.get("model") or {}).get("source", ""), tp)
        # the worker keeps the recipe's learner section and dtype, with PP = DP = 1 (one TP group)
        by_tp.setdefault(tp, []).append({"recipe": recipe, "model_dir": str(folder)})
    rows = [row for tp, jobs in sorted(by_tp.items()) for row in _run_tp(tp, jobs, tmp_path)]
    assert {r["recipe"] for r in rows} == {r for r, _ in cluster_recipes()}
    for r in rows:
        name = r["recipe"]
        assert r["config_diff"] == ["bias_activation_fusion"], (name, r["config_diff"])
        assert r["gpu_cuda_fields"]["use_cpu_initialization"] is False, name   # run unchanged here
        assert r["gpu_cuda_fields"]["apply_rope_fusion"] is False, name        # TE absent
        assert r["gpu_cuda_fields"]["bias_activation_fusion"] is True, name
        assert all(r["spec"].values()), (name, r["spec"])
        assert r["dtype"] == "torch.bfloat16", name
        assert r["sequence_parallel"] == (r["tp"] > 1) and r["norm_params_sequence_parallel"], name
        assert r["seq_len"] % 64 == 0 and r["seq_len"] % r["tp"] == 0, name
        assert r["grads_all_present_and_finite"] and r["grads_nonzero_fraction"] == 1.0, (name, r)
        # bf16 megatron at TP with SP against transformers fp32 on the same weights; the HF
        # logprobs are far from uniform (std), so a layout or RoPE error would show
        assert r["hf_logprob_std"] > 0.3, r
        assert r["logprob_mean_abs"] < 0.05 and r["logprob_max_abs"] < 0.5, r
    print(json.dumps(rows, indent=1))
