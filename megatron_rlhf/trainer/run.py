"""A run as the loop sees it: the verbs :func:`megatron_rlhf.trainer.loop.train` calls, and teardown.

:meth:`Run.open` hands the setup (model, pre-flight checks, prompts, resume, Ray, reward models,
learner, generators, transport, pool, producer) to :mod:`megatron_rlhf.trainer.setup`.
:meth:`Run.close` stops all of it (shared generator actors a test passed in are left running). The
verbs the loop calls (:meth:`train_step`, :meth:`publish`, :meth:`save`, :meth:`poll_checkpoint`,
:meth:`wait_checkpoint`, :meth:`finish`) keep the
remote-call error handling in one place.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
from pathlib import Path


from megatron_rlhf.config import Config
from megatron_rlhf.trainer.checkpoint import CheckpointManager
from megatron_rlhf.trainer.lifecycle import LearnerDiedError, RunResult, learner_guard
from megatron_rlhf.trainer.metrics import json_safe, recovery_totals, summarize, time_breakdown
from megatron_rlhf.rollout.producer import ProducerError, RewardError
from megatron_rlhf.utils.faults import kill_point
from megatron_rlhf.trainer.watchdog import prune_empty_stack_files
from megatron_rlhf.utils.atomic import fsync_dir, write_json

__all__ = ["Run", "RunResult", "LearnerDiedError", "NonFiniteTrainingError", "learner_guard"]


class NonFiniteTrainingError(RuntimeError):
    """``learner.max_skipped_steps`` steps in a row had a non-finite loss or gradient."""


class Run:
    """The actors, data and state of one run (see the module docstring).

    Attributes (the ones the loop reads):
        cfg: the resolved config.
        start_step / version: step and learner weight version the loop starts from (0 / 0, or the
            resumed checkpoint's).
        batches: the producer's output queue (``maxsize=1``: Cleanba's bounded hand-over).
        learner: the learner actor (one rank) or ``LearnerGroup`` coordinator.
        channel: the published-weights channel the producer waits on.
        staleness: the staleness bounds in force and their controller (``async.max_staleness:
            auto``; ``rollout.staleness_control``); its state is part of every checkpoint.
        metrics: the ``metrics.jsonl`` logger.
        pad_id: the tokenizer's pad id (learner batches).
        too_long: prompts dropped for length at load time (a per-row metric).
    """

    def __init__(self, cfg: Config, say):
        self.cfg, self.say, self.run_dir = cfg, say, cfg.run_dir
        self.timeout = cfg.async_.timeout_s
        self.learner = self.transport = self.channel = self.producer = self.thread = None
        self.staleness = None   # rollout.staleness_control.StalenessController (set up with the producer)
        self.pool = self.metrics = self.reward = self.placement = self.evals = None
        self.rm_actors: dict = {}
        self.generators: list = []
        self.shared_generators: list = []
        self.ray_head = None   # see setup.init_ray
        self.resume_from = (None, None)   # (checkpoint path, its state): set by setup.prepare
        self._calls: dict[str, float] = {}   # learner calls in flight -> start (monotonic s)
        self.stacks_dir = self.watchdog = None
        self.skipped_in_row = 0
        self.phase_s: dict[str, float] = {}   # seconds of this session's set-up / teardown phases
        self.t_open = time.perf_counter()
        self._ckpt_in_flight = None   # checkpoint.PendingCheckpoint of an asynchronous save
        self._ckpt_blocked_s = self._ckpt_write_s = 0.0   # since the last row (checkpoint_metrics)
        self._ckpt_step = 0
        self.checkpoint_fallbacks = self.damaged_moved = 0   # set by setup.prepare (trainer.readback)
        self._recovered: dict[str, int] = {}   # recovery totals already reported in a row

    @contextlib.contextmanager
    def phase(self, name: str, what: str | None = None):
        """Time one phase of this session (``time/<name>_s`` in the summary's ``time`` table,
        :func:`metrics.time_breakdown`); ``what``: its console line, printed as it starts."""
        if what:
            self.say(what)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    @classmethod
    def open(cls, cfg: Config, *, quiet: bool = False, generators: list | None = None,
             stop=None) -> "Run | RunResult":
        """Set the run up; a run folder that already holds the finished run returns its saved
        :class:`RunResult` instead (nothing is started).

        Args:
            stop: the stop flag (``.requested``), polled during start-up.
        Raises:
            ConfigError: a bad config or model folder, or a refused resume, before any actor starts
                (``setup.ResumeRefusedError``: the learner cannot load the checkpoint).
            LearnerDiedError / TimeoutError: an actor failed while starting (the timeout names the
                actors and ``async.timeout_s``).
            setup.StoppedBeforeStart: ``stop`` was requested during start-up (all is stopped).
        """
        say = (lambda *a: None) if quiet else console_say
        run = cls(cfg, say)
        from megatron_rlhf.trainer import setup

        # model conversion and reward-model training poll nothing: a stop signal interrupts them
        interrupting = getattr(stop, "interrupting", None)
        with (interrupting(lambda: (run.resume_from[1] or {}).get("step", 0) + 1) if interrupting
              else contextlib.nullcontext()):
            done = setup.prepare(run)
        if done is not None:
            return done
        try:
            with run.phase("start", "starting Ray, the learner, the generators and the reward models..."):
                setup.start(run, generators, stop)
        except BaseException:
            run.close()
            raise
        return run

    # ----- the verbs of the loop -------------------------------------------------------------------
    def call(self, ref, what: str):
        """``ray.get`` of a learner call within ``async.timeout_s``; a dead learner raises
        :class:`LearnerDiedError` naming the last complete checkpoint (see :func:`_learner_call`);
        a timeout names the call and the file with every process's stacks (:meth:`dump_stacks`)."""
        self._calls[what] = time.monotonic()
        try:
            return _learner_call(ref, what, self.timeout, self.ckpts)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; {self.dump_stacks('learner timeout')}") from e
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
        """Save ``batch`` to ``<run>/rollouts/`` (``rollout.batch_io``) in ``rollout_only`` or with
        ``run.save_rollouts``."""
        if self.cfg.run.mode == "rollout_only" or (self.cfg.run.save_rollouts and self.cfg.run.mode == "train"):
            from megatron_rlhf.rollout.batch_io import save_batch
            from megatron_rlhf.trainer.replay import ROLLOUTS_DIR

            from megatron_rlhf.rollout.batch_io import algorithm_tag

            save_batch(batch, self.run_dir / ROLLOUTS_DIR, algorithm=algorithm_tag(self.cfg.algorithm))

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
        try:
            with learner_guard(what, self.ckpts):
                weights = self.transport.publish(self.learner, version, self.timeout, self.probe)
        except TimeoutError as e:   # the learner's export (or a broken group) did not end in time
            raise TimeoutError(f"{what} (training): {e}; {self.dump_stacks('weight publish timeout')}") from e
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
        ``batches/``, :mod:`rollout.batch_io` format, with their weight versions), and the producer
        state (data-sampler position, pair RNG, normaliser) after the last of them (after ``batch``,
        the one just trained, when none is pending). A resumed run trains the pending batches first,
        then generates from that position: what the uninterrupted run would have trained.

        With ``checkpoint.async_save`` a save still in flight is completed first, then the learner
        starts writing this one and training goes on: it becomes ``step_<step>`` in
        :meth:`poll_checkpoint` or :meth:`wait_checkpoint`. The seconds spent here count in the next
        row's ``time/checkpoint_s``."""
        from megatron_rlhf.rollout.batch_io import algorithm_tag, save_batch

        self.wait_checkpoint()   # (its seconds are counted there)
        t0 = time.perf_counter()
        last = pending[-1] if pending else batch
        state = {"step": step, "weight_version": version, "sampler_state": last.sampler_state,
                 "rng_state": last.rng_state, "producer_state": last.producer_state,
                 "pending_batches": [b.index for b in pending], "time": time.time()}
        if self.staleness is not None:   # the bound in force (async.max_staleness: auto)
            state["staleness_control"] = self.staleness.state_dict()
        if pending:   # where to generate from instead, when a resume regenerates them (setup.load_pending)
            state["before_pending"] = {"sampler_state": batch.sampler_state, "rng_state": batch.rng_state,
                                       "producer_state": batch.producer_state}
        tag = algorithm_tag(self.cfg.algorithm)
        async_save = self.cfg.checkpoint.async_save

        def write(tmp: Path) -> None:
            for b in pending:
                save_batch(b, tmp / "batches", algorithm=tag)
            self.call(self.learner.save_checkpoint.remote(str(tmp / "learner"), str(self.ckpts.root),
                                                          async_save), f"checkpoint save of step {step}")

        started = self.ckpts.start(step, state, write, passthrough=(LearnerDiedError,))
        if async_save:
            self._ckpt_in_flight = started
            kill_point("async_save", step)
        else:
            self.ckpts.finish(started)
            self._ckpt_done(time.perf_counter() - t0, step)
        self._ckpt_blocked_s += time.perf_counter() - t0
        return step

    def poll_checkpoint(self) -> None:
        """Complete the asynchronous save in flight if the learner's writers are done (a quick
        collective check on the learner; called after every train step, as Megatron-LM's
        ``maybe_finalize_async_save(blocking=False)``)."""
        if self._ckpt_in_flight is not None:
            self._finish_async(blocking=False)

    def wait_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight, if any, and complete it (the next save, the
        end of the run and a stop signal call this)."""
        if self._ckpt_in_flight is not None:
            self._finish_async(blocking=True)

    def _finish_async(self, blocking: bool) -> None:
        """Ask the learner whether the writers of the save in flight are done (``blocking``: wait
        for them); once they are, complete the checkpoint (:meth:`CheckpointManager.finish`, which
        also turns a failed writer into a ``CheckpointError`` and removes the temporary folder)."""
        t0, ckpt = time.perf_counter(), self._ckpt_in_flight
        what = f"checkpoint save of step {ckpt.step}"

        def finalize():
            return self.call(self.learner.finalize_checkpoint.remote(blocking), what)

        got: dict = {}
        try:
            polled = None
            if not blocking:
                try:
                    polled = finalize()
                except LearnerDiedError:
                    raise
                except Exception as e:   # noqa: BLE001 - a failed writer: finish() names it
                    polled = e
                if isinstance(polled, dict) and not polled["done"]:
                    return
            self._ckpt_in_flight = None

            def writers_done() -> None:
                if isinstance(polled, Exception):
                    raise polled
                got.update((finalize() if blocking else polled) or {})
                if got:   # the writers' Unix times, in the checkpoint's trainer_state.json
                    ckpt.trainer_state["async_write"] = {k: got[k] for k in
                                                         ("write_start", "write_end", "write_s")}

            self.ckpts.finish(ckpt, writers_done)
        finally:
            self._ckpt_blocked_s += time.perf_counter() - t0
        self._ckpt_done(got.get("write_s", 0.0), ckpt.step)

    def _ckpt_done(self, write_s: float, step: int) -> None:
        self._ckpt_write_s += write_s
        self._ckpt_step = step

    def checkpoint_metrics(self) -> dict:
        """The checkpoint keys of a metrics row, over the time since the previous row:
        ``time/checkpoint_s`` (seconds the loop was blocked by checkpointing: a save, its completion,
        a wait for an asynchronous writer), ``checkpoint/write_s`` (seconds the learner's writers
        took for the checkpoints completed meanwhile: with ``checkpoint.async_save`` in the
        background, so ``write_s`` above ``time/checkpoint_s`` is the overlap), ``checkpoint/step``
        (the newest complete checkpoint's step, 0 before the first)."""
        out = {"time/checkpoint_s": self._ckpt_blocked_s, "checkpoint/write_s": self._ckpt_write_s,
               "checkpoint/step": max(self._ckpt_step, getattr(self, "start_step", 0))}
        self._ckpt_blocked_s = self._ckpt_write_s = 0.0
        return out

    def recovery_metrics(self) -> dict:
        """The recovery keys of a metrics row: ``recovery/<kind>`` (``metrics.RECOVERY_KINDS``), how
        many recoveries of each kind happened since the previous row (the session's first row also
        counts its start-up's). Each was also logged in one line where it happened."""
        now = self._recovery_totals()
        out = {f"recovery/{k}": v - self._recovered.get(k, 0) for k, v in now.items()}
        self._recovered = now
        return out

    def _recovery_totals(self) -> dict[str, int]:
        """This session's recoveries so far, by kind (cumulative)."""
        damaged = self.damaged_moved + (self.metrics.damaged_count if self.metrics is not None else 0)
        return {"reward_worker_restarts": int(getattr(self.reward, "num_restarts", 0) or 0),
                "generator_restarts": self.pool.restarts if self.pool is not None else 0,
                "checkpoint_fallbacks": self.checkpoint_fallbacks, "damaged_files": damaged}

    def next_batch(self, stop) -> "object | None":
        """The batch the loop trains next: a pending one (resumed from a checkpoint, or taken for
        one) first, else the producer's next; ``None`` once a stop is requested.

        Raises:
            TimeoutError: none within ``async.timeout_s``: names what the rollout producer waits
                for (:meth:`describe_wait`) and the file with every process's stacks.
        """
        return self.pending.popleft() if self.pending else _take(self.batches, self.timeout, stop,
                                                                  self.describe_wait)

    def describe_wait(self) -> str:
        """What the rollout producer is stuck on, in words, for a timeout's message: its phase
        (``scoring``, ``generation``, ``training``: waiting for the learner's weights, ``weight
        push``), the task and reward function being scored (and for how long) or the generator
        requests in flight, then where the stacks of every process were written
        (:meth:`dump_stacks`)."""
        p = self.producer
        now = time.monotonic()
        if p is None:
            what = "no rollout producer runs"
        elif p.phase_kind == "scoring" and p.scoring:
            what = "scoring: " + "; ".join(
                f"the reward of task {t!r} ({name}) has not returned for {now - t0:.0f} s"
                for t, (name, t0) in list(p.scoring.items())) + f" ({p.phase}); if it is only slow, raise " \
                "async.timeout_s, else fix the reward function (it must return)"
        elif p.phase_kind == "generation":
            calls = self.pool.pending_calls() if self.pool is not None else []
            what = (f"generation ({p.phase}): " + ("; ".join(calls) if calls else "no generate request in flight")
                    + "; a generator that hangs is restarted after async.timeout_s")
        elif p.phase_kind == "training":
            what = f"training ({p.phase}): the learner has not published these weights"
        else:
            what = f"{p.phase_kind} ({p.phase})"
        return f"the rollout producer is in {what}; {self.dump_stacks('no rollout batch')}"

    def dump_stacks(self, why: str) -> str:
        """Write the Python stacks of every Ray worker of the run and of the driver (all threads;
        ``trainer.watchdog.dump_actor_stacks``) to ``<run>/logs/stacks-<why>-<UTC time>.txt`` and
        return ``"stacks of every process: <file>"`` (or why they could not be written): called when
        a wait runs out, so the stuck call is visible in the file."""
        from megatron_rlhf.trainer.watchdog import dump_actor_stacks
        from megatron_rlhf.utils.atomic import write_text

        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = self.run_dir / "logs" / f"stacks-{why.replace(' ', '_')}-{stamp}.txt"
        try:
            text = dump_actor_stacks(self.stacks_dir or self.run_dir / "logs" / "stacks", wait_s=1.0, timeout_s=10.0)
            write_text(path, f"# {why}: stacks of every process at {stamp}\n{text}\n")
        except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the timeout itself
            return f"the stacks could not be written ({type(e).__name__}: {e})"
        return f"stacks of every process: {path}"

    def take_for_checkpoint(self, stop) -> tuple:
        """The next batch for a checkpoint to keep (it stays first in :attr:`pending`): wait for it,
        or, once a stop is requested, only if it is already there (else the resumed run
        regenerates it, with newer weights)."""
        if not self.pending:
            b = _take(self.batches, self.timeout, stop, self.describe_wait) if not stop.requested \
                else _poll(self.batches)
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
        if stopped_early and done == self.start_step:   # a stop before this session's first step
            return RunResult(run_dir=str(run_dir), steps=0, stopped_early=True,
                             stopped_before_step=done + 1, resumed_from_step=self.start_step, report=None)
        if not stopped_early and cfg.checkpoint.export_hf and self.trains and (done > self.start_step or not (
                run_dir / "hf_final" / "config.json").is_file()):
            with self.phase("export"):
                _export_final(self, run_dir, self.model_dir)
        result = RunResult(summarize(self.metrics.rows, wall_s + self.metrics.adopted_wall_s))
        result["time"] = time_breakdown(self.metrics.rows, self.phase_s, loop_s=wall_s,
                                        total_s=time.perf_counter() - self.t_open, since_step=self.start_step)
        result.update(run_dir=str(run_dir), stopped_early=stopped_early, resumed_from_step=self.start_step,
                      data=self.data_counts, prompts_too_long=self.too_long,
                      generator_restarts=self.pool.restarts if self.pool else 0,
                      report=str(run_dir / "report.html"),
                      tensorboard=str(self.metrics.tensorboard_dir) if self.metrics.tensorboard_dir else None)
        result["pending_regenerated"] = getattr(self, "pending_regenerated", 0)
        # every session's rows, and what this session recovered after its last row
        late = {k.removeprefix("recovery/"): v for k, v in self.recovery_metrics().items()}
        result["recoveries"] = {k: v + late[k] for k, v in recovery_totals(self.metrics.rows).items()}
        # strict JSON (jq, JavaScript): a NaN (e.g. mfu_mean on CPU) is written as null
        write_json(run_dir / "summary.json", json_safe(result), indent=1, default=str, allow_nan=False)
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
        prune_empty_stack_files(self.stacks_dir)   # workers' unused stack-dump files

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----- helpers ----------------------------------------------------------------------------------

def console_say(*parts) -> None:
    """A ``[megatron-rlhf]`` console line; through ``tqdm.write`` so that a line printed while the
    step bar is shown (an eval's progress, from the producer thread) does not break the bar."""
    from tqdm import tqdm

    tqdm.write(" ".join(["[megatron-rlhf]", *map(str, parts)]))
    sys.stdout.flush()


def _learner_call(ref, what: str, timeout: float, ckpts: CheckpointManager):
    """``ray.get`` of a learner call; a dead learner stops the run with a clear error.

    Raises:
        LearnerDiedError: the learner actor died (killed, OOM); names the last complete checkpoint.
        TimeoutError: no answer within ``async.timeout_s`` (names the call and the key).
    """
    import ray
    from ray.exceptions import GetTimeoutError

    with learner_guard(what, ckpts):
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as e:
            raise TimeoutError(f"the learner did not answer {what} within async.timeout_s={timeout:.0f} s "
                               "(raise async.timeout_s for a slow file system or a large model)") from e


def _take(batches: queue.Queue, timeout: float, stop, describe=None) -> object | None:
    """The next batch from the producer; None when a stop was requested.

    Args:
        describe: returns what the producer waits for (:meth:`Run.describe_wait`), for the message.
    Raises:
        TimeoutError: none within ``async.timeout_s`` (with ``describe()``'s words).
        ProducerError: the producer failed (its exception attached).
    """
    deadline = time.monotonic() + timeout
    while True:
        if stop.requested:
            return None
        try:
            item = batches.get(timeout=min(1.0, max(0.05, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout batch within async.timeout_s={timeout:.0f} s"
                                   + (f": {describe()}" if describe is not None else ""))
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


def _drain(batches: queue.Queue) -> None:
    try:
        while True:
            batches.get_nowait()
    except queue.Empty:
        pass

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
    written to a temporary sibling first, so a crash never leaves no export).

    Temporary folders (ours ``.hf_final.tmp-<pid>``, the learner's ``..hf_final.tmp-<pid>.*``) never
    outlive a failed export, and those an earlier driver left (killed mid-export) are removed with
    an earlier swap's ``.hf_final.old-*`` once this export is in place (the run lock makes this
    driver the folder's only writer).

    Raises:
        AtomicWriteError: a write failed (no space, read-only, name too long): one line naming the
            path, the cause and the fix, not safetensors' traceback; the old export, if any, stays.
    """
    import shutil

    final, tmp = run_dir / "hf_final", run_dir / f".hf_final.tmp-{os.getpid()}"
    old = run_dir / f".hf_final.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run.call(run.learner.export_hf.remote(str(tmp), str(model_dir)), "the final HF export")
    except BaseException as e:
        _remove_export_leftovers(run_dir, ("tmp",))   # no stray temporary folder; the old export stays
        err = export_write_error(final, e)
        if err is not None:
            raise err from e
        raise
    if final.exists():   # swap: a crash in between leaves the old export (as .hf_final.old-<pid>)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(run_dir)
    _remove_export_leftovers(run_dir, ("tmp", "old"))


def _remove_export_leftovers(run_dir: Path, kinds: tuple[str, ...]) -> None:
    """Remove ``.hf_final.<kind>-*`` and the learner's ``..hf_final.<kind>-*`` folders of ``run_dir``."""
    import shutil

    for kind in kinds:
        for p in [*run_dir.glob(f".hf_final.{kind}-*"), *run_dir.glob(f"..hf_final.{kind}-*")]:
            shutil.rmtree(p, ignore_errors=True)


def export_write_error(path: Path, e: BaseException):
    """The one-line :class:`~megatron_rlhf.utils.atomic.AtomicWriteError` of a failed HF export
    ``e`` (a Ray task error from the learner carries it as ``.cause``; a raw ``OSError`` or
    ``SafetensorError`` is named as a failed write of ``path``), or None for any other failure."""
    from megatron_rlhf.utils.atomic import AtomicWriteError, write_error

    seen, chain = set(), [e]
    while chain:
        x = chain.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(getattr(x, "cause", None), BaseException):   # a RayTaskError: its cause first
            chain.insert(0, x.cause)
            continue
        if isinstance(x, AtomicWriteError):   # a fresh one: a RayTaskError subclass prints a traceback
            return AtomicWriteError(x.errno, x.strerror, x.filename)
        if isinstance(x, OSError) or type(x).__name__ == "SafetensorError":
            return write_error(path, x)
        chain += [getattr(x, "cause", None), x.__cause__, x.__context__]
    return None

