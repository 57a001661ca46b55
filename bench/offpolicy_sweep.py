"""Off-policyness sweep: final reward vs KL to the reference per (loss, N).

Noukhovitch et al. 2024 ("Asynchronous RLHF", sec. 3.2, fig. 3) measure how robust each loss is to
off-policy samples by training with N updates per generation and plotting the final reward
against the KL to the reference (a loss is robust if its points stay on the same reward-KL
frontier as N grows). Here N is ``async.sync_interval``: the generators get new weights every N
learner batches, so samples are up to N versions old (``async.max_staleness = N``).

    # CPU, minutes: tiny random Llama, synthetic vowel-rate reward, real MAWPS prompts
    python bench/offpolicy_sweep.py --model tiny            # = --steps 48 --tail 8 --lr 1e-3
    # the demo model on math (SmolLM2-135M, math-verify): hours on 2 cores, see bench/RESULTS.md
    python bench/offpolicy_sweep.py --model smollm2 --steps 32 --losses online_dpo,proximal_rloo

For every (loss, N) it runs ``train`` with one shared Ray cluster and one shared vLLM generator
(reset to the base weights at every run's start) and reads the run's metrics: final reward =
mean ``reward/mean`` over the last ``--tail`` steps; KL = mean ``kl/ref_k1`` (the sequence-summed
log-ratio estimate of KL(pi || pi_ref) on the batch's samples, nats per completion token) over the
same steps. Writes ``results.json``, ``results.md`` (the table) and ``reward_vs_kl.png`` under
``--out`` and prints the table, the wall time of every run and of the sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_TASK = {"name": "synthetic", "reward": "megatron_rlhf.rewards.synthetic:letter_rate",
             "instruction": "",
             "data": {"path": "data/math_word_problems/mawps.jsonl", "prompt_field": "input",
                      "answer_field": "target"}}


def _overrides(args, model_dir: str, loss: str, n: int) -> list[str]:
    out = [f"model.source={model_dir}", f"run.output_dir={args.out / 'runs'}", f"run.name={loss}-N{n}",
           f"run.num_steps={args.steps}", f"algorithm.loss={loss}", f"async.sync_interval={n}",
           f"async.max_staleness={n}", "async.sync=false", "checkpoint.interval=0",
           "checkpoint.export_hf=false", "checkpoint.resume=false", "logging.progress=false",
           f"run.seed={args.seed}"]
    return out + list(args.override)


def _config(args, model_dir: str, loss: str, n: int):
    import yaml

    from megatron_rlhf.config import load_config

    if args.model == "tiny":
        recipe = Path(tempfile.mkdtemp(prefix="sweep-")) / "tiny.yaml"
        recipe.write_text(yaml.safe_dump({
            "defaults": str(REPO / "configs" / "ci_tiny.yaml"), "tasks": [TINY_TASK],
            "generators": {"max_new_tokens": 24, "temperature": 1.0},
            "algorithm": {"prompts_per_step": 4, "samples_per_prompt": 4},
            "learner": {"optimizer": {"lr": args.lr or 1e-3}}}))
        return load_config(recipe, _overrides(args, model_dir, loss, n))
    extra = [f"learner.optimizer.lr={args.lr}"] if args.lr else []
    return load_config(REPO / "configs" / "cpu_demo.yaml",
                       _overrides(args, model_dir, loss, n) + ["tasks=[{name: math, data: {path: "
                       "data/math_word_problems/mawps.jsonl, prompt_field: input, answer_field: target, "
                       "filter: {type: [singleop, addsub]}}, reward: math_verify}]"] + extra)


def _tail_mean(rows: list[dict], key: str, tail: int) -> float:
    vals = [r[key] for r in rows[-tail:] if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for loss in dict.fromkeys(r["loss"] for r in results):
        pts = [r for r in results if r["loss"] == loss]
        ax.plot([p["kl"] for p in pts], [p["reward"] for p in pts], marker="o", label=loss)
        for p in pts:
            ax.annotate(f"N={p['N']}", (p["kl"], p["reward"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("KL(pi || pi_ref) k1, nats per completion token (last steps)")
    ax.set_ylabel("reward (mean over last steps)")
    ax.set_title("Final reward vs KL per loss and off-policyness N")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (see the module docstring); returns the exit status."""
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                    help="tiny random Llama + synthetic reward, or the demo model on math")
    ap.add_argument("--losses", default="online_dpo,ppo,proximal_rloo", help="comma-separated algorithm.loss values")
    ap.add_argument("--intervals", default="1,2,4,8", help="values of N = async.sync_interval")
    ap.add_argument("--steps", type=int, default=48, help="learner batches per run")
    ap.add_argument("--tail", type=int, default=8, help="final reward/KL = mean over the last TAIL steps")
    ap.add_argument("--lr", type=float, default=None, help="learner.optimizer.lr (None: tiny 1e-3, smollm2 the demo's)")
    ap.add_argument("--seed", type=int, default=0, help="run.seed of every run")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "offpolicy_sweep",
                    help="results folder (runs go to OUT/runs, git-ignored)")
    ap.add_argument("override", nargs="*", help="extra config overrides key=value for every run")
    args = ap.parse_args(argv)
    losses = [x for x in args.losses.split(",") if x]
    intervals = [int(x) for x in args.intervals.split(",") if x]
    if args.steps < max(intervals) + args.tail:
        ap.error(f"--steps {args.steps} is too short: need >= max N + tail = {max(intervals) + args.tail}")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray

    from megatron_rlhf.generator.vllm_engine import VLLMGenerator
    from megatron_rlhf.runtime import apply_process_env, process_env
    from megatron_rlhf.trainer.loop import resolve_model_dir, train

    apply_process_env()
    t_sweep = time.perf_counter()
    if args.model == "tiny":
        from megatron_rlhf.testing.tiny import make_tiny_model

        model_dir = str(make_tiny_model(args.out / "runs" / "tiny_model", "llama"))  # runs/ is git-ignored
    else:
        model_dir = str(resolve_model_dir(_config(args, "smollm2", losses[0], 1).model))
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    results = []
    try:
        base = _config(args, model_dir, losses[0], intervals[0])
        gen = ray.remote(num_cpus=1, max_restarts=0)(VLLMGenerator).remote(
            model_dir=model_dir, generator_cfg=base.generators, dtype=base.model.dtype, seed=args.seed,
            cpu_core=-1)
        ray.get(gen.__ray_ready__.remote(), timeout=900)
        for loss in losses:
            for n in intervals:
                cfg = _config(args, model_dir, loss, n)
                t0 = time.perf_counter()
                res = train(cfg, quiet=True, generators=[gen])
                wall = time.perf_counter() - t0
                rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
                rows = rows[-args.steps:]
                r = {"loss": loss, "N": n, "reward": _tail_mean(rows, "reward/mean", args.tail),
                     "kl": _tail_mean(rows, "kl/ref_k1", args.tail),
                     "kl_k3": _tail_mean(rows, "kl/ref_k3", args.tail),
                     "reward_first": _tail_mean(rows[:args.tail], "reward/mean", args.tail),
                     "staleness_mean": sum(x["staleness/mean"] for x in rows) / len(rows),
                     "steps": len(rows), "wall_s": wall}
                results.append(r)
                print(f"{loss:>14} N={n}: reward {r['reward_first']:.4f} -> {r['reward']:.4f}, KL {r['kl']:.4f}, "
                      f"staleness {r['staleness_mean']:.2f}, {wall:.0f} s", flush=True)
                (args.out / "results.json").write_text(json.dumps(
                    {"model": args.model, "steps": args.steps, "tail": args.tail, "results": results}, indent=1))
        ray.kill(gen)
    finally:
        ray.shutdown()
    total = time.perf_counter() - t_sweep
    lines = [f"Off-policy sweep ({args.model} model, {args.steps} steps per run, final = mean of the last "
             f"{args.tail} steps; {total / 60:.1f} min in all on this machine)", "",
             "| loss | N | reward first | reward final | KL (k1) | KL (k3) | staleness mean | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['loss']} | {r['N']} | {r['reward_first']:.4f} | {r['reward']:.4f} | {r['kl']:.4f} | "
                     f"{r['kl_k3']:.4f} | {r['staleness_mean']:.2f} | {r['wall_s']:.0f} |")
    table = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(table)
    _plot([r for r in results if not math.isnan(r["kl"])], args.out / "reward_vs_kl.png")
    print(table)
    print(f"wrote {args.out / 'results.md'}, {args.out / 'results.json'}, {args.out / 'reward_vs_kl.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
