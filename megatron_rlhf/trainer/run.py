"""A run's setup and teardown: everything :func:`megatron_rlhf.trainer.loop.train` needs around its
loop, in one object.

:meth:`Run.open` resolves the model, runs the pre-flight checks (before any actor starts), loads
the prompts, finds the checkpoint to resume from, starts Ray, the reward-model actors, the learner
(group) and the generator engines, forms the weight transport, and builds the generator pool and
the rollout producer. :meth:`Run.close` stops all of it (shared generator actors a test passed in
are left running). The verbs the loop calls (:meth:`train_step`, :meth:`publish`,
:meth:`save`, :meth:`finish`) keep the remote-call error handling in one place.
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

import yaml

from megatron_rlhf.config import Config, ConfigError, config_diff, config_to_dict, save_config
from megatron_rlhf.generator.pool import GeneratorPool
from megatron_rlhf.generator.weight_sync import PublishedWeights, make_transport
from megatron_rlhf.trainer.checkpoint import CheckpointManager
from megatron_rlhf.trainer.metrics import MetricsLogger, summarize
from megatron_rlhf.trainer.preflight import check_model_source, preflight
from megatron_rlhf.trainer.rollout import ProducerError, RewardError, RolloutProducer, WeightChannel
from megatron_rlhf.trainer.watchdog import HangWatchdog, dump_actor_stacks

__all__ = ["Run", "RunResult", "LearnerDiedError", "NonFiniteTrainingError", "resolve_model_dir"]


class LearnerDiedError(RuntimeError):
    """The learner actor died; the run stops (the last complete checkpoint is left intact)."""


class NonFiniteTrainingError(RuntimeError):
    """``learner.max_skipped_steps`` steps in a row had a non-finite loss or gradient."""


class RunResult(dict):
    """Summary of a finished (or stopped) run: :func:`metrics.summarize` plus ``run_dir``,
    ``stopped_early``, ``resumed_from_step``, ``report`` (the HTML page) and ``tensorboard`` (the
    event-file folder, or None with ``logging.tensorboard: false``)."""


class Run:
    """The actors, data and state of one run (see the module docstring).

    Attributes (the ones the loop reads):
        cfg: the resolved config.
        start_step / version: step and learner weight version the loop starts from (0 / 0, or the
            resumed checkpoint's).
        batches: the producer's output queue (``maxsize=1``: Cleanba's bounded hand-over).
        learner: the learner actor (one rank) or ``LearnerGroup`` coordinator.
        channel: the published-weights channel the producer waits on.
        metrics: the ``metrics.jsonl`` logger.
        pad_id: the tokenizer's pad id (learner batches).
        too_long: prompts dropped for length at load time (a per-row metric).
    """

    def __init__(self, cfg: Config, say):
        self.cfg, self.say, self.run_dir = cfg, say, cfg.run_dir
        self.timeout = cfg.async_.timeout_s
        self.learner = self.transport = self.channel = self.producer = self.thread = None
        self.pool = self.metrics = self.reward = self.placement = self.evals = None
        self.rm_actors: dict = {}
        self.generators: list = []
        self.shared_generators: list = []
        self.ray_head = None   # see _init_ray
        self._calls: dict[str, float] = {}   # learner calls in flight -> start (monotonic s)
        self.stacks_dir = self.watchdog = None
        self.skipped_in_row = 0

    @classmethod
    def open(cls, cfg: Config, *, quiet: bool = False, generators: list | None = None) -> "Run | RunResult":
        """Set the run up; a run folder that already holds the finished run returns its saved
        :class:`RunResult` instead (nothing is started).

        Raises:
            ConfigError: a bad config or model folder, before any actor starts.
            LearnerDiedError / TimeoutError: an actor failed while starting.
        """
        say = (lambda *a: None) if quiet else (lambda *a: print("[megatron-rlhf]", *a, flush=True))
        run = cls(cfg, say)
        done = run._prepare()
        if done is not None:
            return done
        try:
            run._start(generators)
        except BaseException:
            run.close()
            raise
        return run

    def _prepare(self) -> "RunResult | None":
        """Everything before any actor starts: model, pre-flight checks, data, plug-ins, folder.
        A config error leaves no empty run folder behind (one this call created)."""
        existed = self.run_dir.exists()
        try:
            return self._prepare_checked()
        except ConfigError:
            if not existed:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()   # only when empty
            raise

    def _prepare_checked(self) -> "RunResult | None":
        cfg, say, run_dir = self.cfg, self.say, self.run_dir
        say(f"run folder {run_dir}")
        check_model_source(cfg.model)
        self.model_dir = resolve_model_dir(cfg.model)
        self.plugins = preflight(cfg, self.model_dir)    # before any actor starts: a bad config stops here
        try:
            self.sampler, self.data_counts, self.pad_id, self.eval_by_task = _load_prompts(cfg, self.model_dir)
        except (ValueError, FileNotFoundError) as e:   # names tasks[].data.*: a config problem
            raise ConfigError(str(e)) from e
        say(f"model {self.model_dir}; prompts per task: {json.dumps(self.data_counts)}")
        self.too_long = sum(c.get("too_long", 0) for c in self.data_counts.values())
        self.ckpts = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
        done_before = _completed_run(cfg, self.ckpts, run_dir)
        if done_before is not None:
            say(f"run already complete at step {cfg.run.num_steps}: nothing to train (raise run.num_steps "
                "to continue it, or pick another run.name for a new run)")
            changes = _config_changes(cfg, run_dir / "config.yaml")
            if changes:
                say(f"note: this config differs from the one the run used ({run_dir / 'config.yaml'}); "
                    f"it was not applied: {'; '.join(changes)}")
            return done_before
        self.reward_models = _resolve_reward_models(cfg)
        for task, folder in self.reward_models.items():
            say(f"task {task}: reward model {folder}{_rm_accuracy(folder)}")
        changes = _config_changes(cfg, run_dir / "config.yaml")
        if changes:
            say(f"warning: resuming {run_dir} with a changed config (config.yaml is rewritten, the new "
                f"values apply from here on): {'; '.join(changes)}")
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        return None

    def _start(self, generators: list | None) -> None:
        """Start the actors, resume the learner from the latest checkpoint, hand the generators
        the starting weights, and build the pool, the producer and the metrics logger."""
        import ray

        from megatron_rlhf.rewards import MathVerifyReward
        from megatron_rlhf.rollout.pairs import select_pair
        from megatron_rlhf.trainer.nodes import actor_nodes, write_actor_nodes

        cfg, timeout = self.cfg, self.timeout
        if any(t.kind == "math_verify" for t in cfg.tasks):
            self.reward = MathVerifyReward(num_workers=1)
        self.stacks_dir = self.run_dir / "logs" / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.ray_head = _init_ray(cfg, self.run_dir, self.stacks_dir,
                                  extra_cpus=len(set(self.reward_models.values())))
        self.shared_generators = list(generators or [])
        self.placement = _placement(cfg, len(set(self.reward_models.values())), timeout)
        self.rm_actors = _build_reward_models(cfg, self.reward_models, self.placement)
        reward_fns = _reward_fns(cfg, self.reward, self.rm_actors, self.plugins, timeout)
        live = cfg.run.mode != "train_only"   # train_only replays saved batches: no vLLM engine
        self.learner, self.generators = _build_actors(cfg, self.model_dir, self.shared_generators,
                                                      self.placement, live)
        self.transport = make_transport(cfg.generators, self.run_dir, cfg.async_.timeout_s)
        self.probe = (_probe_tokens(self.sampler, cfg.generators.max_model_len)
                      if cfg.generators.check_weight_sync else None)
        self.start_step, self.version, rng_state, producer_state = 0, 0, None, None
        self.pending = collections.deque()
        latest = self.ckpts.latest() if cfg.checkpoint.resume else None
        if latest is not None:
            path, state = latest
            self.version = self.call(self.learner.load_checkpoint.remote(str(path / "learner")),
                                     f"loading checkpoint {path.name}")
            self.start_step, rng_state = state["step"], state["rng_state"]
            producer_state = state.get("producer_state")
            self.pending.extend(_load_pending(path, state))
            try:
                self.sampler.load_state_dict(state["sampler_state"])
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"cannot resume from {path}: its data-sampler position does not fit "
                                  f"this config's tasks ({e}); resume with the same tasks[] and run.seed, "
                                  "or start a new run (another run.name)") from e
            self.say(f"resuming from {path.name} (step {self.start_step}, weight version {self.version}"
                     f"{_pending_note(self.pending)})")
        with _learner_guard("start-up", self.ckpts):
            ray.get([a.__ray_ready__.remote() for a in (self.learner, *self.generators, *self.rm_actors.values())],
                    timeout=timeout)
            if live and hasattr(self.transport, "setup"):   # broadcast: form the groups
                self.transport.setup(self.learner, self.generators, timeout)
        write_actor_nodes(self.run_dir, actor_nodes(self.learner, self.generators, self.rm_actors, timeout))
        self.channel = WeightChannel(PublishedWeights(version=0))
        self.batches = queue.Queue(maxsize=1)
        if not live:
            from megatron_rlhf.trainer.replay import ReplayProducer, check_replay_dir

            try:
                folder = check_replay_dir(cfg.run.replay, self.start_step, cfg.run.num_steps)
            except ValueError as e:
                raise ConfigError(str(e)) from e
            self.say(f"train_only: replaying the saved batches of {folder} (no generator, no eval)")
            self.producer = ReplayProducer(folder, self.batches, self.start_step + len(self.pending),
                                           cfg.run.num_steps)
            self.thread = threading.Thread(target=self.producer.run, name="rollout-replay", daemon=True)
            self._open_metrics()
            return
        if self.version > 0:  # the generators start from the base weights: hand them the resumed ones
            self.publish(self.version)
        elif self.shared_generators:  # reused actors hold an earlier run's weights: reset to version 0
            with _learner_guard("the export of the starting weights", self.ckpts):
                start = self.transport.publish(self.learner, 0, timeout, None)
            ray.get([self.transport.push(g, start) for g in self.shared_generators], timeout=timeout)
        self.pool = GeneratorPool(self.generators, transport=self.transport, generator_cfg=cfg.generators,
                                  timeout_s=timeout, probe=self.probe,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
        self.evals = _eval_service(cfg, self.pool, self.eval_by_task, reward_fns)
        bound = cfg.run.num_steps if cfg.run.mode == "rollout_only" else cfg.async_.staleness_bound
        self.producer = RolloutProducer(   # rollout_only: never waits for weights (no training)
            pool=self.pool, sampler=self.sampler, reward_fns=reward_fns,
            pair_fn=select_pair, channel=self.channel, out_queue=self.batches, algorithm_cfg=cfg.algorithm,
            generator_cfg=cfg.generators, staleness_bound=bound,
            first_batch=self.start_step + len(self.pending), num_batches=cfg.run.num_steps,
            min_version=self.version,
            rng_state=rng_state, producer_state=producer_state, seed=cfg.run.seed, timeout_s=timeout,
            evals=self.evals)
        self.thread = threading.Thread(target=self.producer.run, name="rollout-producer", daemon=True)
        self._open_metrics()

    def _open_metrics(self) -> None:
        """The metrics logger (rows above the resumed step moved aside, see ``MetricsLogger``) and
        the hang watchdog."""
        cfg = self.cfg
        self.metrics = MetricsLogger(self.run_dir, cfg.logging, config_to_dict(cfg),
                                     resume_step=self.start_step)
        if self.metrics.aside is not None:
            self.say(f"metrics rows after step {self.start_step} (training lost in a crash) moved to "
                     f"{self.metrics.aside.name}")
        self.watchdog = HangWatchdog(
            factor=cfg.async_.watchdog_factor, min_steps=cfg.async_.watchdog_min_steps,
            pending_calls=self.pending_calls, dump_stacks=lambda: dump_actor_stacks(self.stacks_dir),
            log=lambda m: print(m, file=sys.stderr, flush=True))

    # ----- the verbs of the loop -------------------------------------------------------------------
    def call(self, ref, what: str):
        """``ray.get`` of a learner call within ``async.timeout_s``; a dead learner raises
        :class:`LearnerDiedError` naming the last complete checkpoint (see :func:`_learner_call`)."""
        self._calls[what] = time.monotonic()
        try:
            return _learner_call(ref, what, self.timeout, self.ckpts)
        finally:
            self._calls.pop(what, None)

    def pending_calls(self) -> list[str]:
        """The remote calls in flight, one line each (the hang watchdog's report): the learner
        call the loop waits on, the generator requests, and what the rollout producer is doing."""
        now = time.monotonic()
        out = [f"learner: {what} (waiting {now - t0:.0f} s)" for what, t0 in list(self._calls.items())]
        if self.pool is not None:
            out += self.pool.pending_calls()
        if self.producer is not None:
            out.append(f"rollout producer: {self.producer.phase}")
        return out

    @property
    def trains(self) -> bool:
        """Whether steps update the policy (False in ``run.mode: rollout_only``)."""
        return self.cfg.run.mode != "rollout_only"

    def train_step(self, learner_batch, step: int) -> dict:
        """One learner update on ``learner_batch`` (step ``step``, 1-based); returns its metrics
        (``{"loss/total": None}`` in ``rollout_only``: nothing is trained).

        Raises:
            NonFiniteTrainingError: this is the ``learner.max_skipped_steps``-th step in a row
                that the learner skipped for a non-finite loss or gradient (the policy's update,
                or, with ppo, the critic's).
        """
        if not self.trains:
            return {"loss/total": None}
        out = self.call(self.learner.train_step.remote(learner_batch), f"train_step of step {step}")
        policy_skipped = bool(out.get("train/skipped_nonfinite"))
        critic_skipped = bool(out.get("critic/skipped_nonfinite"))
        critic_only = critic_skipped and not policy_skipped
        self.skipped_in_row = self.skipped_in_row + 1 if policy_skipped or critic_skipped else 0
        limit = self.cfg.learner.max_skipped_steps
        if self.skipped_in_row >= limit:
            what, norm = (("the critic's value loss or gradient", "critic/grad_norm") if critic_only
                          else ("the loss or gradient", "grad/norm"))
            raise NonFiniteTrainingError(
                f"steps {step - limit + 1}..{step}: {what} was not finite {limit} steps in a row "
                f"(learner.max_skipped_steps={limit}); no {'critic ' if critic_only else ''}update was "
                f"applied ({norm} {out.get(norm)}, loss {out.get('loss/total')}): check the rewards' "
                "scale, the learning rate and learner.optimizer.clip_grad")
        return out

    def keep(self, batch) -> None:
        """Save ``batch`` to ``<run>/rollouts/`` (``trainer.batch_io``) in ``rollout_only`` or with
        ``run.save_rollouts``."""
        if self.cfg.run.mode == "rollout_only" or (self.cfg.run.save_rollouts and self.cfg.run.mode == "train"):
            from megatron_rlhf.trainer.batch_io import save_batch
            from megatron_rlhf.trainer.replay import ROLLOUTS_DIR

            save_batch(batch, self.run_dir / ROLLOUTS_DIR)

    def publish(self, version: int, *, generation: bool = True, eval_step: int | None = None):
        """Export the learner's weights of ``version`` through the transport and publish them to
        the producer, which pushes them to the engines (``generation``); with ``eval_step`` first
        queue their evaluation for the metrics row of that step (before the producer can see the
        version, so the eval finds the engines at it).

        Returns:
            ``(sync, future)``: ``sync`` = ``{'sync/learner_blocked_s', 'sync/push_wait_s'}``, seconds
            the learner spent publishing before it can take its next train step (TP gathers,
            staging / export, and, part of it, waiting for the previous version's broadcast or write
            to end); ``future`` = the eval's ``Future`` or None.
        """
        idle = {"sync/learner_blocked_s": 0.0, "sync/push_wait_s": 0.0}
        if self.cfg.run.mode != "train":   # debug modes: weights never change / no engine to push to
            return idle, (self.evals.request(eval_step) if eval_step is not None and self.evals else None)
        what = f"the weight publish of version {version}"
        t0 = time.perf_counter()
        with _learner_guard(what, self.ckpts):
            weights = self.transport.publish(self.learner, version, self.timeout, self.probe)
        # the object-store transport only waits for the export's ref, which is ready (as an error)
        # when the learner died: a call queued behind the export confirms it, cheaply
        self.call(self.learner.get_weight_version.remote(), what)
        fut = self.evals.request(eval_step, weights) if eval_step is not None and self.evals else None
        if generation:
            self.channel.publish(weights)
        return {"sync/learner_blocked_s": time.perf_counter() - t0, "sync/push_wait_s": weights.push_wait_s}, fut

    def end_evals(self, completed: bool) -> None:
        """No more eval requests: the producer serves the queued ones and stops (``completed``), or
        the unserved ones are dropped (a stopped run)."""
        if self.evals is not None:
            self.evals.close() if completed else self.evals.cancel_pending()

    def save(self, step: int, version: int, batch, pending: tuple = ()) -> int:
        """Write ``checkpoints/step_<step>``: the learner's state, and what the producer had made
        beyond it: ``pending``, the generated but untrained batches the loop trains next (in
        ``batches/``, :mod:`trainer.batch_io` format, with their weight versions), and the producer
        state (data-sampler position, pair RNG, normaliser) after the last of them (after ``batch``,
        the one just trained, when none is pending). A resumed run trains the pending batches first,
        then generates from that position: what the uninterrupted run would have trained."""
        from megatron_rlhf.trainer.batch_io import save_batch

        last = pending[-1] if pending else batch
        state = {"step": step, "weight_version": version, "sampler_state": last.sampler_state,
                 "rng_state": last.rng_state, "producer_state": last.producer_state,
                 "pending_batches": [b.index for b in pending], "time": time.time()}

        def write(tmp: Path) -> None:
            for b in pending:
                save_batch(b, tmp / "batches")
            self.call(self.learner.save_checkpoint.remote(str(tmp / "learner")), f"checkpoint save of step {step}")

        self.ckpts.save(step, state, write, passthrough=(LearnerDiedError,))
        return step

    def next_batch(self, stop) -> "object | None":
        """The batch the loop trains next: a pending one (resumed from a checkpoint, or taken for
        one) first, else the producer's next; ``None`` once a stop is requested."""
        return self.pending.popleft() if self.pending else _take(self.batches, self.timeout, stop)

    def take_for_checkpoint(self, stop) -> tuple:
        """The next batch for a checkpoint to keep (it stays first in :attr:`pending`): wait for it,
        or, once a stop is requested, only if it is already there (else the resumed run
        regenerates it, with newer weights)."""
        if not self.pending:
            b = _take(self.batches, self.timeout, stop) if not stop.requested else _poll(self.batches)
            if b is not None:
                self.pending.append(b)
        return tuple(self.pending)

    def finish(self, done: int, wall_s: float, stopped_early: bool) -> RunResult:
        """Stop the producer, export ``hf_final`` (a completed run), write ``summary.json``."""
        self.producer.stop_event.set()
        self.channel.close()
        _drain(self.batches)
        self.thread.join(timeout=5)
        self.metrics.close()
        cfg, run_dir = self.cfg, self.run_dir
        if not stopped_early and cfg.checkpoint.export_hf and self.trains and (done > self.start_step or not (
                run_dir / "hf_final" / "config.json").is_file()):
            _export_final(self, run_dir, self.model_dir)
        result = RunResult(summarize(self.metrics.rows, wall_s + self.metrics.adopted_wall_s))
        result.update(run_dir=str(run_dir), stopped_early=stopped_early, resumed_from_step=self.start_step,
                      data=self.data_counts, prompts_too_long=self.too_long,
                      generator_restarts=self.pool.restarts if self.pool else 0,
                      report=str(run_dir / "report.html"),
                      tensorboard=str(self.metrics.tensorboard_dir) if self.metrics.tensorboard_dir else None)
        (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
        _report(run_dir, result)
        return result

    def close(self) -> None:
        """Stop the producer thread, the math-verify pool, every actor this run started (not the
        shared generators a caller passed in), the transport, and Ray if this run started it."""
        import ray

        if self.watchdog is not None:
            self.watchdog.close()
        if self.metrics is not None:   # also after an error (finish closes it on success)
            self.metrics.close()
        if self.producer is not None:   # an error in the learner loop: stop the generation thread too
            self.producer.stop_event.set()
        if self.channel is not None:
            self.channel.close()
        if self.reward is not None:
            self.reward.close()
        for actor in (self.learner, *self.generators, *self.rm_actors.values()):
            if actor is not None and actor not in self.shared_generators:
                ray.kill(actor)
        if self.transport is not None:
            self.transport.close()
        if self.placement is not None:
            self.placement.remove()
        if self.ray_head is not None:   # this run connected to (or started) the cluster
            ray.shutdown()
            if self.ray_head:
                self.ray_head.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----- helpers ----------------------------------------------------------------------------------

def _learner_call(ref, what: str, timeout: float, ckpts: CheckpointManager):
    """``ray.get`` of a learner call; a dead learner stops the run with a clear error.

    Raises:
        LearnerDiedError: the learner actor died (killed, OOM); names the last complete checkpoint.
        ray.exceptions.GetTimeoutError: no answer within ``async.timeout_s``.
    """
    import ray

    with _learner_guard(what, ckpts):
        return ray.get(ref, timeout=timeout)


@contextlib.contextmanager
def _learner_guard(what: str, ckpts: CheckpointManager):
    """Every learner call (train_step, checkpoint save, weight publish, final export) runs inside
    this: an actor death (``RayActorError``, also when raised by the transport's own ``ray.get``)
    becomes :class:`LearnerDiedError` naming ``what`` and the last complete checkpoint."""
    from ray.exceptions import RayActorError

    try:
        yield
    except RayActorError as e:
        latest = ckpts.latest()
        where = (f"the last complete checkpoint {latest[0]} is intact: rerun the same command to resume "
                 "from it" if latest else "no checkpoint was written yet")
        raise LearnerDiedError(f"the learner died during {what} ({type(e).__name__}); {where}") from e


def _take(batches: queue.Queue, timeout: float, stop) -> object | None:
    """The next batch from the producer; None when a stop was requested.

    Raises:
        TimeoutError: none within ``async.timeout_s``.
        ProducerError: the producer failed (its exception attached).
    """
    deadline = time.monotonic() + timeout
    while True:
        if stop.requested:
            return None
        try:
            item = batches.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout batch within async.timeout_s={timeout:.0f} s")
            continue
        return _checked(item)


def _poll(batches: queue.Queue) -> object | None:
    """The producer's next batch if it is already queued, else None."""
    try:
        return _checked(batches.get_nowait())
    except queue.Empty:
        return None


def _checked(item):
    if isinstance(item, RewardError):   # names the task and its reward function
        raise ProducerError(str(item)) from item
    if isinstance(item, BaseException):
        raise ProducerError(f"generation failed: {type(item).__name__}: {item}") from item
    return item


def _load_pending(path: Path, state: dict) -> list:
    """The untrained batches checkpoint ``path`` keeps (``trainer_state["pending_batches"]``).

    Raises:
        ConfigError: a listed batch file is missing or unreadable (names it).
    """
    from megatron_rlhf.trainer.batch_io import batch_path, load_batch

    out = []
    for index in state.get("pending_batches", []):
        try:
            out.append(load_batch(batch_path(path / "batches", index)))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot resume from {path}: its untrained batch {index} is unreadable ({e}); "
                              "delete this checkpoint folder to resume from the one before") from e
    return out


def _pending_note(pending) -> str:
    if not pending:
        return ""
    return "; then its untrained batches " + ", ".join(
        f"{b.index} (weight version {b.weight_version})" for b in pending)


def _drain(batches: queue.Queue) -> None:
    try:
        while True:
            batches.get_nowait()
    except queue.Empty:
        pass

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


def _init_ray(cfg: Config, run_dir: Path, stacks_dir: Path, extra_cpus: int = 0):
    """Connect to Ray: the cluster at ``RAY_ADDRESS`` (slurm/ray_cluster.sh), the one this process
    already joined (tests), or a local head started here in its own session (``LocalRayHead``), so
    that a signal to the driver's process group does not stop Ray under the final checkpoint.
    Every worker of the run registers a stack dump into ``stacks_dir`` (the hang watchdog).

    Returns:
        ``None``: this process had already joined a cluster (left as it is); ``False``: connected
        to ``RAY_ADDRESS`` (disconnect at the end); else the
        :class:`~megatron_rlhf.runtime.LocalRayHead` to stop at the end.
    """
    import ray

    from megatron_rlhf.runtime import LocalRayHead, process_env

    if ray.is_initialized():
        return None
    from megatron_rlhf.trainer.watchdog import STACKS_ENV

    env = {**process_env(), STACKS_ENV: str(stacks_dir)}
    kw = dict(log_to_driver=True, logging_level="WARNING", runtime_env={
        "env_vars": env, "worker_process_setup_hook": "megatron_rlhf.trainer.watchdog.register_stack_dump"})
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kw)
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
    print(f"[megatron-rlhf] local Ray head pid {head.proc.pid} (own session; log {head.log_path})",
          flush=True)
    return head


def _actor_options(role: str, gpus: int) -> dict:
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


def _placement(cfg: Config, reward_models: int, timeout: float):
    """Ray placement groups for a GPU cluster run (``placement.gpus_per_node > 0`` and GPUs in the
    Ray cluster): :class:`megatron_rlhf.placement.ActorPlacement`, reserved before any actor starts
    (a shortfall raises ``ConfigError``); ``None`` on CPU and local runs."""
    import ray

    from megatron_rlhf.placement import ActorPlacement, BundleLayout

    if cfg.placement.gpus_per_node == 0 or ray.cluster_resources().get("GPU", 0) == 0:
        return None
    return ActorPlacement(BundleLayout.from_config(cfg, reward_models), timeout_s=timeout,
                          engine_backend=cfg.generators.distributed_executor_backend)


def _build_actors(cfg: Config, model_dir: Path, generators: list | None = None, placement=None,
                  with_generators: bool = True):
    """The learner (one rank, or a ``LearnerGroup`` coordinator of one actor per rank) and the
    generators (none without ``with_generators``: ``run.mode: train_only``); with ``placement``,
    every rank and engine in its placement-group bundle."""
    import ray

    from megatron_rlhf.learner.actor import MegatronLearner

    pin, g = cfg.generators.cpu_core, cfg.generators
    lc = cfg.learner
    world = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
    kw = dict(model_dir=str(model_dir), learner_cfg=lc, algorithm_cfg=cfg.algorithm,
              dtype=cfg.model.dtype, seed=cfg.run.seed, total_steps=cfg.run.num_steps,
              temperature=cfg.generators.temperature,   # the learner picks each loss's own
              cpu_core=pin + g.num_workers * g.tensor_parallel if pin >= 0 else -1)
    rank_opts = ([{"max_restarts": 0, **placement.learner_options(r)} for r in range(world)] if placement
                 else [_actor_options("learner", 1)] * world)
    if world == 1:
        learner = ray.remote(**rank_opts[0])(MegatronLearner).remote(**kw)
    else:  # a coordinator actor (no CPU/GPU of its own) driving one actor per learner rank
        from megatron_rlhf.learner.group import LearnerGroup

        learner = ray.remote(num_cpus=0, max_restarts=0)(LearnerGroup).remote(
            rank_actor_options=rank_opts, timeout_s=cfg.async_.timeout_s, **kw)
    if not with_generators:
        return learner, []
    return learner, (list(generators) if generators else _build_generators(cfg, model_dir, placement))


def _build_generators(cfg: Config, model_dir: Path, placement=None) -> list:
    """``generators.num_workers`` VLLMGenerator actors: worker i has engine seed ``run.seed + i``
    (distinct samples), is pinned to core ``cpu_core + i`` (CPU, TP 1, unless -1; TP > 1: its
    workers bind cores ``cpu_core + i*TP + r``), sits in its placement-group bundle on GPU clusters,
    and is restarted by Ray up to ``generators.max_restarts`` times when its process dies."""
    import ray

    from megatron_rlhf.generator.vllm_engine import RAY_ACTOR_OPTIONS, VLLMGenerator

    g = cfg.generators
    out = []
    for i in range(g.num_workers):
        opts = placement.engine_options(i) if placement else _actor_options("generator", g.tensor_parallel)
        opts["max_restarts"] = g.max_restarts
        opts.update(RAY_ACTOR_OPTIONS)   # threaded: weight pushes land between engine steps of a request
        out.append(ray.remote(**opts)(VLLMGenerator).remote(
            model_dir=str(model_dir), generator_cfg=g, dtype=cfg.model.dtype, seed=cfg.run.seed + i,
            cpu_core=g.cpu_core + i if g.cpu_core >= 0 else -1, engine_index=i))
    return out


def _load_prompts(cfg: Config, model_dir: Path):
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


def _probe_tokens(sampler, max_model_len: int) -> list[int]:
    """The weight-sync probe: the first task's first prompt's tokens (fixed for the run), cut to
    the context."""
    first = sampler.prompts(sampler.tasks[0])[0]
    return list(first.token_ids[: max_model_len - 1])


def _eval_service(cfg: Config, pool, eval_by_task: dict, reward_fns: dict):
    """The ``EvalService`` of the run's held-out prompts (None with ``eval.enabled: false``)."""
    if not cfg.eval.enabled:
        return None
    from megatron_rlhf.trainer.evaluate import EvalService, Evaluator

    return EvalService(Evaluator(pool, eval_by_task, {t.name: t.kind for t in cfg.tasks}, reward_fns,
                                 cfg.eval, cfg.generators.temperature))


def _report(run_dir: Path, result: RunResult) -> None:
    """Write ``<run>/report.html`` (``trainer.report``); a failure is reported, not raised (the
    run itself is complete; ``tools/report.py`` can write it again)."""
    from megatron_rlhf.trainer.report import write_report

    try:
        write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - plotting must not fail a finished run
        result["report"] = None
        print(f"[megatron-rlhf] WARNING could not write the run report ({type(e).__name__}: {e}); "
              f"retry with: python tools/report.py {run_dir}", file=sys.stderr, flush=True)


def _export_final(run: "Run", run_dir: Path, model_dir: Path) -> None:
    """Write ``<run>/hf_final`` (replacing the export of an earlier, shorter run of this folder:
    written to a temporary sibling first, so a crash never leaves no export)."""
    import shutil

    final, tmp = run_dir / "hf_final", run_dir / f".hf_final.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    run.call(run.learner.export_hf.remote(str(tmp), str(model_dir)), "the final HF export")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def _completed_run(cfg: Config, ckpts: CheckpointManager, run_dir: Path) -> RunResult | None:
    """The saved summary when the run folder already holds a finished run of ``run.num_steps``
    steps (final checkpoint, HF export if asked for, summary), so a re-run is a cheap no-op."""
    latest = ckpts.latest() if cfg.checkpoint.resume else None
    summary = run_dir / "summary.json"
    if latest is None or latest[1]["step"] < cfg.run.num_steps or not summary.is_file():
        return None
    if cfg.checkpoint.export_hf and not (run_dir / "hf_final" / "config.json").is_file():
        return None
    result = RunResult(json.loads(summary.read_text()))
    result["already_complete"] = True
    return result


def _config_changes(cfg: Config, saved: Path) -> list[str]:
    """``["key: old -> new", ...]`` between the config saved at ``saved`` and ``cfg``; empty when
    there is no saved config or it cannot be read (a note only)."""
    if not saved.is_file():
        return []
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return config_diff(old, config_to_dict(cfg))


def _rm_accuracy(folder: Path) -> str:
    """``"; held-out pairwise accuracy A +- se (n = N)"`` from the folder's ``rm_report.json``, or ``""``."""
    try:
        rep = json.loads((Path(folder) / "rm_report.json").read_text())
        return f"; held-out pairwise accuracy {rep['accuracy']:.3f} +- {rep['se']:.3f} (n = {rep['n_eval']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _resolve_reward_models(cfg: Config) -> dict[str, Path]:
    """Task name -> reward-model folder for every ``reward: {reward_model: ...}`` task (the demo
    name ``smollm2-demo`` is trained once and cached).

    Raises:
        ConfigError: a path that does not exist / is not a reward model, named by its task.
    """
    from megatron_rlhf.rewards import resolve_reward_model

    out = {}
    for task in cfg.tasks:
        if task.kind == "reward_model":
            try:
                out[task.name] = resolve_reward_model(task.reward.reward_model,
                                                      os.path.expanduser(cfg.model.cache_dir),
                                                      key=f"tasks[{task.name}].reward.reward_model")
            except (ValueError, FileNotFoundError) as e:
                raise ConfigError(str(e)) from e
    return out


def _build_reward_models(cfg: Config, folders: dict[str, Path], placement=None) -> dict:
    """One ``RewardModelWorker`` Ray actor per reward-model folder (tasks sharing a folder share
    the actor): one CPU, and on GPU clusters one GPU of the generator nodes (its placement-group
    bundle, or the ``mrlhf_generator`` resource of slurm/ray_cluster.sh; the placement check counts
    it beside the vLLM engines)."""
    import ray

    from megatron_rlhf.rewards.server import RewardModelWorker

    by_dir: dict[Path, object] = {}
    out = {}
    for task in cfg.tasks:
        if task.name not in folders:
            continue
        d = folders[task.name]
        if d not in by_dir:
            opts = placement.reward_options(len(by_dir)) if placement else _actor_options("generator", 1)
            by_dir[d] = ray.remote(**opts)(RewardModelWorker).remote(
                model_dir=str(d), dtype=cfg.model.dtype, batch_size=task.reward.batch_size)
        out[task.name] = by_dir[d]
    return out


def _reward_fns(cfg: Config, math_reward, rm_actors: dict, plugins: dict, timeout: float) -> dict:
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

