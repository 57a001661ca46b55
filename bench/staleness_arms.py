#!/usr/bin/env python
"""The demo under different staleness settings, side by side: step time, idle time, waste and
held-out gain, read from finished run folders (issue 35: ``async.max_staleness: auto`` against
fixed 1 and 2; leftovers trained under ``async.max_carry_staleness`` or requeued).

    python train.py --config configs/cpu_demo.yaml run.name=demo_s1                       # fixed 1
    python train.py --config configs/cpu_demo.yaml run.name=demo_s2 async.max_staleness=2
    python train.py --config configs/cpu_demo.yaml run.name=demo_auto async.max_staleness=auto
    python train.py --config configs/cpu_demo.yaml run.name=demo_carry1 async.max_carry_staleness=1
    python bench/staleness_arms.py runs/demo_s1 runs/demo_s2 runs/demo_auto runs/demo_carry1

Per run, from ``metrics.jsonl`` and ``summary.json``: the bound in force (``async/max_staleness``,
the values it took in step order, collapsed) and why it moved last; mean step time
(``time/step_s``) over steps 2.. (step 1 waits for the eval before it); mean learner idle
seconds per step (``time/learner_idle_s``: waiting for a batch) and generator idle
(``time/generator_idle_s``: waiting for weights); mean staleness of the trained samples
(``staleness/mean``); generated tokens per trained completion token (``rollout/generated_tokens``
over ``train/num_pairs`` x (``response/chosen_len_mean_tokens`` + ``response/rejected_len_mean_tokens``),
the pair losses' trained completions); carried groups trained, prompts requeued as too stale and
pairs dropped as too stale; math greedy pass@1 before and after with the standard errors the run
reports (over the held-out prompts), the gain and ``z = gain / sqrt(se_before^2 + se_after^2)``
(the two evals treated as independent, as ``bench/demo_seeds.py``); the chat reward-model score
before and after. One run per setting: the gains' intervals are per run, not over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from demo_seeds import _ev  # noqa: E402  (the demo's eval summary, read as demo_seeds reads it)

from megatron_rlhf.trainer.report import load_rows  # noqa: E402


def _rows(run_dir: Path) -> list[dict]:
    """The training rows (one per step, the last copy of a resumed step), eval-only records left out."""
    return [r for r in load_rows(run_dir) if "loss/total" in r]


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.mean(vals) if vals else float("nan")


def _collapsed(values: list) -> str:
    out = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return " -> ".join(str(v) for v in out)


def arm_row(run_dir: Path) -> dict:
    """The numbers of one finished run folder (see the module docstring).

    Raises:
        FileNotFoundError: the folder has no ``metrics.jsonl`` or ``summary.json`` (not finished).
    """
    rows = _rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = sum((r.get("train/num_pairs") or 0) * ((r.get("response/chosen_len_mean_tokens") or 0)
                                                    + (r.get("response/rejected_len_mean_tokens") or 0))
                  for r in rows)
    generated = sum(r.get("rollout/generated_tokens") or 0 for r in rows)
    math_ev, chat_ev = _ev(summary, "math", "pass@1"), _ev(summary, "chat", "reward_mean")
    row = {
        "run": run_dir.name, "steps": len(rows),
        "bound": _collapsed([r.get("async/max_staleness") for r in rows]),
        "reason": rows[-1].get("async/max_staleness_reason", "") if rows else "",
        "step_s": _mean(rows[1:], "time/step_s"),
        "learner_idle_s": _mean(rows[1:], "time/learner_idle_s"),
        "generator_idle_s": _mean(rows[1:], "time/generator_idle_s"),
        "staleness": _mean(rows, "staleness/mean"),
        "gen_per_trained": generated / trained if trained else float("nan"),
        "carried": sum(r.get("rollout/carried_trained") or 0 for r in rows),
        "requeued": sum(r.get("rollout/requeued_stale") or 0 for r in rows),
        "dropped": sum(r.get("staleness/dropped_pairs") or 0 for r in rows),
        "wall_s": summary.get("wall_s", float("nan")),
    }
    if math_ev:
        b, bse, a, ase = math_ev
        row["math"] = (b, bse, a, ase, a - b, math.hypot(bse, ase))
    if chat_ev:
        row["chat"] = chat_ev
    return row


def eval_cells(r: dict) -> tuple[str, str]:
    """The math cells (``before -> after | gain ± se (z)``) and the chat cell of one run's row."""
    m, c = r.get("math"), r.get("chat")
    mtxt = (f"{m[0]:.3f} ± {m[1]:.3f} -> {m[2]:.3f} ± {m[3]:.3f} | {m[4]:+.3f} ± {m[5]:.3f} ({m[4] / m[5]:.1f})"
            if m else "n/a | n/a")
    ctxt = f"{c[0]:.2f} ± {c[1]:.2f} -> {c[2]:.2f} ± {c[3]:.2f}" if c else "n/a"
    return mtxt, ctxt


def table(rows: list[dict]) -> str:
    """Markdown table, one line per run."""
    out = ["| run | bound (steps in order) | step s (mean, steps 2..) | learner idle s | generator idle s | "
           "staleness mean | generated / trained tokens | carried trained | requeued | dropped stale | "
           "math pass@1 before -> after | gain ± se (z) | chat RM before -> after | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mtxt, ctxt = eval_cells(r)
        out.append(f"| {r['run']} | {r['bound']} | {r['step_s']:.1f} | {r['learner_idle_s']:.1f} | "
                   f"{r['generator_idle_s']:.1f} | {r['staleness']:.2f} | {r['gen_per_trained']:.2f} | {r['carried']} | "
                   f"{r['requeued']} | {r['dropped']} | {mtxt} | {ctxt} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def read_runs(runs: list[Path], row_fn) -> list[dict] | None:
    """``row_fn(folder)`` of every run folder, or None after naming (on stderr) the first one that
    is not a finished run (``row_fn`` raised ``FileNotFoundError``)."""
    rows = []
    for d in runs:
        try:
            rows.append(row_fn(d))
        except FileNotFoundError as e:
            print(f"{d}: not a finished run folder ({e})", file=sys.stderr)
            return None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    args = ap.parse_args(argv)
    rows = read_runs(args.runs, arm_row)
    if rows is None:
        return 2
    print(table(rows))
    for r in rows:
        print(f"{r['run']}: last bound reason: {r['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
