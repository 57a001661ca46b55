"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard event files,
optional wandb, run summary.

Keys are namespaced and carry their units (``time/gen_s``, ``response/len_mean_tokens``); other
tools read them, so names are kept stable. Required keys of every row: ``step``,
``weight_version``, ``staleness/max``, ``reward/mean``, ``pairs/count``, ``pairs/skipped_prompts``,
``loss/total``, ``time/gen_s``, ``time/train_s``, ``time/sync_s``, ``time/learner_idle_s``,
``time/generator_idle_s``, ``response/len_mean_tokens``, ``async/max_staleness`` (the staleness bound
in force, fixed or chosen by ``async.max_staleness: auto``).

Exactly one row per trained step, whatever crashed: a run that resumes from the checkpoint of
step N keeps the rows of steps 1..N and moves every row above N (written after that checkpoint,
for training the crash threw away), any duplicate and any torn last line aside into
``metrics.crash-resumed_at_step_N-<UTC time>.jsonl`` (never deleted); the resumed run then appends
N+1, N+2, ... . :attr:`MetricsLogger.rows` holds the whole run's rows, so the summary covers it.

TensorBoard (``logging.tensorboard: true``): every number of a step's row (``step`` itself aside;
a null, i.e. NaN/inf, is left out) is a scalar of the same name at that step in
``<run>/tensorboard/``, and the resolved config is a text (``config``) at the session's first step.
Each session opens its writer with ``purge_step`` = the first step it (re)does (N+1 after a resume
from step N, 1 on a fresh start): the event file starts with a ``SessionLog.START`` at that step, and
TensorBoard drops every older event of a step >= it (torch ``SummaryWriter(purge_step=...)``;
tensorboard's ``EventAccumulator``), so the event files hold the same one value per step as
``metrics.jsonl``. (TensorBoard's fast Rust loader, ``--load_fast``, drops them per tag when the tag
is written again at a step <= its last, which the re-done steps do.)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "StepProgress", "json_safe", "REQUIRED_KEYS", "adopt_rows", "read_rows", "summarize",
           "summarize_evals", "task_names", "time_breakdown", "RECOVERY_KINDS", "recovery_totals",
           "wandb_run_id", "open_tensorboard", "TENSORBOARD_DIR"]

TENSORBOARD_DIR = "tensorboard"
"""The TensorBoard folder inside the run folder (``tensorboard --logdir <run>/tensorboard``)."""

EVAL_METRICS = ("pass@1", "mean@k", "reward_mean", "gold_reward_mean", "win_rate", "proxy_win_rate",
                "len_mean_tokens", "kl_ref")
"""Per-task eval values (``eval/<task>/<name>`` with ``.../se``; ``trainer.evaluate``; ``kl_ref``:
KL to the reference on fresh samples, nats/token; ``gold_reward_mean`` and the win rates against the
starting policy: reward-model tasks with ``tasks[].eval_reward``), besides
``pass@<k>_unbiased`` (``eval.pass_at_k``; :func:`is_eval_metric`)."""


def is_eval_metric(name: str) -> bool:
    """Whether ``name`` (the last part of ``eval/<task>/<name>``) is an eval value: one of
    :data:`EVAL_METRICS` or ``pass@<k>_unbiased``."""
    return name in EVAL_METRICS or (name.startswith("pass@") and name.endswith("_unbiased")
                                    and name[5:-9].isdigit())

RECOVERY_KINDS = ("reward_worker_restarts", "generator_restarts", "checkpoint_fallbacks", "damaged_files")
"""The recoveries a run counts: ``recovery/<kind>`` in each row is how many happened since the
previous row (the first row of a session also counts its start-up's: checkpoint fallbacks and
damaged files moved aside, ``trainer.readback``); the summary's ``recoveries`` sums them over the
run (:func:`recovery_totals`). Reward-worker restarts are math-verify pool rebuilds (a worker
killed or stuck), generator restarts are engines restarted by Ray (``generator.pool``), a
checkpoint fallback is a damaged checkpoint moved aside for an older one."""


def recovery_totals(rows: list[dict]) -> dict[str, int]:
    """``{kind: sum of recovery/<kind> over rows}`` for every kind of :data:`RECOVERY_KINDS`."""
    return {k: int(sum(r.get(f"recovery/{k}") or 0 for r in rows)) for k in RECOVERY_KINDS}


REQUIRED_KEYS = ("step", "weight_version", "staleness/max", "reward/mean", "pairs/count",
                 "pairs/skipped_prompts", "loss/total", "time/gen_s", "time/train_s", "time/sync_s",
                 "time/learner_idle_s", "time/generator_idle_s", "response/len_mean_tokens",
                 "sync/learner_blocked_s", "sync/GBps", "time/checkpoint_s", "async/max_staleness")


def json_safe(v: Any) -> Any:
    """``v`` (dicts, lists, tuples walked) with numpy/torch scalars as Python numbers and every
    non-finite float as None, so ``json.dumps(..., allow_nan=False)`` writes strict JSON."""
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Appends one JSON row per step to ``<run>/metrics.jsonl`` and mirrors it to TensorBoard and
    wandb.

    Args:
        run_dir: the run folder.
        logging_cfg: ``megatron_rlhf.config.LoggingConfig`` (tensorboard and wandb switches).
        config_dict: resolved config, given to wandb and written to TensorBoard as text.
        resume_step: the step of the checkpoint this session starts from (0: a fresh start); rows
            of an earlier session up to it are kept (:attr:`rows`), the others moved aside (see
            the module doc).
    Attributes:
        rows: every row of the run so far (earlier sessions' kept rows first).
        aside: the file the discarded rows were moved to, or None.
        unreadable: lines of ``metrics.jsonl`` that were no metrics row (damaged, or torn by a
            crash), moved to ``aside``.
        missing: steps ``1..resume_step`` of which ``metrics.jsonl`` held no row.
        damaged_notes: one line per damaged file this logger found (the ``wandb_id``).
        adopted_wall_s: sum of ``time/step_s`` over the kept rows of earlier sessions.
        tensorboard_dir: ``<run>/tensorboard`` (``logging.tensorboard``), or None.
    Raises:
        ValueError: a logged row lacks one of :data:`REQUIRED_KEYS`.
        ImportError: ``logging.tensorboard`` is on and tensorboard is not installed.
    """

    def __init__(self, run_dir: str | os.PathLike, logging_cfg, config_dict: dict | None = None, *,
                 resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.rows, self.aside, self.unreadable = adopt_rows(self.path, resume_step)
        have = {r["step"] for r in self.rows}
        self.missing = [s for s in range(1, resume_step + 1) if s not in have]
        self.damaged_notes: list[str] = []
        self.adopted_wall_s = sum(r.get("time/step_s") or 0.0 for r in self.rows)
        self._wandb = self._tb = self.tensorboard_dir = None
        if logging_cfg.tensorboard:
            self.tensorboard_dir = Path(run_dir) / TENSORBOARD_DIR
            self._tb = open_tensorboard(self.tensorboard_dir, resume_step + 1, config_dict)
        self.warn_mismatch = getattr(logging_cfg, "warn_token_mult_prob_error", float("inf"))
        if logging_cfg.wandb and logging_cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=logging_cfg.wandb_project, mode=logging_cfg.wandb_mode,
                                     dir=str(run_dir), name=Path(run_dir).name, config=config_dict,
                                     id=wandb_run_id(run_dir, self.damaged_notes.append), resume="allow")

    @property
    def damaged_count(self) -> int:
        """Damaged files this logger found (a recovery, ``recovery/damaged_files``): ``metrics.jsonl``
        with unreadable lines or missing rows, and the ``wandb_id``."""
        return int(bool(self.unreadable or self.missing)) + len(self.damaged_notes)

    def log(self, row: dict) -> dict:
        """Write one step's metrics (values made JSON-plain; NaN/inf become null). A
        ``logprobs/token_mult_prob_error`` above ``logging.warn_token_mult_prob_error`` prints a
        warning to stderr."""
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(f"metrics row for step {row.get('step')} lacks {missing}")
        row = {k: json_safe(v) for k, v in row.items()}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
        except OSError as e:   # e.g. a full disk: name the file and the cause
            raise OSError(e.errno, f"cannot append step {row['step']}'s metrics to {self.path}: "
                                   f"{e.strerror}", str(self.path)) from e
        self.rows.append(row)
        err = row.get("logprobs/token_mult_prob_error")
        if err is not None and err > self.warn_mismatch:
            stale = row.get("staleness/mean") or 0
            cause = (f"these samples are {stale:.1f} weight versions old on average "
                     "(async.max_staleness), so part of it is the intended policy lag the "
                     "importance correction pays for; the rest is" if stale >= 1 else "the weights "
                     "are not synced, or")
            print(f"[megatron-rlhf] warning: step {row['step']}: logprobs/token_mult_prob_error = "
                  f"{err:.4f} > logging.warn_token_mult_prob_error = {self.warn_mismatch}: the learner "
                  f"and the generators disagree on the sampled tokens' probabilities: {cause} a "
                  "numerics mismatch between the two",
                  file=sys.stderr, flush=True)
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numbers.items():
                if k != "step":
                    self._tb.add_scalar(k, v, global_step=row["step"])
            self._tb.flush()   # as complete on disk as metrics.jsonl if the run dies now
        if self._wandb is not None:
            self._wandb.log(numbers, step=row["step"])
        return row

    def close(self) -> None:
        """Close the TensorBoard writer and finish the wandb run (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class StepProgress:
    """The console's step progress (``logging.progress``): a tqdm bar on a terminal, one plain line
    per step otherwise (a SLURM log, ``> train.log``, a pipe), where a bar's carriage-return redraws
    would pile up on one line.

    The line: ``[megatron-rlhf] step 3/16: reward=0.512 stale=1 loss=-0.61 pairs=4 drawn=9 (31.2 s;
    mean 30.4 s/step)``: this step's own seconds (``time/step_s``), then the mean over the steps this
    session ran (the first of a fresh run also waits for the eval before step 1).

    Args:
        total: ``run.num_steps``; initial: the step the session starts after (a resume).
        enabled: false for none at all (``logging.progress=false`` or a quiet run).
        stream: where it goes (default ``sys.stderr``); a bar only when ``stream.isatty()``.
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, stream=None):
        from tqdm import tqdm

        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.initial, self.t0 = total, initial, initial, time.perf_counter()
        self.enabled = enabled
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = tqdm(total=total, initial=initial, desc="steps", unit="step", file=self.stream,
                        disable=not (enabled and tty), dynamic_ncols=True)
        self.lines = enabled and not tty

    def update(self, step_s: float, **postfix) -> None:
        """One more step done, which took ``step_s`` seconds (``time/step_s``); ``postfix``
        (``reward=..., stale=...``) shown beside it."""
        self.done += 1
        self.bar.update(1)
        self.bar.set_postfix(**postfix)
        if self.lines:
            mean = (time.perf_counter() - self.t0) / max(self.done - self.initial, 1)
            fields = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"[megatron-rlhf] step {self.done}/{self.total}: {fields} ({step_s:.1f} s; mean {mean:.1f} s/step)",
                  file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()


def open_tensorboard(log_dir: str | os.PathLike, first_step: int, config_dict: dict | None = None):
    """A TensorBoard writer on ``log_dir`` for a session that (re)does steps ``first_step, ...``.

    Opened with ``purge_step=first_step`` (module doc), so TensorBoard hides every event an
    earlier session wrote at a step >= ``first_step``; the resolved config (``config_dict``) is
    written as a YAML text at ``first_step``.

    Returns:
        ``torch.utils.tensorboard.SummaryWriter``.
    Raises:
        ImportError: tensorboard is not installed (names ``logging.tensorboard`` and the fix).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("logging.tensorboard: true needs the tensorboard package (pip install "
                          "tensorboard; it is in requirements/), or set logging.tensorboard: false") from e
    _wait_past_event_files(Path(log_dir))
    writer = SummaryWriter(str(log_dir), purge_step=first_step)
    if config_dict is not None:
        import yaml

        text = yaml.safe_dump(config_dict, sort_keys=False)
        writer.add_text("config", "".join("    " + ln + "\n" for ln in text.splitlines()),
                        global_step=first_step)   # indented: a markdown code block
    writer.flush()
    return writer


def _wait_past_event_files(log_dir: Path) -> None:
    """Wait (at most ~1 s) until the clock's second is past the creation second of every event file
    in ``log_dir``. TensorBoard reads a run's files in name order, and a name starts with that second
    (``events.out.tfevents.<s>.<host>.<pid>.<n>``): a session started within the same second as an
    earlier one (tests, a quick crash) would otherwise have its file, and its purge, read first."""
    stamps = []
    for f in log_dir.glob("events.out.tfevents.*"):
        try:
            stamps.append(int(f.name.split(".")[3]))
        except (IndexError, ValueError):
            continue
    deadline = time.monotonic() + 1.1
    while stamps and time.time() < max(stamps) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def wandb_run_id(run_dir: str | os.PathLike, note=None) -> str:
    """The wandb run id of this run folder, kept in ``<run>/wandb_id`` (made on first use), so a
    requeued or resumed run logs into the same wandb run (``wandb.init(id=..., resume="allow")``;
    wandb docs, "Resume a run"). A damaged file (not one id of letters, digits, ``-`` and ``_``)
    is moved aside and a new id made (a new wandb run); ``note`` gets its one line."""
    import re

    from megatron_rlhf.utils.atomic import move_aside, write_text

    path = Path(run_dir) / "wandb_id"
    if path.is_file():
        try:
            text = path.read_bytes().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            text, why = "", f"{type(e).__name__}"
        else:
            why = "empty" if not text else "not a wandb run id"
        if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", text):
            return text
        dest = move_aside(path)
        (note or (lambda m: None))(f"wandb_id is damaged ({why}): moved aside to {dest.name}; a new wandb "
                                   "run id is made (the earlier wandb run is not continued)")
    import uuid

    run_id = uuid.uuid4().hex[:16]
    write_text(path, run_id + "\n")
    return run_id


def _parse_row(line: str) -> dict | None:
    """One line of ``metrics.jsonl`` as a row (a JSON object with an integer ``step``), else None."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
        return None
    return row


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The rows of ``metrics.jsonl`` at ``path`` in file order, and how many non-empty lines were no
    row (damaged or torn); ``([], 0)`` when there is no file. Reads only."""
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return [], 0
    rows, bad = [], 0
    for line in text.splitlines():
        row = _parse_row(line)
        if row is not None:
            rows.append(row)
        elif line.strip():
            bad += 1
    return rows, bad


def adopt_rows(path: Path, resume_step: int) -> tuple[list[dict], Path | None, int]:
    """Keep the rows of steps ``1..resume_step`` of ``path`` (the last copy of each step, in step
    order) and move every other line aside (module doc): rows above ``resume_step``, duplicates,
    and lines that are no row (a JSON object with an integer ``step``: damaged, or torn by a crash).

    Args:
        path: ``<run>/metrics.jsonl`` (may be missing).
        resume_step: the resumed checkpoint's step (0: keep nothing).
    Returns:
        ``(kept rows, aside file or None when nothing was moved, unreadable lines moved)``.
    """
    if not path.is_file():
        return [], None, 0
    kept: dict[int, dict] = {}
    moved: list[str] = []
    unreadable = 0
    for line in path.read_bytes().decode("utf-8", errors="surrogateescape").splitlines():
        row = _parse_row(line)
        if row is None:
            if line.strip():
                moved.append(line)
                unreadable += 1
            continue
        step = row["step"]
        if 1 <= step <= resume_step:
            if step in kept:
                moved.append(json.dumps(kept[step]))
            kept[step] = row
        else:
            moved.append(line)
    rows = [kept[k] for k in sorted(kept)]
    if not moved:
        return rows, None, 0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"metrics.crash-resumed_at_step_{resume_step}-{stamp}.jsonl")
    from megatron_rlhf.utils.atomic import write_bytes, write_text

    earlier = aside.read_bytes() if aside.is_file() else b""   # same second: one file, appended
    write_bytes(aside, earlier + "".join(m + "\n" for m in moved).encode("utf-8", "surrogateescape"))
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows, aside, unreadable


def summarize(rows: list[dict], wall_s: float, edge: int = 3) -> dict:
    """Run summary from the run's metric rows (every session's, see :class:`MetricsLogger`).

    Returns a dict: ``steps``, ``reward_first``/``reward_last`` (mean ``reward/mean`` of the first
    and last ``edge`` steps; ``reward_window_steps`` = min(edge, steps)), ``pairs_formed``, ``prompts_skipped``, ``gen_s_mean``,
    ``train_s_mean``, ``sync_s_mean`` (seconds per step), ``wall_s`` and ``async_speedup`` =
    sum(gen + train + sync seconds) / ``steps_wall_s`` (``wall_s`` less the eval before step 1):
    what a synchronous run would have spent over what this run spent; > 1 means the overlap paid off, ``learner_tokens_per_s_mean``,
    ``learner_tflops_mean`` and ``mfu_mean`` (means of ``perf/learner_tokens_per_s``,
    ``perf/learner_tflops``, ``perf/mfu`` over the steps that have them; NaN when none, e.g.
    ``perf/mfu`` on CPU), and ``tasks``: per task
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
    # the steps' wall time without the eval before step 1 (the first batch waits for it; it is no
    # generation, training or sync, and a synchronous run waits for it too)
    steps_wall = wall_s - sum(e.get("time/eval_s") or 0.0 for e in eval_records(rows) if e.get("eval/step") == 0)
    return {
        "steps": len(rows),
        "first_step": rows[0]["step"], "last_step": rows[-1]["step"],
        "reward_window_steps": min(edge, len(rows)),   # steps averaged in reward_first / reward_last
        "reward_first": mean("reward/mean", rows[:edge]),
        "reward_last": mean("reward/mean", rows[-edge:]),
        "pairs_formed": sum(r.get("pairs/count") or 0 for r in rows),
        "prompts_drawn": sum(r.get("prompts/drawn", 0) for r in rows),
        "prompts_skipped": sum(r.get("pairs/skipped_prompts") or 0 for r in rows),
        "pairs_surplus": sum(r.get("pairs/surplus_dropped", 0) for r in rows),
        "surplus_carried": sum(r.get("rollout/surplus_carried", 0) for r in rows),
        "partial_resumed": sum(r.get("rollout/partial_resumed", 0) for r in rows),
        "carried_trained": sum(r.get("rollout/carried_trained", 0) for r in rows),   # leftovers trained
        "partial_trained": sum(r.get("rollout/partial_trained", 0) for r in rows),
        "requeued_stale": sum(r.get("rollout/requeued_stale", 0) for r in rows),
        "gen_s_mean": mean("time/gen_s", rows),
        "train_s_mean": mean("time/train_s", rows),
        "sync_s_mean": mean("time/sync_s", rows),
        "wall_s": wall_s,
        "serial_s": serial, "steps_wall_s": steps_wall,
        "async_speedup": serial / steps_wall if steps_wall > 0 else float("nan"),
        **_learner_throughput(rows, mean),
        "eval": summarize_evals(rows),
        "tasks": {t: {"reward_first": mean(f"task/{t}/reward_mean", rows[:edge]),
                      "reward_last": mean(f"task/{t}/reward_mean", rows[-edge:]),
                      "pairs": sum(r.get(f"task/{t}/units") or 0 for r in rows),
                      "drawn": sum(r.get(f"task/{t}/drawn") or 0 for r in rows),
                      "skipped": sum(r.get(f"task/{t}/skipped") or 0 for r in rows)}
                  for t in task_names(rows)},
    }


def _learner_throughput(rows: list[dict], mean) -> dict:
    """The learner's throughput means of the summary (see :func:`summarize`)."""
    return {"learner_tokens_per_s_mean": mean("perf/learner_tokens_per_s", rows),
            "learner_tflops_mean": mean("perf/learner_tflops", rows),
            "mfu_mean": mean("perf/mfu", rows)}


def task_names(rows: list[dict]) -> list[str]:
    """Task names of the ``task/<name>/reward_mean`` keys, in first-seen order."""
    out: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith("task/") and k.endswith("/reward_mean"):
                out[k.split("/")[1]] = None
    return list(out)


def eval_records(rows: list[dict]) -> list[dict]:
    """Every eval of the run, oldest first, as a dict of its ``eval/*`` fields and ``time/eval_s``.

    A row with ``eval/step`` is one eval; a row that also holds earlier evals
    (``eval/earlier``, written by ``trainer.evaluate.PendingRows``: the eval before step 1 of a
    1-step run) gives those first, and its own record's ``time/eval_s`` is its own eval's seconds."""
    out = []
    for r in rows:
        earlier = r.get("eval/earlier") or []
        out += earlier
        if r.get("eval/step") is not None:
            own = r if not earlier else {**r, "time/eval_s": (r.get("time/eval_s") or 0.0)
                                         - sum(e.get("time/eval_s") or 0.0 for e in earlier)}
            out.append(own)
    return out


def summarize_evals(rows: list[dict]) -> dict:
    """First and last eval of the run per task: ``{task: {metric: {"first", "first_se",
    "first_step", "last", "last_se", "last_step"}}}`` for the eval values present
    (:func:`is_eval_metric`) (:func:`eval_records`; ``first_step`` is 0 for the eval before step 1)."""
    evals = eval_records(rows)
    out: dict = {}
    if not evals:
        return out
    first, last = evals[0], evals[-1]
    for key in first:
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "eval" or not is_eval_metric(parts[2]):
            continue
        out.setdefault(parts[1], {})[parts[2]] = {
            "first": first[key], "first_se": first.get(key + "/se"), "first_step": first["eval/step"],
            "last": last.get(key), "last_se": last.get(key + "/se"), "last_step": last["eval/step"]}
    return out


def time_breakdown(rows: list[dict], phases: dict[str, float], *, loop_s: float, total_s: float,
                   since_step: int = 0) -> dict:
    """Where the run's time went, in seconds (the summary's ``time`` table; ``train.py`` prints it).

    Args:
        rows: the run's metric rows (every session's).
        phases: this session's set-up / teardown phases (``Run.phase``): ``model`` (the HF folder:
            GGUF conversion on first use), ``reward_model`` (trained on first use), ``start`` (Ray,
            learner, generators, reward models, first weights), ``export`` (``hf_final``).
        loop_s: wall seconds of this session's step loop.
        total_s: wall seconds from opening the run to its summary.
        since_step: the step this session resumed from (0: a fresh run); only the rows after it
            count, so a resumed session's figures are its own.
    Returns:
        ``time/<phase>_s`` for each phase; ``time/loop_s``; inside the loop (overlapped, so they add
        up to more than ``loop_s``): ``time/eval_first_s`` (the first eval's seconds, before step
        1 on a fresh run) and the sums over rows of ``time/gen_s``, ``time/train_s``,
        ``time/sync_s`` as ``time/gen_total_s``, ``time/train_total_s``, ``time/sync_total_s`` (this
        session's rows);
        after the loop: ``time/eval_last_s`` (the final eval, when the run has two or more; the
        loop ends when the last step is trained, its eval runs after); ``time/eval_total_s``;
        ``time/other_s`` = total minus the phases, the loop and the final eval (data, the last
        checkpoint, summary); ``time/total_s``.
    """
    out = {f"time/{k}_s": float(v) for k, v in phases.items()}
    rows = [r for r in rows if r.get("step", 0) > since_step]
    records = eval_records(rows)
    evals = [r.get("time/eval_s") or 0.0 for r in records]
    if evals:
        before = records[0].get("eval/step") == 0   # the eval before step 1 (a fresh run's)
        if before:
            out["time/eval_first_s"] = evals[0]
        if len(evals) > int(before):
            out["time/eval_last_s"] = evals[-1]
        out["time/eval_total_s"] = sum(evals)
    for key in ("gen", "train", "sync"):
        out[f"time/{key}_total_s"] = sum(r.get(f"time/{key}_s") or 0.0 for r in rows)
    out["time/loop_s"] = float(loop_s)
    out["time/other_s"] = max(0.0, total_s - loop_s - sum(phases.values()) - out.get("time/eval_last_s", 0.0))
    out["time/total_s"] = float(total_s)
    return out
