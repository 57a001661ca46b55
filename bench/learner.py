"""Learner throughput benchmark: Online DPO train steps of MegatronLearner, tokens/s and MFU.

No Ray: one process, or one per GPU with torchrun (ranks rendezvous through torchrun's env://).

    # CPU, the tiny random Llama (hidden 128, 2 layers), one process
    OMP_NUM_THREADS=2 python bench/learner.py --preset tiny --pairs 8 --seq 256 --steps 5
    # one GPU, random-weight Llama-3.2-1B shape in bf16
    python bench/learner.py --preset llama-1b --pairs 8 --seq 1024 --mbs 4 --steps 10
    # 8 GPUs, TP=2 x DP=4
    torchrun --nproc_per_node=8 bench/learner.py --preset llama-3b --tp 2 --dp 4 --pairs 32 --seq 2048
    # any HF Llama folder
    python bench/learner.py --model-dir /path/to/hf --pairs 8 --seq 1024

Each step trains on ``--pairs`` synthetic preference pairs (2 sequences each) of ``--seq`` tokens
(``--variable``: completion lengths drawn uniformly from [seq/4, seq], to see length grouping at
work; ``--max-tokens N``: micro-batches under a token budget instead of ``--mbs`` rows, and the
result reports ``padding_fraction_rows`` / ``padding_fraction_token_budget``: the same batches
planned both ways): a reference forward, a policy forward + backward, one Adam step.

Packed vs padded (``--pack both``, the default): two learners on the same weights, in one run,
train on the same batches, step by step in turn (so load on a shared machine hits both alike):
``learner.pack_sequences=false`` (rows right-padded to the micro-batch's longest) and ``true``
(rows back to back in one THD row). The result has each mode's ``padding_fraction`` and
``tokens_per_s`` under ``padded`` / ``packed`` and their ratio ``packed_over_padded_tokens_per_s``;
the top-level figures are the packed run's. ``--pack on|off`` runs one mode.

Model FLOPs (what MFU counts): F(T) per token, derived in ``megatron_rlhf.learner.flops``.
A DPO step counts, for every real token of every row, 3*F(T) for the policy
(forward + backward = 2x forward) plus F(T) for the reference forward, with T the row's real
length (``megatron_rlhf.learner.flops.model_flops_per_token``, which the learner's ``perf/*``
metrics use too). MFU = model FLOPs per second / (peak FLOPs per device * devices). Peak:
``--peak-tflops``, else the table of ``megatron_rlhf/platform/peaks.py`` (H100/H200 bf16 dense
989 TFLOPs, A100 312, ...), or on CPU cores * GHz * 32 (fp32 AVX2: two
8-wide FMA units, 2 FLOPs per FMA; the frequency from /proc/cpuinfo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

#: Llama 3.1's RoPE scaling (its config.json, with max_position_embeddings 131072): the rule the
#: 8B/70B recipes' models use, which megatron implements as ``rope_scaling=True``
#: (``megatron_rlhf.convert.mapping._rope_scaling``). Presets carrying it (``tiny``: gpu_check's
#: dry run in CI; ``llama-3b``: gpu_check on a GPU) compare that conversion against transformers
#: (review 2, N15); ``llama-1b`` stays unscaled, so the GPU run checks both.
LLAMA31_ROPE = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    max_position_embeddings=131072)

PRESETS = {  # HF LlamaConfig fields; random weights
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, **LLAMA31_ROPE),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True),   # Llama-3.2-1B shape
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True, **LLAMA31_ROPE),   # Llama-3.2-3B shape, Llama-3.1 RoPE
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True),   # the CPU demo's model shape (SmolLM2-135M)
    "llama-1b-4l": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                        tie_word_embeddings=True),   # Llama-3.2-1B layers, 4 of them: 0.31 B params
}


def write_random_llama(out: Path, preset: str, dtype: str) -> Path:
    """An HF folder (config.json + safetensors shards of <= 2 GB) with N(0, 0.02) weights and
    unit norms for a preset shape; the learner needs no tokenizer. Rank 0 writes, others wait.
    Returns ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                         **PRESETS[preset]})
    cfg.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for k, shape in shapes.items():
        t = torch.ones(shape) if k.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
        shard[k] = t.to(dt)
        size += t.numel() * t.element_size()
        if size > 2 * 2**30:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg.save_pretrained(out)
    return out


def model_flops_per_token(hf, seq_len: int) -> float:
    """Forward FLOPs of one token in a sequence of ``seq_len`` tokens:
    :func:`megatron_rlhf.learner.flops.model_flops_per_token` (see the module doc)."""
    from megatron_rlhf.learner.flops import model_flops_per_token as flops

    return flops(hf, seq_len)


def peak_flops(device: str, override_tflops: float | None, dtype: str = "bfloat16") -> tuple[float | None, str]:
    """Peak FLOPs/s of one device and how it was obtained."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if device == "cuda":
        import torch

        from megatron_rlhf.platform.peaks import peak_tflops

        name = torch.cuda.get_device_name()
        tf = peak_tflops(name, dtype)
        if tf is not None:
            return tf * 1e12, f"{name} {dtype} dense {tf:.0f} TFLOPs (platform/peaks.py)"
        return None, f"{name} {dtype}: unknown peak (pass --peak-tflops)"
    try:
        mhz = max(float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz"))
    except (OSError, ValueError):
        return None, "CPU frequency unknown (pass --peak-tflops)"
    import torch

    threads = torch.get_num_threads()
    return threads * mhz * 1e6 * 32, f"CPU {threads} threads x {mhz / 1000:.2f} GHz x 32 FLOPs/cycle (AVX2 fp32)"


def make_batch(pairs: int, seq: int, vocab: int, variable: bool, seed: int):
    """Synthetic DPO batch: prompts of seq/4 tokens shared per pair, completions to ``seq``
    (``variable``: uniform lengths in [seq/4, seq])."""
    import torch

    from megatron_rlhf.types import LearnerBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, seq), generator=g)
    mask = torch.zeros(2 * pairs, seq)
    prompt = max(1, seq // 4)
    for r in range(2 * pairs):
        ids[r | 1, :prompt] = ids[r & ~1, :prompt]
        end = int(torch.randint(prompt + 1, seq + 1, (1,), generator=g)) if variable else seq
        mask[r, prompt:end] = 1.0
    return LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0)


def planned_padding(lengths: list[int], a, learner) -> tuple[tuple[float, int], tuple[float, int]]:
    """``(batch/padding_fraction, micro-batches)`` of the same rows planned with ``--mbs``
    sequences per micro-batch and with the ``--max-tokens`` budget (``(nan, 0)`` when no budget),
    over all DP ranks."""
    from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches

    pad = a.tp if learner.sequence_parallel else 1

    def frac(max_tokens: int) -> tuple[float, int]:
        plans = [plan_microbatches(lengths, rows_per_microbatch=a.mbs, dp_rank=d, dp_size=a.dp,
                                   pad_multiple=pad, max_tokens=max_tokens) for d in range(a.dp)]
        return padding_fraction(lengths, plans), sum(len(p) for p in plans)

    return frac(0), (frac(a.max_tokens) if a.max_tokens else (float("nan"), 0))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--model-dir", help="HF Llama folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pairs", type=int, default=8, help="preference pairs per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--mbs", type=int, default=2, help="learner.micro_batch_size (sequences)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variable", action="store_true", help="random completion lengths")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="learner.max_tokens_per_microbatch (0: --mbs sequences per micro-batch)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--pack", choices=["both", "on", "off"], default="both",
                   help="learner.pack_sequences: both (padded and packed in turn, one run), on, off")
    p.add_argument("--workdir", default=None, help="where preset weights are written (default: a temp dir)")
    a = p.parse_args(argv)

    import torch

    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = a.dtype or ("bfloat16" if device == "cuda" else "float32")
    if a.preset:
        root = Path(a.workdir or os.environ.get("TMPDIR", tempfile.gettempdir())) / f"bench_{a.preset}_{dtype}"
        if rank == 0 and not (root / "config.json").is_file():
            write_random_llama(root, a.preset, dtype)
        model_dir = root
    else:
        model_dir = Path(a.model_dir)
    if world > 1:  # wait for rank 0's weights without torch.distributed (not initialised yet)
        deadline = time.time() + 1800
        while not (model_dir / "config.json").is_file() and time.time() < deadline:
            time.sleep(1)
    modes = {"both": [False, True], "on": [True], "off": [False]}[a.pack]
    t0 = time.perf_counter()
    learners = {}
    for pack in modes:   # the second learner reuses the first one's process groups
        cfg = LearnerConfig(tensor_parallel=a.tp, pipeline_parallel=a.pp, data_parallel=a.dp,
                            micro_batch_size=a.mbs, distributed_optimizer=a.distributed_optimizer,
                            recompute=a.recompute, max_tokens_per_microbatch=a.max_tokens,
                            pack_sequences=pack, optimizer=OptimizerConfig(lr=1e-6))
        learners[pack] = MegatronLearner(model_dir=str(model_dir), learner_cfg=cfg,
                                         algorithm_cfg=AlgorithmConfig(), dtype=dtype,
                                         total_steps=a.steps + a.warmup, rank=rank, world_size=world,
                                         init_method="env://" if world > 1 else None)
    build_s = time.perf_counter() - t0
    learner = learners[modes[-1]]
    hf = learner.hf_config
    times = {m: [] for m in modes}
    pad = {m: [] for m in modes}
    tokens, flops, pad_unsorted, pad_rows, pad_budget = 0, 0.0, [], [], []
    for step in range(a.warmup + a.steps):
        batch = make_batch(a.pairs, a.seq, hf.vocab_size, a.variable, seed=step)
        for pack in (modes if step % 2 == 0 else modes[::-1]):   # alternate which mode goes first
            learner.platform.synchronize()
            t = time.perf_counter()
            m = learners[pack].train_step(batch)
            learner.platform.synchronize()
            if step >= a.warmup:
                times[pack].append(time.perf_counter() - t)
                pad[pack].append(m["batch/padding_fraction"])
        if step >= a.warmup:
            lengths = [int(x) for x in (batch.loss_mask.cumsum(1).argmax(1) + 1).tolist()]
            tokens += sum(lengths)
            flops += sum(n * 4 * model_flops_per_token(hf, n) for n in lengths)
            pad_unsorted.append(m["batch/padding_fraction_unsorted"])
            rows_plan, budget_plan = planned_padding(lengths, a, learner)
            pad_rows.append(rows_plan)
            pad_budget.append(budget_plan)
    peak, peak_src = peak_flops(device, a.peak_tflops, dtype)
    per_mode = {("packed" if pack else "padded"): {
        "step_s": round(sum(times[pack]) / len(times[pack]), 4),
        "tokens_per_s": round(tokens / sum(times[pack]), 1),
        "padding_fraction": round(sum(pad[pack]) / len(pad[pack]), 4)} for pack in modes}
    secs = sum(times[modes[-1]])
    res = {"model": a.preset or str(model_dir), "device": device, "dtype": dtype,
           "tp": a.tp, "pp": a.pp, "dp": a.dp, "pairs": a.pairs, "seq": a.seq, "mbs": a.mbs,
           "variable": a.variable, "steps": a.steps, "build_s": round(build_s, 2),
           "pack_sequences": a.pack, **per_mode,
           "packed_over_padded_tokens_per_s": (round(per_mode["packed"]["tokens_per_s"]
                                                     / per_mode["padded"]["tokens_per_s"], 3)
                                               if a.pack == "both" else None),
           "step_s": round(secs / len(times[modes[-1]]), 4),
           "tokens_per_s": round(tokens / secs, 1),   # real tokens of the batch per wall second
           "model_tflops_per_s": round(flops / secs / 1e12, 4),
           "mfu": None if peak is None else round(flops / secs / (peak * world), 4),
           "peak": peak_src, "padding_fraction": round(sum(pad[modes[-1]]) / len(pad[modes[-1]]), 4),
           "padding_fraction_unsorted": round(sum(pad_unsorted) / len(pad_unsorted), 4),
           # the same batches planned both ways (pure planning, whatever --max-tokens ran)
           "padding_fraction_rows": round(sum(f for f, _ in pad_rows) / len(pad_rows), 4),
           "microbatches_rows": sum(n for _, n in pad_rows) / len(pad_rows),
           "padding_fraction_token_budget": (round(sum(f for f, _ in pad_budget) / len(pad_budget), 4)
                                             if a.max_tokens else None),
           "microbatches_token_budget": (sum(n for _, n in pad_budget) / len(pad_budget)
                                         if a.max_tokens else None),
           "torch_threads": torch.get_num_threads()}
    for lr in reversed(list(learners.values())):
        lr.close()
    if rank == 0:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a plain checkout works too
    sys.exit(0 if main() else 1)
