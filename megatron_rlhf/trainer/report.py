"""The run report: one self-contained HTML page per run folder (``<run>/report.html``).

Written at the end of every run by the trainer and at any time by ``tools/report.py RUN_DIR``,
from ``metrics.jsonl`` (the last row per step wins after a resume), ``summary.json`` and
``config.yaml``. Sections, each a PNG embedded as a data URI (``<img id="plot-NAME">``):

* ``reward``: ``task/<name>/reward_mean`` per step (the step's own rollouts);
* ``eval``: held-out ``eval/<task>/pass@1``, ``mean@k``, ``pass@<k>_unbiased``
  (``eval.pass_at_k``), ``reward_mean`` per eval, with standard-error bars (``trainer.evaluate``);
* ``kl``: ``kl/ref_k1`` / ``kl/ref_k3`` to the reference;
* ``lengths``: completion lengths (rollouts per task, greedy eval completions);
* ``staleness``: histogram of the staleness of every trained sample (``staleness/hist_<d>``
  summed over steps; ``over`` = beyond the learner's bound, the larger of ``async.max_staleness``
  and ``async.max_carry_staleness``, dropped);
* ``time``: seconds per step on the learner side (train, sync export, idle, other) and on the
  generator side (generation, scoring, sync, eval, idle), stacked; and the learner's throughput
  per step (``perf/learner_tokens_per_s``; model TFLOP/s ``perf/learner_tflops`` and ``perf/mfu``,
  where the device's peak is known, on the right axis);

then the eval before/after table, the run summary and the resolved config; the page names the
TensorBoard folder when the run has one (``logging.tensorboard``).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

__all__ = ["load_rows", "write_report", "PLOTS"]

PLOTS = ("reward", "eval", "kl", "lengths", "staleness", "time")
"""Plot ids of the report, in page order (``<img id="plot-<id>">``)."""


def load_rows(run_dir: str | Path) -> list[dict]:
    """The metric rows of ``run_dir/metrics.jsonl``, one per step (the last row of a step wins).

    Raises:
        FileNotFoundError: no metrics.jsonl there.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give a run folder (runs/<run.name>)")
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _keys(rows: list[dict], prefix: str, suffix: str) -> list[str]:
    out: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith(prefix) and k.endswith(suffix):
                out[k] = None
    return list(out)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _series_png(fig, ax, title: str, xlabel: str, ylabel: str | None, empty: str) -> str:
    """Title and axis labels, then a legend, or the ``empty`` note when nothing was plotted; the PNG."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if ax.has_data():
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
    return _png(fig)


def _lines(rows, keys, title, ylabel, labels=None):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, k in enumerate(keys):
        xs, ys = _series(rows, k)
        if xs:
            ax.plot(xs, ys, marker=".", label=labels[i] if labels else k)
    return _series_png(fig, ax, title, "step", ylabel, "no data in metrics.jsonl")


def _eval_plot(rows):
    import matplotlib.pyplot as plt

    from megatron_rlhf.trainer.metrics import eval_records, is_eval_metric

    evals = eval_records(rows)
    keys = [k for k in _keys(evals, "eval/", "") if k.count("/") == 2
            and is_eval_metric(k.rsplit("/", 1)[1]) and not k.endswith("/len_mean_tokens")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k in keys:
        pts = [(r["eval/step"], r[k], r.get(k + "/se") or 0.0) for r in evals if r.get(k) is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=k[len("eval/"):])
    return _series_png(fig, ax, "held-out eval (error bars: standard error over prompts)", "steps trained", None,
                       "no eval in this run (eval.enabled: false)")


def _staleness_plot(rows):
    import matplotlib.pyplot as plt

    counts: dict[str, float] = {}
    for k in _keys(rows, "staleness/hist_", ""):
        counts[k[len("staleness/hist_"):]] = sum(r.get(k) or 0 for r in rows)
    order = sorted((d for d in counts if d.isdigit()), key=int) + [d for d in counts if not d.isdigit()]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(order, [counts[d] for d in order], color="tab:purple")
    ax.set_title("staleness of trained samples (all steps)")
    ax.set_xlabel("staleness (weight versions)")
    ax.set_ylabel("samples")
    return _png(fig)


LEARNER_PARTS = (("time/train_s", "train"), ("sync/export_s", "sync (export)"), ("time/learner_idle_s", "idle"))
GENERATOR_PARTS = (("time/gen_s", "generation"), ("time/reward_s", "scoring"), ("time/sync_s", "sync"),
                   ("time/eval_s", "eval"), ("time/generator_idle_s", "idle"))


def _time_plot(rows):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    axes[1].sharey(axes[0])
    steps = [r["step"] for r in rows]
    for ax, parts, title in ((axes[0], LEARNER_PARTS, "learner side"), (axes[1], GENERATOR_PARTS, "generator side")):
        bottom = [0.0] * len(rows)
        for key, label in parts:
            vals = [float(r.get(key) or 0.0) for r in rows]
            ax.bar(steps, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if ax is axes[0]:   # the rest of the step's wall time (logging, checkpoints, waiting for evals)
            other = [max(0.0, float(r.get("time/step_s") or 0.0) - b) for r, b in zip(rows, bottom)]
            ax.bar(steps, other, bottom=bottom, label="other", color="lightgray")
        ax.set_title(f"seconds per step, {title}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    _throughput_axes(axes[2], rows)
    return _png(fig)


def _throughput_axes(ax, rows) -> None:
    """Learner tokens/s per step (left axis) and model TFLOP/s, with MFU in the label when the
    device's peak is known (right axis)."""
    xs, ys = _series(rows, "perf/learner_tokens_per_s")
    ax.set_title("learner throughput per step")
    ax.set_xlabel("step")
    if not xs:
        ax.text(0.5, 0.5, "no perf/* in metrics.jsonl", ha="center", transform=ax.transAxes)
        return
    ax.plot(xs, ys, marker=".", color="tab:blue", label="real tokens / s")
    ax.set_ylabel("tokens / s")
    tx, ty = _series(rows, "perf/learner_tflops")
    mx, my = _series(rows, "perf/mfu")
    twin = ax.twinx()
    label = "model TFLOP/s" + (f" (MFU mean {100 * sum(my) / len(my):.1f}%)" if my else " (MFU: peak unknown)")
    twin.plot(tx, ty, marker=".", color="tab:red", label=label)
    twin.set_ylabel("TFLOP/s")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7)


def _eval_table(summary_eval: dict) -> str:
    if not summary_eval:
        return "<p>No held-out eval in this run.</p>"
    f = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    out = ["<table><tr><th>task</th><th>metric</th><th>first (step)</th><th>last (step)</th></tr>"]
    for task, metrics in summary_eval.items():
        for name, v in metrics.items():
            out.append(f"<tr><td>{html.escape(task)}</td><td>{html.escape(name)}</td>"
                       f"<td>{f(v['first'])} &plusmn; {f(v['first_se'])} ({v['first_step']})</td>"
                       f"<td>{f(v['last'])} &plusmn; {f(v['last_se'])} ({v['last_step']})</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` (default ``<run_dir>/report.html``); returns its path.

    Raises:
        FileNotFoundError: ``run_dir`` has no metrics.jsonl.
    """
    import matplotlib

    matplotlib.use("Agg")
    from megatron_rlhf.trainer.metrics import TENSORBOARD_DIR, summarize_evals, task_names

    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    tasks = task_names(rows)
    plots = {
        "reward": _lines(rows, [f"task/{t}/reward_mean" for t in tasks] or ["reward/mean"],
                         "reward of the step's rollouts, per task", "reward"),
        "eval": _eval_plot(rows),
        "kl": _lines(rows, ["kl/ref_k1", "kl/ref_k3"], "KL(policy || reference) on the batch", "nats / token"),
        "lengths": _lines(rows, [f"task/{t}/len_mean_tokens" for t in tasks] + _keys(rows, "eval/", "/len_mean_tokens"),
                          "completion length (rollouts; eval = greedy)", "tokens"),
        "staleness": _staleness_plot(rows),
        "time": _time_plot(rows),
    }
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config = config_path.read_text() if config_path.is_file() else "(no config.yaml)"
    body = [f"<h1>Run {html.escape(run_dir.name)}</h1>",
            f"<p>{len(rows)} steps in metrics.jsonl ({rows[0]['step'] if rows else '-'} to "
            f"{rows[-1]['step'] if rows else '-'}); folder {html.escape(str(run_dir.resolve()))}</p>",
            *([f"<p>TensorBoard: <code>tensorboard --logdir {html.escape(str(tb.resolve()))}</code></p>"]
              if (tb := run_dir / TENSORBOARD_DIR).is_dir() else []),
            "<h2>Held-out eval, first and last</h2>", _eval_table(summarize_evals(rows))]
    for name in PLOTS:
        body.append(f'<h2>{name}</h2><img id="plot-{name}" alt="{name}" src="data:image/png;base64,{plots[name]}">')
    body += ["<h2>Summary</h2>", f"<pre>{html.escape(json.dumps(summary, indent=1, default=str))}</pre>",
             "<h2>Config</h2>", f"<pre>{html.escape(config)}</pre>"]
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>megatron-rlhf run "
            f"{html.escape(run_dir.name)}</title><style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    out = Path(out) if out is not None else run_dir / "report.html"
    from megatron_rlhf.utils.atomic import write_text

    write_text(out, page)
    return out
