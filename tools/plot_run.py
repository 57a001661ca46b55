"""Plot a run's curves from ``<run>/metrics.jsonl``: per-task reward (raw and per token), loss, KL.

    .venv/bin/python tools/plot_run.py runs/cpu_demo            # writes runs/cpu_demo/curves.png
    .venv/bin/python tools/plot_run.py runs/cpu_demo --table     # also prints the per-step table

One panel per quantity, one line per task (``task/<name>/reward_mean``,
``task/<name>/reward_per_token``), plus ``loss/total`` and ``kl/ref_k1``. Steps without a value
(null in the JSON) are left out of that line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rlhf.trainer.metrics import task_names  # noqa: E402


def load_rows(run_dir: Path) -> list[dict]:
    """The metric rows of ``run_dir/metrics.jsonl`` (the last row per step wins after a resume).

    Raises:
        FileNotFoundError: no metrics.jsonl there.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give a run folder (runs/<run.name>)")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]


def table(rows: list[dict]) -> str:
    """A markdown table: step, per-task reward mean and per-token reward, loss, KL."""
    tasks = task_names(rows)
    head = ["step"] + [f"{t} reward" for t in tasks] + [f"{t} reward/token" for t in tasks] + ["loss", "KL k1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v):
        return "" if v is None else f"{v:.4f}"

    for r in rows:
        cells = [str(r["step"])] + [f(r.get(f"task/{t}/reward_mean")) for t in tasks] + \
                [f(r.get(f"task/{t}/reward_per_token")) for t in tasks] + [f(r.get("loss/total")), f(r.get("kl/ref_k1"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """Write the curves to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = task_names(rows)
    panels = [("reward (mean of K samples)", [(t, f"task/{t}/reward_mean") for t in tasks]),
              ("reward per token", [(t, f"task/{t}/reward_per_token") for t in tasks]),
              ("loss/total", [("loss", "loss/total")]), ("KL to reference (k1)", [("KL", "kl/ref_k1")])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, series) in zip(axes, panels):
        for label, key in series:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """CLI: plot (and optionally tabulate) a run's curves; returns the exit status (2: no metrics)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN/curves.png)")
    ap.add_argument("--table", action="store_true", help="print the per-step markdown table")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {args.run_dir}/metrics.jsonl has no rows yet", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "curves.png"
    plot(rows, out)
    if args.table:
        print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
