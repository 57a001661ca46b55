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

import yaml

from megatron_rlhf.config import Config, ConfigError, config_diff, config_to_dict, save_config
from megatron_rlhf.generator.pool import GeneratorPool
from megatron_rlhf.generator.weight_sync import PublishedWeights, make_transport
from megatron_rlhf.trainer.checkpoint import CheckpointManager
from megatron_rlhf.trainer.metrics import MetricsLogger
from megatron_rlhf.trainer.preflight import check_model_source, preflight
from megatron_rlhf.trainer.rollout import RolloutProducer, WeightChannel
from megatron_rlhf.trainer.run import RunResult, learner_guard
from megatron_rlhf.trainer.watchdog import HangWatchdog, dump_actor_stacks

__all__ = ["prepare", "start", "resolve_model_dir", "init_ray", "worker_pythonpath", "load_prompts", "resolve_reward_models",
           "build_reward_models", "reward_fns", "build_actors", "build_generators"]


def prepare(run) -> "RunResult | None":
    """Everything before any actor starts: model, pre-flight checks, data, plug-ins, folder.
    A config error leaves no empty run folder behind (one this call created)."""
    existed = run.run_dir.exists()
    try:
        return _prepare_checked(run)
    except ConfigError:
        if not existed:
            with contextlib.suppress(OSError):
                run.run_dir.rmdir()   # only when empty
        raise


def _prepare_checked(run) -> "RunResult | None":
    cfg, say, run_dir = run.cfg, run.say, run.run_dir
    say(f"run folder {run_dir}")
    check_model_source(cfg.model)
    with run.phase("model", f"model {cfg.model.source}: preparing the Hugging Face folder (a GGUF or "
                   "Megatron source is converted once and cached)..."):
        run.model_dir = resolve_model_dir(cfg.model)
    run.plugins = preflight(cfg, run.model_dir)    # before any actor starts: a bad config stops here
    try:
        run.sampler, run.data_counts, run.pad_id, run.eval_by_task = load_prompts(cfg, run.model_dir)
    except (ValueError, FileNotFoundError) as e:   # names tasks[].data.*: a config problem
        raise ConfigError(str(e)) from e
    say(f"model {run.model_dir}; prompts: " + ", ".join(
        f"{t} {c.get('kept')} to train, {c.get('eval_prompts', 0)} held out" for t, c in run.data_counts.items()))
    run.too_long = sum(c.get("too_long", 0) for c in run.data_counts.values())
    run.ckpts = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    done_before = completed_run(cfg, run.ckpts, run_dir)
    if done_before is not None:
        say(f"run already complete at step {cfg.run.num_steps}: nothing to train (raise run.num_steps "
            "to continue it, or pick another run.name for a new run)")
        changes = config_changes(cfg, run_dir / "config.yaml")
        if changes:
            say(f"note: this config differs from the one the run used ({run_dir / 'config.yaml'}); "
                f"it was not applied: {'; '.join(changes)}")
        return done_before
    with run.phase("reward_model"):   # trains the demo reward model on first use (it says so)
        run.reward_models = resolve_reward_models(cfg)
    for task, folder in run.reward_models.items():
        say(f"task {task}: reward model {folder}{rm_accuracy(folder)}")
    changes = config_changes(cfg, run_dir / "config.yaml")
    if changes:
        say(f"warning: resuming {run_dir} with a changed config (config.yaml is rewritten, the new "
            f"values apply from here on): {'; '.join(changes)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return None


def start(run, generators: list | None) -> None:
    """Start the actors, resume the learner from the latest checkpoint, hand the generators
    the starting weights, and build the pool, the producer and the metrics logger."""
    import ray

    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.rewards.math_verify import default_num_workers
    from megatron_rlhf.rollout.pairs import select_pair
    from megatron_rlhf.trainer.nodes import actor_nodes, write_actor_nodes

    cfg, timeout = run.cfg, run.timeout
    if any(t.kind == "math_verify" for t in cfg.tasks):
        run.reward = MathVerifyReward(num_workers=default_num_workers(cfg.rewards.math_verify_workers))
    run.stacks_dir = run.run_dir / "logs" / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run.ray_head = init_ray(cfg, run.run_dir, run.stacks_dir,
                              extra_cpus=len(set(run.reward_models.values())))
    run.shared_generators = list(generators or [])
    run.placement = reserve_placement(cfg, len(set(run.reward_models.values())), timeout)
    run.rm_actors = build_reward_models(cfg, run.reward_models, run.placement)
    fns = reward_fns(cfg, run.reward, run.rm_actors, run.plugins, timeout)
    live = cfg.run.mode != "train_only"   # train_only replays saved batches: no vLLM engine
    run.learner, run.generators = build_actors(cfg, run.model_dir, run.shared_generators,
                                                  run.placement, live)
    run.transport = make_transport(cfg.generators, run.run_dir, cfg.async_.timeout_s)
    run.probe = (probe_tokens(run.sampler, cfg.generators.max_model_len)
                  if cfg.generators.check_weight_sync else None)
    run.start_step, run.version, rng_state, producer_state = 0, 0, None, None
    run.pending = collections.deque()
    latest = run.ckpts.latest() if cfg.checkpoint.resume else None
    if latest is not None:
        path, state = latest
        run.version = run.call(run.learner.load_checkpoint.remote(str(path / "learner")),
                                 f"loading checkpoint {path.name}")
        run.start_step, rng_state = state["step"], state["rng_state"]
        producer_state = state.get("producer_state")
        run.pending.extend(load_pending(path, state))
        try:
            run.sampler.load_state_dict(state["sampler_state"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot resume from {path}: its data-sampler position does not fit "
                              f"this config's tasks ({e}); resume with the same tasks[] and run.seed, "
                              "or start a new run (another run.name)") from e
        run.say(f"resuming from {path.name} (step {run.start_step}, weight version {run.version}"
                 f"{pending_note(run.pending)})")
    with learner_guard("start-up", run.ckpts):
        ray.get([a.__ray_ready__.remote() for a in (run.learner, *run.generators, *run.rm_actors.values())],
                timeout=timeout)
        if live and hasattr(run.transport, "setup"):   # broadcast: form the groups
            run.transport.setup(run.learner, run.generators, timeout)
    write_actor_nodes(run.run_dir, actor_nodes(run.learner, run.generators, run.rm_actors, timeout))
    run.channel = WeightChannel(PublishedWeights(version=0))
    run.batches = queue.Queue(maxsize=1)
    if not live:
        from megatron_rlhf.trainer.replay import ReplayProducer, check_replay_dir

        try:
            folder = check_replay_dir(cfg.run.replay, run.start_step, cfg.run.num_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from e
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
        ray.get([run.transport.push(g, start) for g in run.shared_generators], timeout=timeout)
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
    run.evals = eval_service(cfg, run.pool, run.eval_by_task, fns, log=run.say)
    bound = cfg.run.num_steps if cfg.run.mode == "rollout_only" else cfg.async_.staleness_bound
    run.producer = RolloutProducer(   # rollout_only: never waits for weights (no training)
        pool=run.pool, sampler=run.sampler, reward_fns=fns,
        pair_fn=select_pair, channel=run.channel, out_queue=run.batches, algorithm_cfg=cfg.algorithm,
        generator_cfg=cfg.generators, staleness_bound=bound,
        first_batch=run.start_step + len(run.pending), num_batches=cfg.run.num_steps,
        min_version=run.version,
        rng_state=rng_state, producer_state=producer_state, seed=cfg.run.seed, timeout_s=timeout,
        evals=run.evals)
    run.thread = threading.Thread(target=run.producer.run, name="rollout-producer", daemon=True)
    open_metrics(run)


def open_metrics(run) -> None:
    """The metrics logger (rows above the resumed step moved aside, see ``MetricsLogger``) and
    the hang watchdog."""
    cfg = run.cfg
    run.metrics = MetricsLogger(run.run_dir, cfg.logging, config_to_dict(cfg),
                                 resume_step=run.start_step)
    if run.metrics.aside is not None:
        run.say(f"metrics rows after step {run.start_step} (training lost in a crash) moved to "
                 f"{run.metrics.aside.name}")
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

    from megatron_rlhf.runtime import LocalRayHead, process_env

    if ray.is_initialized():
        return None
    from megatron_rlhf.trainer.watchdog import STACKS_ENV

    env = {**process_env(), STACKS_ENV: str(stacks_dir), "PYTHONPATH": worker_pythonpath()}
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

    pin, g = cfg.generators.cpu_core, cfg.generators
    lc = cfg.learner
    world = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
    kw = dict(model_dir=str(model_dir), learner_cfg=lc, algorithm_cfg=cfg.algorithm,
              dtype=cfg.model.dtype, seed=cfg.run.seed, total_steps=cfg.run.num_steps,
              temperature=cfg.generators.temperature,   # the learner picks each loss's own
              cpu_core=pin + g.num_workers * g.tensor_parallel if pin >= 0 else -1)
    rank_opts = ([{"max_restarts": 0, **placement.learner_options(r)} for r in range(world)] if placement
                 else [actor_options("learner", 1)] * world)
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


def probe_tokens(sampler, max_model_len: int) -> list[int]:
    """The weight-sync probe: the first task's first prompt's tokens (fixed for the run), cut to
    the context."""
    first = sampler.prompts(sampler.tasks[0])[0]
    return list(first.token_ids[: max_model_len - 1])


def eval_service(cfg: Config, pool, eval_by_task: dict, reward_fns: dict, log=None):
    """The ``EvalService`` of the run's held-out prompts (None with ``eval.enabled: false``);
    ``log``: where its progress lines go (None: nowhere)."""
    if not cfg.eval.enabled:
        return None
    from megatron_rlhf.trainer.evaluate import EvalService, Evaluator

    return EvalService(Evaluator(pool, eval_by_task, {t.name: t.kind for t in cfg.tasks}, reward_fns,
                                 cfg.eval, cfg.generators.temperature, log=log))


def completed_run(cfg: Config, ckpts: CheckpointManager, run_dir: Path) -> RunResult | None:
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


def config_changes(cfg: Config, saved: Path) -> list[str]:
    """``["key: old -> new", ...]`` between the config saved at ``saved`` and ``cfg``; empty when
    there is no saved config or it cannot be read (a note only)."""
    if not saved.is_file():
        return []
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return config_diff(old, config_to_dict(cfg))


def rm_accuracy(folder: Path) -> str:
    """``"; held-out pairwise accuracy A +- se (n = N)"`` from the folder's ``rm_report.json``, or ``""``."""
    try:
        rep = json.loads((Path(folder) / "rm_report.json").read_text())
        return f"; held-out pairwise accuracy {rep['accuracy']:.3f} +- {rep['se']:.3f} (n = {rep['n_eval']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def resolve_reward_models(cfg: Config) -> dict[str, Path]:
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


def build_reward_models(cfg: Config, folders: dict[str, Path], placement=None) -> dict:
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
            opts = placement.reward_options(len(by_dir)) if placement else actor_options("generator", 1)
            by_dir[d] = ray.remote(**opts)(RewardModelWorker).remote(
                model_dir=str(d), dtype=cfg.model.dtype, batch_size=task.reward.batch_size)
        out[task.name] = by_dir[d]
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


def load_pending(path: Path, state: dict) -> list:
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


def pending_note(pending) -> str:
    if not pending:
        return ""
    return "; then its untrained batches " + ", ".join(
        f"{b.index} (weight version {b.weight_version})" for b in pending)
