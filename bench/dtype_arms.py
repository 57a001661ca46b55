#!/usr/bin/env python
"""The demo in bf16 against fp32, side by side: speed, learner/engine mismatch, held-out gain, and
how much of the model the run moved, read from finished run folders (issue 32).

    python train.py --config configs/cpu_demo.yaml run.name=demo_fp32
    python train.py --config configs/cpu_demo.yaml run.name=demo_bf16 model.dtype=bfloat16
    python bench/dtype_arms.py runs/demo_fp32 runs/demo_bf16 --base ~/.cache/megatron_rlhf/SmolLM2-135M-Instruct-hf

Per run, from ``config.yaml``, ``metrics.jsonl``, ``summary.json`` and ``hf_final/``: the dtype
(``model.dtype``); mean step, training and generation seconds over steps 2.. (step 1 waits for the
eval before it; ``time/step_s``, ``time/train_s``, ``time/gen_s``); mean generation throughput
(``throughput/gen_tokens_per_s``, tokens/s); the learner/engine mismatch per step on the trained
tokens, mean and largest over the run (``logprobs/vllm_gap_abs_mean``, nats/token, and
``logprobs/token_mult_prob_error``, 1.0 = none); math greedy pass@1 and the chat score before and
after with the gain and its z (as ``bench/staleness_arms.py``: the two evals' se in quadrature); and,
with ``--base``, the share of the exported model's weights (``hf_final``) whose value differs from
the base model's rounded to the export's dtype: how much of the model the 16 steps moved in the
dtype the generator samples with. One run per dtype: the gains' intervals are per run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from staleness_arms import _mean, _rows, arm_row, eval_cells, read_runs  # noqa: E402  (the shared per-run numbers)


def _max(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return max(vals) if vals else float("nan")


def changed_fraction(final_dir: Path, base_dir: Path) -> float:
    """Share of the elements of ``final_dir``'s safetensors weights that differ from the same
    tensors of ``base_dir`` cast to the final model's dtype (tensors only one side has are left out).

    Raises:
        FileNotFoundError: either folder has no ``*.safetensors`` file.
    """
    from safetensors.torch import load_file

    def weights(d: Path) -> dict:
        files = sorted(Path(d).expanduser().glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {d}")
        out: dict = {}
        for f in files:
            out.update(load_file(str(f)))
        return out

    final, base = weights(final_dir), weights(base_dir)
    total = changed = 0
    for name, t in final.items():
        b = base.get(name)
        if b is None or b.shape != t.shape:
            continue
        total += t.numel()
        changed += int((b.to(t.dtype) != t).sum())
    return changed / total if total else float("nan")


def dtype_row(run_dir: Path, base_dir: Path | None = None) -> dict:
    """:func:`staleness_arms.arm_row`'s numbers plus the dtype, speed, mismatch and moved-weights
    columns of one finished run folder (module docstring).

    Raises:
        FileNotFoundError: the folder is not a finished run (or ``--base`` / ``hf_final`` lacks weights).
    """
    import yaml

    row = arm_row(run_dir)
    rows = _rows(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    row.update({
        "dtype": (cfg.get("model") or {}).get("dtype", "?"),
        "train_s": _mean(rows[1:], "time/train_s"), "gen_s": _mean(rows[1:], "time/gen_s"),
        "gen_tokens_per_s": _mean(rows, "throughput/gen_tokens_per_s"),
        "gap_mean": _mean(rows, "logprobs/vllm_gap_abs_mean"), "gap_max": _max(rows, "logprobs/vllm_gap_abs_mean"),
        "mult_mean": _mean(rows, "logprobs/token_mult_prob_error"),
        "mult_max": _max(rows, "logprobs/token_mult_prob_error"),
        "changed": changed_fraction(run_dir / "hf_final", base_dir) if base_dir is not None else float("nan"),
    })
    return row


def table(rows: list[dict]) -> str:
    """Markdown table, one line per run."""
    cols = ["run", "dtype", "step s", "train s", "gen s", "gen tokens/s", "learner-engine gap, nats/token (mean, max)",
            "token_mult_prob_error (mean, max)", "math pass@1 before -> after", "gain ± se (z)", "chat before -> after",
            "weights moved", "wall s"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        mtxt, ctxt = eval_cells(r)
        moved = f"{100 * r['changed']:.1f}%" if r["changed"] == r["changed"] else "n/a"
        out.append(f"| {r['run']} | {r['dtype']} | {r['step_s']:.1f} | {r['train_s']:.1f} | {r['gen_s']:.1f} | "
                   f"{r['gen_tokens_per_s']:.0f} | {r['gap_mean']:.4f}, {r['gap_max']:.4f} | "
                   f"{r['mult_mean']:.3f}, {r['mult_max']:.3f} | {mtxt} | {ctxt} | {moved} | {r['wall_s']:.0f} |")
    if len(rows) == 2:
        a, b = rows
        out.append("")
        out.append(f"{b['run']} / {a['run']}: step time {b['step_s'] / a['step_s']:.2f}x, training "
                   f"{b['train_s'] / a['train_s']:.2f}x, generation throughput "
                   f"{b['gen_tokens_per_s'] / a['gen_tokens_per_s']:.2f}x")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    ap.add_argument("--base", type=Path, default=None,
                    help="the base model's HF folder: also report the share of weights each run moved")
    args = ap.parse_args(argv)
    base = args.base.expanduser() if args.base else None
    rows = read_runs(args.runs, lambda d: dtype_row(d, base))
    if rows is None:
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
