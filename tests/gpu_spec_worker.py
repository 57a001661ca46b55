"""One gloo rank of tests/test_gpu_spec_recipes.py: build, for each recipe, the GPU learner's exact
TransformerConfig and layer spec without Transformer Engine (``learner_model_spec(cuda=True,
te=False)``), turn off only the CUDA-only fusions, and run one forward/backward at the recipe's TP
with sequence parallelism through the learner's own micro-batch code.

    python tests/gpu_spec_worker.py RANK WORLD PORT OUT_JSON JOB_JSON

JOB_JSON: ``[{"recipe": path, "model_dir": tiny HF folder}]`` (every job has this TP = WORLD). The
recipe's ``learner`` section (merged over its ``defaults:``, typed and validated by the config
loader) and ``model.dtype`` are used as they are, with ``pipeline_parallel`` and ``data_parallel``
set to 1 (one TP group). Rank 0 writes OUT_JSON: per recipe the config fields that differ from the GPU
variant, the spec's module classes, the mean / max |logprob - HF fp32 logprob| and gradient checks.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _config_diff(a, b) -> list[str]:
    out = []
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name, None), getattr(b, f.name, None)
        try:
            same = bool(va == vb)
        except Exception:   # tensors, callables compare by identity
            same = va is vb
        if not same:
            out.append(f.name)
    return sorted(out)


def run_job(job: dict, groups, rank: int) -> dict:
    from megatron_rlhf.config import LearnerConfig, _build, _read_yaml
    from megatron_rlhf.convert.sharding import padded_vocab_size
    from megatron_rlhf.learner.model import build_gpt_model, learner_model_spec, load_hf_config
    from megatron_rlhf.learner.schedule import make_microbatch, run_microbatches
    from megatron_rlhf.learner.weights import load_hf_weights, mark_tensor_parallel
    from megatron_rlhf.platform import CUDA_ONLY_FIELDS, get_platform, micro_batch_length_multiple
    from megatron_rlhf.platform.local_spec import SDPACoreAttention, TorchNorm

    tree = _read_yaml(REPO / job["recipe"])
    learner_cfg = dataclasses.replace(_build(LearnerConfig, tree.get("learner"), "learner"),
                                      pipeline_parallel=1, data_parallel=1)
    dtype = (tree.get("model") or {}).get("dtype", "float32")
    hf = load_hf_config(job["model_dir"])
    tp = learner_cfg.tensor_parallel
    gpu = learner_model_spec(hf, learner_cfg, dtype=dtype, cuda=True, te=False)
    # the only change for CPU: the fusions that need CUDA kernels to run
    cpu_config = dataclasses.replace(gpu.config, **{k: False for k in CUDA_ONLY_FIELDS})
    layer = gpu.layer_spec.submodules.layer_specs[0].submodules
    spec_classes = {"core_attention": layer.self_attention.submodules.core_attention is SDPACoreAttention,
                    "input_layernorm": layer.input_layernorm is TorchNorm,
                    "pre_mlp_layernorm": layer.pre_mlp_layernorm is TorchNorm,
                    "final_layernorm": gpu.layer_spec.submodules.layer_norm is TorchNorm}
    padded = padded_vocab_size(hf.vocab_size, tp)
    model = build_gpt_model(hf, cpu_config, platform=get_platform("cpu"),
                            pg_collection=groups.pg_collection, vocab_size=padded,
                            layer_spec=gpu.layer_spec)
    mark_tensor_parallel(model, hf)
    load_hf_weights(model, job["model_dir"], hf, tp_rank=groups.pg_collection.tp.rank(), tp=tp,
                    padded_vocab=padded)
    seq = micro_batch_length_multiple(learner_cfg.seq_length_multiple, cuda=True, tp=tp,
                                      sequence_parallel=gpu.sequence_parallel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (2, seq), generator=g)
    mb = make_microbatch(ids, (0, 1), seq, "cpu")
    got = {}

    def on_logprobs(k, mb_, tok):
        got["tok"] = tok.detach().float()
        return -tok[:, 1:].float().mean()

    model.train()
    run_microbatches(model, [mb], on_logprobs, forward_only=False, pp=1,
                     pg_collection=groups.pg_collection, vocab_size=hf.vocab_size, padded_vocab=padded,
                     tp_rank=groups.pg_collection.tp.rank(), tp=tp)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
    out = {"recipe": job["recipe"], "tp": tp, "seq_len": seq, "dtype": str(cpu_config.params_dtype),
           "sequence_parallel": gpu.sequence_parallel, "config_diff": _config_diff(gpu.config, cpu_config),
           "gpu_cuda_fields": {k: getattr(gpu.config, k) for k in
                               ("use_cpu_initialization", "bias_activation_fusion", "apply_rope_fusion",
                                "sequence_parallel", "recompute_granularity", "recompute_modules")},
           "spec": spec_classes,
           "grads_all_present_and_finite": all(gr is not None and bool(torch.isfinite(gr).all()) for gr in grads),
           "grads_nonzero_fraction": sum(bool(gr is not None and gr.abs().sum() > 0) for gr in grads) / len(grads),
           "norm_params_sequence_parallel": all(getattr(p, "sequence_parallel", False) == gpu.sequence_parallel
                                                for m in norms for p in m.parameters())}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
        with torch.no_grad():
            lp = torch.log_softmax(ref(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        d = (got["tok"][:, 1:] - lp).abs()
        out.update(logprob_mean_abs=float(d.mean()), logprob_max_abs=float(d.max()),
                   hf_logprob_std=float(lp.std()))
    return out


def main() -> None:
    rank, world, port, out_path, job_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    sys.path.insert(0, str(REPO))
    from megatron_rlhf.learner import parallel
    from megatron_rlhf.platform import cpu

    torch.set_num_threads(1)
    cpu.install(function_mode=False)   # P1: use_cpu_initialization=False allocates on current_device()
    groups = parallel.acquire(backend="gloo", tp=world, pp=1, rank=rank, world_size=world,
                              init_method=f"tcp://127.0.0.1:{port}")
    cpu.seed(0)
    rows = [run_job(job, groups, rank) for job in json.loads(Path(job_path).read_text())]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    parallel.release()


if __name__ == "__main__":
    main()
