#!/usr/bin/env python
"""megatron-rlhf entry point: asynchronous RL post-training (Online DPO) of an LLM.

    # CPU demo (embedded Ray, SmolLM2-135M-Instruct, single-digit multiplication and chat prompts):
    python train.py --config configs/cpu_demo.yaml
    # any key can be overridden:
    python train.py --config configs/cpu_demo.yaml run.num_steps=4 async.sync=true
    # check a config as a run would before it starts anything (seconds to a minute), then exit:
    python train.py --config configs/cpu_demo.yaml --check learner.tensor_parallel=2
    # cluster: slurm/*.sbatch start Ray and run this same script with RAY_ADDRESS set.

Writes ``<run.output_dir>/<run.name>/`` (config.yaml, metrics.jsonl, checkpoints/, hf_final/,
summary.json). Starting again on the same run folder resumes from its newest verified checkpoint
(one driver per run folder: a second one stops at once naming the PID and host holding it).
SIGTERM (SLURM's warning signal) finishes the current step, writes a checkpoint and exits 0; during
start-up it stops the start-up and exits 0 ("stopped before step N").
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rlhf.utils.stop import StoppedBeforeStart


def main(argv: list[str] | None = None) -> int:
    restore = _stop_while_starting()   # first: a stop while the config loads is a stop, never an error
    try:
        return _main(argv)
    except StoppedBeforeStart as e:   # a BaseException: no library's `except Exception` rewraps it
        print(f"{e}: nothing trained in this session (start again to run it)", file=sys.stderr)
        return 0
    finally:
        restore()


def _stop_while_starting():
    """Until ``trainer.loop.train`` installs its own handler: SIGTERM/SIGINT raise
    :class:`StoppedBeforeStart` at once (nothing is written yet). Returns a function that puts the
    previous handlers back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise StoppedBeforeStart(None)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(sig, h) for sig, h in old.items()]


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe, e.g. configs/cpu_demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: run.num_steps=4 algorithm.beta=0.05")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit (the field checks only; --check runs the rest)")
    parser.add_argument("--check", action="store_true",
                        help="run every check a run makes before any actor starts (paths, layout against the "
                             "model, vLLM engine fit, plug-ins, data rows), then exit: 0 when the config would "
                             "start, 2 with the refused key and its fix otherwise; no actor starts, nothing is trained")
    args = parser.parse_intermixed_args(argv)

    from megatron_rlhf.config import ConfigError, config_to_dict, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        try:
            print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), flush=True)
        except BrokenPipeError:   # `--print-config | head`: the reader closed the pipe; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    from megatron_rlhf.runtime import apply_process_env

    apply_process_env()
    if args.check:
        from megatron_rlhf.trainer import setup
        from megatron_rlhf.trainer.run import Run, console_say as say

        try:
            setup.check(Run(cfg, say))
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        say(f"config {args.config}: every check before the start passed (a run would now start Ray and "
             "the actors; not checked: a checkpoint to resume from)")
        return 0
    from megatron_rlhf.rollout.producer import ProducerError
    from megatron_rlhf.trainer.loop import train
    from megatron_rlhf.trainer.run_lock import RunLockedError
    from megatron_rlhf.trainer.setup import ActorStartError, ResumeRefusedError
    from megatron_rlhf.utils.atomic import AtomicWriteError

    try:
        res = train(cfg)
    except ResumeRefusedError as e:
        print(f"resume refused: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except RunLockedError as e:
        print(f"run folder in use: {e}", file=sys.stderr)
        return 3
    except ActorStartError as e:
        print(f"start-up failed: {e}", file=sys.stderr)
        return 1
    except AtomicWriteError as e:   # a full disk, a read-only folder, a name too long: path, cause, fix
        print(f"write failed: {e.strerror or e}", file=sys.stderr)
        return 1
    except ProducerError as e:   # a reward that raised, a generator dead beyond its restarts
        print(f"generation failed: {producer_error_text(e, cfg.run_dir)}", file=sys.stderr)
        return 1
    except TimeoutError as e:   # a wait ran out: names what it waited for, the key, the stacks' file
        print(f"timed out: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # a second Ctrl-C: stop now (the first one finishes the step and checkpoints)
        from megatron_rlhf.trainer.checkpoint import CheckpointManager

        had = bool(CheckpointManager(cfg.run_dir / "checkpoints").complete_checkpoints())
        print("interrupted: stopped at once without a checkpoint; " + (
            "the last complete one is intact (run the same command again to resume from it)" if had else
            "none was written before (run the same command again to start afresh)"), file=sys.stderr)
        return 130
    print(format_summary(res), flush=True)
    return 0


def producer_error_text(e: BaseException, run_dir) -> str:
    """One line for a ``ProducerError``: its message's first line, where its first cause was raised
    (``file:line in function``), and the file its whole traceback is written to
    (``<run_dir>/logs/error-<UTC time>.txt``; the line says so when it cannot be written)."""
    import time
    import traceback
    from pathlib import Path

    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    frames = traceback.extract_tb(root.__traceback__) if root.__traceback__ is not None else []
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    path = Path(run_dir) / "logs" / f"error-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(e)))
        saved = f"; traceback in {path}"
    except OSError as err:
        saved = f"; its traceback could not be written to {path} ({err.strerror or err})"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"{first}{where}{saved}; the last complete checkpoint is intact: fix the cause and run the "
            "same command again to resume from it")


def format_summary(res: dict) -> str:
    """A few lines for the terminal: where the run is and how it went."""
    f = lambda v, p=3: "n/a" if v is None or v != v else f"{v:.{p}f}"  # noqa: E731 (NaN-safe)
    lines = [f"run folder: {res['run_dir']}"] + ([f"report: {res['report']}"] if res.get("report") else []) + (
        [f"tensorboard: tensorboard --logdir {res['tensorboard']}"] if res.get("tensorboard") else [])
    if res.get("stopped_before_step"):
        lines.append(f"stopped before step {res['stopped_before_step']}: nothing trained in this session "
                     "(start again to run it)")
        return "\n".join(lines)
    if res.get("already_complete"):
        lines.append("(already complete: this is the summary of the earlier run; nothing was trained now)")
    if res.get("steps", 0) == 0:
        lines.append("no steps run (already complete?)")
        return "\n".join(lines)
    w = res.get("reward_window_steps", 3)   # a summary.json written before the key: 3
    lines += [
        (f"step {res['last_step']}" if res['first_step'] == res['last_step']
         else f"steps {res['first_step']}-{res['last_step']}")
        + (f" (resumed after step {res['resumed_from_step']})" if res.get("resumed_from_step") else "")
        + (" STOPPED EARLY (checkpoint written; start again to resume)" if res.get("stopped_early") else ""),
        *([f"mean reward: first {w} steps {f(res['reward_first'])} -> last {w} steps {f(res['reward_last'])}"]
          if len(res.get("tasks") or {}) <= 1 else [f"mean reward per task (first {w} steps -> last {w} steps):"]),
        *[f"  task {t}: reward {f(v['reward_first'])} -> {f(v['reward_last'])}; {v['pairs']} trained from "
          f"{v['drawn']} prompts, {v['skipped']} skipped" for t, v in (res.get("tasks") or {}).items()],
        f"trained {res['pairs_formed']} pairs/groups from {res['prompts_drawn']} prompts; "
        f"{res['prompts_skipped']} prompts skipped (nothing to learn from: no pair, or all rewards equal)"
        + f"; surplus dropped: {res.get('pairs_surplus', 0)} prompts "
          f"({100 * res.get('pairs_surplus', 0) / max(res['prompts_drawn'], 1):.1f}% of drawn), "
          f"{res.get('surplus_carried', 0)} carried to the next batch"
        + (f", {res['partial_resumed']} partial rollouts resumed" if res.get("partial_resumed") else ""),
        *_eval_lines(res.get("eval") or {}, f),
        f"mean seconds per step: gen {f(res['gen_s_mean'], 1)}, train {f(res['train_s_mean'], 1)}, "
        f"sync {f(res['sync_s_mean'], 2)}",
        f"async speed-up: {f(res['async_speedup'], 2)}x (gen+train+sync {f(res['serial_s'], 0)} s "
        f"serial vs {f(res.get('steps_wall_s', res['wall_s']), 0)} s of steps, the eval before step 1 excluded)",
        *_time_lines(res.get("time") or {}),
        *_throughput_lines(res, f),
        *_recovery_lines(res.get("recoveries") or {}),
    ]
    return "\n".join(lines)


def _recovery_lines(rec: dict) -> list[str]:
    """``recovered: 2 generator restarts, 1 damaged file moved aside`` (nothing when none)."""
    names = {"reward_worker_restarts": ("reward-worker restart", "reward-worker restarts"),
             "generator_restarts": ("generator restart", "generator restarts"),
             "checkpoint_fallbacks": ("checkpoint fallback", "checkpoint fallbacks"),
             "damaged_files": ("damaged file moved aside", "damaged files moved aside")}
    parts = [f"{n} {names.get(k, (k, k))[n != 1]}" for k, n in rec.items() if n]
    return [f"recovered: {', '.join(parts)} (each logged where it happened)"] if parts else []


def _time_lines(t: dict) -> list[str]:
    """Where the time went (``summary["time"]``, ``trainer.metrics.time_breakdown``), in seconds."""
    if not t:
        return []
    s = lambda k: f"{t[k]:.0f}"  # noqa: E731
    setup = [f"{name} {s(k)}" for name, k in (("model", "time/model_s"), ("reward model", "time/reward_model_s"),
                                              ("start", "time/start_s")) if k in t]
    inside = [f"{name} {s(k)}" for name, k in (("first eval", "time/eval_first_s"), ("generation", "time/gen_total_s"),
                                                ("training", "time/train_total_s"), ("sync", "time/sync_total_s"))
              if k in t]
    tail = [f"{name} {s(k)}" for name, k in (("final eval", "time/eval_last_s"), ("hf export", "time/export_s"),
                                             ("other", "time/other_s")) if k in t]
    return [f"time (s): total {s('time/total_s')} = set-up ({', '.join(setup)}) + steps {s('time/loop_s')} "
            f"(overlapped inside: {', '.join(inside)}) + {', '.join(tail)}"]


def _throughput_lines(res: dict, f) -> list[str]:
    """The learner's mean tokens/s, model TFLOP/s and MFU (``n/a (peak unknown: CPU)`` without one)."""
    if res.get("learner_tokens_per_s_mean") is None:
        return []
    mfu = res.get("mfu_mean")
    mfu_text = "n/a (device peak unknown, e.g. CPU; set learner.peak_tflops)" if mfu is None or mfu != mfu \
        else f"{100 * mfu:.1f}%"
    return [f"learner throughput: {f(res['learner_tokens_per_s_mean'], 0)} tokens/s, "
            f"{f(res['learner_tflops_mean'], 3)} model TFLOP/s, MFU {mfu_text}"]


def _eval_lines(evals: dict, f) -> list[str]:
    """``held-out eval`` lines: per task and metric, first -> last eval with standard errors."""
    if not evals:
        return []
    lines = ["held-out eval (mean +- standard error over prompts; step of the eval):"]
    for task, metrics in evals.items():
        for name, v in metrics.items():
            if name == "len_mean_tokens":
                continue
            line = (f"  task {task}: {name} {f(v['first'])} +- {f(v['first_se'])} (step {v['first_step']}) "
                    f"-> {f(v['last'])} +- {f(v['last_se'])} (step {v['last_step']})")
            gain = _gain(v)
            if gain is not None:
                line += f"; gain {gain[0]:+.3f} +- {gain[1]:.3f} ({gain[0] / gain[1]:.1f} se)" if gain[1] > 0 else \
                    f"; gain {gain[0]:+.3f}"
            lines.append(line)
    return lines


def _gain(v: dict) -> tuple[float, float] | None:
    """Last minus first eval value and its standard error sqrt(se_first^2 + se_last^2) (the two
    evals' errors taken as independent), or None when the run has one eval or a value is missing."""
    vals = (v.get("first"), v.get("first_se"), v.get("last"), v.get("last_se"))
    if v.get("first_step") == v.get("last_step") or any(x is None or x != x for x in vals):
        return None
    return v["last"] - v["first"], (v["first_se"] ** 2 + v["last_se"] ** 2) ** 0.5


if __name__ == "__main__":
    sys.exit(main())
