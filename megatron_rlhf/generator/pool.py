"""The generator pool: M vLLM workers (Ray actors) behind one ``generate`` / ``push`` interface.

Used by the rollout producer (one controller thread; the pool is not thread-safe):

* :meth:`GeneratorPool.stream` keeps every worker busy while the caller's ``draw()`` gives
  prompts: each finished request is yielded (for scoring) as it arrives, and its worker gets its
  next prompts right after: no round barrier across workers. Remote waits
  use ``ray.wait`` (bounded by ``timeout_s`` per request). With a ``refresh`` callable (inflight
  updates) a newer published version is pushed to every worker as soon as it appears, also to
  workers whose requests are running (``VLLMGenerator`` loads it between engine steps).
* Partial rollouts (``stream(park=, full=)``): once the batch is full, the running requests are
  aborted (``VLLMGenerator.abort_generation``) and their unfinished prompts handed back to be
  parked; a later ``draw()`` returns them as ``PartialGroup`` s, continued from their tokens.
* :meth:`GeneratorPool.generate` is one balanced round through :meth:`stream` (one request per
  worker, split by expected tokens: :func:`balance`, cost of a prompt = its tokens + K x the
  running mean completion length; longest-processing-time-first greedy); results in prompt order.
* :meth:`GeneratorPool.push` loads a published weight version on every worker through the
  transport (``weight_sync``), records bytes / seconds / GB/s, and, with
  ``generators.check_weight_sync``, compares every worker's probe logprobs with the learner's
  (gate on the mean |diff| above the start-up probe's, :meth:`GeneratorPool.calibrate_check`).
* Faults: a worker whose request raises ``RayActorError`` (process killed, OOM; Ray reports
  ``ActorUnavailableError`` while it restarts) or exceeds ``timeout_s`` (then it is killed with
  ``ray.kill(no_restart=False)``) is restarted by Ray (``max_restarts``): the pool waits until it
  answers again, pushes the current weights to it (the version the pool's workers hold), reseeds
  it for the current batch, and re-sends its unfinished prompts to it. This holds in every phase
  of the pool: every remote call to an engine goes through :meth:`GeneratorPool._wait_each`
  (reseeding between batches, weight loads, the probe check, aborts, ``pids``) or, for the
  generate requests of :meth:`GeneratorPool.stream`, through :meth:`GeneratorPool._collect` and
  :meth:`GeneratorPool._check_timeouts`; all three end in :meth:`GeneratorPool._recover`. A worker that answers with an older weight version than
  the pool gave it (Ray restarted it between requests and ran the request on the fresh engine)
  is treated the same way, so no batch is silently generated with base weights. Each restart
  prints a line and counts in
  ``generator/restarts``. When Ray's restarts are used up (``ActorDiedError``) or
  ``generators.max_restarts`` is exceeded, :class:`GeneratorDiedError` stops the run.

Metrics (:meth:`GeneratorPool.take_stats`, per batch): ``generator/<i>/tokens_per_s`` (completion
tokens / seconds of its requests), ``generator/<i>/idle_s`` (seconds worker i had no request
while the batch still needed prompts; see :meth:`GeneratorPool.stream`), ``generator/<i>/prompts``,
``generator/<i>/weight_version``, ``generator/restarts`` (cumulative), ``sync/inflight_pushes`` /
``sync/inflight_s`` (pushes made during this batch's generation, their seconds),
``sync/midrequest_pushes`` (worker loads among them that happened while the worker had requests
running), ``sync/inflight_check_max_abs_diff`` (nats; the probe check after those pushes, when on).

Sources: Ray docs "Fault tolerance -> Actor fault tolerance" (``max_restarts``,
``RayActorError``, ``ActorUnavailableError``, ``ActorDiedError``); Graham 1969 (LPT scheduling).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from megatron_rlhf.generator.weight_sync import PublishedWeights, WeightTransport, compare_probe
from megatron_rlhf.types import Completion, Prompt
from megatron_rlhf.utils.faults import engine_kill_point

__all__ = ["GeneratorPool", "GeneratorDiedError", "balance", "batch_seed"]


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


def batch_seed(seed: int, batch_index: int, worker: int) -> int:
    """Engine seed of ``worker`` for batch ``batch_index`` of a run seeded ``seed``: a 31-bit
    number from ``random.Random`` seeded with the string ``"seed/batch/worker"`` (SHA-512 based,
    the same in every process and Python run)."""
    import random

    return random.Random(f"{seed}/{batch_index}/{worker}").getrandbits(31)


def _fresh_versions(items: list, groups: list) -> list[int]:
    """Versions the worker itself must have sampled with: the first token of every sample of a
    fresh prompt and the last token of every continued (parked) sample that got new tokens."""
    from megatron_rlhf.rollout.carry import ABORTED, PartialGroup

    out = []
    for x, g in zip(items, groups):
        if isinstance(x, PartialGroup):
            out += [c.weight_version_last for pre, c in zip(x.completions, g)
                    if pre.finish_reason == ABORTED and len(c.token_ids) > len(pre.token_ids)]
        else:
            out += [c.weight_version for c in g]
    return out


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
        max_mult_prob_error: the check's absolute bound on NeMo-RL's ``token_mult_prob_error``
            of the probe (``logging.warn_token_mult_prob_error``).
    """

    def __init__(self, handles: list, *, transport: WeightTransport, generator_cfg, timeout_s: float,
                 probe: list[int] | None = None, initial: PublishedWeights | None = None,
                 log: Callable[[str], None] | None = None, max_mult_prob_error: float = 1.05):
        if not handles:
            raise ValueError("GeneratorPool: no worker handle given (generators.num_workers >= 1)")
        self.workers = [_Worker(i, h) for i, h in enumerate(handles)]
        self.transport, self.cfg, self.timeout_s = transport, generator_cfg, float(timeout_s)
        self.probe = list(probe) if probe is not None else None
        if generator_cfg.check_weight_sync and not self.probe:
            raise ValueError("GeneratorPool: generators.check_weight_sync needs a probe sequence")
        self.current = initial or PublishedWeights(version=0)
        self.max_mult_prob_error = float(max_mult_prob_error)
        self.check_baseline: float | None = None   # mean |diff| of the start-up probe (calibrate_check)
        self.last_check: dict = {}
        self.restarts = 0
        self.expected_len = float(generator_cfg.max_new_tokens)
        self._seen_completions = 0
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.batch_index = -1   # set by the producer; only used in messages
        self._inflight_pushes, self._inflight_sync_s, self._midrequest_pushes = 0, 0.0, 0
        self._inflight_check: float | None = None
        self._pending: tuple[dict, int] = ({}, 0)   # generate requests in flight (the watchdog's view)
        self._temperature: float | None = None      # generate()'s per-call temperature (the eval's)
        self.free_workers = 1   # while draw() runs: free workers left to fill, this one included
        self._seed: tuple[int, int] | None = None   # (run seed, batch index) of the last reseed
        self._sent: dict = {}   # generate request (ObjectRef) -> its worker's restarts when it was sent

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def versions(self) -> list[int]:
        """Weight version held by each worker."""
        return [w.version for w in self.workers]

    def pids(self) -> list[int]:
        """OS process id of each worker (``VLLMGenerator.pid``; a dead worker is restarted first)."""
        return self._wait_each([(w, w.handle.pid.remote()) for w in self.workers], "pid",
                               again=lambda w: w.handle.pid.remote())

    def reseed(self, seed: int, batch_index: int) -> None:
        """Reseed every worker's engine for batch ``batch_index``: worker i gets
        :func:`batch_seed` ``(seed, batch_index, i)``, so each batch samples the same completions
        whenever it is generated (an uninterrupted run or a resumed one). A worker that dies
        meanwhile is restarted and reseeded (:meth:`_wait_each`); a worker restarted later in the
        batch is reseeded with the same seed by :meth:`_recover`.

        Raises:
            GeneratorDiedError: a worker died beyond its restarts.
        """
        self._seed = (seed, batch_index)
        for w in self.workers:
            engine_kill_point("reseed", batch_index, w.index, w.handle)

        def start(w: _Worker):
            return w.handle.reseed.remote(batch_seed(seed, batch_index, w.index))

        self._wait_each([(w, start(w)) for w in self.workers], f"reseeding for batch {batch_index}",
                        again=lambda w: None)   # _recover reseeds the restarted worker itself

    def _wait_each(self, refs: list, what: str, again: Callable[[_Worker], Any] | None = None) -> list:
        """The results of one engine call per worker (``refs``: ``[(worker, ObjectRef)]``), each waited
        for within ``timeout_s``: the one path of every engine call besides the generate requests
        (which :meth:`_collect` and :meth:`_check_timeouts` watch the same way). A worker that died
        (``RayActorError``; ``ActorUnavailableError`` while Ray restarts it) or did not answer in
        time (then it is killed, so Ray restarts it) is recovered (:meth:`_recover`: restarted,
        given the current weights and the batch's seed), then asked again with ``again(w)`` (its
        new ObjectRef; ``again`` None or returning None: not asked again, its result is None).

        Returns:
            The results in ``refs`` order.
        Raises:
            GeneratorDiedError: a worker died beyond its restarts, or did not come back.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        out = []
        for w, ref in refs:
            while True:
                try:
                    out.append(ray.get(ref, timeout=self.timeout_s))
                    break
                except (RayActorError, GetTimeoutError) as e:
                    err: BaseException = e
                    if isinstance(e, GetTimeoutError):   # hung: kill it, Ray restarts it
                        ray.kill(w.handle, no_restart=False)
                        err = TimeoutError(f"{what}: no answer within async.timeout_s={self.timeout_s:.0f} s")
                    self._recover(w, err, 0, during=what)
                    ref = again(w) if again is not None else None
                    if ref is None:
                        out.append(None)
                        break
        return out

    def pending_calls(self) -> list[str]:
        """The generate requests in flight, one line each (for the hang watchdog; any thread)."""
        pending, n = self._pending
        now = time.perf_counter()
        return [f"generator {w.index}: generate({len(ps)} prompts of task "
                f"{', '.join(sorted({getattr(x, 'prompt', x).task for x in ps}))} x {n} samples, batch "
                f"{self.batch_index}, weight version {w.version}) for {now - t0:.0f} s"
                for w, ps, t0, _ in list(pending.values())]

    def state_dict(self) -> dict:
        """What the prompt split depends on: the running mean completion length (JSON-plain)."""
        return {"expected_len": self.expected_len, "seen_completions": self._seen_completions}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.expected_len = float(state["expected_len"])
        self._seen_completions = int(state["seen_completions"])

    # ------------------------------------------------------------------------------ generate
    def stream(self, n: int, draw: Callable[[], list],
               refresh: Callable[[], PublishedWeights] | None = None,
               park: Callable[[Any], None] | None = None, full: Callable[[], bool] | None = None,
               ) -> Iterator[tuple[list[Prompt], list[list[Completion]]]]:
        """Keep every worker busy while ``draw`` gives prompts; yield each request as it finishes.

        No round barrier: each finished request is handed to the caller at once (who scores it
        while the other workers keep generating), and right after that the free worker gets its
        next prompts if ``draw()`` still has any. Refilling after the caller's turn, not before,
        lets ``draw()`` see the finished request's scores: a request that completes the batch
        does not start another one that would only be waited for. Ends when nothing runs and
        ``draw()`` gave no prompt to any free worker.

        Args:
            n: completions per prompt (K).
            draw: prompts for one request of a free worker; ``[]`` = the batch needs no more
                prompts now. Called in the caller's thread, between yields.
            refresh: inflight updates: returns the newest published weights; checked whenever
                the pool waits, and a newer version is pushed to every worker holding an older
                one at once, also to workers with requests running (they load it between two
                engine steps and continue: ``sync/midrequest_pushes``).
                ``draw()`` may return :class:`~megatron_rlhf.rollout.carry.PartialGroup` s
                besides prompts: parked samples the worker continues (``generate(prefixes=)``).
            park: partial rollouts: once ``full()`` is true while requests run, every worker with
                a request gets ``abort_generation`` (the requests return at once with what they
                have); of each returned request the prompts whose K samples all finished are
                yielded as usual and the others are handed to ``park(PartialGroup)``.
            full: the batch needs nothing more (with ``park``; checked whenever the pool waits).
        Yields:
            ``(prompts, groups)`` of one finished request: ``groups[i]`` = the ``n`` completions
            of ``prompts[i]``.
        Raises:
            GeneratorDiedError: a worker died beyond its restarts.
            ray.exceptions.RayTaskError: a worker raised (bad prompt, broken engine).

        ``generator/<i>/idle_s`` counts the seconds worker i had no request while ``draw()``
        still gave prompts: from when its result was seen (or, for a result found ready when
        the caller handed control back, from when the pool yielded: an upper bound) to its next
        submission, so it includes the caller's scoring of that result. Time with nothing to
        draw (batch complete, staleness handshake) is not idle.
        """
        import ray

        free = {w.index: time.perf_counter() for w in self.workers}   # worker -> free since
        pending: dict = {}
        self._pending = (pending, n)
        yielded_at: float | None = None   # set while checking what finished during the caller's turn
        aborts: list | None = None
        while True:
            self._refresh(refresh)
            self._fill(free, pending, n, draw)
            if not pending:
                if aborts:   # every abort has landed before the next batch's requests go out
                    # (a worker that died meanwhile is restarted once: not again for its abort)
                    self._wait_each([(w, r) for w, r, restarts in aborts if w.restarts == restarts],
                                    "aborting the running requests (the batch is full)")
                return
            if park is not None and aborts is None and full is not None and full():
                # the batch is full: stop the running requests, park what they have
                aborts = [(w, w.handle.abort_generation.remote(), w.restarts)
                          for w in {id(v[0]): v[0] for v in pending.values()}.values()]
                for w, _, _ in aborts:
                    engine_kill_point("abort", self.batch_index, w.index, w.handle)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0 if yielded_at is not None else 0.2)
            if not ready:
                if yielded_at is None:
                    self._check_timeouts(pending, n)
                yielded_at = None
                continue
            w, prompts, t_sub, v_sub = pending.pop(ready[0])
            groups = self._collect(w, ready[0], prompts, n, t_sub, v_sub, pending)
            if groups is None:
                continue
            free[w.index] = yielded_at if yielded_at is not None else time.perf_counter()
            prompts, groups = self._split_parked(prompts, groups, park)
            if not prompts:
                continue
            t_yield = time.perf_counter()
            yield prompts, groups
            yielded_at = t_yield

    @staticmethod
    def _split_parked(items: list, groups: list, park: Callable[[Any], None] | None
                      ) -> tuple[list[Prompt], list[list[Completion]]]:
        """The finished prompts of a request (``draw()``'s own list when nothing was parked or
        continued); prompts with an aborted sample go to ``park`` as a ``PartialGroup``."""
        from megatron_rlhf.rollout.carry import ABORTED, PartialGroup

        plain = not any(isinstance(x, PartialGroup) for x in items)
        if plain and not any(c.finish_reason == ABORTED for g in groups for c in g):
            return items, groups
        prompts, done = [], []
        for x, g in zip(items, groups):
            prompt = x.prompt if isinstance(x, PartialGroup) else x
            if any(c.finish_reason == ABORTED for c in g):
                if park is None:
                    raise RuntimeError(f"prompt {prompt.index} (task {prompt.task}) came back aborted, "
                                       "but this stream parks nothing")
                park(PartialGroup(prompt=prompt, completions=tuple(g)))
            else:
                prompts.append(prompt)
                done.append(g)
        return prompts, done

    def generate(self, prompts: list[Prompt], n: int,
                 refresh: Callable[[], PublishedWeights] | None = None,
                 temperature: float | None = None) -> list[list[Completion]]:
        """Sample ``n`` completions for every prompt, spread over the workers (one request per
        worker, balanced by expected tokens: :func:`balance`; through :meth:`stream`).

        ``temperature``: sampling temperature of these requests (``None``: ``generators.temperature``;
        ``0``: greedy; the evaluation, ``trainer.evaluate``, uses both).

        Returns:
            ``out[i]`` = the ``n`` completions of ``prompts[i]``.
        """
        if not prompts:
            return []
        if temperature is not None:
            self._temperature = temperature
            try:
                return self.generate(prompts, n, refresh)
            finally:
                self._temperature = None
        costs = [len(p.token_ids) + n * self.expected_len for p in prompts]
        parts = [idx for idx in balance(costs, self.num_workers) if idx]
        chunks = [[prompts[i] for i in idx] for idx in parts]
        where = {id(c): idx for c, idx in zip(chunks, parts)}   # stream yields draw()'s own list
        todo = list(chunks)
        out: list[list[Completion] | None] = [None] * len(prompts)
        for ps, groups in self.stream(n, lambda: todo.pop(0) if todo else [], refresh):
            for i, g in zip(where[id(ps)], groups):
                out[i] = g
        return out  # type: ignore[return-value]

    def _fill(self, free: dict, pending: dict, n: int, draw: Callable[[], list[Prompt]]) -> None:
        """Give every free worker a request while ``draw()`` has prompts (idle time counted)."""
        for w in self.workers:
            if w.index not in free:
                continue
            self.free_workers = sum(1 for x in self.workers if x.index in free and x.index >= w.index)
            prompts = draw()   # yielded back as this very list
            now = time.perf_counter()
            if not prompts:   # nothing needed now: this wait is not idle time
                for i in free:
                    free[i] = now
                return
            w.idle_s += max(0.0, now - free.pop(w.index))
            pending[self._submit(w, prompts, list(range(len(prompts))), n)] = (w, prompts, now, w.version)

    def _refresh(self, refresh: Callable[[], PublishedWeights] | None) -> None:
        if refresh is None:
            return
        latest = refresh()
        if latest.version > min(self.versions()):
            res = self.push(latest, only_stale=True)
            self._inflight_pushes += 1
            self._inflight_sync_s += res.get("time/sync_s", 0.0)
            if "sync/check_max_abs_diff" in res:
                self._inflight_check = max(self._inflight_check or 0.0, res["sync/check_max_abs_diff"])

    def _collect(self, w: _Worker, ref, prompts: list[Prompt], n: int, t_sub: float, v_sub: int,
                 pending: dict) -> list[list[Completion]] | None:
        """The groups of a finished request, or None after re-queueing it on a restarted worker."""
        import ray
        from ray.exceptions import RayActorError

        sent_at = self._sent.pop(ref, w.restarts)
        try:
            groups = ray.get(ref)
        except RayActorError as e:
            if sent_at == w.restarts:   # else: already restarted since (a push or an abort saw it die)
                self._recover(w, e, len(prompts), during=f"generating batch {self.batch_index}")
            pending[self._submit(w, prompts, list(range(len(prompts))), n)] = (w, prompts, time.perf_counter(), w.version)
            return None
        first = _fresh_versions(prompts, groups)
        if first and min(first) < v_sub:
            # Ray restarted the process between requests and ran this one on the fresh engine
            # (base weights): same treatment as a death in flight
            self._recover(w, RuntimeError(f"worker answered with weight version {min(first)}, expected "
                                          f">= {v_sub} (restarted silently)"), len(prompts),
                          during=f"generating batch {self.batch_index}")
            pending[self._submit(w, prompts, list(range(len(prompts))), n)] = (w, prompts, time.perf_counter(), w.version)
            return None
        w.busy_s += time.perf_counter() - t_sub
        self._record(w, prompts, groups)
        return groups

    def _check_timeouts(self, pending: dict, n: int) -> None:
        """Kill a worker whose request exceeded ``timeout_s``; Ray restarts it; redo its prompts."""
        import ray

        now = time.perf_counter()
        for ref, (w, prompts, t0, _) in list(pending.items()):
            if now - t0 > self.timeout_s:
                del pending[ref]
                self._sent.pop(ref, None)
                ray.kill(w.handle, no_restart=False)
                self._recover(w, TimeoutError(f"no answer within async.timeout_s={self.timeout_s:.0f} s"),
                              len(prompts), during=f"generating batch {self.batch_index}")
                pending[self._submit(w, prompts, list(range(len(prompts))), n)] = (w, prompts, time.perf_counter(), w.version)

    def _submit(self, w: _Worker, prompts: list, idx: list[int], n: int):
        from megatron_rlhf.rollout.carry import PartialGroup

        items = [prompts[i] for i in idx]
        if any(isinstance(x, PartialGroup) for x in items):   # continue parked samples
            ref = w.handle.generate.remote(
                [x.prompt if isinstance(x, PartialGroup) else x for x in items], n, self._temperature,
                [list(x.completions) if isinstance(x, PartialGroup) else None for x in items])
        elif self._temperature is None:
            ref = w.handle.generate.remote(items, n)
        else:
            ref = w.handle.generate.remote(items, n, self._temperature)
        self._sent[ref] = w.restarts
        engine_kill_point("generate", self.batch_index, w.index, w.handle)
        return ref

    def _record(self, w: _Worker, prompts: list[Prompt], groups: list[list[Completion]]) -> None:
        toks = [len(c.token_ids) for g in groups for c in g]
        w.tokens += sum(toks)
        w.prompts += len(prompts)
        if toks:   # running mean completion length (tokens) for the balancing cost
            total = self._seen_completions + len(toks)
            self.expected_len = (self.expected_len * self._seen_completions + sum(toks)) / total
            self._seen_completions = total

    # ------------------------------------------------------------------------------ faults
    def _recover(self, w: _Worker, err: BaseException, num_prompts: int, during: str = "") -> None:
        """Wait for Ray to restart worker ``w``, give it the current weights and the batch's seed;
        raise when it cannot come back (then a collective transport is told the groups will not be
        re-formed, so a publish waiting for that raises at once: ``BroadcastTransport.abandon``).
        ``during``: what the pool was doing, for the restart's log line."""
        try:
            self._recover_worker(w, err, num_prompts, during or f"batch {self.batch_index}")
        except BaseException as e:
            if hasattr(self.transport, "abandon"):
                self.transport.abandon(f"{type(e).__name__}: {str(e)[:500]}")
            raise

    def _recover_worker(self, w: _Worker, err: BaseException, num_prompts: int, during: str) -> None:
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
                if self._seed is not None:   # a fresh engine: this batch's seed, as the others have
                    ray.get(w.handle.reseed.remote(batch_seed(*self._seed, w.index)),
                            timeout=max(1.0, deadline - time.monotonic()))
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
        if getattr(self.transport, "collective", False):   # re-form the groups, resend to everyone
            latest = self.transport.recover([x.handle for x in self.workers], self.timeout_s)
            for x in self.workers:
                x.version = latest.version if latest is not None else 0
            if latest is not None and latest.version != self.current.version:
                self.current = latest   # the latest staged version, now on every worker
        elif self.current.payload is not None:
            self._push_workers([w], self.current)
        self._log(f"[megatron-rlhf] WARNING generator worker {w.index} died during batch {self.batch_index} "
                  f"({during}: {type(err).__name__}); restarted by Ray (restart {w.restarts}/{self.cfg.max_restarts}) "
                  f"in {time.perf_counter() - t0:.1f} s, weight version {w.version} loaded, "
                  f"{num_prompts} prompts re-queued")

    # ------------------------------------------------------------------------------ weights
    def push(self, weights: PublishedWeights, only_stale: bool = False) -> dict:
        """Load ``weights`` on every worker (``only_stale``: on workers holding an older version).

        Returns:
            sync metrics: ``time/sync_s`` (export + slowest load, seconds), ``sync/bytes``
            (payload bytes per worker), ``sync/export_s``, ``sync/load_s``, ``sync/GBps``
            (bytes x workers / (export + load seconds) / 1e9), and the check's ``sync/check_*``
            (:meth:`check`) when it is on.
        Raises:
            WeightSyncError: the check failed. GeneratorDiedError: see :meth:`_recover`.
        """
        targets = [w for w in self.workers if not only_stale or w.version < weights.version]
        if not targets:
            return {}
        res = self._push_workers(targets, weights)   # sets self.current to what was loaded
        if min(self.versions()) >= self.current.version:
            self.transport.retire(self.current.version)
        return res

    def _push_one(self, w: _Worker, weights: PublishedWeights):
        """Start the load of ``weights`` on worker ``w`` (returns the ObjectRef of its result)."""
        return self.transport.push(w.handle, weights)

    def _push_workers(self, targets: list[_Worker], weights: PublishedWeights) -> dict:
        t0 = time.perf_counter()
        if getattr(self.transport, "collective", False):
            results = self._push_collective(targets, weights)
            # the broadcast transport may load a newer version (this one was superseded)
            weights = results[0].get("weights", weights) if results else weights
        else:
            def start(w: _Worker):
                ref = self._push_one(w, weights)
                engine_kill_point("push", self.batch_index, w.index, w.handle)
                return ref

            refs = [(w, start(w)) for w in targets]
            previous, self.current = self.current, weights   # a worker restarted meanwhile gets these
            try:
                got = self._wait_each(refs, f"loading weight version {weights.version}")
            except BaseException:
                self.current = previous
                raise
            results = []
            for w, r in zip(targets, got):
                w.version = weights.version   # loaded here, or by _recover's push
                if r is not None:
                    results.append(r)
                    self._midrequest_pushes += bool(r.get("midrequest", False))
        load_s = time.perf_counter() - t0
        self.current = weights
        nbytes = max([int(r.get("bytes", 0)) for r in results] + [weights.bytes])
        out = {"time/sync_s": weights.export_s + load_s, "sync/bytes": nbytes,
               "sync/export_s": weights.export_s, "sync/load_s": load_s,
               "sync/GBps": nbytes * len(targets) / 1e9 / max(load_s + weights.export_s, 1e-9)}
        if self.cfg.check_weight_sync:
            self.check(weights, targets)
            out.update(self.last_check)
        return out

    def _push_collective(self, targets: list[_Worker], weights: PublishedWeights) -> list[dict]:
        """A broadcast push reaches every worker at once; a worker that died in it is restarted by
        Ray and the groups are re-formed (:meth:`_recover`), which resends the latest version.
        Each result's ``weights`` is the version loaded: ``weights`` or, when the exporters had
        superseded it, a newer one (``BroadcastTransport.push_all``)."""
        from megatron_rlhf.generator.weight_sync import BroadcastPushError

        try:
            results = self.transport.push_all([w.handle for w in targets], weights, self.timeout_s)
        except BroadcastPushError as e:
            if not e.died:   # no worker to wait for: the run stops, a waiting publish too
                self.transport.abandon(f"{type(e).__name__}: {str(e)[:500]}")
                raise
            self._recover(self.workers[targets[e.engine].index], e, 0)   # every worker holds self.current
            return [{"weights": self.current}]
        for w in targets:
            w.version = results[0]["weights"].version if results else weights.version
        return results

    def calibrate_check(self, learner_probe_ref, version: int = 0) -> dict:
        """The start-up probe (before step 1, every worker holding ``version``, the learner's
        weights): fail fast when engines and learner disagree beyond the absolute bound
        (``max_mult_prob_error``), and keep the largest worker's mean |diff| as the floor later
        checks are measured against (:func:`~megatron_rlhf.generator.weight_sync.compare_probe`).

        Args:
            learner_probe_ref: ObjectRef (or value) of the learner's ``token_logprobs([probe])``.
        Returns:
            the check metrics (see :meth:`check`), with ``sync/check_baseline_mean_abs_diff``.
        Raises:
            WeightSyncError: beyond the absolute bound (names the worker and the numbers).
        """
        self.check_baseline = None
        self.check(PublishedWeights(version=version, probe_ref=learner_probe_ref))
        self.check_baseline = self.last_check["sync/check_mean_abs_diff"]
        self.last_check["sync/check_baseline_mean_abs_diff"] = self.check_baseline
        return dict(self.last_check)

    def check(self, weights: PublishedWeights, targets: list[_Worker] | None = None) -> float:
        """Compare the probe logprobs of ``targets`` (default all) with the learner's at
        ``weights.version``; returns the max abs difference (nats, logged only). The gate
        (:func:`~megatron_rlhf.generator.weight_sync.compare_probe`): mean |diff| within
        ``generators.check_weight_sync_tol`` of the start-up probe's (:meth:`calibrate_check`;
        without one, e.g. on resume, the first check sets it) and NeMo-RL's ``token_mult_prob_error``
        within ``max_mult_prob_error``. ``last_check`` holds ``sync/check_max_abs_diff``,
        ``sync/check_mean_abs_diff``, ``sync/check_token_mult_prob_error`` (largest over workers)
        and ``sync/check_baseline_mean_abs_diff``.

        Raises:
            WeightSyncError: a bound is exceeded.
            ValueError: ``weights`` carries no learner probe logprobs.
        """
        import ray

        if weights.probe_ref is None:
            raise ValueError(f"weight version {weights.version} was published without probe logprobs "
                             "(publish with the probe when generators.check_weight_sync is on)")
        learner_lp = ray.get(weights.probe_ref, timeout=self.timeout_s) \
            if isinstance(weights.probe_ref, ray.ObjectRef) else weights.probe_ref
        targets = targets or self.workers
        for w in targets:
            engine_kill_point("check", self.batch_index, w.index, w.handle)

        def start(w: _Worker):
            return w.handle.prompt_logprobs.remote([self.probe])

        got = self._wait_each([(w, start(w)) for w in targets],   # a restarted worker holds self.current
                              f"the weight-sync check of version {weights.version}", again=start)
        gaps = [compare_probe(lp[0], learner_lp, tol=self.cfg.check_weight_sync_tol, baseline=self.check_baseline,
                              max_mult_prob_error=self.max_mult_prob_error, worker=w.index,
                              version=weights.version) for w, lp in zip(targets, got)]
        if self.check_baseline is None:   # resumed run: its first check is the floor
            self.check_baseline = max(g.mean_abs for g in gaps)
        self.last_check = {"sync/check_max_abs_diff": max(g.max_abs for g in gaps),
                           "sync/check_mean_abs_diff": max(g.mean_abs for g in gaps),
                           "sync/check_token_mult_prob_error": max(g.mult_prob_error for g in gaps),
                           "sync/check_baseline_mean_abs_diff": self.check_baseline}
        return self.last_check["sync/check_max_abs_diff"]

    # ------------------------------------------------------------------------------ metrics
    def take_stats(self) -> dict:
        """Per-worker metrics since the previous call (then reset); see the module docstring."""
        out: dict = {"generator/restarts": self.restarts, "generator/num_workers": self.num_workers,
                     "sync/inflight_pushes": self._inflight_pushes, "sync/inflight_s": self._inflight_sync_s,
                     "sync/midrequest_pushes": self._midrequest_pushes}
        if self._inflight_check is not None:
            out["sync/inflight_check_max_abs_diff"] = self._inflight_check
        self._inflight_pushes, self._inflight_sync_s, self._midrequest_pushes = 0, 0.0, 0
        self._inflight_check = None
        for w in self.workers:
            p = f"generator/{w.index}"
            out[f"{p}/tokens_per_s"] = w.tokens / w.busy_s if w.busy_s else 0.0
            out[f"{p}/idle_s"] = w.idle_s
            out[f"{p}/prompts"] = w.prompts
            out[f"{p}/weight_version"] = w.version
            out[f"{p}/restarts"] = w.restarts
            w.tokens, w.busy_s, w.idle_s, w.prompts = 0, 0.0, 0.0, 0
        return out
