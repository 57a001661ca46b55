"""Math-verify scoring throughput: completions/s of ``MathVerifyReward`` at 1 worker vs N workers
(issue 21 item 8, gpu-path-review C4), on one step's worth of completions.

    .venv/bin/python bench/rewards.py                       # 4096 completions, 1 vs the run's default
    .venv/bin/python bench/rewards.py --workers 1 2 8 --n 4096 --out bench/results/rewards.json

What is scored: ``--n`` sampled-looking completions built from MAWPS gold answers
(``data/math_word_problems/mawps.jsonl``), in the shapes policies write: ``#### 72`` endings, a
``\\boxed{}`` fraction, a rambling sentence ending in a number, a wrong number, no number; half are
correct. Each pool is started (sympy imported in every worker) before the clock starts, so the
rows measure scoring, as in a run where the pool lives for the whole run.

Rows: ``in-process`` (``score_one`` in this process, no pool: the scoring cost alone), then one
row per worker count; ``ratio`` is completions/s over the 1-worker pool's, ``pool/in-process``
(1 worker) is the per-item IPC round trip's share (one item in flight per worker). The run's
default pool size is ``rewards.math_verify_workers=0`` -> ``min(32, cores - 1)``
(``default_num_workers``). Say the load average (printed) when quoting numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def completions(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` (completion, gold answer) pairs in the shapes sampled policies write, half correct."""
    rows = [json.loads(line) for line in (REPO / "data" / "math_word_problems" / "mawps.jsonl").open()]
    rng = random.Random(seed)
    comps, golds = [], []
    for i in range(n):
        gold = str(rng.choice(rows)["target"])
        try:
            value = float(gold)
        except ValueError:
            value = 0.0
        ans = gold if i % 2 == 0 else f"{value + rng.randint(1, 9):g}"
        shape = i % 5
        if shape == 0:
            text = f"First we add the numbers: {rng.randint(1, 99)} + {rng.randint(1, 99)}. #### {ans}"
        elif shape == 1:
            text = f"The answer is \\boxed{{\\frac{{{ans}}}{{1}}}}"
        elif shape == 2:
            text = (f"Tom had {rng.randint(2, 50)} apples and gave away some of them, so the total is "
                    f"{ans} apples.")
        elif shape == 3:
            text = f"Let x be the unknown. Then 3x = {rng.randint(3, 30)}, so x = {ans}."
        else:
            text = "I am not sure how to solve this problem." if i % 2 else f"So it is {ans}"
        comps.append(text)
        golds.append(gold)
    return comps, golds


def main(argv: list[str] | None = None) -> int:
    from megatron_rlhf.rewards.math_verify import MathVerifyReward, default_num_workers, score_one

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="completions scored per row")
    ap.add_argument("--workers", type=int, nargs="*", default=None,
                    help="pool sizes (default: 1 and the run's default, min(32, cores - 1), or 2 if that is 1)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    default = default_num_workers(0)
    workers = args.workers or sorted({1, default if default > 1 else min(2, cores)})
    comps, golds = completions(args.n)
    load = os.getloadavg()
    print(f"cores {cores}, run default pool {default} workers, load average {load[0]:.1f} "
          f"{load[1]:.1f} {load[2]:.1f}; {args.n} completions", flush=True)

    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    for c, g in zip(comps[:10], golds[:10]):   # every completion shape once: lazy sympy/LaTeX imports off the clock
        score_one(c, g, timeout_s=10.0)
    t0 = time.perf_counter()
    k = min(args.n, 512)   # in-process: a sample is enough for the per-item cost
    ref = [score_one(c, g, timeout_s=10.0)[0] for c, g in zip(comps[:k], golds[:k])]
    in_proc = k / (time.perf_counter() - t0)
    rows = [{"row": "in-process", "workers": 0, "completions_per_s": in_proc}]
    print(f"{'row':>12} {'workers':>7} {'completions/s':>14} {'ratio':>6} {'mean reward':>11}", flush=True)
    print(f"{'in-process':>12} {'-':>7} {in_proc:14.0f} {'':>6} {sum(ref) / k:11.3f}", flush=True)
    base = None
    for w in workers:
        with MathVerifyReward(num_workers=w) as reward:
            reward(comps[:w], golds[:w])          # start the pool (sympy import) off the clock
            t0 = time.perf_counter()
            got = reward(comps, golds)
            rate = args.n / (time.perf_counter() - t0)
        assert got[:k] == ref, "pool and in-process scores differ"
        base = base or rate
        rows.append({"row": "pool", "workers": w, "completions_per_s": rate, "ratio": rate / base,
                     "mean_reward": sum(got) / len(got)})
        print(f"{'pool':>12} {w:>7} {rate:14.0f} {rate / base:6.2f} {sum(got) / len(got):11.3f}", flush=True)
    one = next(r for r in rows if r["workers"] == 1) if 1 in workers else None
    if one:
        print(f"pool/in-process (1 worker): {one['completions_per_s'] / in_proc:.2f} "
              f"(per item: {1e3 / in_proc:.2f} ms scoring, {1e3 / one['completions_per_s'] - 1e3 / in_proc:.2f} ms "
              "IPC round trip)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cores": cores, "load": load, "n": args.n, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
