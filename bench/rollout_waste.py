#!/usr/bin/env python
"""Generation waste of the rollout producer: fixed bursts + dropped surplus vs carry, partial
rollouts and draws sized by measured yield (issue 23).

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout_waste.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout_waste.py --batches 8 --long 96

Two real ``VLLMGenerator`` actors (tiny random Llama, fp32, CPU, as ``bench/generator_idle.py``)
with uneven completion lengths: engine 0 stops at ``--short`` new tokens, engine 1 at ``--long``.
One task whose pair yield varies: a prompt gives a pair (sample 0 rewarded 1, the others 0) with
probability 0.6 for prompts of even blocks of 32 indices and 0.15 for odd blocks (seeded per
prompt), so the measured yield has to follow it. The real :class:`RolloutProducer` makes
``--batches`` batches of ``--prompts-per-step`` pairs (K = ``--samples``) per mode under the
one-step handshake (``async.max_staleness: 1``) with weights that change as the loop's do (no
learner: only the generation side is measured): version k (the base weights plus seeded noise of
``--noise`` std) is published when batch k is taken, so batch k+1 is generated with version k and
what it carries on is 2 versions old in batch k+2, as in a training run:

* ``before``: the behaviour before issue 23, through the hand-set knobs:
  ``generators.prompts_per_request=--burst``, ``algorithm.carry_surplus=false``,
  ``generators.partial_rollouts=false``;
* ``after``: the defaults with partial rollouts on: requests sized by measured yield (at most
  ``max_num_seqs // K`` prompts per engine, the expected need rounded down: the default of an
  async run, ``generators.draw_rounding``), surplus carried, running requests aborted and parked
  when a batch fills, continued first in the next;
* ``after_nearest``: the same with the need rounded half up (``generators.draw_rounding=nearest``,
  the default with ``async.sync``);
* ``after_carry1``: ``after`` with ``async.max_carry_staleness: 1`` (one bound for fresh and
  carried work, the rule before issue 35: leftovers of batch k >= 1 are too old for batch k+1 and
  their prompts are requeued).

Printed per mode: generated tokens per trained token (every completion token the engines sampled,
``generator/tokens``, over the completion tokens of the trained pairs), trainable groups dropped
as surplus or as too stale (and as % of prompts drawn), prompts drawn, wall seconds per batch
(mean over the batches after the first), carried groups and parked completions trained, prompts
requeued, and what is still carried at the end. Ratios are within one run.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pair_reward(samples: int):
    """Reward of the synthetic task: per prompt, sample 0 gets 1.0 when the prompt "has a pair"
    (probability 0.6 in even blocks of 32 prompt indices, 0.15 in odd ones; seeded by index)."""
    def fn(prompts, texts):
        out = []
        for i in range(0, len(texts), samples):
            p = prompts[i]
            rate = 0.6 if (p.index // 32) % 2 == 0 else 0.15
            has_pair = random.Random(p.index).random() < rate
            out += [1.0 if has_pair and j == 0 else 0.0 for j in range(samples)]
        return out
    return fn


def versioned_weights(model_dir: Path, noise: float):
    """``publish(version)`` -> :class:`PublishedWeights` of the tiny model's weights plus
    ``noise`` x N(0, 1) seeded by the version (version 0: the base weights, no payload)."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.generator.weight_sync import PublishedWeights

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()

    def publish(version: int) -> PublishedWeights:
        if version == 0:
            return PublishedWeights(version=0, payload=ray.put([base]))
        g = torch.Generator().manual_seed(version)
        return PublishedWeights(version=version, payload=ray.put(
            [{k: v + noise * torch.randn(v.shape, generator=g) for k, v in base.items()}]))
    return publish


def run_mode(mode: str, gens, pool, a, publish) -> dict:
    import ray

    from megatron_rlhf.config import AlgorithmConfig, GeneratorConfig
    from megatron_rlhf.data.mix import MultiTaskSampler
    from megatron_rlhf.generator.weight_sync import PublishedWeights
    from megatron_rlhf.rollout.pairs import select_pair
    from megatron_rlhf.rollout.producer import RolloutProducer, WeightChannel
    from megatron_rlhf.rollout.staleness import trained_rollouts
    from megatron_rlhf.types import Prompt

    before = mode == "before"
    prompts = [Prompt(index=i, task="t", token_ids=(3 + i % 11, 5, 9, 11 + i % 7)) for i in range(4096)]
    sampler = MultiTaskSampler({"t": prompts}, {"t": 1.0}, seed=0)
    gen_cfg = GeneratorConfig(prompts_per_request=a.burst if before else None, max_num_seqs=a.max_num_seqs,
                              partial_rollouts=not before, max_new_tokens=a.long, max_model_len=a.long + 32,
                              draw_rounding="nearest" if mode == "after_nearest" else "auto")
    algo = AlgorithmConfig(samples_per_prompt=a.samples, prompts_per_step=a.prompts_per_step,
                           max_prompts_per_step=4096, carry_surplus=not before)
    out: queue.Queue = queue.Queue(maxsize=1)
    pool.push(publish(0))   # every mode starts from the base weights at version 0
    channel = WeightChannel(PublishedWeights(version=0))
    prod = RolloutProducer(pool=pool, sampler=sampler, reward_fns={"t": pair_reward(a.samples)}, pair_fn=select_pair,
                           channel=channel, out_queue=out, algorithm_cfg=algo, generator_cfg=gen_cfg,
                           staleness_bound=1, carry_staleness_bound=1 if mode == "after_carry1" else None,
                           first_batch=0, num_batches=a.batches, min_version=0, seed=0, timeout_s=600)
    tok0 = sum(s["generator/tokens"] for s in ray.get([g.stats.remote() for g in gens]))
    t = threading.Thread(target=prod.run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    walls, batches = [], []
    last = t0
    for _ in range(a.batches):
        b = out.get(timeout=1200)
        if isinstance(b, BaseException):
            raise b
        now = time.perf_counter()
        walls.append(now - last)
        last = now
        batches.append(b)
        if b.index > 0:   # the learner takes batch k holding version k: batch k+1 is generated with it
            channel.publish(publish(b.index))
    t.join(timeout=60)
    generated = sum(s["generator/tokens"] for s in ray.get([g.stats.remote() for g in gens])) - tok0
    trained = sum(len(r.completion.token_ids) for b in batches for g in b.groups for r in trained_rollouts(g, "pair"))
    dropped = sum(b.stats["pairs/surplus_dropped"] for b in batches)
    drawn = sum(b.stats["prompts/drawn"] for b in batches)
    tail = walls[1:] or walls
    return {"mode": mode, "generated_tokens": generated, "trained_tokens": trained,
            "gen_per_trained": generated / max(trained, 1), "surplus_dropped": dropped, "drawn": drawn,
            "dropped_pct": 100.0 * dropped / max(drawn, 1), "wall_per_batch_s": sum(tail) / len(tail),
            "wall_s": time.perf_counter() - t0,
            "carried_at_end": batches[-1].stats["rollout/carry_groups"],
            "parked_at_end": batches[-1].stats["rollout/carry_parked"],
            "partial_resumed": sum(b.stats["rollout/partial_resumed"] for b in batches),
            "carried_trained": sum(b.stats["rollout/carried_trained"] for b in batches),
            "partial_trained": sum(b.stats["rollout/partial_trained"] for b in batches),
            "requeued": sum(b.stats["rollout/requeued_stale"] for b in batches),
            "yield_ema": [round(b.stats["task/t/yield_ema"], 2) for b in batches]}


def run(a, work_dir: Path) -> list[dict]:
    import ray

    from megatron_rlhf.config import GeneratorConfig
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.vllm_engine import RAY_ACTOR_OPTIONS, VLLMGenerator
    from megatron_rlhf.generator.weight_sync import ObjectStoreTransport
    from megatron_rlhf.runtime import apply_process_env, process_env
    from megatron_rlhf.testing.tiny import make_tiny_model

    apply_process_env(str(work_dir / "tmp"))
    model_dir = make_tiny_model(work_dir / "tiny", "llama")
    ray.init(address="local", num_cpus=3, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    try:
        cls = ray.remote(num_cpus=1, **RAY_ACTOR_OPTIONS)(VLLMGenerator)
        cfgs = [GeneratorConfig(max_new_tokens=m, max_model_len=a.long + 32, kv_cache_gib=0.0625,
                                max_num_seqs=a.max_num_seqs) for m in (a.short, a.long)]
        gens = [cls.remote(model_dir=str(model_dir), generator_cfg=c, seed=i, cpu_core=-1) for i, c in enumerate(cfgs)]
        ray.get([g.get_weight_version.remote() for g in gens], timeout=600)
        pool = GeneratorPool(gens, transport=ObjectStoreTransport(), generator_cfg=cfgs[1], timeout_s=600)
        publish = versioned_weights(model_dir, a.noise)
        return [run_mode(mode, gens, pool, a, publish) for mode in ("before", "after", "after_nearest", "after_carry1")]
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (K)")
    ap.add_argument("--burst", type=int, default=8, help="before: generators.prompts_per_request")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="per engine (after: at most this / K prompts)")
    ap.add_argument("--short", type=int, default=16, help="engine 0's max new tokens")
    ap.add_argument("--long", type=int, default=64, help="engine 1's max new tokens")
    ap.add_argument("--noise", type=float, default=0.01, help="std of the per-version weight noise")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_waste_") as d:
        rows = run(a, Path(d))
    print("| mode | generated / trained tokens | surplus dropped (groups, % of drawn) | prompts drawn | "
          "wall per batch (s) | carried / parked at end | partial resumed | carried / partial trained | "
          "requeued | yield_ema per batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['gen_per_trained']:.2f} ({r['generated_tokens']} / {r['trained_tokens']}) | "
              f"{r['surplus_dropped']} ({r['dropped_pct']:.1f}%) | {r['drawn']} | {r['wall_per_batch_s']:.2f} | "
              f"{r['carried_at_end']} / {r['parked_at_end']} | {r['partial_resumed']} | "
              f"{r['carried_trained']} / {r['partial_trained']} | {r['requeued']} | {r['yield_ema']} |")
    b = rows[0]
    for s in rows[1:]:
        print(f"{s['mode']} / before: generated per trained token {s['gen_per_trained'] / b['gen_per_trained']:.2f}, "
              f"wall per batch {s['wall_per_batch_s'] / b['wall_per_batch_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
