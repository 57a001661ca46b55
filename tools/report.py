"""Write a run's HTML report (plots of reward, held-out eval, KL, lengths, staleness, time per
step; eval table; summary; config) from its folder, at any time, also while it trains.

    .venv/bin/python tools/report.py runs/cpu_demo             # writes runs/cpu_demo/report.html
    .venv/bin/python tools/report.py runs/cpu_demo --out /tmp/r.html

The trainer writes the same page at the end of every run (``megatron_rlhf.trainer.report``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run folder (runs/<run.name>) with metrics.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="HTML file to write (default RUN_DIR/report.html)")
    args = ap.parse_args(argv)
    from megatron_rlhf.trainer.report import write_report

    try:
        path = write_report(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
