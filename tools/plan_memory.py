#!/usr/bin/env python
"""Per-GPU memory estimate of a megatron-rlhf layout: learner GPUs and vLLM generator GPUs.

    # a named preset or an HF config.json (file or model folder), layout on the command line:
    python tools/plan_memory.py --model llama3.1-8b --tp 2 --pp 1 --dp 4 --micro-batch 2 --seq-len 2048
    python tools/plan_memory.py --model /models/Llama-3.1-70B --tp 8 --pp 2 --dp 2 --gen-tp 4
    # or everything from a recipe (model.source, learner.*, generators.*, placement.gpu_memory_gib):
    python tools/plan_memory.py --config configs/online-dpo-llama3.1-8b-2n8g.yaml

Exit code 0 when both GPU kinds fit, 2 when either estimate exceeds its budget (the learner GPU:
``--gpu-mem-gib``; a generator GPU: ``--gpu-memory-utilization`` x ``--gpu-mem-gib``, the share
vLLM takes), 1 on bad input. ``slurm/submit.py`` runs the same check before submitting.

The formulas (learner GPU per pipeline stage, vLLM generator GPU, the weight-sync staging line)
are :mod:`megatron_rlhf.memory_plan`'s docstring; this file is its command line and table. A run
decides its staging from the same numbers (``memory_plan.learner_plan_bytes``, passed to the
broadcast transport by ``trainer/setup.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # this checkout's package, whatever else is installed
    sys.path.insert(0, _REPO)

from megatron_rlhf.memory_plan import (  # noqa: E402,F401  (after the path set-up; re-exported for callers)
    PRESETS, GeneratorLayout, GiB, LearnerLayout, ModelShape, generator_memory, layer_activation_bytes,
    layouts_from_config, learner_layout_from_config, learner_memory, learner_plan_bytes, learner_resident_bytes,
    learner_staging, load_shape, plan, shape_from_hf_config, stage_hf_bytes, stage_params)


def format_plan(p: dict, lay: LearnerLayout | None, gen: GeneratorLayout | None) -> str:
    """A human-readable table of :func:`plan`'s result."""
    lines = [f"model: {p['model_params'] / 1e9:.2f} B parameters; GPU {p['gpu_mem_gib']:g} GiB"]
    if lay is not None:
        r = p["learner"]
        lines += [f"learner GPU (TP={lay.tp} PP={lay.pp} DP={lay.dp}, distributed optimizer "
                  f"{'on' if lay.distributed_optimizer else 'off'}, micro-batch {lay.micro_batch} x "
                  f"{lay.seq_len} tokens, recompute {lay.recompute}"
                  + (f" {'+'.join(lay.recompute_modules)}" if lay.recompute == "selective" else "")
                  + f"; worst stage {r['stage']}, "
                  f"{r['params'] / 1e9:.3f} B params):"]
        for k in ("weights", "grads", "optimizer", "reference", "activations", "logits"):
            lines.append(f"  {k:<12} {r[k]:8.2f} GiB")
        lines.append(f"  {'overhead':<12} {p['overhead_gib']:8.2f} GiB")
        st = r["staging"]
        lines.append(f"  {'staging':<12} {st['device_gib']:8.2f} GiB  {st['place']}: {st['stage_gib']:.2f} GiB stage copy "
                     f"({st['reason']})")
        lines.append(f"  {'total':<12} {r['total']:8.2f} GiB of {r['budget']:g}  "
                     + ("OK" if r["fits"] else "EXCEEDS"))
    if gen is not None:
        r = p["generator"]
        lines += [f"generator GPU (vLLM TP={gen.tp}, {gen.concurrent_seqs} seqs x {gen.max_model_len} "
                  f"tokens, {r['kv_bytes_per_token'] / 1024:.0f} KiB KV per token per GPU):"]
        for k in ("weights", "kv_cache", "activations"):
            lines.append(f"  {k:<12} {r[k]:8.2f} GiB")
        lines.append(f"  {'overhead':<12} {p['overhead_gib']:8.2f} GiB")
        lines.append(f"  {'total':<12} {r['total']:8.2f} GiB of {r['budget']:.1f} "
                     f"(gpu_memory_utilization x GPU)  " + ("OK" if r["fits"] else "EXCEEDS")
                     + f"; KV room for {r['kv_capacity_seqs']} full-length sequences")
        lines += [f"  vLLM would refuse to start: {p}" for p in r["problems"]]
    return "\n".join(lines)


def _positive(kind):
    """An argparse type: ``kind`` (int or float) > 0, refused with the value named otherwise."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a recipe YAML: layout read from it (other layout flags ignored)")
    ap.add_argument("overrides", nargs="*", help="config overrides (with --config)")
    ap.add_argument("--model", default=None,
                    help=f"preset ({', '.join(PRESETS)}), config.json or HF folder (default llama3.1-8b); with "
                         "--config: the shape instead of model.source, so a recipe is planned without its weights")
    ap.add_argument("--tp", type=_positive(int), default=1, help="learner tensor parallel (learner.tensor_parallel)")
    ap.add_argument("--pp", type=_positive(int), default=1, help="learner pipeline parallel (learner.pipeline_parallel)")
    ap.add_argument("--dp", type=_positive(int), default=1,
                    help="learner data parallel (learner.data_parallel): shards the distributed optimizer")
    ap.add_argument("--micro-batch", type=_positive(int), default=1, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=_positive(int), default=2048, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--no-sequence-parallel", action="store_true")
    ap.add_argument("--recompute", choices=("none", "full", "selective"), default="none")
    ap.add_argument("--recompute-modules", default="core_attn",
                    help="with --recompute selective: comma-separated core_attn,mlp")
    ap.add_argument("--no-reference", action="store_true", help="reference model not on learner GPUs")
    ap.add_argument("--attention", choices=("fused", "unfused"), default="fused",
                    help="fused: TE or SDPA flash (no score matrix); unfused: megatron DotProductAttention")
    ap.add_argument("--gen-tp", type=_positive(int), default=1, help="generator tensor parallel (generators.tensor_parallel)")
    ap.add_argument("--gen-max-model-len", type=int, default=None, help="default: --seq-len")
    ap.add_argument("--gen-concurrent-seqs", type=int, default=256,
                    help="sequences the engine runs at once (generators.max_num_seqs): its KV cache")
    ap.add_argument("--gen-max-batched-tokens", type=int, default=8192,
                    help="tokens per engine step (vLLM max_num_batched_tokens): its activations")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of a generator GPU vLLM may take (generators.gpu_memory_utilization)")
    ap.add_argument("--gpu-mem-gib", type=_positive(float), default=None, help="GPU memory (default 80, or the recipe's)")
    ap.add_argument("--overhead-gib", type=float, default=3.0,
                    help="per GPU, learner and generator: CUDA context, NCCL buffers, allocator fragmentation")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="generators.weight_sync_bucket_mb (default 256, or the recipe's)")
    ap.add_argument("--only", choices=("learner", "generator"), help="estimate one GPU kind only")
    ap.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = ap.parse_intermixed_args(argv)
    try:
        if args.config:
            from megatron_rlhf.config import load_config

            from megatron_rlhf.config import ConfigError

            try:
                cfg = load_config(args.config, args.overrides)
            except ConfigError as e:   # a recipe's model.source is a folder on the cluster, not here
                if "'model.source'" not in str(e):
                    raise
                if args.model is None:
                    raise ConfigError(f"{e}; to plan without the weights here, give the shape: --model "
                                      f"<{'|'.join(PRESETS)}|config.json>") from None
                cfg = load_config(args.config, [*args.overrides, "model.source=smollm2"])   # its shape: --model
            shape, lay, gen, mem = layouts_from_config(cfg, load_shape(args.model) if args.model else None)
            bucket_mb = cfg.generators.weight_sync_bucket_mb
        else:
            if args.overrides:
                ap.error("overrides need --config")
            shape = load_shape(args.model or "llama3.1-8b")
            lay = LearnerLayout(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
                                seq_len=args.seq_len, distributed_optimizer=not args.no_distributed_optimizer,
                                sequence_parallel=not args.no_sequence_parallel, recompute=args.recompute,
                                recompute_modules=tuple(args.recompute_modules.split(",")),
                                reference=not args.no_reference, attention=args.attention)
            gen = GeneratorLayout(tp=args.gen_tp, max_model_len=args.gen_max_model_len or args.seq_len,
                                  concurrent_seqs=args.gen_concurrent_seqs,
                                  max_batched_tokens=args.gen_max_batched_tokens,
                                  gpu_memory_utilization=args.gpu_memory_utilization)
            mem, bucket_mb = 80.0, 256.0
        if args.bucket_mb is not None:
            bucket_mb = args.bucket_mb
        if args.gpu_mem_gib is not None:
            mem = args.gpu_mem_gib
        if args.only == "learner":
            gen = None
        elif args.only == "generator":
            lay = None
        result = plan(shape, lay, gen, gpu_mem_gib=mem, overhead_gib=args.overhead_gib, bucket_mb=bucket_mb)
    except ValueError as e:  # includes ConfigError
        print(f"plan_memory: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"shape": asdict(shape), **result}, indent=1))
    else:
        print(format_plan(result, lay, gen))
    if not result["fits"]:
        over = [k for k in ("learner", "generator") if k in result and not result[k]["fits"]]
        fixes = {"learner": "the learner: raise TP/PP/DP, turn on the distributed optimizer or recompute, "
                            "or lower the micro-batch",
                 "generator": "the generator: raise its TP (--gen-tp), lower its concurrent sequences "
                              "(--gen-concurrent-seqs, generators.max_num_seqs) or its context (--gen-max-model-len)"}
        print(f"WARNING: the estimate exceeds the GPU memory for {'; and for '.join(fixes[k] for k in over)}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
