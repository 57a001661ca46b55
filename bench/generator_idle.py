#!/usr/bin/env python
"""Generator idle time with 2 engines of uneven completion lengths: round barrier vs streaming.

    OMP_NUM_THREADS=1 .venv/bin/python bench/generator_idle.py                 # tiny random Llama
    OMP_NUM_THREADS=1 .venv/bin/python bench/generator_idle.py --requests 12 --short 16 --long 64

Two real ``VLLMGenerator`` actors (tiny random Llama, fp32, CPU). Their completions have uneven
lengths by construction: engine 0 stops at ``--short`` new tokens, engine 1 at ``--long`` (a
random tiny model's lengths cannot be steered per prompt, so the cap stands in for "this engine
drew the long answers"). The same ``--requests`` requests of ``--prompts-per-request`` prompts x
``--samples`` samples run twice through :class:`~megatron_rlhf.generator.pool.GeneratorPool`:

* ``barrier``: rounds of one request per engine (``GeneratorPool.generate``), each round waiting
  for both engines, as the pool did before streaming;
* ``stream``: :meth:`GeneratorPool.stream`, a free engine takes the next request at once.

Printed per mode: wall seconds, prompts per engine, each engine's seconds without a request
(wall - its busy seconds, measured here the same way for both modes; includes the final tail,
when nothing was left to hand out) and the pool's own ``generator/<i>/idle_s`` metric (seconds
without a request while ``draw()`` still had prompts; in ``barrier`` mode each round's draw is
empty once both requests are out, so the metric reads 0 there by construction and the wall -
busy column is the comparison). Ratios are within one run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(requests: int, per_request: int, samples: int, short: int, long: int, work_dir: Path) -> list[dict]:
    import ray

    from megatron_rlhf.config import GeneratorConfig
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.vllm_engine import RAY_ACTOR_OPTIONS, VLLMGenerator
    from megatron_rlhf.generator.weight_sync import ObjectStoreTransport
    from megatron_rlhf.runtime import apply_process_env, process_env
    from megatron_rlhf.testing.tiny import make_tiny_model
    from megatron_rlhf.types import Prompt

    apply_process_env(str(work_dir / "tmp"))
    model_dir = make_tiny_model(work_dir / "tiny", "llama")
    ray.init(address="local", num_cpus=3, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    try:
        cls = ray.remote(num_cpus=1, **RAY_ACTOR_OPTIONS)(VLLMGenerator)
        cfgs = [GeneratorConfig(max_new_tokens=m, max_model_len=m + 32, kv_cache_gib=0.0625) for m in (short, long)]
        gens = [cls.remote(model_dir=str(model_dir), generator_cfg=c, seed=i, cpu_core=-1) for i, c in enumerate(cfgs)]
        ray.get([g.get_weight_version.remote() for g in gens], timeout=600)
        pool = GeneratorPool(gens, transport=ObjectStoreTransport(), generator_cfg=cfgs[1], timeout_s=600)
        prompts = [Prompt(index=i, task="t", token_ids=(3 + i % 11, 5, 9, 11 + i % 7)) for i in range(requests * per_request)]
        pool.generate(prompts[:2], samples)   # warm-up, not timed
        pool.take_stats()
        rows = []
        for mode in ("barrier", "stream"):
            t0 = time.perf_counter()
            chunks = [prompts[i:i + per_request] for i in range(0, len(prompts), per_request)]
            if mode == "barrier":
                while chunks:
                    pool.generate([p for c in chunks[:2] for p in c], samples)
                    chunks = chunks[2:]
            else:
                for _ in pool.stream(samples, lambda: chunks.pop(0) if chunks else []):
                    pass
            wall = time.perf_counter() - t0
            busy = [w.busy_s for w in pool.workers]
            st = pool.take_stats()
            rows.append({"mode": mode, "wall_s": wall,
                         **{f"engine{i}_prompts": st[f"generator/{i}/prompts"] for i in (0, 1)},
                         **{f"engine{i}_idle_s": max(0.0, wall - busy[i]) for i in (0, 1)},
                         **{f"engine{i}_pool_idle_s": st[f"generator/{i}/idle_s"] for i in (0, 1)}})
        return rows
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="requests (default 8)")
    ap.add_argument("--prompts-per-request", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2, help="completions per prompt (K)")
    ap.add_argument("--short", type=int, default=16, help="engine 0's max new tokens")
    ap.add_argument("--long", type=int, default=64, help="engine 1's max new tokens")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_idle_") as d:
        rows = run(a.requests, a.prompts_per_request, a.samples, a.short, a.long, Path(d))
    print("| mode | wall (s) | prompts engine 0 / 1 | engine 0 without request (s) | engine 1 without request (s) | pool idle_s 0 / 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['engine0_prompts']} / {r['engine1_prompts']} | "
              f"{r['engine0_idle_s']:.1f} | {r['engine1_idle_s']:.1f} | "
              f"{r['engine0_pool_idle_s']:.2f} / {r['engine1_pool_idle_s']:.2f} |")
    b, s = rows
    print(f"stream / barrier wall time: {s['wall_s'] / b['wall_s']:.2f}; engine-0 idle "
          f"{b['engine0_idle_s']:.1f} s -> {s['engine0_idle_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
