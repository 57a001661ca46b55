"""The Cleanba one-step off-policy loop (setup and teardown live in :mod:`trainer.run`).

    weight_version = batches the learner has finished; the generator starts at version 0.
    generator thread (RolloutProducer): batch k waits for version >= k - bound, is generated,
        scored and paired, then queued (maxsize 1).
    learner loop (:func:`train`): take batch k; staleness of every sample = own version - its
        version (fresh groups within async.max_staleness, carried ones within
        async.max_carry_staleness; older ones dropped and counted); train; version += 1;
        every async.sync_interval batches publish the weights (exported on the learner through the
        weight transport; pushed to the M generator engines by the producer); checkpoint every
        checkpoint.interval steps; evaluate (trainer.evaluate) before step 1, every eval.interval
        steps and after the last (on the producer thread; each row waits for its eval). With
        checkpoint.async_save the learner writes checkpoint k while step k+1 trains; it completes
        after a train step once its writers are done (the next save and the end wait for it).

With ``async.sync: true`` the bound is 0, so batch k waits for the weights of step k: generate,
train, sync strictly in turn (the on-policy A/B baseline, staleness always 0). With bound 1 the
first batch has staleness 0 and every later one exactly 1. With ``async.max_staleness: auto`` each
row goes to :meth:`StalenessController.update` (``rollout.staleness_control``), which may move the
bound by one for the batches generated next; each batch is checked against the bound it was
generated under.

What each side waits for: the learner loop waits for the queue (``time/learner_idle_s``) and is
unblocked by the producer putting a batch; the producer waits for the weight version its next
batch may use and is unblocked by :meth:`Run.publish`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from megatron_rlhf.config import Config
from megatron_rlhf.trainer.evaluate import PendingRows, eval_due
from megatron_rlhf.trainer.metrics import StepProgress
from megatron_rlhf.trainer.lifecycle import LearnerDiedError, RunResult
from megatron_rlhf.trainer.run import Run
from megatron_rlhf.trainer.run_lock import hold_run_folder
from megatron_rlhf.trainer.setup import StoppedBeforeStart, resolve_model_dir
from megatron_rlhf.utils.faults import kill_point
from megatron_rlhf.types import LearnerBatch

__all__ = ["train", "resolve_model_dir", "RunResult", "LearnerDiedError"]


def train(cfg: Config, *, quiet: bool = False, generators: list | None = None) -> RunResult:
    """Run (or resume) the job ``cfg`` describes; returns its summary.

    Args:
        cfg: the resolved config.
        quiet: no console output.
        generators: already started ``VLLMGenerator`` actors of the same base model to use instead
            of starting ``generators.num_workers`` new ones (tests share one per module): they are
            reset to the run's starting weights first and left running at the end.

    Raises:
        ConfigError: a bad config or model folder (before any actor starts).
        ProducerError: a task's reward failed (the message names the task and the reward function:
            it raised or returned a non-finite value, see ``algorithm.invalid_rewards``), or
            generation failed (cause attached: e.g. ``GeneratorDiedError`` when a
            generator worker died beyond ``generators.max_restarts``, ``WeightSyncError`` when
            ``generators.check_weight_sync`` found a worker with other weights than the learner).
        LearnerDiedError: the learner died (the last complete checkpoint is intact).
        NonFiniteTrainingError: ``learner.max_skipped_steps`` steps in a row were skipped for a
            non-finite loss or gradient.
        CheckpointError: a checkpoint could not be written (path and cause named; the last
            complete one is intact).
        TimeoutError: a remote wait exceeded ``async.timeout_s`` (names the wait and the key).
        RunLockedError: another driver holds the run folder (names its PID and host).

    The stop handler is installed first (a SIGTERM during start-up stops it cleanly: the result has
    ``stopped_before_step``), then the run folder is locked for the rest of this call.
    """
    from megatron_rlhf.trainer.preflight import check_output_folder

    with _StopFlag() as stop, hold_run_folder(cfg.run_dir, explain=lambda: check_output_folder(cfg)):
        try:
            run = Run.open(cfg, quiet=quiet, generators=generators, stop=stop)
        except StoppedBeforeStart as e:
            return RunResult(run_dir=str(cfg.run_dir), steps=0, stopped_early=True,
                             stopped_before_step=e.next_step, report=None)
        if isinstance(run, RunResult):   # the run folder already holds the finished run
            return run
        with run:
            return _loop(run, stop, quiet)


def _loop(run: Run, stop: "_StopFlag", quiet: bool) -> RunResult:
    cfg, n = run.cfg, run.cfg.run.num_steps
    bar = StepProgress(n, run.start_step, enabled=not quiet and cfg.logging.progress)   # a line per step in a log
    done = saved = run.start_step
    version, last_batch, t_start = run.version, None, time.perf_counter()
    rows = PendingRows(run.metrics.log, run.thread, run.batches, run.timeout, run.dump_stacks)   # rows wait for evals
    first_eval = run.evals.request(0) if run.evals is not None and run.start_step == 0 else None
    run.thread.start()
    while done < n and not stop.requested:
        t_wait = time.perf_counter()
        run.watchdog.start_step(done + 1)
        batch = run.next_batch(stop)
        if batch is None:
            break
        learner_idle = time.perf_counter() - t_wait
        run.keep(batch)   # debug modes: rollouts saved to the run folder
        learner_batch, stale = _learner_batch(run, batch, version, done + 1)
        t0 = time.perf_counter()
        out = run.train_step(learner_batch, done + 1)
        train_s = time.perf_counter() - t0
        run.poll_checkpoint()   # checkpoint.async_save: an earlier step's writers may be done
        version, done, last_batch = version + (1 if run.trains else 0), done + 1, batch
        publish = done < n and not stop.requested and version % cfg.async_.sync_interval == 0
        due = eval_due(cfg.eval, n, done, publish) and (first_eval is None or done >= n)  # row 1: eval 0
        futures, first_eval = [f for f in (first_eval,) if f is not None], None
        sync = {"sync/learner_blocked_s": 0.0, "sync/push_wait_s": 0.0}
        if publish or due:
            sync, fut = run.publish(version, generation=publish, eval_step=done if due else None)
            futures += [fut] if fut is not None else []
        row = {"step": done, "weight_version": version, "loss/total": out.get("loss/total"),
               **stale, "prompts/too_long_filtered": run.too_long,
               **{k: v for k, v in out.items() if k != "time/train_s"},
               **batch.stats,   # the rollouts' numbers win over a learner key of the same name
               "time/train_s": train_s, "time/learner_idle_s": learner_idle,
               **sync, "sync/GBps": batch.stats.get("sync/GBps", 0.0), **run.checkpoint_metrics(),
               **run.recovery_metrics(), "time/step_s": time.perf_counter() - t_wait}
        row.update(run.staleness.update(row))   # async/max_staleness; with auto, maybe moved
        rows.add(row, futures)
        kill_point("row", done)
        bar.update(row["time/step_s"], reward=f"{row['reward/mean']:.3f}", stale=stale["staleness/max"],
                   loss=f"{row['loss/total'] if row['loss/total'] is None else round(row['loss/total'], 3)}",
                   pairs=row["pairs/count"], drawn=row["prompts/drawn"])   # drawn: new prompts this step
        if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0 and done < n:
            saved = _flush_and_save(run, rows, done, version, batch, lambda: run.take_for_checkpoint(stop))
        run.watchdog.end_step()   # a step's time includes its checkpoint (a hung save is caught too)
    bar.close()   # before the final eval: the bar's s/step is the steps' own
    run.end_evals(completed=done >= n)
    wall = time.perf_counter() - t_start
    if last_batch is not None and saved < done:  # the end, or a stop signal
        saved = _flush_and_save(run, rows, done, version, last_batch,
                                lambda: run.take_for_checkpoint(stop) if done < n else ())
    run.wait_checkpoint()   # the end and a stop signal wait for an asynchronous save
    rows.flush()
    return run.finish(done, wall, stopped_early=done < n)


def _flush_and_save(run: Run, rows: PendingRows, done: int, version: int, batch, pending) -> int:
    """Write the queued metrics rows (waiting for their evals), then checkpoint step ``done``, so a
    checkpoint never gets ahead of ``metrics.jsonl``. When an eval failed (e.g. an engine died
    during the end-of-run eval) its row is still written without the eval's fields and the trained
    steps are checkpointed (without pending batches: a resumed run regenerates them) before the
    error is raised: a failed eval never costs trained steps.

    Returns:
        ``done``, the step now checkpointed.
    """
    try:
        rows.flush()
    except BaseException:
        run.save(done, version, batch, ())
        run.wait_checkpoint()
        raise
    return run.save(done, version, batch, pending())


def _learner_batch(run: Run, batch, version: int, step: int):
    """The :class:`LearnerBatch` of ``batch`` at learner ``version`` and its staleness metrics:
    groups older than both ``async.max_staleness`` and the carry bound
    (``async.max_carry_staleness``) are dropped and counted; only carried ones
    (``rollout/carried_trained`` + ``rollout/partial_trained``) may be older than the first.

    Raises:
        RuntimeError: fewer groups than DP ranks survive the bound, or more groups are older than
            ``async.max_staleness`` than the batch carried (a broken handshake).
    """
    cfg, unit = run.cfg, run.cfg.algorithm.unit
    groups, stale, fresh, carry = run.staleness.split(batch, version, unit)   # the batch's bounds (auto)
    carried = batch.stats.get("rollout/carried_trained", 0) + batch.stats.get("rollout/partial_trained", 0)
    older = sum(version - g.weight_version > fresh for g in groups)
    if len(groups) < cfg.learner.data_parallel or older > carried:
        raise RuntimeError(f"step {step}: {len(batch.groups) - len(groups)} groups are older than "
                           f"async.max_carry_staleness={carry} and {older} (of {carried} "
                           f"carried) older than async.max_staleness={fresh} ({stale}); the "
                           "weight handshake is broken")
    return LearnerBatch.from_groups(groups, unit, run.pad_id), stale


class _StopFlag:
    """SIGTERM/SIGINT -> finish the current step, checkpoint, exit cleanly (SLURM requeue); a
    second SIGINT stops at once."""

    def __init__(self):
        self.requested = False
        self._old = {}
        self._next_step = None   # inside interrupting(): a signal raises StoppedBeforeStart

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def reinstall(self):
        """Take the signals back after ``ray.init``, which installs Ray's fatal-signal handler."""
        for sig in self._old:
            signal.signal(sig, self._handle)

    @contextlib.contextmanager
    def interrupting(self, next_step):
        """While inside, a stop signal raises :class:`StoppedBeforeStart` (``next_step()``) at once:
        for start-up work that polls nothing (GGUF conversion, reward-model training; each
        publishes its cache folder by an atomic rename, so nothing half-written is left)."""
        if self.requested:
            raise StoppedBeforeStart(next_step())
        self._next_step = next_step
        try:
            yield
        finally:
            self._next_step = None

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if self._next_step is not None:
            print(f"\n[megatron-rlhf] signal {signal.Signals(signum).name} during start-up: stopping", flush=True)
            next_step, self._next_step = self._next_step, None
            raise StoppedBeforeStart(next_step())
        print(f"\n[megatron-rlhf] signal {signal.Signals(signum).name}: finishing this step, "
              "then checkpointing and exiting", flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
