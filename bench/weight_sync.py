#!/usr/bin/env python
"""Weight-sync benchmark: learner -> vLLM worker(s) per transport, against a memcpy floor.

    .venv/bin/python bench/weight_sync.py                       # tiny random Llama, CPU transports
    .venv/bin/python bench/weight_sync.py --model smollm2       # SmolLM2-135M (517 MB fp32)
    .venv/bin/python bench/weight_sync.py --workers 2 --repeats 5 --transports object_store

For each transport available on this machine (``object_store`` and ``filesystem`` everywhere,
``nccl`` only with CUDA GPUs) it publishes the learner's weights (a real ``MegatronLearner``
actor) and pushes them to every worker (real ``VLLMGenerator`` actors) ``--repeats`` times through
the same :class:`~megatron_rlhf.generator.pool.GeneratorPool` path the trainer uses, checks the
workers' probe logprobs against the learner's after each push, and prints the median seconds of
export (learner side), load (worker side, slowest worker) and their sum. The floor is a plain
``torch`` tensor copy of the same number of bytes in the same run (``dst.copy_(src)``, median of
5): ``ratio = sync seconds / floor seconds`` says how far each transport is from moving the bytes
once through memory. GB/s = bytes x workers / sync seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_floor_s(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of ``dst.copy_(src)`` for two ``nbytes`` uint8 CPU tensors (first-touch
    excluded)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def available_transports() -> list[str]:
    """``object_store`` and ``filesystem``; plus ``nccl`` when CUDA is visible."""
    import torch

    return ["object_store", "filesystem"] + (["nccl"] if torch.cuda.is_available() else [])


def run(model: str, workers: int, repeats: int, transports: list[str], work_dir: Path) -> list[dict]:
    import ray

    from megatron_rlhf.config import load_config
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.vllm_engine import VLLMGenerator
    from megatron_rlhf.generator.weight_sync import make_transport
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.runtime import apply_process_env, process_env

    apply_process_env(str(work_dir / "tmp"))
    if model == "tiny":
        from megatron_rlhf.testing.tiny import make_tiny_model

        model_dir = make_tiny_model(work_dir / "tiny", "llama")
    elif model == "smollm2":
        from megatron_rlhf.convert.gguf import ensure_smollm2_hf

        model_dir = ensure_smollm2_hf(os.path.expanduser("~/.cache/megatron_rlhf"))
    else:
        model_dir = Path(model)
    ray.init(num_cpus=workers + 1, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    rows = []
    try:
        cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
            f"model.source={model_dir}", "generators.check_weight_sync=true", "generators.cpu_core=-1",
            f"generators.num_workers={workers}", "generators.max_model_len=512",
            "generators.max_new_tokens=16"])
        learner = ray.remote(num_cpus=1)(MegatronLearner).remote(
            model_dir=str(model_dir), learner_cfg=cfg.learner, algorithm_cfg=cfg.algorithm, seed=0)
        gens = [ray.remote(num_cpus=1)(VLLMGenerator).remote(model_dir=str(model_dir), generator_cfg=cfg.generators,
                                                             seed=i) for i in range(workers)]
        ray.get([a.__ray_ready__.remote() for a in (learner, *gens)])
        probe = list(range(10, 74))
        version = 0
        for name in transports:
            cfg.generators.transport = name
            transport = make_transport(cfg.generators, work_dir / f"run_{name}")
            if hasattr(transport, "setup"):
                transport.setup(learner, gens, 600)
            pool = GeneratorPool(gens, transport=transport, generator_cfg=cfg.generators, timeout_s=600,
                                 probe=probe, log=lambda m: print(m, file=sys.stderr))
            res = []
            for _ in range(repeats):
                version += 1   # same weights, new version number: every push really loads
                w = transport.publish(learner, version, 600, probe)
                res.append(pool.push(w))
            transport.close()
            nbytes = res[-1]["sync/bytes"]
            floor = copy_floor_s(nbytes)
            export_s = statistics.median(r["sync/export_s"] for r in res)
            load_s = statistics.median(r["sync/load_s"] for r in res)
            total = statistics.median(r["time/sync_s"] for r in res)
            rows.append({"transport": name, "bytes": nbytes, "workers": workers, "export_s": export_s,
                         "load_s": load_s, "sync_s": total, "floor_s": floor, "ratio": total / floor,
                         "GBps": nbytes * workers / total / 1e9, "floor_GBps": nbytes / floor / 1e9,
                         "check_max_abs_diff": max(r["sync/check_max_abs_diff"] for r in res)})
    finally:
        ray.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'smollm2', or an HF folder")
    ap.add_argument("--workers", type=int, default=1, help="vLLM workers receiving every push")
    ap.add_argument("--repeats", type=int, default=3, help="pushes per transport (median reported)")
    ap.add_argument("--transports", nargs="+", default=None, help="default: all available here")
    args = ap.parse_args(argv)
    transports = args.transports or available_transports()
    with tempfile.TemporaryDirectory(prefix="mrlhf_bench_sync_") as d:
        rows = run(args.model, args.workers, args.repeats, transports, Path(d))
    print(f"\nweight sync, model={args.model}, workers={args.workers}, repeats={args.repeats} (median)")
    print(f"{'transport':<13}{'MB':>9}{'export s':>10}{'load s':>9}{'sync s':>9}{'floor s':>10}"
          f"{'ratio':>8}{'GB/s':>8}{'floor GB/s':>11}{'check':>10}")
    for r in rows:
        print(f"{r['transport']:<13}{r['bytes'] / 1e6:>9.1f}{r['export_s']:>10.3f}{r['load_s']:>9.3f}"
              f"{r['sync_s']:>9.3f}{r['floor_s']:>10.4f}{r['ratio']:>8.0f}{r['GBps']:>8.3f}"
              f"{r['floor_GBps']:>11.2f}{r['check_max_abs_diff']:>10.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
