"""A run's setup: everything :meth:`megatron_rlhf.trainer.run.Run.open` does before the loop's first
step, apart from the verbs the loop calls (those stay in :mod:`megatron_rlhf.trainer.run`).

:func:`prepare` resolves the model, runs the pre-flight checks (before any actor starts), loads the
prompts and finds the checkpoint to resume from; :func:`start` starts Ray, the reward-model actors,
the learner (group) and the generator engines, forms the weight transport, and builds the
generator pool, the rollout producer and the metrics logger. The helpers below are also what
``tools/evaluate.py`` uses to build the same services outside a run.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

from megatron_rlhf.config import Config, ConfigError, config_diff, config_to_dict, save_config
from megatron_rlhf.data import skipped_rows_text
from megatron_rlhf.generator.pool import GeneratorPool
from megatron_rlhf.generator.weight_sync import PublishedWeights, make_transport
from megatron_rlhf.trainer.checkpoint import CheckpointManager
from megatron_rlhf.trainer.lifecycle import RunResult, learner_guard
from megatron_rlhf.trainer.metrics import MetricsLogger
from megatron_rlhf.trainer.preflight import (check_device, check_layout_before_conversion, check_model_source,
                                             check_task_files, preflight)
from megatron_rlhf.trainer.readback import completed_run, config_damage, move_damaged, steps_text
from megatron_rlhf.rollout.producer import RolloutProducer, WeightChannel
from megatron_rlhf.rollout.staleness_control import StalenessController
from megatron_rlhf.trainer.watchdog import HangWatchdog, dump_actor_stacks
from megatron_rlhf.utils.stop import StoppedBeforeStart  # noqa: F401 - re-exported (a BaseException)

__all__ = ["ActorStartError", "LEARNER", "prepare", "start", "resolve_model_dir", "init_ray", "worker_pythonpath", "load_prompts", "resolve_reward_models",
           "build_reward_models", "reward_fns", "eval_reward_fns", "reward_model_specs", "build_actors", "build_generators"]


class ResumeRefusedError(ConfigError):
    """The run folder's checkpoint cannot be resumed with this config (a layout change, a missing
    key): the message names the folder and the cause, in one line; nothing was changed."""


class StartupTimeoutError(TimeoutError):
    """A start-up wait exceeded ``async.timeout_s``; the message names the actors and the key."""


LEARNER = "the learner"
"""The learner's name in :func:`wait_ready`'s ``actors``: its death there is left to ``learner_guard``."""


class ActorStartError(RuntimeError):
    """A generator or reward-model actor raised in its constructor or died while starting: the
    message names the actor and the root cause (the learner's own death is a ``LearnerDiedError``)."""


def _root_cause(e: Exception) -> str:
    """The last ``SomeError: message`` line of a Ray actor error (the constructor's exception),
    else its last line."""
    import re

    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    causes = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    return (causes or lines or [type(e).__name__])[-1]


def prepare(run) -> "RunResult | None":
    """Everything before any actor starts: model, pre-flight checks, data, plug-ins, and every
    resume check (the checkpoint to resume from, verified; its data position and pending batches
    against this config; ``checkpoint.resume=false`` on a used folder). Nothing in the run folder
    is changed until all of them passed (then :func:`_accept_folder`; the config is written after
    the learner loaded the checkpoint, :func:`accept_resume`). A config error leaves no empty run
    folder behind (one this call created)."""
    existed = run.run_dir.exists()
    try:
        return _prepare_checked(run)
    except ConfigError:
        _remove_if_new_and_empty(run.run_dir, existed)
        raise


def check(run) -> None:
    """``train.py --check``: every check :func:`prepare` makes of the config before any actor starts,
    and nothing else. Model source, data and reward-model paths, device and dtype, the parallel
    layout against the model, a used run folder with ``checkpoint.resume=false``, the model folder
    (a GGUF or Megatron source is converted and cached, as a run would), the pre-flight
    (:func:`trainer.preflight.preflight`: vLLM engine fit, weight transport, plug-ins, logging, a
    writable run folder) and the prompts (malformed, filtered and too-long rows counted). No actor
    starts and a run folder this call created is removed again. Not checked: a checkpoint to resume
    from (the learner loads it) and anything only a running actor shows.

    Raises:
        ConfigError: the first refused value, naming the key and the fix (as a run would).
    """
    existed = run.run_dir.exists()
    try:
        _checks(run)
    finally:
        _remove_if_new_and_empty(run.run_dir, existed)   # the pre-flight's write test leaves nothing


def _remove_if_new_and_empty(run_dir: Path, existed: bool) -> None:
    """Remove ``run_dir`` when it did not exist before this call and is empty (never its contents)."""
    if not existed:
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def _checks(run) -> None:
    """The checks of :func:`prepare` before the resume checks (see :func:`check`); sets
    ``run.model_dir``, ``run.plugins``, ``run.restart_aside`` and the prompts."""
    cfg, say, run_dir = run.cfg, run.say, run.run_dir
    check_model_source(cfg.model)
    check_task_files(cfg)   # a wrong data path or reward-model folder: refused before the model is prepared
    check_device(cfg)
    check_layout_before_conversion(cfg)   # a cold smollm2 conversion takes a minute: refuse a bad layout first
    run.restart_aside = None   # checkpoint.resume=false on a used folder: refused before the conversion too
    used = used_run_folder(run_dir)
    if used and cfg.run.restart:
        run.restart_aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    elif used and not cfg.checkpoint.resume:
        raise ConfigError(
            f"checkpoint.resume=false, but the run folder {run_dir} already holds a run ({used}): "
            "training there afresh would mix two runs. Pick another run.name, or set run.restart=true "
            f"to move the old run aside to {run_dir.name}.old-<UTC time>/ (nothing is deleted) and "
            "start fresh")
    with run.phase("model", f"model {cfg.model.source}: preparing the Hugging Face folder (a GGUF or "
                   "Megatron source is converted once and cached)..."):
        run.model_dir = resolve_model_dir(cfg.model)
    run.plugins = preflight(cfg, run.model_dir)    # before any actor starts: a bad config stops here
    try:
        run.sampler, run.data_counts, run.pad_id, run.eval_by_task = load_prompts(cfg, run.model_dir)
    except (ValueError, FileNotFoundError) as e:   # names tasks[].data.*: a config problem
        raise ConfigError(str(e)) from e
    say(f"model {run.model_dir}; prompts: " + ", ".join(
        f"{t} {c.get('kept')} to train, {c.get('eval_prompts', 0)} held out{skipped_rows_text(c)}"
        for t, c in run.data_counts.items()))


def _prepare_checked(run) -> "RunResult | None":
    cfg, say, run_dir = run.cfg, run.say, run.run_dir
    say(f"run folder {run_dir}")
    _checks(run)
    run.too_long = sum(c.get("too_long", 0) for c in run.data_counts.values())
    run.ckpts = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    found = run.ckpts.resumable() if cfg.checkpoint.resume and run.restart_aside is None else None
    run.resume_from = (found.path, found.state) if found is not None else (None, None)
    run.damaged = found.damaged if found is not None else []
    run.damaged_files = []   # trainer.readback: damaged files to move aside once the run is accepted
    done_before = completed_run(cfg, run.resume_from, run_dir, say, run.damaged_files)
    if done_before is not None:
        say(f"run already complete at step {cfg.run.num_steps}: nothing to train (raise run.num_steps "
            "to continue it, or pick another run.name for a new run)")
        config_damage(run_dir, run.damaged_files, "not rewritten: the run is complete and nothing was trained now")
        run.damaged_moved += move_damaged(run.damaged_files, say)
        changes = config_changes(cfg, run_dir / "config.yaml")
        if changes:
            say(f"note: this config differs from the one the run used ({run_dir / 'config.yaml'}); "
                f"it was not applied: {'; '.join(changes)}")
        done_before["recoveries"]["damaged_files"] += run.damaged_moved   # a config.yaml moved aside now
        return done_before
    path, state = run.resume_from
    run.pending, run.pending_regenerated, run.resume_states = collections.deque(), 0, None
    if path is not None:
        if not found.verified:
            say(f"note: checkpoint {path.name} has no manifest (written before checkpoints were "
                "verified): resuming from it unverified")
        pending, run.resume_states, run.pending_regenerated = load_pending(path, state, cfg.algorithm, say)
        run.pending.extend(pending)
        check_sampler_position(run, path, run.resume_states or state)
    run.replay_folder = None
    if cfg.run.mode == "train_only":   # the saved batches, each checked against this config
        run.replay_folder = checked_replay_folder(cfg, (state or {}).get("step", 0), run.model_dir)
    with run.phase("reward_model"):   # trains the demo reward model on first use (it says so)
        run.reward_models = resolve_reward_models(cfg)
    for key, folder in run.reward_models.items():
        task, _, part = key.partition("/")
        what = "evaluation reward model (never trained against)" if part else "reward model"
        say(f"task {task}: {what} {folder}{rm_accuracy(folder)}")
    if run.restart_aside is None:
        config_damage(run_dir, run.damaged_files, "this run's resolved config is written in its place")
    _accept_folder(run)
    return None



def checked_replay_folder(cfg: Config, start_step: int, model_dir: Path) -> Path:
    """``run.replay``'s folder, its batches ``start_step .. run.num_steps-1`` checked against this
    config (:func:`~megatron_rlhf.trainer.replay.check_replay_dir`: readable, the algorithm tag,
    ``algorithm.prompts_per_step``, token ids within ``model_dir``'s ``config.json`` vocab_size).

    Raises:
        ConfigError: a check failed (names ``run.replay``, the file and the fix).
    """
    from megatron_rlhf.rollout.batch_io import algorithm_tag
    from megatron_rlhf.trainer.replay import check_replay_dir

    try:
        vocab = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    try:
        return check_replay_dir(cfg.run.replay, start_step, cfg.run.num_steps, algorithm=algorithm_tag(cfg.algorithm),
                                prompts_per_step=cfg.algorithm.prompts_per_step,
                                vocab_size=vocab if isinstance(vocab, int) else None)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def used_run_folder(run_dir: Path) -> str:
    """What of an earlier run ``run_dir`` holds, in words (``""``: nothing; the lock file, ``logs/``
    and an empty ``checkpoints/`` do not count)."""
    if not run_dir.is_dir():
        return ""
    from megatron_rlhf.trainer.run_lock import LOCK_FILE

    found = []
    ckpt = run_dir / "checkpoints"
    steps = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    if steps:
        found.append(f"checkpoints/{', '.join(steps[-3:])}")
    for p in sorted(run_dir.iterdir()):
        if p.name not in (LOCK_FILE, "logs", "checkpoints") and not p.name.startswith(".write-test-"):
            found.append(p.name + ("/" if p.is_dir() else ""))
    return ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")


def _accept_folder(run) -> None:
    """The first changes to the run folder, once every check of :func:`prepare` passed:
    ``run.restart=true`` moves the old run aside; damaged checkpoints are moved aside (never
    deleted), each named in one line, and the fallback is printed."""
    say, run_dir = run.say, run.run_dir
    if run.restart_aside is not None:
        from megatron_rlhf.trainer.run_lock import LOCK_FILE

        run.restart_aside.mkdir()
        for p in list(run_dir.iterdir()):
            if p.name != LOCK_FILE:
                os.rename(p, run.restart_aside / p.name)
        say(f"run.restart=true: the earlier run of this folder was moved to {run.restart_aside}; starting fresh")
    for path, why in run.damaged:
        dest = run.ckpts.move_aside(path)
        is_step = path.name.startswith("step_")
        say(f"{'checkpoint' if is_step else 'the shared reference'} {path.name} is damaged ({why}): "
            f"moved aside to {dest}")
        run.checkpoint_fallbacks += is_step
        run.damaged_moved += not is_step
    if run.damaged:
        path = run.resume_from[0]
        say(f"falling back to {path.name}" if path is not None else
            "no intact checkpoint is left: starting from step 0")
    run.damaged_moved += move_damaged(run.damaged_files, say)


def accept_resume(run) -> None:
    """The run is accepted (the learner loaded its checkpoint): write the resolved config
    (``config.yaml``), noting what changed."""
    changes = config_changes(run.cfg, run.run_dir / "config.yaml")
    if changes:
        run.say(f"warning: resuming {run.run_dir} with a changed config (config.yaml is rewritten, the new "
                f"values apply from here on): {'; '.join(changes)}")
    save_config(run.cfg, run.run_dir / "config.yaml")


_PROMPT_KEYS = ("tasks", "eval.", "generators.max_model_len", "generators.max_new_tokens", "model.", "run.seed")


def check_sampler_position(run, path: Path, state: dict) -> None:
    """Restore the data sampler's position from checkpoint ``path``'s ``state``.

    Raises:
        ConfigError: it does not fit this config's prompts; names the changed keys that change the
            training prompts (``eval.num_prompts`` takes held-out prompts out of training, so it
            changes them too), else the sampler's own reason.
    """
    try:
        run.sampler.load_state_dict(state["sampler_state"])
    except (ValueError, KeyError, TypeError) as e:
        changed = [c for c in config_changes(run.cfg, run.run_dir / "config.yaml") if c.startswith(_PROMPT_KEYS)]
        if changed:
            raise ConfigError(
                f"cannot resume from {path}: the training prompts differ from the checkpoint's because "
                f"{'; '.join(changed)} (held-out eval prompts are taken out of training, so eval.* changes "
                "the training set too); resume with the values in config.yaml, or start fresh: another "
                "run.name, or run.restart=true") from e
        raise ConfigError(f"cannot resume from {path}: its data-sampler position does not fit "
                          f"this config's tasks ({e}); resume with the same tasks[] and run.seed, "
                          "or start a new run (another run.name, or run.restart=true)") from e


def wait_ready(actors: dict, timeout: float, what: str, stop=None, next_step: int = 1) -> None:
    """Wait until every actor of ``actors`` (name -> handle) has started, polling a stop signal.

    Raises:
        StartupTimeoutError: some are not ready within ``async.timeout_s`` (names them and the key).
        StoppedBeforeStart: ``stop.requested`` (a SIGTERM/SIGINT during start-up).
        ActorStartError: a generator or reward-model actor died while starting (names it and the cause).
        ray.exceptions.RayActorError: the learner (:data:`LEARNER`) died while starting.
    """
    import ray

    refs = {a.__ray_ready__.remote(): name for name, a in actors.items()}
    pending, deadline = list(refs), time.monotonic() + timeout
    while pending:
        if stop is not None and stop.requested:
            raise StoppedBeforeStart(next_step)
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(refs[r] for r in pending)
            raise StartupTimeoutError(
                f"{what}: {names} not ready within async.timeout_s={timeout:.0f} s ({len(refs) - len(pending)} "
                f"of {len(refs)} actors ready): raise async.timeout_s (a slow first model load or vLLM "
                "start), or check the Ray cluster's resources (ray status)")
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, left))
        for ref in ready:
            try:
                ray.get(ref)   # an actor that died while starting raises here
            except ray.exceptions.RayActorError as e:
                if refs[ref] == LEARNER:
                    raise   # learner_guard: LearnerDiedError, naming the last checkpoint
                raise ActorStartError(f"{what}: {refs[ref]} failed to start: {_root_cause(e)}") from e


def check_stop(run, stop) -> None:
    """Raise :class:`StoppedBeforeStart` when a stop was requested (between start-up phases)."""
    if stop is not None and stop.requested:
        raise StoppedBeforeStart(run.start_step + 1)


def start(run, generators: list | None, stop=None) -> None:
    """Start the actors, resume the learner from the checkpoint :func:`prepare` chose, hand the
    generators the starting weights, and build the pool, the producer and the metrics logger.

    Raises:
        StoppedBeforeStart: ``stop`` was requested (checked between the phases and while waiting
            for the actors).
        ResumeRefusedError: the learner cannot load the checkpoint (folder and cause in one line).
        StartupTimeoutError / TimeoutError: a start-up wait exceeded ``async.timeout_s`` (names it).
    """
    import ray

    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.rewards.math_verify import default_num_workers
    from megatron_rlhf.rollout.pairs import select_pair
    from megatron_rlhf.trainer.nodes import actor_nodes, write_actor_nodes

    cfg, timeout = run.cfg, run.timeout
    run.start_step = (run.resume_from[1] or {}).get("step", 0)
    check_stop(run, stop)
    run.stacks_dir = run.run_dir / "logs" / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    if any(t.kind == "math_verify" for t in cfg.tasks):
        run.reward = MathVerifyReward(num_workers=default_num_workers(cfg.rewards.math_verify_workers),
                                      stacks_dir=run.stacks_dir)
    run.ray_head = init_ray(cfg, run.run_dir, run.stacks_dir,
                              extra_cpus=len(set(run.reward_models.values())))
    if stop is not None and hasattr(stop, "reinstall"):
        stop.reinstall()   # ray.init installs Ray's own SIGTERM handler (a dump, then abort: rc 134)
    check_stop(run, stop)
    run.shared_generators = list(generators or [])
    run.placement = reserve_placement(cfg, len(set(run.reward_models.values())), timeout)
    run.rm_actors = build_reward_models(cfg, run.reward_models, run.placement)
    fns = reward_fns(cfg, run.reward, run.rm_actors, run.plugins, timeout)
    gold = eval_reward_fns(cfg, run.rm_actors, timeout)
    live = cfg.run.mode != "train_only"   # train_only replays saved batches: no vLLM engine
    run.learner, run.generators = build_actors(cfg, run.model_dir, run.shared_generators,
                                                  run.placement, live)
    run.transport = make_transport(cfg.generators, run.run_dir, cfg.async_.timeout_s,
                                   learner_plan_bytes=staging_plan_bytes(cfg, run.model_dir, run.say))
    run.probe = (probe_tokens(run.sampler, cfg.generators.max_model_len)
                  if cfg.generators.check_weight_sync else None)
    with learner_guard("start-up", run.ckpts):   # polls the stop flag; names what it waits for
        actors = {LEARNER: run.learner, **{f"generator {i}": g for i, g in enumerate(run.generators)},
                  **{f"the {'evaluation ' if k.endswith('/eval') else ''}reward model of task {k.split('/')[0]}": a
                     for k, a in run.rm_actors.items()}}
        wait_ready(actors, timeout, "start-up", stop, run.start_step + 1)
        if live and hasattr(run.transport, "setup"):   # broadcast: form the groups
            run.transport.setup(run.learner, run.generators, timeout)
    check_stop(run, stop)
    run.version, rng_state, producer_state = 0, None, None
    path, state = run.resume_from
    if path is not None:
        run.version = load_learner(run, path)
        states = run.resume_states or state   # resume_states: the pending batches are regenerated
        rng_state, producer_state = states["rng_state"], states.get("producer_state")
        run.say(f"resuming from {path.name} (step {run.start_step}, weight version {run.version}"
                 f"{pending_note(run.pending)})")
    accept_resume(run)
    check_stop(run, stop)
    try:
        write_actor_nodes(run.run_dir, actor_nodes(run.learner, run.generators, run.rm_actors, timeout))
    except ray.exceptions.GetTimeoutError as e:
        raise StartupTimeoutError(f"start-up: the learner, generator and reward-model actors did not report "
                                  f"their nodes within async.timeout_s={timeout:.0f} s") from e
    run.channel = WeightChannel(PublishedWeights(version=0))
    check_stop(run, stop)
    run.batches = queue.Queue(maxsize=1)
    run.staleness = StalenessController(cfg.async_, active=cfg.run.mode == "train", log=run.say,
                                        state=(run.resume_from[1] or {}).get("staleness_control"))
    if not live:
        from megatron_rlhf.trainer.replay import ReplayProducer

        folder = run.replay_folder   # checked in prepare(), before any actor started
        run.say(f"train_only: replaying the saved batches of {folder} (no generator, no eval)")
        run.producer = ReplayProducer(folder, run.batches, run.start_step + len(run.pending),
                                       cfg.run.num_steps)
        run.thread = threading.Thread(target=run.producer.run, name="rollout-replay", daemon=True)
        open_metrics(run)
        return
    if run.version > 0:  # the generators start from the base weights: hand them the resumed ones
        run.publish(run.version)
    elif run.shared_generators:  # reused actors hold an earlier run's weights: reset to version 0
        with learner_guard("the export of the starting weights", run.ckpts):
            start = run.transport.publish(run.learner, 0, timeout, None)
        try:
            ray.get([run.transport.push(g, start) for g in run.shared_generators], timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise StartupTimeoutError(f"start-up: the push of the starting weights to {len(run.shared_generators)} "
                                      f"generators took over async.timeout_s={timeout:.0f} s") from e
    check_stop(run, stop)
    run.pool = GeneratorPool(run.generators, transport=run.transport, generator_cfg=cfg.generators,
                              timeout_s=timeout, probe=run.probe,
                              log=lambda m: print(m, file=sys.stderr, flush=True),
                              max_mult_prob_error=cfg.logging.warn_token_mult_prob_error)
    if run.probe is not None and run.version == 0:   # the start-up probe: fails fast, calibrates the check
        with learner_guard("the start-up weight-sync probe", run.ckpts):
            got = run.pool.calibrate_check(run.learner.token_logprobs.remote([run.probe]))
        run.say(f"weight-sync check calibrated at version 0: probe mean |diff| "
                f"{got['sync/check_mean_abs_diff']:.2e} nats (max {got['sync/check_max_abs_diff']:.2e}); "
                f"later pushes must stay within generators.check_weight_sync_tol="
                f"{cfg.generators.check_weight_sync_tol:g} of it")
    run.evals = eval_service(cfg, run.pool, run.eval_by_task, fns, log=run.say,
                             reference=eval_reference(run) if cfg.eval.kl_ref else None, gold_fns=gold)
    bound = cfg.run.num_steps if cfg.run.mode == "rollout_only" else run.staleness.bound
    run.producer = RolloutProducer(   # rollout_only: never waits for weights (no training)
        pool=run.pool, sampler=run.sampler, reward_fns=fns,
        pair_fn=select_pair, channel=run.channel, out_queue=run.batches, algorithm_cfg=cfg.algorithm,
        generator_cfg=cfg.generators, staleness_bound=bound,
        carry_staleness_bound=None if cfg.run.mode == "rollout_only" else run.staleness.carry_bound(bound),
        first_batch=run.start_step + len(run.pending), num_batches=cfg.run.num_steps,
        min_version=run.version,
        rng_state=rng_state, producer_state=producer_state, seed=cfg.run.seed, timeout_s=timeout,
        evals=run.evals)
    run.staleness.on_change = run.producer.set_bound   # async.max_staleness: auto
    run.thread = threading.Thread(target=run.producer.run, name="rollout-producer", daemon=True)
    open_metrics(run)
    if run.evals is not None and run.start_step > 0 and not run.evals.evaluator.set_base(run.metrics.rows):
        run.say("note: the eval before step 1 is not among the metrics rows kept: no win rates against the "
                "starting policy in this session")


def open_metrics(run) -> None:
    """The metrics logger (rows above the resumed step moved aside, see ``MetricsLogger``) and
    the hang watchdog."""
    cfg = run.cfg
    run.metrics = m = MetricsLogger(run.run_dir, cfg.logging, config_to_dict(cfg), resume_step=run.start_step)
    n = run.start_step
    if m.unreadable or m.missing:   # one line: what is wrong, what was moved, what happens next
        why = [f"{m.unreadable} line{' is' if m.unreadable == 1 else 's are'} no metrics row: garbage, or torn "
               "by a crash"] if m.unreadable else []
        why += [f"it holds no row of step{'s' if len(m.missing) > 1 else ''} {steps_text(m.missing)}"] if m.missing else []
        moved = f"moved aside to {m.aside.name} with any row after step {n}; " if m.aside is not None else ""
        cover = f"; its summary and report cover the {len(m.rows)} rows left and the new ones" if m.missing else ""
        run.say(f"metrics.jsonl is damaged ({'; '.join(why)}): {moved}the run goes on from step {n + 1}{cover}")
    elif m.aside is not None:
        run.say(f"metrics rows after step {n} (training lost in a crash) moved to {m.aside.name}")
    for note in m.damaged_notes:
        run.say(note)
    run.watchdog = HangWatchdog(
        factor=cfg.async_.watchdog_factor, min_steps=cfg.async_.watchdog_min_steps,
        pending_calls=run.pending_calls, dump_stacks=lambda: dump_actor_stacks(run.stacks_dir),
        log=lambda m: print(m, file=sys.stderr, flush=True))


# ----- helpers ------------------------------------------------------------------------------------


def resolve_model_dir(model_cfg) -> Path:
    """The HF folder of the base model.

    ``model.source`` is ``smollm2`` (converted from the registry package's GGUF and cached), an HF
    folder, or a Megatron checkpoint (``tools/convert/hf_to_megatron.py`` output or a trainer
    ``checkpoints/step_N``): the latter is exported once (exactly, tensor by tensor) to an HF folder
    cached under ``model.cache_dir``, which both the learner and the vLLM generators start from.
    """
    if model_cfg.source == "smollm2":
        from megatron_rlhf.convert.gguf import ensure_smollm2_hf

        return Path(ensure_smollm2_hf(os.path.expanduser(model_cfg.cache_dir)))
    src = Path(os.path.expanduser(model_cfg.source)).resolve()
    if (src / "config.json").is_file() and any(src.glob("*.safetensors")):
        return src
    import hashlib

    from megatron_rlhf.convert.pipeline import megatron_to_hf

    key = hashlib.sha256(str(src).encode()).hexdigest()[:16]
    out = Path(os.path.expanduser(model_cfg.cache_dir)) / "from_megatron" / f"{src.name}-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[megatron-rlhf] exporting Megatron checkpoint {src} -> {out}", flush=True)
        megatron_to_hf(src, out, progress=False)
    return out


def worker_pythonpath(environ: dict | None = None) -> str:
    """``PYTHONPATH`` for every Ray worker of the run: the folder this driver imported
    ``megatron_rlhf`` from (a plain checkout needs no ``pip install``), then the driver's own
    ``PYTHONPATH``. Ray imports the ``worker_process_setup_hook`` (``trainer.watchdog``) before
    the driver's directory reaches the worker's ``sys.path`` (``default_worker.py`` runs the hook
    before ``main_loop``; the job's code paths arrive with the first task), so without this every
    actor dies at start with ``No module named 'megatron_rlhf'`` (issue 21 item 1). A package
    installed into site-packages adds nothing (that folder is on every worker's path already)."""
    import megatron_rlhf

    environ = os.environ if environ is None else environ
    root = str(Path(megatron_rlhf.__file__).resolve().parents[1])
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if Path(root).name not in ("site-packages", "dist-packages") and root not in parts:
        parts.insert(0, root)
    return os.pathsep.join(parts)


def init_ray(cfg: Config, run_dir: Path, stacks_dir: Path, extra_cpus: int = 0):
    """Connect to Ray: the cluster at ``RAY_ADDRESS`` (slurm/ray_cluster.sh), the one this process
    already joined (tests), or a local head started here in its own session (``LocalRayHead``), so
    that a signal to the driver's process group does not stop Ray under the final checkpoint.
    Every worker of the run registers a stack dump into ``stacks_dir`` (the hang watchdog) and
    imports the package from where the driver did (:func:`worker_pythonpath`).

    Returns:
        ``None``: this process had already joined a cluster (left as it is); ``False``: connected
        to ``RAY_ADDRESS`` (disconnect at the end); else the
        :class:`~megatron_rlhf.runtime.LocalRayHead` to stop at the end.
    """
    import ray

    from megatron_rlhf.runtime import LocalRayHead, process_env, route_ray_system_noise

    if ray.is_initialized():
        return None
    from megatron_rlhf.utils.stacks import STACKS_ENV

    env = {**process_env(), STACKS_ENV: str(stacks_dir), "PYTHONPATH": worker_pythonpath()}
    kw = dict(log_to_driver=True, logging_level="WARNING", runtime_env={
        "env_vars": env, "worker_process_setup_hook": "megatron_rlhf.utils.stacks.register_stack_dump"})
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kw)
        route_ray_system_noise(run_dir / "logs" / "ray-system.log")
        return False
    lc = cfg.learner  # one CPU per generator engine and per learner rank
    ranks = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
    head = LocalRayHead(num_cpus=max(2, cfg.generators.num_workers + ranks + extra_cpus),
                        log_path=run_dir / "logs" / "ray-head.log")
    try:
        ray.init(address=head.address, **kw)
    except BaseException:
        head.stop()
        raise
    route_ray_system_noise(run_dir / "logs" / "ray-system.log")
    print(f"[megatron-rlhf] local Ray head pid {head.proc.pid} (own session; log {head.log_path})",
          flush=True)
    return head


def actor_options(role: str, gpus: int) -> dict:
    """Ray options of a learner rank or generator engine: one CPU; on GPU clusters ``gpus`` GPUs
    and the role resource ``mrlhf_<role>`` that slurm/ray_cluster.sh declares on that role's
    nodes (so learners and vLLM engines never share a GPU)."""
    import ray

    resources = ray.cluster_resources()
    opts: dict = {"num_cpus": 1, "max_restarts": 0}
    if resources.get("GPU", 0) > 0:
        opts["num_gpus"] = gpus
    if resources.get(f"mrlhf_{role}", 0) > 0:
        opts["resources"] = {f"mrlhf_{role}": gpus}
    return opts


def reserve_placement(cfg: Config, reward_models: int, timeout: float):
    """Ray placement groups for a GPU cluster run (``placement.gpus_per_node > 0`` and GPUs in the
    Ray cluster): :class:`megatron_rlhf.placement.ActorPlacement`, reserved before any actor starts
    (a shortfall raises ``ConfigError``); ``None`` on CPU and local runs."""
    import ray

    from megatron_rlhf.placement import ActorPlacement, BundleLayout

    if cfg.placement.gpus_per_node == 0 or ray.cluster_resources().get("GPU", 0) == 0:
        return None
    return ActorPlacement(BundleLayout.from_config(cfg, reward_models), timeout_s=timeout,
                          engine_backend=cfg.generators.distributed_executor_backend)


def build_actors(cfg: Config, model_dir: Path, generators: list | None = None, placement=None,
                  with_generators: bool = True):
    """The learner (one rank, or a ``LearnerGroup`` coordinator of one actor per rank) and the
    generators (none without ``with_generators``: ``run.mode: train_only``); with ``placement``,
    every rank and engine in its placement-group bundle."""
    import ray

    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.utils.faults import actor_env

    pin, g = cfg.generators.cpu_core, cfg.generators
    lc = cfg.learner
    world = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
    kw = dict(model_dir=str(model_dir), learner_cfg=lc, algorithm_cfg=cfg.algorithm,
              dtype=cfg.model.dtype, seed=cfg.run.seed, total_steps=cfg.run.num_steps,
              temperature=cfg.generators.temperature,   # the learner picks each loss's own
              cpu_core=pin + g.num_workers * g.tensor_parallel if pin >= 0 else -1)
    rank_opts = ([{"max_restarts": 0, **placement.learner_options(r)} for r in range(world)] if placement
                 else [actor_options("learner", 1)] * world)
    test_env = actor_env()   # fault-injection hooks only (utils.faults); {} in real runs
    if test_env:
        rank_opts = [dict(o, runtime_env={"env_vars": test_env}) for o in rank_opts]
    if world == 1:
        learner = ray.remote(**rank_opts[0])(MegatronLearner).remote(**kw)
    else:  # a coordinator actor (no CPU/GPU of its own) driving one actor per learner rank
        from megatron_rlhf.learner.group import LearnerGroup

        learner = ray.remote(num_cpus=0, max_restarts=0)(LearnerGroup).remote(
            rank_actor_options=rank_opts, timeout_s=cfg.async_.timeout_s, **kw)
    if not with_generators:
        return learner, []
    return learner, (list(generators) if generators else build_generators(cfg, model_dir, placement))


def build_generators(cfg: Config, model_dir: Path, placement=None) -> list:
    """``generators.num_workers`` VLLMGenerator actors: worker i has engine seed ``run.seed + i``
    (distinct samples), is pinned to core ``cpu_core + i`` (CPU, TP 1, unless -1; TP > 1: its
    workers bind cores ``cpu_core + i*TP + r``), sits in its placement-group bundle on GPU clusters,
    and is restarted by Ray up to ``generators.max_restarts`` times when its process dies."""
    import ray

    from megatron_rlhf.generator.vllm_engine import RAY_ACTOR_OPTIONS, VLLMGenerator

    g = cfg.generators
    out = []
    for i in range(g.num_workers):
        opts = placement.engine_options(i) if placement else actor_options("generator", g.tensor_parallel)
        opts["max_restarts"] = g.max_restarts
        opts.update(RAY_ACTOR_OPTIONS)   # threaded: weight pushes land between engine steps of a request
        out.append(ray.remote(**opts)(VLLMGenerator).remote(
            model_dir=str(model_dir), generator_cfg=g, dtype=cfg.model.dtype, seed=cfg.run.seed + i,
            cpu_core=g.cpu_core + i if g.cpu_core >= 0 else -1, engine_index=i))
    return out


def load_prompts(cfg: Config, model_dir: Path):
    """Every task's prompts (math loaders or chat loaders by the task's reward kind) in one
    ``MultiTaskSampler`` (per-task seeded samplers, quotas by ``tasks[].weight``), and with
    ``eval.enabled`` every task's held-out prompts (taken out of training)."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data import load_prompts_for_task
    from megatron_rlhf.data.mix import MultiTaskSampler

    tok = AutoTokenizer.from_pretrained(model_dir)
    max_prompt = cfg.generators.max_model_len - cfg.generators.max_new_tokens
    by_task, counts = {}, {}
    for task in cfg.tasks:
        by_task[task.name], counts[task.name] = load_prompts_for_task(task, tok, max_prompt)
        if not by_task[task.name]:
            raise ValueError(f"tasks[{task.name}].data: no usable prompt ({counts[task.name]}); check "
                             "path, prompt_field, filter and generators.max_model_len")
    eval_by_task = {}
    if cfg.eval.enabled:   # held-out prompts out of training (trainer.evaluate)
        from dataclasses import replace

        from megatron_rlhf.trainer.evaluate import split_eval_prompts

        def load_eval(task):
            try:
                return load_prompts_for_task(replace(task, data=task.eval_data), tok, max_prompt)[0]
            except ValueError as e:   # the loader names tasks[<name>].data: here it read eval_data
                raise ValueError(str(e).replace(f"tasks[{task.name}].data", f"tasks[{task.name}].eval_data")) from e

        by_task, eval_by_task, eval_counts = split_eval_prompts(cfg.tasks, by_task, cfg.eval, load_eval)
        for name, c in eval_counts.items():
            counts[name].update(c)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sampler = MultiTaskSampler(by_task, {t.name: t.weight for t in cfg.tasks}, seed=cfg.run.seed)
    return sampler, counts, pad_id, eval_by_task


def staging_plan_bytes(cfg: Config, model_dir: Path, say=lambda *a: None) -> dict[int, float] | None:
    """The memory plan's resident bytes of one learner GPU per pipeline stage
    (:func:`megatron_rlhf.memory_plan.learner_plan_bytes` of this config and the model's
    ``config.json``), which the broadcast exporters decide their staging from, once (device when
    it fits, else pinned host; each exporter logs its decision). None for the other transports,
    or, said in one line, when the model's shape cannot be planned (host staging then)."""
    from megatron_rlhf import memory_plan

    if cfg.generators.transport not in ("broadcast", "nccl"):
        return None
    try:
        return memory_plan.learner_plan_bytes(cfg, memory_plan.load_shape(str(model_dir)))
    except (ValueError, OSError) as e:   # a config.json the plan cannot read (not a Llama/Qwen2 shape)
        say(f"weight-sync staging: no memory plan for {model_dir} ({e}); the exporters stage in pinned host memory")
        return None


def probe_tokens(sampler, max_model_len: int) -> list[int]:
    """The weight-sync probe: the first task's first prompt's tokens (fixed for the run), cut to
    the context."""
    first = sampler.prompts(sampler.tasks[0])[0]
    return list(first.token_ids[: max_model_len - 1])


def eval_service(cfg: Config, pool, eval_by_task: dict, reward_fns: dict, log=None, reference=None,
                 gold_fns: dict | None = None):
    """The ``EvalService`` of the run's held-out prompts (None with ``eval.enabled: false``);
    ``log``: where its progress lines go (None: nowhere); ``reference``: :func:`eval_reference`
    (``eval.kl_ref``; None: no reference pass); ``gold_fns``: :func:`eval_reward_fns`."""
    if not cfg.eval.enabled:
        return None
    from megatron_rlhf.trainer.evaluate import EvalService, Evaluator

    return EvalService(Evaluator(pool, eval_by_task, {t.name: t.kind for t in cfg.tasks}, reward_fns,
                                 cfg.eval, cfg.generators.temperature, log=log, reference=reference,
                                 gold_fns=gold_fns))


def eval_reference(run):
    """The evaluator's reference pass (``eval.kl_ref``; ``trainer.evaluate.Evaluator``'s
    ``reference``): ``submit(input_ids, loss_mask, temperature)`` queues
    ``MegatronLearner.reference_logprobs`` on the run's learner and returns the function that waits
    for it (``Run.call``: within ``async.timeout_s``; a dead learner raises ``LearnerDiedError``)."""
    import itertools

    count = itertools.count(1)

    def submit(input_ids, loss_mask, temperature: float):
        ref = run.learner.reference_logprobs.remote(input_ids, loss_mask, temperature)
        what = f"the reference pass of eval {next(count)} (eval.kl_ref, {len(input_ids)} completions)"
        return lambda: run.call(ref, what)
    return submit




def config_changes(cfg: Config, saved: Path) -> list[str]:
    """``["key: old -> new", ...]`` between the config saved at ``saved`` and ``cfg``; empty when
    there is no saved config or it cannot be read (a note only; a damaged one is moved aside by
    :func:`prepare`)."""
    from megatron_rlhf.trainer.readback import read_yaml_mapping

    old, _ = read_yaml_mapping(saved)
    if old is None:
        return []
    try:
        return config_diff(old, config_to_dict(cfg))
    except (AttributeError, TypeError, ValueError):   # parses, but is no config of ours
        return []


def rm_accuracy(folder: Path) -> str:
    """``"; held-out pairwise accuracy A +- se (n = N)"`` from the folder's ``rm_report.json``, or ``""``."""
    try:
        rep = json.loads((Path(folder) / "rm_report.json").read_text())
        return f"; held-out pairwise accuracy {rep['accuracy']:.3f} +- {rep['se']:.3f} (n = {rep['n_eval']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def reward_model_specs(cfg: Config) -> list[tuple[str, object]]:
    """``[(key, RewardModelSpec)]`` of every reward model the run loads: key ``<task>`` for a
    task's ``reward``, ``<task>/eval`` for its ``eval_reward`` (the keys of
    :func:`resolve_reward_models` and :func:`build_reward_models`)."""
    out = []
    for task in cfg.tasks:
        if task.kind == "reward_model":
            out.append((task.name, task.reward))
            if task.eval_reward is not None:
                out.append((f"{task.name}/eval", task.eval_reward))
    return out


def resolve_reward_models(cfg: Config) -> dict[str, Path]:
    """Key -> reward-model folder for every ``reward: {reward_model: ...}`` task (key: the task
    name) and every ``eval_reward`` (key ``<task>/eval``); a demo name (``smollm2-demo``,
    ``smollm2-demo-gold``, ...) is trained once and cached.

    Raises:
        ConfigError: a path that does not exist / is not a reward model, named by its task and key.
    """
    from megatron_rlhf.rewards import resolve_reward_model

    out = {}
    for key, spec in reward_model_specs(cfg):
        task, _, part = key.partition("/")
        try:
            out[key] = resolve_reward_model(spec.reward_model, os.path.expanduser(cfg.model.cache_dir),
                                            key=f"tasks[{task}].{'eval_reward' if part else 'reward'}.reward_model")
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from e
    return out


def build_reward_models(cfg: Config, folders: dict[str, Path], placement=None) -> dict:
    """One ``RewardModelWorker`` Ray actor per reward-model folder, keyed as ``folders``
    (:func:`resolve_reward_models`; keys sharing a folder share the actor): one CPU, and on GPU clusters one GPU of the generator nodes (its placement-group
    bundle, or the ``mrlhf_generator`` resource of slurm/ray_cluster.sh; the placement check counts
    it beside the vLLM engines)."""
    import ray

    from megatron_rlhf.rewards.server import RewardModelWorker

    by_dir: dict[Path, object] = {}
    out = {}
    for key, spec in reward_model_specs(cfg):
        if key not in folders:
            continue
        d = folders[key]
        if d not in by_dir:
            opts = placement.reward_options(len(by_dir)) if placement else actor_options("generator", 1)
            by_dir[d] = ray.remote(**opts)(RewardModelWorker).remote(
                model_dir=str(d), dtype=cfg.model.dtype, batch_size=spec.batch_size)
        out[key] = by_dir[d]
    return out


def reward_fns(cfg: Config, math_reward, rm_actors: dict, plugins: dict, timeout: float) -> dict:
    """Task name -> ``(prompts, completions) -> rewards``: math-verify against the prompt's gold
    answer (process pool), a reward-model actor scoring (prompt text, completion), or a
    ``module:function`` plug-in called as ``fn(completions, answers)``."""
    import ray

    fns = {}
    for task in cfg.tasks:
        if task.kind == "math_verify":
            fns[task.name] = lambda ps, texts, f=math_reward: f(texts, [p.answer for p in ps])
            fns[task.name].reward_name = "math_verify"
        elif task.kind == "reward_model":
            fns[task.name] = lambda ps, texts, a=rm_actors[task.name]: ray.get(
                a.score.remote([p.text for p in ps], list(texts)), timeout=timeout)
            fns[task.name].reward_name = f"reward model {task.reward.reward_model}"
        else:
            fns[task.name] = lambda ps, texts, f=plugins[task.name]: f(list(texts), [p.answer for p in ps])
            fns[task.name].reward_name = task.reward
    return fns


def eval_reward_fns(cfg: Config, rm_actors: dict, timeout: float) -> dict:
    """Task name -> ``(prompts, completions) -> rewards`` of each task's ``eval_reward`` (the
    evaluator's gold judge; ``rm_actors`` keyed as :func:`build_reward_models`)."""
    import ray

    fns = {}
    for task in cfg.tasks:
        actor = rm_actors.get(f"{task.name}/eval")
        if actor is not None:
            fns[task.name] = lambda ps, texts, a=actor: ray.get(
                a.score.remote([p.text for p in ps], list(texts)), timeout=timeout)
            fns[task.name].reward_name = f"evaluation reward model {task.eval_reward.reward_model}"
    return fns


def load_learner(run, path: Path) -> int:
    """Load checkpoint ``path`` into the learner; returns its weight version.

    Raises:
        ResumeRefusedError: the learner refused it (a layout change, a missing key, another model):
            the folder and the cause in one line, not the actor's traceback.
        LearnerDiedError / TimeoutError: the learner died / did not answer within async.timeout_s.
    """
    from ray.exceptions import RayTaskError

    try:
        return run.call(run.learner.load_checkpoint.remote(str(path / "learner")), f"loading checkpoint {path.name}")
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        text = str(cause).strip().splitlines()
        line = text[0] if text else ""
        raise ResumeRefusedError(
            f"cannot resume from {path}: the learner cannot load it ({type(cause).__name__}: {line[:400]}); "
            "resume with the config the checkpoint was written with (config.yaml), or start fresh: "
            "another run.name, or run.restart=true") from None


def load_pending(path: Path, state: dict, algorithm_cfg, say=lambda *a: None) -> tuple[list, dict | None, int]:
    """The untrained batches checkpoint ``path`` keeps (``trainer_state["pending_batches"]``), when
    they were built for this config's algorithm (loss, K, pairing: ``batch_io.algorithm_tag``).

    Batches built for another one are regenerated, never trained as the wrong kind: none is
    returned, and the producer starts from the position before them (``state["before_pending"]``;
    a checkpoint written before that was kept starts after them: their prompts are skipped). An
    untagged batch (written before the tag) is taken as built for this algorithm.

    Returns:
        ``(batches, producer states to start from or None for the checkpoint's own, regenerated count)``.
    Raises:
        ConfigError: a listed batch file is missing or unreadable (names it).
    """
    from megatron_rlhf.rollout.batch_io import algorithm_tag, batch_path, load_batch

    out, want = [], algorithm_tag(algorithm_cfg)
    for index in state.get("pending_batches", []):
        try:
            out.append(load_batch(batch_path(path / "batches", index), with_algorithm=True))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot resume from {path}: its untrained batch {index} is unreadable ({e}); "
                              "move this checkpoint folder aside to resume from the one before") from e
    wrong = [(b, tag) for b, tag in out if tag is not None and tag != want]
    if not wrong:
        return [b for b, _ in out], None, 0
    b, tag = wrong[0]
    say(f"checkpoint {path.name}: its {len(out)} untrained batches were built for {tag} and this run "
        f"trains {want}: they are regenerated (pending_regenerated = {len(out)})")
    return [], state.get("before_pending"), len(out)


def pending_note(pending) -> str:
    if not pending:
        return ""
    return "; then its untrained batches " + ", ".join(
        f"{b.index} (weight version {b.weight_version})" for b in pending)
