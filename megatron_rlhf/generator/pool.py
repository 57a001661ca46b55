"""The generator pool: M vLLM workers (Ray actors) behind one ``generate`` / ``push`` interface.

Used by the rollout producer (one controller thread; the pool is not thread-safe):

* :meth:`GeneratorPool.generate` spreads one round of prompts over the live workers, balanced by
  expected tokens (:func:`balance`: cost of a prompt = its tokens + K x the running mean
  completion length; longest-processing-time-first greedy), sends one request per worker, and
  waits with ``ray.wait`` (bounded by ``timeout_s`` per request). Results come back in prompt
  order, each completion stamped with the version of the worker that produced it.
* :meth:`GeneratorPool.push` loads a published weight version on every worker through the
  transport (``weight_sync``), records bytes / seconds / GB/s, and, with
  ``generators.check_weight_sync``, compares every worker's probe logprobs with the learner's.
* Faults: a worker whose request raises ``RayActorError`` (process killed, OOM; Ray reports
  ``ActorUnavailableError`` while it restarts) or exceeds ``timeout_s`` (then it is killed with
  ``ray.kill(no_restart=False)``) is restarted by Ray (``max_restarts``): the pool waits until it
  answers again, pushes the current weights to it (the version the pool's workers hold), and
  re-sends its unfinished prompts to it. A worker that answers with another weight version than
  the pool gave it (Ray restarted it between requests and ran the request on the fresh engine)
  is treated the same way, so no batch is silently generated with base weights. Each restart
  prints a line and counts in
  ``generator/restarts``. When Ray's restarts are used up (``ActorDiedError``) or
  ``generators.max_restarts`` is exceeded, :class:`GeneratorDiedError` stops the run.

Metrics (:meth:`GeneratorPool.take_stats`, per batch): ``generator/<i>/tokens_per_s`` (completion
tokens / seconds of its requests), ``generator/<i>/idle_s`` (seconds worker i waited inside
generate rounds for the slowest worker), ``generator/<i>/prompts``, ``generator/<i>/weight_version``,
``generator/restarts`` (cumulative), ``sync/inflight_pushes`` / ``sync/inflight_s`` (pushes made
between requests of this batch, their seconds).

Sources: Ray docs "Fault tolerance -> Actor fault tolerance" (``max_restarts``,
``RayActorError``, ``ActorUnavailableError``, ``ActorDiedError``); Graham 1969 (LPT scheduling).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rlhf.generator.weight_sync import PublishedWeights, WeightTransport, compare_probe
from megatron_rlhf.types import Completion, Prompt

__all__ = ["GeneratorPool", "GeneratorDiedError", "balance"]


class GeneratorDiedError(RuntimeError):
    """A generator worker died and cannot be restarted (restarts used up)."""


def balance(costs: list[float], num_bins: int) -> list[list[int]]:
    """Split items over ``num_bins`` bins so the largest bin total is small (LPT greedy: items by
    decreasing cost, each to the currently lightest bin; ties -> lower bin index).

    Args:
        costs: cost of each item (e.g. expected tokens), >= 0.
        num_bins: >= 1.
    Returns:
        ``num_bins`` lists of item indices, each in increasing index order (a bin may be empty).
    Raises:
        ValueError: ``num_bins < 1``.
    """
    if num_bins < 1:
        raise ValueError(f"balance(num_bins={num_bins}): need at least one bin")
    loads = [0.0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(num_bins), key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += costs[i]
    return [sorted(b) for b in bins]


@dataclass
class _Worker:
    index: int
    handle: Any
    version: int = 0
    restarts: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    prompts: int = 0


class GeneratorPool:
    """M generator workers; see the module docstring.

    Args:
        handles: Ray actor handles of ``VLLMGenerator`` (created with ``max_restarts`` >= the
            configured restarts so Ray brings a dead one back).
        transport: the weight transport.
        generator_cfg: ``GeneratorConfig`` (``max_new_tokens``, ``check_weight_sync``,
            ``check_weight_sync_tol``, ``max_restarts``).
        timeout_s: bound of every remote wait (seconds).
        probe: token ids of the weight-sync probe (required when ``check_weight_sync``).
        initial: the weights every worker holds at start (version 0 = the base model).
        log: where restart lines go (default: stderr).
    """

    def __init__(self, handles: list, *, transport: WeightTransport, generator_cfg, timeout_s: float,
                 probe: list[int] | None = None, initial: PublishedWeights | None = None,
                 log: Callable[[str], None] | None = None):
        if not handles:
            raise ValueError("GeneratorPool: no worker handle given (generators.num_workers >= 1)")
        self.workers = [_Worker(i, h) for i, h in enumerate(handles)]
        self.transport, self.cfg, self.timeout_s = transport, generator_cfg, float(timeout_s)
        self.probe = list(probe) if probe is not None else None
        if generator_cfg.check_weight_sync and not self.probe:
            raise ValueError("GeneratorPool: generators.check_weight_sync needs a probe sequence")
        self.current = initial or PublishedWeights(version=0)
        self.restarts = 0
        self.expected_len = float(generator_cfg.max_new_tokens)
        self._seen_completions = 0
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.batch_index = -1   # set by the producer; only used in messages
        self._inflight_pushes, self._inflight_sync_s = 0, 0.0
        self._temperature: float | None = None

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def versions(self) -> list[int]:
        """Weight version held by each worker."""
        return [w.version for w in self.workers]

    def pids(self) -> list[int]:
        """OS process id of each worker (``VLLMGenerator.pid``)."""
        import ray

        return ray.get([w.handle.pid.remote() for w in self.workers], timeout=self.timeout_s)

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[Prompt], n: int,
                 refresh: Callable[[], PublishedWeights] | None = None,
                 temperature: float | None = None) -> list[list[Completion]]:
        """Sample ``n`` completions for every prompt, spread over the workers.

        Args:
            prompts: this round's prompts.
            n: completions per prompt (K).
            refresh: inflight updates: returns the newest published weights; a worker holding an
                older version gets them before its request.
            temperature: sampling temperature of this round (``None``: ``generators.temperature``;
                ``0``: greedy; the evaluation uses both).
        Returns:
            ``out[i]`` = the ``n`` completions of ``prompts[i]``.
        Raises:
            GeneratorDiedError: a worker died beyond its restarts.
            ray.exceptions.RayTaskError: a worker raised (bad prompt, broken engine).
        """
        import ray
        from ray.exceptions import RayActorError

        if not prompts:
            return []
        if refresh is not None:
            latest = refresh()
            if latest.version > min(self.versions()):
                res = self.push(latest, only_stale=True)
                self._inflight_pushes += 1
                self._inflight_sync_s += res.get("time/sync_s", 0.0)
        self._temperature = temperature
        costs = [len(p.token_ids) + n * self.expected_len for p in prompts]
        parts = balance(costs, self.num_workers)
        out: list[list[Completion] | None] = [None] * len(prompts)
        pending: dict = {}
        t_round = time.perf_counter()
        busy = [0.0] * self.num_workers
        for w, idx in zip(self.workers, parts):
            if idx:
                pending[self._submit(w, prompts, idx, n)] = (w, idx, time.perf_counter())
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            now = time.perf_counter()
            for ref in ready:
                w, idx, t0 = pending.pop(ref)
                try:
                    groups = ray.get(ref)
                except RayActorError as e:
                    self._recover(w, e, len(idx))
                    pending[self._submit(w, prompts, idx, n)] = (w, idx, time.perf_counter())
                    continue
                stamped = {c.weight_version for g in groups for c in g}
                if stamped and stamped != {w.version}:
                    # Ray restarted the process between requests and ran this one on the fresh
                    # engine (base weights): same treatment as a death in flight
                    self._recover(w, RuntimeError(f"worker answered with weight versions {sorted(stamped)}, "
                                                  f"expected {w.version} (restarted silently)"), len(idx))
                    pending[self._submit(w, prompts, idx, n)] = (w, idx, time.perf_counter())
                    continue
                dt = time.perf_counter() - t0
                busy[w.index] += dt
                w.busy_s += dt
                self._record(w, [prompts[i] for i in idx], groups)
                for i, g in zip(idx, groups):
                    out[i] = g
            for ref, (w, idx, t0) in list(pending.items()):
                if now - t0 > self.timeout_s:   # hung: kill it, Ray restarts it, redo its prompts
                    del pending[ref]
                    ray.kill(w.handle, no_restart=False)
                    self._recover(w, TimeoutError(f"no answer within async.timeout_s={self.timeout_s:.0f} s"),
                                  len(idx))
                    pending[self._submit(w, prompts, idx, n)] = (w, idx, time.perf_counter())
        wall = time.perf_counter() - t_round
        for w in self.workers:
            w.idle_s += max(0.0, wall - busy[w.index])
        return out  # type: ignore[return-value]

    def _submit(self, w: _Worker, prompts: list[Prompt], idx: list[int], n: int):
        if self._temperature is None:   # the round's temperature (generate's argument)
            return w.handle.generate.remote([prompts[i] for i in idx], n)
        return w.handle.generate.remote([prompts[i] for i in idx], n, self._temperature)

    def _record(self, w: _Worker, prompts: list[Prompt], groups: list[list[Completion]]) -> None:
        toks = [len(c.token_ids) for g in groups for c in g]
        w.tokens += sum(toks)
        w.prompts += len(prompts)
        if toks:   # running mean completion length (tokens) for the balancing cost
            total = self._seen_completions + len(toks)
            self.expected_len = (self.expected_len * self._seen_completions + sum(toks)) / total
            self._seen_completions = total

    # ------------------------------------------------------------------------------ faults
    def _recover(self, w: _Worker, err: BaseException, num_prompts: int) -> None:
        """Wait for Ray to restart worker ``w``, give it the current weights; raise when it cannot
        come back."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        w.restarts += 1
        self.restarts += 1
        if w.restarts > self.cfg.max_restarts:
            raise GeneratorDiedError(
                f"generator worker {w.index} failed {w.restarts} times (generators.max_restarts="
                f"{self.cfg.max_restarts}); last error: {type(err).__name__}: {err}") from err
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ray.get(w.handle.get_weight_version.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ActorDiedError as e:
                raise GeneratorDiedError(f"generator worker {w.index} died and Ray will not restart it "
                                         f"(restarts used up): {e}") from err
            except (ActorUnavailableError, RayActorError, ray.exceptions.GetTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise GeneratorDiedError(f"generator worker {w.index} did not come back within "
                                             f"async.timeout_s={self.timeout_s:.0f} s: {e}") from err
                time.sleep(0.5)
        w.version = 0   # a restarted engine holds the base model
        if getattr(self.transport, "collective", False):
            raise GeneratorDiedError(
                f"generator worker {w.index} restarted, but transport {self.transport.name!r} cannot "
                "bring a single worker up to date (its group must be re-formed by the controller)") from err
        if self.current.payload is not None:
            self._push_workers([w], self.current)
        self._log(f"[megatron-rlhf] WARNING generator worker {w.index} died during batch {self.batch_index} "
                  f"({type(err).__name__}); restarted by Ray (restart {w.restarts}/{self.cfg.max_restarts}) "
                  f"in {time.perf_counter() - t0:.1f} s, weight version {w.version} loaded, "
                  f"{num_prompts} prompts re-queued")

    # ------------------------------------------------------------------------------ weights
    def push(self, weights: PublishedWeights, only_stale: bool = False) -> dict:
        """Load ``weights`` on every worker (``only_stale``: on workers holding an older version).

        Returns:
            sync metrics: ``time/sync_s`` (export + slowest load, seconds), ``sync/bytes``
            (payload bytes per worker), ``sync/export_s``, ``sync/load_s``, ``sync/GBps``
            (bytes x workers / (export + load seconds) / 1e9), and ``sync/check_max_abs_diff``
            (nats) when the check is on.
        Raises:
            WeightSyncError: the check failed. GeneratorDiedError: see :meth:`_recover`.
        """
        targets = [w for w in self.workers if not only_stale or w.version < weights.version]
        if not targets:
            return {}
        chain = self.transport.chain(min(w.version for w in targets), weights) \
            if hasattr(self.transport, "chain") else [weights]
        res: dict = {}
        for wts in chain:
            res = self._push_workers(targets, wts)
        self.current = weights
        if min(self.versions()) >= weights.version:
            self.transport.retire(weights.version)
        return res

    def _push_one(self, w: _Worker, weights: PublishedWeights):
        """Start the load of ``weights`` on worker ``w`` (returns the ObjectRef of its result)."""
        return self.transport.push(w.handle, weights)

    def _push_workers(self, targets: list[_Worker], weights: PublishedWeights) -> dict:
        import ray
        from ray.exceptions import RayActorError

        t0 = time.perf_counter()
        refs = {self._push_one(w, weights): w for w in targets}
        results = []
        for ref, w in refs.items():
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
                w.version = weights.version
            except RayActorError as e:  # died while loading: restart, which pushes current again
                self.current = weights
                self._recover(w, e, 0)
        load_s = time.perf_counter() - t0
        nbytes = max([int(r.get("bytes", 0)) for r in results] + [weights.bytes])
        out = {"time/sync_s": weights.export_s + load_s, "sync/bytes": nbytes,
               "sync/export_s": weights.export_s, "sync/load_s": load_s,
               "sync/GBps": nbytes * len(targets) / 1e9 / max(load_s + weights.export_s, 1e-9)}
        if self.cfg.check_weight_sync:
            out["sync/check_max_abs_diff"] = self.check(weights, targets)
        return out

    def check(self, weights: PublishedWeights, targets: list[_Worker] | None = None) -> float:
        """Compare the probe logprobs of ``targets`` (default all) with the learner's at
        ``weights.version``; returns the max abs difference (nats).

        Raises:
            WeightSyncError: beyond ``generators.check_weight_sync_tol``.
            ValueError: ``weights`` carries no learner probe logprobs.
        """
        import ray

        if weights.probe_ref is None:
            raise ValueError(f"weight version {weights.version} was published without probe logprobs "
                             "(publish with the probe when generators.check_weight_sync is on)")
        learner_lp = ray.get(weights.probe_ref, timeout=self.timeout_s)
        targets = targets or self.workers
        got = ray.get([w.handle.prompt_logprobs.remote([self.probe]) for w in targets], timeout=self.timeout_s)
        return max(compare_probe(lp[0], learner_lp, self.cfg.check_weight_sync_tol, worker=w.index,
                                 version=weights.version) for w, lp in zip(targets, got))

    # ------------------------------------------------------------------------------ metrics
    def take_stats(self) -> dict:
        """Per-worker metrics since the previous call (then reset); see the module docstring."""
        out: dict = {"generator/restarts": self.restarts, "generator/num_workers": self.num_workers,
                     "sync/inflight_pushes": self._inflight_pushes, "sync/inflight_s": self._inflight_sync_s}
        self._inflight_pushes, self._inflight_sync_s = 0, 0.0
        for w in self.workers:
            p = f"generator/{w.index}"
            out[f"{p}/tokens_per_s"] = w.tokens / w.busy_s if w.busy_s else 0.0
            out[f"{p}/idle_s"] = w.idle_s
            out[f"{p}/prompts"] = w.prompts
            out[f"{p}/weight_version"] = w.version
            out[f"{p}/restarts"] = w.restarts
            w.tokens, w.busy_s, w.idle_s, w.prompts = 0, 0.0, 0.0, 0
        return out
