"""The main job over several seeds: held-out eval before and after, per seed and pooled.

Issue 15 asks that the demo (``configs/cpu_demo.yaml``) visibly learns: the held-out math pass@1
gain must exceed two standard errors, reported over 3 seeds. This script runs the demo once per
seed (``run.seed=S run.name=<prefix>_sS``; an existing finished run folder is only read) and
prints a Markdown table from each run's ``summary.json``:

    python bench/demo_seeds.py --seeds 0 1 2                 # runs what is missing, then the table
    python bench/demo_seeds.py --seeds 0 1 2 --no-run        # the table of finished runs only

Per seed: math pass@1 (greedy) and mean@k before step 1 and after the last step with their
standard errors over the held-out prompts (``trainer/evaluate.py``), the gain and its z-score
``(after - before) / sqrt(se_before^2 + se_after^2)`` (the two evals treated as independent: a
conservative bound, since the same prompts are scored twice), the chat reward-model score before
and after, the mean math completion length and the wall time of its loop (setup and the reward model excluded). The pooled row averages the
gains over seeds with the standard error of that mean over seeds (``std / sqrt(n)``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_seed(seed: int, prefix: str, config: str, overrides: list[str]) -> Path:
    """Run the demo for one seed (skipped when its run folder holds a summary); returns the folder."""
    run_dir = REPO / "runs" / f"{prefix}_s{seed}"
    if (run_dir / "summary.json").is_file():
        return run_dir
    t0 = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config, f"run.name={prefix}_s{seed}",
           f"run.seed={seed}", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True)
    (run_dir / "command_wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return run_dir


def _ev(summary: dict, task: str, key: str) -> tuple[float, float, float, float] | None:
    e = summary.get("eval", {}).get(task, {}).get(key)
    if not e:
        return None
    return e["first"], e["first_se"], e["last"], e["last_se"]


def seed_row(run_dir: Path) -> dict:
    """The numbers of one finished run (see the module docstring)."""
    s = json.loads((run_dir / "summary.json").read_text())
    row = {"run": run_dir.name, "wall_min": s["wall_s"] / 60, "steps": s["steps"]}
    for key in ("pass@1", "mean@k"):
        ev = _ev(s, "math", key)
        if ev:
            b, bse, a, ase = ev
            row[key] = (b, bse, a, ase, a - b, (a - b) / math.hypot(bse, ase))
    row["chat"] = _ev(s, "chat", "reward_mean")
    row["len"] = _ev(s, "math", "len_mean_tokens")
    return row


def table(rows: list[dict]) -> str:
    """Markdown table: one line per seed and a pooled line."""
    out = ["| run | math pass@1 before -> after | gain (z) | math mean@k before -> after | "
           "chat RM score before -> after | math length (tokens) | loop wall time |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, m, c, n = r.get("pass@1"), r.get("mean@k"), r.get("chat"), r.get("len")
        out.append(
            f"| {r['run']} | {p[0]:.3f} ± {p[1]:.3f} -> {p[2]:.3f} ± {p[3]:.3f} | {p[4]:+.3f} ({p[5]:.1f}) | "
            + (f"{m[0]:.3f} ± {m[1]:.3f} -> {m[2]:.3f} ± {m[3]:.3f} | " if m else "n/a (eval.samples: 0) | ")
            + f"{c[0]:.2f} ± {c[1]:.2f} -> {c[2]:.2f} ± {c[3]:.2f} | {n[0]:.0f} -> {n[2]:.0f} | "
            f"{r['wall_min']:.1f} min |")
    gains = [r["pass@1"][4] for r in rows if r.get("pass@1")]
    if len(gains) > 1:
        mean, sd = statistics.mean(gains), statistics.stdev(gains)
        chat = [r["chat"][2] - r["chat"][0] for r in rows if r.get("chat")]
        out.append(f"| mean of {len(gains)} seeds | | {mean:+.3f} ± {sd / math.sqrt(len(gains)):.3f} "
                   f"(over seeds) | | chat change {statistics.mean(chat):+.2f} | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prefix", default="demo")
    ap.add_argument("--config", default="configs/cpu_demo.yaml")
    ap.add_argument("--no-run", action="store_true", help="only read finished run folders")
    ap.add_argument("overrides", nargs="*", help="dotted overrides passed to train.py")
    args = ap.parse_args(argv)
    rows = []
    for seed in args.seeds:
        run_dir = REPO / "runs" / f"{args.prefix}_s{seed}"
        if not args.no_run:
            run_dir = run_seed(seed, args.prefix, args.config, args.overrides)
        if (run_dir / "summary.json").is_file():
            rows.append(seed_row(run_dir))
        else:
            print(f"{run_dir}: no summary.json (not finished)", file=sys.stderr)
    print(table(rows))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
