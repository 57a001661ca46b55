"""What a run reads back from its folder on start and on resume, read defensively.

Atomic writes (:mod:`megatron_rlhf.utils.atomic`) prevent the damage a run could do itself; a full
disk from another job, a copy cut short or a user's editor can still leave a file truncated, empty
or full of garbage. Every file a start reads from ``runs/<name>/`` is therefore checked before it
is trusted, and a damaged one is moved aside to ``<name>.damaged-<UTC time>`` (never deleted;
:func:`~megatron_rlhf.utils.atomic.move_aside`), named in one line with what happens next, and
counted (``recovery/damaged_files``, ``recovery/checkpoint_fallbacks``; ``trainer.run.Run``):

* ``run.lock`` (:mod:`~megatron_rlhf.trainer.run_lock`): its content only names a holder; it is
  rewritten by every start, so any content is fine;
* ``summary.json`` of a finished run (printed again by a re-run): re-derived from
  ``metrics.jsonl`` and written again (:func:`rederive_summary`); when the rows cannot give it, the
  run resumes from its last checkpoint, trains nothing and writes it;
* ``config.yaml`` (compared with this config; it ends with ``config.SAVED_CONFIG_END``, so one cut
  short that still parses is damaged): a resumed run writes its own config in its place; a
  finished run is left without one (nothing was trained);
* ``metrics.jsonl`` (the rows up to the resumed step are kept): unreadable lines are moved aside
  with the rows beyond the checkpoint (``trainer.metrics.adopt_rows``); rows it lacks are named;
* ``checkpoints/step_N/`` (trainer state, ``COMPLETE``, the learner's files, untrained batches):
  verified against its ``MANIFEST.json``; a damaged one is moved aside and the previous one is
  used; ``checkpoints/reference_vK/`` (the shared reference) likewise, with every checkpoint
  using it (:meth:`~megatron_rlhf.trainer.checkpoint.CheckpointManager.resumable`);
* ``wandb_id`` (``logging.wandb``): a new id (a new wandb run).

Never read back on start: ``report.html`` and ``hf_final/`` (written at the end of a session; for
``hf_final`` only the presence of its ``config.json`` is checked), the TensorBoard event files
(only their names are read), and ``logs/``. ``tests/test_reliability_loop.py`` damages every file
of a finished tiny run in three ways and checks each case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Damaged", "read_json_object", "read_yaml_mapping", "move_damaged", "SUMMARY_KEYS",
           "read_summary", "rederive_summary", "completed_run", "config_damage", "steps_text"]

SUMMARY_KEYS = ("run_dir", "steps", "first_step", "last_step", "pairs_formed", "prompts_drawn",
                "prompts_skipped", "wall_s")
"""Keys every ``summary.json`` of a finished run holds (``train.py``'s summary prints them)."""


@dataclass(frozen=True)
class Damaged:
    """A damaged file of the run folder: ``path``, ``why`` (in words) and ``then`` (what the run does
    about it, the end of its line)."""

    path: Path
    why: str
    then: str


def _problem(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def read_json_object(path: Path, required: tuple[str, ...] = ()) -> tuple[dict | None, str | None]:
    """The JSON object in ``path``: ``(object, None)``; ``(None, None)`` when there is no such file;
    ``(None, problem)`` when it cannot be read, is not UTF-8 JSON, is not an object, or lacks a
    key of ``required`` (``problem`` in words, e.g. ``"JSONDecodeError: Expecting value: line 1"``)."""
    if not path.is_file():
        return None, None
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, _problem(e)
    if not isinstance(obj, dict):
        return None, f"it holds a JSON {type(obj).__name__}, not an object"
    missing = [k for k in required if k not in obj]
    if missing:
        return None, f"it lacks {', '.join(missing)}"
    return obj, None


def read_yaml_mapping(path: Path) -> tuple[dict | None, str | None]:
    """The YAML mapping in ``path`` (a saved ``config.yaml``), as :func:`read_json_object` returns.

    A saved config ends with the line ``config.SAVED_CONFIG_END``; one without it was cut short
    (a truncated YAML file often still parses, with its last sections missing)."""
    import yaml

    from megatron_rlhf.config import SAVED_CONFIG_END

    if not path.is_file():
        return None, None
    try:
        text = path.read_bytes().decode("utf-8")
        obj = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return None, _problem(e)
    if not isinstance(obj, dict) or not obj:
        return None, ("it is empty" if obj is None else f"it holds a YAML {type(obj).__name__}, not a config")
    if text.rstrip("\n").rsplit("\n", 1)[-1] != SAVED_CONFIG_END:
        return None, f"it was cut short: its last line is not {SAVED_CONFIG_END!r}"
    return obj, None


def move_damaged(found: list[Damaged], say: Callable[..., None]) -> int:
    """Move every file of ``found`` aside (``<name>.damaged-<UTC time>``), one line each:
    ``"<file> is damaged (<why>): moved aside to <new name>; <then>"``. Returns how many.

    Raises:
        AtomicWriteError: a rename failed (path and cause named).
    """
    from megatron_rlhf.utils.atomic import move_aside

    for d in found:
        dest = move_aside(d.path)
        say(f"{d.path.name} is damaged ({d.why}): moved aside to {dest.name}; {d.then}")
    return len(found)


def read_summary(path: Path) -> tuple[dict | None, str | None]:
    """A finished run's ``summary.json`` (:func:`read_json_object` with :data:`SUMMARY_KEYS`)."""
    return read_json_object(path, SUMMARY_KEYS)


def rederive_summary(run_dir: Path, num_steps: int) -> dict | None:
    """The summary of the finished run in ``run_dir`` computed again from its ``metrics.jsonl``
    (``trainer.metrics.summarize`` over the rows, wall time = the sum of their ``time/step_s``,
    the recoveries summed over the rows), or None when the file lacks a row of steps
    ``1..num_steps`` (then only resuming the run can write the summary). Reads, writes nothing."""
    from megatron_rlhf.trainer.metrics import read_rows, recovery_totals, summarize

    rows, _ = read_rows(run_dir / "metrics.jsonl")
    by_step = {r["step"]: r for r in rows if 1 <= r["step"] <= num_steps}
    if sorted(by_step) != list(range(1, num_steps + 1)):
        return None
    rows = [by_step[s] for s in sorted(by_step)]
    out = summarize(rows, sum(r.get("time/step_s") or 0.0 for r in rows))
    out.update(run_dir=str(run_dir), stopped_early=False, rederived_from="metrics.jsonl",
               recoveries=recovery_totals(rows))
    report, tensorboard = run_dir / "report.html", run_dir / "tensorboard"
    out["report"] = str(report) if report.is_file() else None
    out["tensorboard"] = str(tensorboard) if tensorboard.is_dir() else None
    return out

def completed_run(cfg, latest: tuple, run_dir: Path, say=lambda *a: None,
                  damaged: list | None = None):
    """The saved summary when the run folder already holds a finished run of ``run.num_steps``
    steps (``latest`` = ``(path, trainer state)`` of the verified final checkpoint, HF export if
    asked for, summary), so a re-run is a cheap no-op.

    A damaged ``summary.json`` (``trainer.readback``) is moved aside and re-derived from
    ``metrics.jsonl`` (written again, with ``rederived_from``); when the rows cannot give it, it is
    added to ``damaged`` (moved aside once the run is accepted) and None is returned: the run
    resumes from its last checkpoint, trains nothing, and writes the summary."""
    from megatron_rlhf.trainer.lifecycle import RunResult
    from megatron_rlhf.trainer.metrics import RECOVERY_KINDS, json_safe
    from megatron_rlhf.utils.atomic import move_aside, write_json

    summary = run_dir / "summary.json"
    if latest[0] is None or latest[1]["step"] < cfg.run.num_steps or not summary.is_file():
        return None
    if cfg.checkpoint.export_hf and not (run_dir / "hf_final" / "config.json").is_file():
        return None
    saved, problem = read_summary(summary)
    if problem is None:
        result = RunResult(saved)
        result["recoveries"] = {k: 0 for k in RECOVERY_KINDS} | dict(result.get("recoveries") or {})
        result["already_complete"] = True
        return result
    again = rederive_summary(run_dir, cfg.run.num_steps)
    if again is None:
        (damaged if damaged is not None else []).append(Damaged(
            summary, problem, f"metrics.jsonl lacks rows of steps 1..{cfg.run.num_steps}, so the run resumes "
            f"from {latest[0].name} (nothing to train) to write it again"))
        return None
    dest = move_aside(summary)
    again["recoveries"]["damaged_files"] += 1
    say(f"summary.json is damaged ({problem}): moved aside to {dest.name}; re-derived from metrics.jsonl "
        f"({again['steps']} rows) and written again")
    write_json(summary, json_safe(again), indent=1, default=str, allow_nan=False)
    result = RunResult(again)
    result["already_complete"] = True
    return result


def config_damage(run_dir: Path, found: list, then: str) -> None:
    """Add a damaged ``config.yaml`` of ``run_dir`` to ``found`` (``readback.Damaged``; ``then``: what
    the run does about it)."""
    _, problem = read_yaml_mapping(run_dir / "config.yaml")
    if problem is not None:
        found.append(Damaged(run_dir / "config.yaml", problem, then))


def steps_text(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)
