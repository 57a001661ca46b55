"""The controller: set up a run, then the Cleanba one-step off-policy loop.

    weight_version = batches the learner has finished; the generator starts at version 0.
    generator thread (RolloutProducer): batch k waits for version >= k - bound, is generated,
        scored and paired, then queued (maxsize 1).
    learner loop (below): take batch k; staleness of every sample = own version - its version
        (pairs older than async.max_staleness dropped and counted); train; version += 1; every
        async.sync_interval batches publish the weights (exported on the learner through the
        weight transport: object store, safetensors files or NCCL; pushed to the M generator
        workers by the producer); checkpoint every checkpoint.interval steps.

With ``async.sync: true`` the bound is 0, so batch k waits for the weights of step k: generate,
train, sync strictly in turn (the on-policy A/B baseline, staleness always 0). With bound 1 the
first batch has staleness 0 and every later one exactly 1.

The learner loop consumes RolloutBatches, waits for the queue (learner idle time), and is
unblocked by the generator thread putting a batch.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

from megatron_rlhf.config import Config, ConfigError, config_to_dict, save_config
from megatron_rlhf.trainer.checkpoint import CheckpointManager
from megatron_rlhf.trainer.metrics import MetricsLogger, summarize
from megatron_rlhf.generator.pool import GeneratorPool
from megatron_rlhf.generator.weight_sync import PublishedWeights, make_transport
from megatron_rlhf.trainer.rollout import ProducerError, RolloutProducer, WeightChannel
from megatron_rlhf.trainer.staleness import split_by_staleness
from megatron_rlhf.types import LearnerBatch

__all__ = ["train", "resolve_model_dir", "RunResult", "LearnerDiedError"]


class LearnerDiedError(RuntimeError):
    """The learner actor died; the run stops (the last complete checkpoint is left intact)."""


class RunResult(dict):
    """Summary of a finished (or stopped) run: :func:`metrics.summarize` plus ``run_dir``,
    ``stopped_early`` and ``resumed_from_step``."""


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


class _StopFlag:
    """SIGTERM/SIGINT -> finish the current step, checkpoint, exit cleanly (SLURM requeue)."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n[megatron-rlhf] signal {signal.Signals(signum).name}: finishing this step, "
              "then checkpointing and exiting", flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _init_ray(cfg: Config, extra_cpus: int = 0):
    import ray

    from megatron_rlhf.runtime import process_env

    if ray.is_initialized():
        return False
    env = process_env()
    address = os.environ.get("RAY_ADDRESS")
    kw = dict(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env},
              logging_level="WARNING")
    if address:
        ray.init(address=address, **kw)
    else:
        lc = cfg.learner  # one CPU per generator engine and per learner rank
        ranks = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
        ray.init(num_cpus=max(2, cfg.generators.num_workers + ranks + extra_cpus), **kw)
    return True


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


def _build_actors(cfg: Config, model_dir: Path, generators: list | None = None):
    import ray

    from megatron_rlhf.learner.actor import MegatronLearner

    pin = cfg.generators.cpu_core
    lc = cfg.learner
    kw = dict(model_dir=str(model_dir), learner_cfg=lc, algorithm_cfg=cfg.algorithm,
              dtype=cfg.model.dtype, seed=cfg.run.seed, total_steps=cfg.run.num_steps,
              temperature=cfg.generators.temperature if cfg.algorithm.is_policy_gradient else 1.0,
              cpu_core=pin + cfg.generators.num_workers if pin >= 0 else -1)
    if lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel == 1:
        learner = ray.remote(**_actor_options("learner", 1))(MegatronLearner).remote(**kw)
    else:  # a coordinator actor (no CPU/GPU of its own) driving one actor per learner rank
        from megatron_rlhf.learner.group import LearnerGroup

        learner = ray.remote(num_cpus=0, max_restarts=0)(LearnerGroup).remote(
            rank_actor_options=_actor_options("learner", 1), timeout_s=cfg.async_.timeout_s, **kw)
    return learner, (list(generators) if generators else _build_generators(cfg, model_dir))


def _build_generators(cfg: Config, model_dir: Path) -> list:
    """``generators.num_workers`` VLLMGenerator actors: worker i has engine seed ``run.seed + i``
    (distinct samples), is pinned to core ``cpu_core + i`` (CPU, unless -1) and is restarted by
    Ray up to ``generators.max_restarts`` times when its process dies."""
    import ray

    from megatron_rlhf.generator.vllm_engine import VLLMGenerator

    g = cfg.generators
    opts = _actor_options("generator", g.tensor_parallel)
    opts["max_restarts"] = g.max_restarts
    gen_cls = ray.remote(**opts)(VLLMGenerator)
    return [gen_cls.remote(model_dir=str(model_dir), generator_cfg=g, dtype=cfg.model.dtype,
                           seed=cfg.run.seed + i, cpu_core=g.cpu_core + i if g.cpu_core >= 0 else -1)
            for i in range(g.num_workers)]


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
            return load_prompts_for_task(replace(task, data=task.eval_data), tok, max_prompt)[0]

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


def train(cfg: Config, *, quiet: bool = False, generators: list | None = None) -> RunResult:
    """Run (or resume) the job ``cfg`` describes; returns its summary.

    Args:
        cfg: the resolved config.
        quiet: no console output.
        generators: already started ``VLLMGenerator`` actors of the same base model to use instead
            of starting ``generators.num_workers`` new ones (tests share one per module): they are
            reset to the run's starting weights first and left running at the end.

    Raises:
        ProducerError: generation failed (cause attached: e.g. ``GeneratorDiedError`` when a
            generator worker died beyond ``generators.max_restarts``, ``WeightSyncError`` when
            ``generators.check_weight_sync`` found a worker with other weights than the learner).
        LearnerDiedError: the learner died (the last complete checkpoint is intact).
        TimeoutError: a remote wait exceeded ``async.timeout_s``.
    """
    import ray
    from tqdm import tqdm

    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.rollout.pairs import select_pair

    run_dir = cfg.run_dir
    say = (lambda *a: None) if quiet else (lambda *a: print("[megatron-rlhf]", *a, flush=True))
    say(f"run folder {run_dir}")
    model_dir = resolve_model_dir(cfg.model)
    _preflight(cfg, model_dir)
    try:
        sampler, data_counts, pad_id, eval_by_task = _load_prompts(cfg, model_dir)
    except (ValueError, FileNotFoundError) as e:   # names tasks[].data.*: a config problem
        raise ConfigError(str(e)) from e
    say(f"model {model_dir}; prompts per task: {json.dumps(data_counts)}")
    ckpts = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    done_before = _completed_run(cfg, ckpts, run_dir)
    if done_before is not None:
        say(f"run already complete at step {cfg.run.num_steps}: nothing to train (raise run.num_steps "
            "to continue it, or pick another run.name for a new run)")
        saved = run_dir / "config.yaml"
        if saved.is_file() and _config_differs(cfg, saved):
            say(f"note: this config differs from the one the run used ({saved}); it was not applied")
        return done_before
    plugins = _import_plugins(cfg)                  # before any actor starts: a bad config stops here
    reward_models = _resolve_reward_models(cfg)
    for task, folder in reward_models.items():
        say(f"task {task}: reward model {folder}{_rm_accuracy(folder)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    needs_math = any(t.kind == "math_verify" for t in cfg.tasks)
    reward = MathVerifyReward(num_workers=1) if needs_math else None
    started_ray = _init_ray(cfg, extra_cpus=len(set(reward_models.values())))
    timeout = cfg.async_.timeout_s
    learner, transport, channel, producer, rm_actors = None, None, None, None, {}
    shared_generators, generators = list(generators or []), []
    too_long = sum(c.get("too_long", 0) for c in data_counts.values())
    try:
        rm_actors = _build_reward_models(cfg, reward_models)
        reward_fns = _reward_fns(cfg, reward, rm_actors, plugins, timeout)
        learner, generators = _build_actors(cfg, model_dir, shared_generators)
        transport = make_transport(cfg.generators, run_dir)
        probe = _probe_tokens(sampler, cfg.generators.max_model_len) if cfg.generators.check_weight_sync else None
        start_step, version, rng_state, producer_state = 0, 0, None, None
        latest = ckpts.latest() if cfg.checkpoint.resume else None
        if latest is not None:
            path, state = latest
            version = ray.get(learner.load_checkpoint.remote(str(path / "learner")), timeout=timeout)
            start_step, rng_state = state["step"], state["rng_state"]
            producer_state = state.get("producer_state")
            try:
                sampler.load_state_dict(state["sampler_state"])
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"cannot resume from {path}: its data-sampler position does not fit "
                                  f"this config's tasks ({e}); resume with the same tasks[] and run.seed, "
                                  "or start a new run (another run.name)") from e
            say(f"resuming from {path.name} (step {start_step}, weight version {version})")
        ray.get([a.__ray_ready__.remote() for a in (learner, *generators, *rm_actors.values())],
                timeout=timeout)
        if hasattr(transport, "setup"):   # nccl: form the broadcast group
            transport.setup(learner, generators, timeout)
        channel = WeightChannel(PublishedWeights(version=0))
        if version > 0:  # the generators start from the base weights: hand them the resumed ones
            channel.publish(transport.publish(learner, version, timeout, probe))
        elif shared_generators:  # reused actors hold an earlier run's weights: reset to version 0
            start = transport.publish(learner, 0, timeout, None)
            ray.get([transport.push(g, start) for g in shared_generators], timeout=timeout)
        pool = GeneratorPool(generators, transport=transport, generator_cfg=cfg.generators,
                             timeout_s=timeout, probe=probe,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
        evals = _eval_service(cfg, pool, eval_by_task, reward_fns)
        batches: queue.Queue = queue.Queue(maxsize=1)
        producer = RolloutProducer(
            pool=pool, sampler=sampler, reward_fns=reward_fns,
            pair_fn=select_pair, channel=channel, out_queue=batches, algorithm_cfg=cfg.algorithm,
            generator_cfg=cfg.generators, staleness_bound=cfg.async_.staleness_bound,
            first_batch=start_step, num_batches=cfg.run.num_steps, min_version=version,
            rng_state=rng_state, producer_state=producer_state, seed=cfg.run.seed, timeout_s=timeout,
            evals=evals)
        thread = threading.Thread(target=producer.run, name="rollout-producer", daemon=True)
        metrics = MetricsLogger(run_dir, cfg.logging, config_to_dict(cfg))
        bar = tqdm(total=cfg.run.num_steps, initial=start_step, desc="steps", unit="step",
                   disable=quiet or not cfg.logging.progress, dynamic_ncols=True)
        done, saved, last_batch = start_step, start_step, None
        rows = _PendingRows(metrics, thread, batches, timeout)
        first_eval = evals.request(0) if evals is not None and start_step == 0 else None
        t_start = time.perf_counter()
        with _StopFlag() as stop:
            thread.start()
            while done < cfg.run.num_steps and not stop.requested:
                t_wait = time.perf_counter()
                batch = _take(batches, timeout, stop)
                if batch is None:
                    break
                learner_idle = time.perf_counter() - t_wait
                unit = cfg.algorithm.unit
                groups, stale = split_by_staleness(batch.groups, version, cfg.async_.max_staleness, unit)
                staleness = stale["staleness/max"]
                if len(groups) < cfg.learner.data_parallel:
                    raise RuntimeError(f"step {done + 1}: {len(batch.groups) - len(groups)} groups are older "
                                       f"than async.max_staleness={cfg.async_.max_staleness} ({stale}); the "
                                       "weight handshake is broken")
                lb = LearnerBatch.from_groups(groups, unit, pad_id)
                t0 = time.perf_counter()
                out = _learner_call(learner.train_step.remote(lb), f"train_step of step {done + 1}",
                                    timeout, ckpts)
                train_s = time.perf_counter() - t0
                version += 1
                done, last_batch = done + 1, batch
                publish = (done < cfg.run.num_steps and not stop.requested
                           and version % cfg.async_.sync_interval == 0)
                due = (evals is not None and _eval_due(cfg, done, publish)   # row 1 holds the eval
                       and (first_eval is None or done >= cfg.run.num_steps))  # before step 1 already
                weights = transport.publish(learner, version, timeout, probe) if publish or due else None
                futures = [evals.request(done, weights)] if due else []   # before the producer may use it
                if first_eval is not None:
                    futures, first_eval = [first_eval, *futures], None
                if publish:
                    channel.publish(weights)
                row = {"step": done, "weight_version": version, "loss/total": out.get("loss/total"),
                       **stale, "prompts/too_long_filtered": too_long,
                       **{k: v for k, v in out.items() if k != "time/train_s"},
                       **batch.stats,   # the rollouts' numbers win over a learner key of the same name
                       "time/train_s": train_s, "time/learner_idle_s": learner_idle,
                       "time/step_s": time.perf_counter() - t_wait}
                rows.add(row, futures)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", stale=staleness,
                                loss=f"{row['loss/total']:.3f}",
                                pairs=f"{row['pairs/count']}/{row['prompts/drawn']}")
                interval = cfg.checkpoint.interval
                if interval and done % interval == 0 and done < cfg.run.num_steps:
                    rows.flush()   # a checkpoint never gets ahead of metrics.jsonl
                    saved = _save(ckpts, learner, done, version, batch, timeout)
            if evals is not None:
                evals.close() if done >= cfg.run.num_steps else evals.cancel_pending()
            rows.flush()
            wall = time.perf_counter() - t_start
            if last_batch is not None and saved < done:  # the end, or a stop signal
                saved = _save(ckpts, learner, done, version, last_batch, timeout)
            stopped_early = done < cfg.run.num_steps
        bar.close()
        producer.stop_event.set()
        channel.close()
        _drain(batches)
        thread.join(timeout=5)
        metrics.close()
        if not stopped_early and cfg.checkpoint.export_hf and (done > start_step or not (
                run_dir / "hf_final" / "config.json").is_file()):
            _export_final(learner, run_dir, model_dir, timeout)
        result = RunResult(summarize(metrics.rows, wall))
        result.update(run_dir=str(run_dir), stopped_early=stopped_early, resumed_from_step=start_step,
                      data=data_counts, prompts_too_long=too_long, generator_restarts=pool.restarts,
                      report=str(run_dir / "report.html"))
        (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
        _report(run_dir, result)
        return result
    finally:
        if producer is not None:   # an error in the learner loop: stop the generation thread too
            producer.stop_event.set()
        if channel is not None:
            channel.close()
        if reward is not None:
            reward.close()
        for actor in (learner, *generators, *rm_actors.values()):
            if actor is not None and actor not in shared_generators:
                ray.kill(actor)
        if transport is not None:
            transport.close()
        if started_ray:
            ray.shutdown()


def _eval_due(cfg: Config, done: int, publish: bool) -> bool:
    """Whether the weights after step ``done`` are evaluated: every ``eval.interval`` steps (when
    they are published for generation) and after the last step."""
    if done >= cfg.run.num_steps:
        return True
    return bool(cfg.eval.interval) and done % cfg.eval.interval == 0 and publish


def _eval_service(cfg: Config, pool, eval_by_task: dict, reward_fns: dict):
    """The ``EvalService`` of the run's held-out prompts (None with ``eval.enabled: false``)."""
    if not cfg.eval.enabled:
        return None
    from megatron_rlhf.trainer.evaluate import EvalService, Evaluator

    return EvalService(Evaluator(pool, eval_by_task, {t.name: t.kind for t in cfg.tasks}, reward_fns,
                                 cfg.eval, cfg.generators.temperature))


class _PendingRows:
    """Metrics rows waiting for their evals (served on the producer thread), logged in step order.

    A row is written once every eval future attached to it has resolved (its fields merged into
    the row); :meth:`add` writes every leading row that is ready without waiting, :meth:`flush`
    waits for all (before a checkpoint, at the end).
    """

    def __init__(self, metrics: MetricsLogger, thread: threading.Thread, batches: queue.Queue, timeout: float):
        self.metrics, self.thread, self.batches, self.timeout = metrics, thread, batches, timeout
        self._rows: list[tuple[dict, list]] = []

    def add(self, row: dict, futures: list) -> None:
        self._rows.append((row, futures))
        while self._rows and all(f.done() for f in self._rows[0][1]):
            self._write(*self._rows.pop(0))

    def flush(self) -> None:
        while self._rows:
            self._write(*self._rows.pop(0))

    def _write(self, row: dict, futures: list) -> None:
        """Merge the row's evals (in order: a later one's keys win; seconds add up) and log it."""
        eval_s = 0.0
        for fut in futures:
            res = self._result(fut)
            if res:
                eval_s += res["time/eval_s"]
                row.update(res)
        row["time/eval_s"] = eval_s
        self.metrics.log(row)

    def _result(self, fut) -> dict | None:
        """The eval's fields; None when it was cancelled or the producer thread ended without it.

        Raises:
            the eval's own error; ProducerError: generation failed while the eval waited.
        """
        deadline = time.monotonic() + self.timeout
        while not fut.done():
            fut_wait = min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                return fut.result(timeout=fut_wait)
            except TimeoutError:
                pass
            if not self.thread.is_alive() and not fut.done():
                try:
                    item = self.batches.get_nowait()
                except queue.Empty:
                    return None
                if isinstance(item, BaseException):
                    raise ProducerError(f"generation failed: {type(item).__name__}: {item}") from item
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no eval result within async.timeout_s={self.timeout:.0f} s")
        return fut.result()


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


def _export_final(learner, run_dir: Path, model_dir: Path, timeout: float) -> None:
    """Write ``<run>/hf_final`` (replacing the export of an earlier, shorter run of this folder:
    written to a temporary sibling first, so a crash never leaves no export)."""
    import shutil

    import ray

    final, tmp = run_dir / "hf_final", run_dir / f".hf_final.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ray.get(learner.export_hf.remote(str(tmp), str(model_dir)), timeout=timeout)
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


def _preflight(cfg: Config, model_dir: Path) -> None:
    """Checks that need the model or the machine, run before any actor starts.

    Raises:
        ConfigError: the model does not split over ``learner.tensor_parallel`` /
            ``pipeline_parallel``, or ``generators.transport=nccl`` without a visible CUDA GPU.
    """
    import torch

    from megatron_rlhf.learner.model import check_divisible, load_hf_config

    try:
        check_divisible(load_hf_config(model_dir), tensor_parallel=cfg.learner.tensor_parallel,
                        pipeline_parallel=cfg.learner.pipeline_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.generators.transport == "nccl" and not torch.cuda.is_available():
        raise ConfigError("config key 'generators.transport' = 'nccl' needs CUDA GPUs on the learner and "
                          "the generators (none is visible here); use 'object_store' or 'filesystem'")


def _config_differs(cfg: Config, saved: Path) -> bool:
    """Whether ``cfg`` differs from the config saved at ``saved`` (ignoring unreadable files)."""
    from megatron_rlhf.config import load_config

    try:
        return config_to_dict(load_config(saved)) != config_to_dict(cfg)
    except Exception:  # noqa: BLE001 - a note only
        return False


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


def _build_reward_models(cfg: Config, folders: dict[str, Path]) -> dict:
    """One ``RewardModelWorker`` Ray actor per reward-model folder (tasks sharing a folder share
    the actor): one CPU, and on GPU clusters one GPU of the generator nodes (the ``mrlhf_generator``
    resource of slurm/ray_cluster.sh; the placement check counts it beside the vLLM engines)."""
    import ray

    from megatron_rlhf.rewards.server import RewardModelWorker

    by_dir: dict[Path, object] = {}
    out = {}
    for task in cfg.tasks:
        if task.name not in folders:
            continue
        d = folders[task.name]
        if d not in by_dir:
            opts = _actor_options("generator", 1)
            by_dir[d] = ray.remote(**opts)(RewardModelWorker).remote(
                model_dir=str(d), dtype=cfg.model.dtype, batch_size=task.reward.batch_size)
        out[task.name] = by_dir[d]
    return out


def _import_plugins(cfg: Config) -> dict:
    """Task name -> the imported ``module:function`` reward plug-in of every plug-in task.

    Raises:
        ConfigError: a plug-in that cannot be imported (named by its task).
    """
    import importlib

    out = {}
    for task in cfg.tasks:
        if task.kind == "plugin":
            mod, _, fn = task.reward.partition(":")
            try:
                out[task.name] = getattr(importlib.import_module(mod), fn)
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"tasks[{task.name}].reward = {task.reward!r} cannot be imported: {e}") from e
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
        elif task.kind == "reward_model":
            fns[task.name] = lambda ps, texts, a=rm_actors[task.name]: ray.get(
                a.score.remote([p.text for p in ps], list(texts)), timeout=timeout)
        else:
            fns[task.name] = lambda ps, texts, f=plugins[task.name]: f(list(texts), [p.answer for p in ps])
    return fns


def _learner_call(ref, what: str, timeout: float, ckpts: CheckpointManager):
    """``ray.get`` of a learner call; a dead learner stops the run with a clear error.

    Raises:
        LearnerDiedError: the learner actor died (killed, OOM); names the last complete checkpoint.
        ray.exceptions.GetTimeoutError: no answer within ``async.timeout_s``.
    """
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(ref, timeout=timeout)
    except RayActorError as e:
        latest = ckpts.latest()
        where = (f"the last complete checkpoint {latest[0]} is intact: rerun the same command to resume "
                 "from it" if latest else "no checkpoint was written yet")
        raise LearnerDiedError(f"the learner died during {what} ({type(e).__name__}); {where}") from e


def _take(batches: queue.Queue, timeout: float, stop) -> object | None:
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
        if isinstance(item, BaseException):
            raise ProducerError(f"generation failed: {type(item).__name__}: {item}") from item
        return item


def _drain(batches: queue.Queue) -> None:
    try:
        while True:
            batches.get_nowait()
    except queue.Empty:
        pass


def _save(ckpts: CheckpointManager, learner, step: int, version: int, batch, timeout: float) -> int:
    import ray

    state = {"step": step, "weight_version": version, "sampler_state": batch.sampler_state,
             "rng_state": batch.rng_state, "producer_state": batch.producer_state, "time": time.time()}
    ckpts.save(step, state, lambda tmp: ray.get(
        learner.save_checkpoint.remote(str(tmp / "learner")), timeout=timeout))
    return step
