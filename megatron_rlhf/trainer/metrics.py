"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), optional wandb, run summary.

Keys are namespaced and carry their units (``time/gen_s``, ``response/len_mean_tokens``); other
tools read them, so names are kept stable. Required keys of every row: ``step``,
``weight_version``, ``staleness/max``, ``reward/mean``, ``pairs/count``, ``pairs/skipped_prompts``,
``loss/total``, ``time/gen_s``, ``time/train_s``, ``time/sync_s``, ``time/learner_idle_s``,
``time/generator_idle_s``, ``response/len_mean_tokens``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "REQUIRED_KEYS", "summarize", "summarize_evals", "task_names", "wandb_run_id"]

EVAL_METRICS = ("pass@1", "mean@k", "reward_mean", "len_mean_tokens")
"""Per-task eval values (``eval/<task>/<name>`` with ``.../se``; ``trainer.evaluate``)."""

REQUIRED_KEYS = ("step", "weight_version", "staleness/max", "reward/mean", "pairs/count",
                 "pairs/skipped_prompts", "loss/total", "time/gen_s", "time/train_s", "time/sync_s",
                 "time/learner_idle_s", "time/generator_idle_s", "response/len_mean_tokens")


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Appends one JSON row per step to ``<run>/metrics.jsonl`` and mirrors it to wandb.

    Args:
        run_dir: the run folder.
        logging_cfg: ``megatron_rlhf.config.LoggingConfig`` (wandb switch, project, mode).
        config_dict: resolved config, given to wandb.
    Raises:
        ValueError: a logged row lacks one of :data:`REQUIRED_KEYS`.
    """

    def __init__(self, run_dir: str | os.PathLike, logging_cfg, config_dict: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.rows: list[dict] = []
        self._wandb = None
        if logging_cfg.wandb and logging_cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=logging_cfg.wandb_project, mode=logging_cfg.wandb_mode,
                                     dir=str(run_dir), name=Path(run_dir).name, config=config_dict,
                                     id=wandb_run_id(run_dir), resume="allow")

    def log(self, row: dict) -> dict:
        """Write one step's metrics (values made JSON-plain; NaN/inf become null)."""
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(f"metrics row for step {row.get('step')} lacks {missing}")
        row = {k: _plain(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        self.rows.append(row)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))},
                            step=row["step"])
        return row

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """The wandb run id of this run folder, kept in ``<run>/wandb_id`` (made on first use), so a
    requeued or resumed run logs into the same wandb run (``wandb.init(id=..., resume="allow")``;
    wandb docs, "Resume a run")."""
    path = Path(run_dir) / "wandb_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:16]
    path.write_text(run_id + "\n")
    return run_id


def summarize(rows: list[dict], wall_s: float, edge: int = 3) -> dict:
    """Run summary from this session's metric rows.

    Returns a dict: ``steps``, ``reward_first``/``reward_last`` (mean ``reward/mean`` of the first
    and last ``edge`` steps), ``pairs_formed``, ``prompts_skipped``, ``gen_s_mean``,
    ``train_s_mean``, ``sync_s_mean`` (seconds per step), ``wall_s`` and ``async_speedup`` =
    sum(gen + train + sync seconds) / wall seconds (what a synchronous run would have spent over
    what this run spent; > 1 means the overlap paid off), and ``tasks``: per task
    ``reward_first``/``reward_last`` (mean ``task/<name>/reward_mean``), ``pairs`` (trained
    pairs or groups), ``drawn`` and ``skipped`` prompts.
    """
    if not rows:
        return {"steps": 0, "wall_s": wall_s}

    def mean(key, rs):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    serial = sum((r.get("time/gen_s") or 0) + (r.get("time/train_s") or 0) + (r.get("time/sync_s") or 0)
                 for r in rows)
    return {
        "steps": len(rows),
        "first_step": rows[0]["step"], "last_step": rows[-1]["step"],
        "reward_first": mean("reward/mean", rows[:edge]),
        "reward_last": mean("reward/mean", rows[-edge:]),
        "pairs_formed": sum(r["pairs/count"] for r in rows),
        "prompts_drawn": sum(r.get("prompts/drawn", 0) for r in rows),
        "prompts_skipped": sum(r["pairs/skipped_prompts"] for r in rows),
        "pairs_surplus": sum(r.get("pairs/surplus_dropped", 0) for r in rows),
        "gen_s_mean": mean("time/gen_s", rows),
        "train_s_mean": mean("time/train_s", rows),
        "sync_s_mean": mean("time/sync_s", rows),
        "wall_s": wall_s,
        "serial_s": serial,
        "async_speedup": serial / wall_s if wall_s > 0 else float("nan"),
        "eval": summarize_evals(rows),
        "tasks": {t: {"reward_first": mean(f"task/{t}/reward_mean", rows[:edge]),
                      "reward_last": mean(f"task/{t}/reward_mean", rows[-edge:]),
                      "pairs": sum(r.get(f"task/{t}/units") or 0 for r in rows),
                      "drawn": sum(r.get(f"task/{t}/drawn") or 0 for r in rows),
                      "skipped": sum(r.get(f"task/{t}/skipped") or 0 for r in rows)}
                  for t in task_names(rows)},
    }


def task_names(rows: list[dict]) -> list[str]:
    """Task names of the ``task/<name>/reward_mean`` keys, in first-seen order."""
    out: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith("task/") and k.endswith("/reward_mean"):
                out[k.split("/")[1]] = None
    return list(out)


def summarize_evals(rows: list[dict]) -> dict:
    """First and last eval of the run per task: ``{task: {metric: {"first", "first_se",
    "first_step", "last", "last_se", "last_step"}}}`` for the metrics of :data:`EVAL_METRICS`
    present (rows with an ``eval/step`` key; ``first_step`` is 0 for the eval before step 1)."""
    evals = [r for r in rows if r.get("eval/step") is not None]
    out: dict = {}
    if not evals:
        return out
    first, last = evals[0], evals[-1]
    for key in first:
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "eval" or parts[2] not in EVAL_METRICS:
            continue
        out.setdefault(parts[1], {})[parts[2]] = {
            "first": first[key], "first_se": first.get(key + "/se"), "first_step": first["eval/step"],
            "last": last.get(key), "last_se": last.get(key + "/se"), "last_step": last["eval/step"]}
    return out
