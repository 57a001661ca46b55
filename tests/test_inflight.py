"""In-flight weight updates and the streaming generator pool (no round barrier).

* A real vLLM engine (tiny random Llama, one Ray actor shared by the module) takes weight
  version 1 while its requests run: the pool pushes it mid-request, the probe check passes right
  after the push, and the completions that spanned the push record ``weight_version`` 0 and
  ``weight_version_last`` 1, with one sampling logprob per token: those before the push equal a
  transformers forward of the old weights, those after it one of the new weights.
* Scheduling without a round barrier: a slow stand-in engine (held until the test releases it)
  and a fast one; the fast one gets its next requests while the slow one still runs. Once with a
  fake fast engine (exact counts), once with the real engine (the flow through vLLM).
* Partial rollouts with the real engine: a running request is aborted, parked (tokens and
  sampling logprobs kept), survives the JSON round trip a checkpoint makes, and is continued
  under version 1 from prompt + its tokens.
"""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rlhf.config import GeneratorConfig
from megatron_rlhf.types import Completion, Prompt

MAX_NEW = 192   # about 1 s of steps on an idle machine: the mid-request push (polled every 0.2 s) lands inside it
TOL = 5e-4   # vLLM fp32 vs transformers fp32 token logprobs (7e-5 observed); versions differ by > 0.05


# ----------------------------------------------------------------------------------- units
@pytest.mark.timeout(30)
def test_staleness_counts_from_the_first_token_version():
    from megatron_rlhf.rollout.staleness import split_by_staleness
    from megatron_rlhf.types import PreferencePair, Rollout

    pr = Prompt(index=0, task="t", token_ids=(1, 2))
    spans = Completion(token_ids=(3, 4), logprobs=(-1.0, -2.0), finish_reason="stop", text="x",
                       weight_version=1, weight_version_last=3)
    assert spans.weight_version_first == 1 and spans.weight_version_last == 3
    plain = Completion(token_ids=(3,), logprobs=(-1.0,), finish_reason="stop", text="x", weight_version=3)
    assert plain.weight_version_last == 3
    pair = PreferencePair(chosen=Rollout(pr, spans, 1.0), rejected=Rollout(pr, plain, 0.0))
    kept, m = split_by_staleness([pair], learner_version=3, max_staleness=1)
    assert kept == [] and m["staleness/max"] == 2          # the oldest token decides
    with pytest.raises(ValueError, match="oldest"):
        Completion(token_ids=(3,), logprobs=(-1.0,), finish_reason="stop", text="x",
                   weight_version=2, weight_version_last=1)


# ----------------------------------------------------------------------------------- actors
class _FakeGenerator:
    """Stand-in generator actor: answers ``generate`` with one fixed completion per sample;
    ``held=True`` makes each request wait until :meth:`release` (a threaded actor)."""

    def __init__(self, name: str, held: bool = False):
        self.name, self.held, self.gate, self.requests = name, held, threading.Event(), 0

    def generate(self, prompts, n):
        self.requests += 1
        if self.held and not self.gate.wait(timeout=120):
            raise TimeoutError("never released")
        return [[Completion(token_ids=(7,), logprobs=(-0.5,), finish_reason="stop", text=self.name,
                            weight_version=0) for j in range(n)] for _ in prompts]

    def release(self):
        self.gate.set()

    def num_requests(self):
        return self.requests

    def get_weight_version(self):
        return 0

    def reseed(self, seed):   # the producer reseeds every engine per batch
        pass


def _prompts(k: int) -> list[Prompt]:
    return [Prompt(index=i, task="t", token_ids=(3 + i % 7, 5, 9, 11 + i % 5)) for i in range(k)]


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_llama_dir):
    """One real VLLMGenerator actor (threaded, as the trainer builds it) + transformers weights."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.generator.vllm_engine import RAY_ACTOR_OPTIONS, VLLMGenerator

    cfg = GeneratorConfig(max_new_tokens=MAX_NEW, max_model_len=256, kv_cache_gib=0.0625,
                          check_weight_sync=True, check_weight_sync_tol=TOL)
    handle = ray.remote(num_cpus=1, **RAY_ACTOR_OPTIONS)(VLLMGenerator).remote(
        model_dir=str(tiny_llama_dir), generator_cfg=cfg, seed=0, cpu_core=-1)
    ray.get(handle.get_weight_version.remote(), timeout=300)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    yield handle, cfg, hf
    ray.kill(handle)


def _pool(handles, cfg, probe=None):
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.weight_sync import ObjectStoreTransport

    return GeneratorPool(handles, transport=ObjectStoreTransport(), generator_cfg=cfg, timeout_s=300,
                         probe=probe)


def _hf_logprobs(model, seq):
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits.float(), -1)[0]
    return [0.0] + [lp[t - 1, seq[t]].item() for t in range(1, len(seq))]


def _version_1(hf, seed: int):
    """Weights version 1 for the engine: the base weights + 0.05 N(0, 1) noise (``seed``), with the
    probe's logprobs under them (transformers). Returns (base, new, probe, PublishedWeights v1);
    ``hf`` is left holding the base weights."""
    import ray
    import torch

    from megatron_rlhf.generator.weight_sync import PublishedWeights

    base = {k: v.clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    probe = list(_prompts(1)[0].token_ids) + [20, 21, 22, 23]
    hf.load_state_dict(new)
    v1 = PublishedWeights(version=1, payload=ray.put([new]), probe_ref=ray.put([_hf_logprobs(hf, probe)]))
    hf.load_state_dict(base)
    return base, new, probe, v1


# ----------------------------------------------------------------------------------- in-flight
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_weights_pushed_mid_request_reach_the_running_completions(engine):
    import ray
    import torch

    from megatron_rlhf.generator.weight_sync import PublishedWeights

    handle, cfg, hf = engine
    base, new, probe, v1 = _version_1(hf, seed=7)
    pool = _pool([handle], cfg, probe)
    steps0 = ray.get(handle.stats.remote())["generator/steps"]

    def refresh():   # version 1 is published once the engine is a few steps into the request
        running = ray.get(handle.stats.remote())["generator/steps"] >= steps0 + 3
        return v1 if running or refresh.sent else PublishedWeights(version=0)
    refresh.sent = False

    requests = [_prompts(2)]
    out = []
    for prompts, groups in pool.stream(2, lambda: requests.pop() if requests else [], refresh):
        out.extend(zip(prompts, groups))
        refresh.sent = True
    stats = pool.take_stats()
    assert stats["sync/midrequest_pushes"] == 1 and stats["sync/inflight_pushes"] == 1
    assert stats["sync/inflight_check_max_abs_diff"] < TOL            # probe check passed after the push
    comps = [(p, c) for p, grp in out for c in grp]
    assert len(comps) == 4
    assert all(len(c.logprobs) == len(c.token_ids) for _, c in comps)
    spanning = [(p, c) for p, c in comps if c.weight_version < c.weight_version_last]
    assert spanning and all((c.weight_version, c.weight_version_last) == (0, 1) for _, c in spanning)
    for p, c in spanning:   # tokens before the push: old weights; from the push on: new weights
        seq = list(p.token_ids) + list(c.token_ids)
        lp_old = _hf_logprobs(hf, seq)[len(p.token_ids):]
        hf.load_state_dict(new)
        lp_new = _hf_logprobs(hf, seq)[len(p.token_ids):]
        hf.load_state_dict(base)
        switch = next(i for i, (a, b) in enumerate(zip(c.logprobs, lp_old)) if abs(a - b) > TOL)
        assert 0 < switch < len(c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs[switch:], lp_new[switch:])) < TOL
    assert ray.get(handle.stats.remote())["generator/midrequest_pushes"] >= 1


# ----------------------------------------------------------------------------------- no barrier
def _stream_until_slow_released(pool, slow, num_requests: int, fast_results_first: int):
    """Stream ``num_requests`` one-prompt requests; release ``slow`` after ``fast_results_first``
    results of the other worker. Returns the yielded completion texts in order."""
    import ray

    prompts = _prompts(num_requests)
    order = []
    for ps, groups in pool.stream(1, lambda: [prompts.pop()] if prompts else []):
        order.append(groups[0][0].text)
        if sum(t != "slow" for t in order) == fast_results_first:
            ray.get(slow.release.remote())
    return order


@pytest.mark.timeout(120)
def test_the_faster_engine_gets_its_next_request_before_the_slower_finishes(ray_cluster):
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=2)(_FakeGenerator)
    fast, slow = actor.remote("fast"), actor.remote("slow", held=True)
    pool = _pool([fast, slow], GeneratorConfig())
    order = _stream_until_slow_released(pool, slow, num_requests=6, fast_results_first=3)
    # the slow engine's only request finished after the fast one had finished three (it was held
    # until then), so the fast engine got requests 2 and 3 while the slow one was still running
    assert order.index("slow") >= 3 and len(order) == 6
    n_fast, n_slow = ray.get(fast.num_requests.remote()), ray.get(slow.num_requests.remote())
    assert n_fast >= 4 and n_fast + n_slow == 6      # after the release either may take the last one
    stats = pool.take_stats()
    assert (stats["generator/0/prompts"], stats["generator/1/prompts"]) == (n_fast, n_slow)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_real_engine_keeps_generating_while_another_engine_is_busy(engine):
    import ray

    handle, cfg, _ = engine
    slow = ray.remote(num_cpus=0, max_concurrency=2)(_FakeGenerator).remote("slow", held=True)
    pool = _pool([handle, slow], GeneratorConfig(max_new_tokens=MAX_NEW, max_model_len=256))
    order = _stream_until_slow_released(pool, slow, num_requests=4, fast_results_first=2)
    assert order.index("slow") >= 2 and len(order) == 4
    stats = pool.take_stats()
    assert stats["generator/0/prompts"] == 3 and stats["generator/0/tokens_per_s"] > 0


@pytest.mark.timeout(120)
def test_producer_fills_a_batch_from_the_free_engine_while_the_other_is_held(ray_cluster):
    """The rollout producer over the streaming pool: batch 0 (2 pairs) is filled from the fast
    engine's requests, scored as each finishes, while the slow engine's request is held; the
    held request is waited for and its pair carried to the next batch."""
    import queue

    import ray

    from megatron_rlhf.config import AlgorithmConfig
    from megatron_rlhf.data.mix import MultiTaskSampler
    from megatron_rlhf.generator.weight_sync import PublishedWeights
    from megatron_rlhf.rollout.pairs import select_pair
    from megatron_rlhf.rollout.producer import RolloutProducer, WeightChannel

    actor = ray.remote(num_cpus=0, max_concurrency=2)(_FakeGenerator)
    fast, slow = actor.remote("fast"), actor.remote("slow", held=True)
    pool = _pool([fast, slow], GeneratorConfig())
    scored = []

    def reward(prompts, texts):   # sample j of every prompt: 1.0 for even j -> a pair per prompt
        scored.append(texts[0])
        if texts[0] == "fast" and scored.count("fast") == 2:
            ray.get(slow.release.remote())   # the batch is full: let the held request finish
        return [float(j % 2 == 0) for j in range(len(texts))]

    out: queue.Queue = queue.Queue(maxsize=1)
    prod = RolloutProducer(
        pool=pool, sampler=MultiTaskSampler({"t": _prompts(20)}, {"t": 1.0}, seed=0), reward_fns={"t": reward},
        pair_fn=select_pair, channel=WeightChannel(PublishedWeights(version=0)), out_queue=out,
        algorithm_cfg=AlgorithmConfig(samples_per_prompt=2, prompts_per_step=2, carry_surplus=True),
        generator_cfg=GeneratorConfig(prompts_per_request=1), staleness_bound=1, first_batch=0,
        num_batches=1, min_version=0, seed=0, timeout_s=60)
    prod.run()
    batch = out.get(timeout=5)
    assert not isinstance(batch, BaseException), batch
    # the fast engine's two requests filled the batch while the slow one was held (no third one:
    # a free engine is refilled after its result is scored); the held request was waited for and
    # its pair is surplus
    assert scored == ["fast", "fast", "slow"]
    assert len(batch.groups) == 2 and batch.stats["pairs/surplus_dropped"] == 0
    assert batch.stats["rollout/surplus_carried"] == 1   # the held request's pair: for the next batch
    assert batch.stats["generator/0/prompts"] == 2 and batch.stats["generator/1/prompts"] == 1


# ----------------------------------------------------------------------------------- partial rollouts
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_aborted_requests_are_parked_and_continue_under_new_weights_with_tokens_and_logprobs_intact(engine):
    """Partial rollouts through the real engine: the pool aborts a running request once the batch
    is "full" (a few engine steps in); its samples come back with their tokens and one sampling
    logprob per token and are parked; after a checkpoint round trip of the parked groups (the
    producer state's JSON) and a push of version 1, the engine continues them from prompt +
    tokens: the old tokens and logprobs are kept, the new tokens' logprobs are those of the new
    weights (transformers), and each continued sample spans versions 0 -> 1."""
    import json

    import ray
    import torch

    from megatron_rlhf.generator.weight_sync import PublishedWeights
    from megatron_rlhf.rollout.carry import ABORTED, Carry

    handle, cfg, hf = engine
    base, new, probe, v1 = _version_1(hf, seed=11)
    from megatron_rlhf.generator.weight_sync import ObjectStoreTransport

    # the module's engine may hold an earlier test's version 1: back to the base weights at version 0
    ray.get(ObjectStoreTransport().push(handle, PublishedWeights(version=0, payload=ray.put([base]))), timeout=300)
    pool = _pool([handle], cfg, probe)
    steps0 = ray.get(handle.stats.remote())["generator/steps"]
    parked: list = []
    requests = [_prompts(2)]
    finished = list(pool.stream(2, lambda: requests.pop() if requests else [], park=parked.append,
                                full=lambda: ray.get(handle.stats.remote())["generator/steps"] >= steps0 + 4))
    assert parked and not finished   # both prompts still had a sample running
    prefixes = [c for pg in parked for c in pg.completions]
    assert any(c.finish_reason == ABORTED for c in prefixes)
    for c in prefixes:
        assert len(c.logprobs) == len(c.token_ids) and c.weight_version == 0
        if c.finish_reason == ABORTED:
            assert 0 < len(c.token_ids) < MAX_NEW

    state = json.loads(json.dumps(Carry(parked=parked).state_dict()))   # what a checkpoint keeps
    restored = Carry.from_state_dict(state).parked
    assert restored == parked

    pool.push(v1)
    todo = [restored]
    done = list(pool.stream(2, lambda: todo.pop() if todo else []))
    (prompts, groups), = done
    continued = 0
    for pg, p, grp in zip(restored, prompts, groups):
        assert p == pg.prompt
        for pre, c in zip(pg.completions, grp):
            assert len(c.logprobs) == len(c.token_ids)
            assert c.token_ids[:len(pre.token_ids)] == pre.token_ids
            assert c.logprobs[:len(pre.logprobs)] == pre.logprobs
            if pre.finish_reason != ABORTED:
                assert c == pre
                continue
            assert c.finish_reason in ("stop", "length") and len(c.token_ids) > len(pre.token_ids)
            assert (c.weight_version, c.weight_version_last) == (0, 1)
            seq = list(p.token_ids) + list(c.token_ids)
            lp_old = _hf_logprobs(hf, seq)[len(p.token_ids):]
            hf.load_state_dict(new)
            lp_new = _hf_logprobs(hf, seq)[len(p.token_ids):]
            hf.load_state_dict(base)
            k = len(pre.token_ids)
            assert max(abs(a - b) for a, b in zip(c.logprobs[:k], lp_old[:k])) < TOL
            assert max(abs(a - b) for a, b in zip(c.logprobs[k:], lp_new[k:])) < TOL
            continued += 1
    assert continued >= 1
