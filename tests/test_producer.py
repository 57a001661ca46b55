"""The rollout producer on its own (no vLLM, no learner): multi-task quotas, per-task reward rules,
the trainable unit of every loss, and resuming its state.

The generator pool is replaced by a deterministic fake whose completions are texts with known
answers, so the tests check exactly what the producer does with them. The rewards are the real
ones: math-verify (process pool) for the math task and a (tiny, random) reward model for the
chat task, both called by the producer in the same step.
"""

from __future__ import annotations

import json
import queue
import threading

import pytest

from megatron_rlhf.config import AlgorithmConfig, GeneratorConfig
from megatron_rlhf.data.mix import MultiTaskSampler
from megatron_rlhf.generator.weight_sync import PublishedWeights
from megatron_rlhf.rollout.pairs import select_pair
from megatron_rlhf.rollout.producer import RolloutProducer, WeightChannel
from megatron_rlhf.types import Completion, Prompt

pytestmark = pytest.mark.timeout(300)

CHAT_REPLIES = ("Sure.", "Here is a short answer to your question.", "No.",
                "I would be glad to help: first, consider the problem carefully, then act.")


class FakePool:
    """Stands in for ``GeneratorPool``: completion j of a math prompt answers correctly when
    ``(index + j) % 3 == 0`` (prompts with ``index % 5 == 0`` never do: they must be skipped);
    chat prompts get replies of different lengths. Deterministic in (prompt, j)."""

    num_workers = 1

    def __init__(self):
        self.batch_index = 0
        self.calls: list[list[str]] = []

    def versions(self):
        return [0]

    def push(self, weights, only_stale=True):  # pragma: no cover - never needed at version 0
        raise AssertionError("no push expected")

    def take_stats(self):
        return {}

    def stream(self, n, draw, refresh=None):
        """One worker: each request's completions are handed over before the next draw."""
        while True:
            prompts = draw()
            if not prompts:
                return
            yield prompts, self.generate(prompts, n)

    def reseed(self, seed, batch_index):
        self.reseeds = getattr(self, "reseeds", []) + [(seed, batch_index)]

    def state_dict(self):
        return {"expected_len": 1.0, "seen_completions": 0}

    def load_state_dict(self, state):
        pass

    def generate(self, prompts, n, refresh=None):
        self.calls.append([p.task for p in prompts])
        out = []
        for p in prompts:
            comps = []
            for j in range(n):
                if p.task == "math":
                    ok = p.index % 5 != 0 and (p.index + j) % 3 == 0
                    text = f"So the result is {p.answer}.\n#### {p.answer}" if ok else "#### 987654321"
                else:
                    text = CHAT_REPLIES[(p.index + j) % len(CHAT_REPLIES)] + " " * (j % 2)
                comps.append(Completion(token_ids=tuple(range(1, 2 + (len(text) % 7))),
                                        logprobs=tuple([-1.0] * (1 + len(text) % 7)),
                                        finish_reason="stop", text=text, weight_version=0))
            out.append(comps)
        return out


def _prompts(task: str, n: int) -> list[Prompt]:
    if task == "math":
        return [Prompt(index=i, task="math", token_ids=(5, 6, i % 50 + 7), answer=str(10 + i),
                       text=f"Tom has {i} apples and buys 10 more. How many?") for i in range(n)]
    return [Prompt(index=i, task="chat", token_ids=(8, 9, i % 50 + 7), answer="",
                   text=f"Give me advice number {i} about cooking.") for i in range(n)]


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.rewards.server import RewardModelWorker
    from megatron_rlhf.testing.tiny import make_tiny_reward_model

    rm = RewardModelWorker(model_dir=str(make_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))))
    math = MathVerifyReward(num_workers=1)
    calls = {"math": 0, "chat": 0}

    def math_fn(ps, texts):
        calls["math"] += 1
        return math(texts, [p.answer for p in ps])

    def chat_fn(ps, texts):
        calls["chat"] += 1
        return rm.score([p.text for p in ps], list(texts))

    yield {"math": math_fn, "chat": chat_fn}, rm, calls
    math.close()


def _producer(scorers, loss="online_dpo", weights=(0.75, 0.25), num_batches=3, first=0, sampler_state=None,
              rng_state=None, producer_state=None, **algo):
    fns, _, _ = scorers
    sampler = MultiTaskSampler({"math": _prompts("math", 40), "chat": _prompts("chat", 30)},
                               {"math": weights[0], "chat": weights[1]}, seed=0)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    out: queue.Queue = queue.Queue(maxsize=1)
    prod = RolloutProducer(
        pool=FakePool(), sampler=sampler, reward_fns=fns, pair_fn=select_pair,
        channel=WeightChannel(PublishedWeights(version=0)), out_queue=out,
        algorithm_cfg=AlgorithmConfig(loss=loss, samples_per_prompt=4, prompts_per_step=8, **algo),
        generator_cfg=GeneratorConfig(prompts_per_request=4), staleness_bound=100, first_batch=first,
        num_batches=num_batches, min_version=0, rng_state=rng_state, producer_state=producer_state,
        seed=0, timeout_s=60)
    return prod, out


def _run(prod, out, n, after_batch=None, timeout_s=120):
    """Run the producer for ``n`` batches; ``after_batch(batch)`` is called as each is taken."""
    t = threading.Thread(target=prod.run, daemon=True)
    t.start()
    batches = []
    for _ in range(n):
        item = out.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        batches.append(item)
        if after_batch is not None:
            after_batch(item)
    t.join(timeout=30)
    return batches


def test_mixed_batch_of_8_holds_6_math_and_2_chat_every_step(scorers):
    fns, rm, calls = scorers
    prod, out = _producer(scorers)
    batches = _run(prod, out, 3)
    for b in batches:
        tasks = [g.prompt.task for g in b.groups]
        assert tasks.count("math") == 6 and tasks.count("chat") == 2, tasks
        assert b.stats["task/math/units"] == 6 and b.stats["task/chat/units"] == 2
        assert b.stats["pairs/count"] == 8
        for key in ("reward_mean", "reward_per_token", "len_mean_tokens", "skipped", "drawn",
                    "chosen_len_mean_tokens", "rejected_len_mean_tokens"):
            assert f"task/math/{key}" in b.stats and f"task/chat/{key}" in b.stats
    # math prompts that are never right (index % 5 == 0) were drawn, skipped and counted
    assert sum(b.stats["task/math/skipped"] for b in batches) > 0
    # both scorers ran in the same steps (one call per task per generation round)
    assert calls["math"] > 0 and calls["chat"] > 0


def test_each_task_pairs_by_its_own_rule(scorers):
    fns, rm, _ = scorers
    prod, out = _producer(scorers)
    for b in _run(prod, out, 2):
        for g in b.groups:
            c, r = g.pair
            rewards = [x.reward for x in g.rollouts]
            if g.prompt.task == "math":
                # math-verify: 1.0 exactly for the right answer; chosen is a random correct one
                assert set(rewards) == {0.0, 1.0}
                assert rewards[c] == 1.0 and rewards[r] == 0.0
                assert g.rollouts[c].completion.text.endswith(f"#### {g.prompt.answer}")
            else:
                # reward model: scalar scores of (prompt, completion); best vs worst
                again = rm.score([g.prompt.text] * len(g.rollouts), [x.completion.text for x in g.rollouts])
                assert rewards == pytest.approx(again, abs=1e-5)
                assert rewards[c] == max(rewards) and rewards[r] == min(rewards) and max(rewards) > min(rewards)


@pytest.mark.parametrize("loss", ["grpo", "ppo", "group_dpo", "best_of_k_sft"])
def test_group_units_per_loss(scorers, loss):
    prod, out = _producer(scorers, loss=loss, num_batches=1)
    (b,) = _run(prod, out, 1)
    assert len(b.groups) == 8 and [g.prompt.task for g in b.groups].count("chat") == 2
    for g in b.groups:
        assert len(g.rollouts) == 4 and g.pair is None
        raw = [x.reward for x in g.rollouts]
        assert max(raw) > min(raw)            # uniform groups are skipped (skip_uniform_groups)
        if loss == "ppo":                     # per-task running normalisation
            n, mean, std = prod.normalizer.stats(g.prompt.task)
            assert n > 0 and g.loss_rewards is not None
        elif loss == "group_dpo" and g.prompt.task == "chat":
            mean = sum(raw) / len(raw)        # scalar rewards: correct = above the group mean
            assert g.loss_rewards == tuple(1.0 if v > mean else 0.0 for v in raw)
        else:
            assert g.loss_rewards is None and g.rewards == tuple(raw)


def test_weights_half_half_and_single_task(scorers):
    prod, out = _producer(scorers, weights=(0.5, 0.5), num_batches=1)
    (b,) = _run(prod, out, 1)
    assert [g.prompt.task for g in b.groups].count("math") == 4


def test_resume_continues_with_the_same_prompts_and_pairs(scorers):
    prod, out = _producer(scorers, num_batches=3)
    full = _run(prod, out, 3)
    b1 = full[1]
    state = json.loads(json.dumps({"sampler": b1.sampler_state, "rng": b1.rng_state,
                                   "producer": b1.producer_state}))
    prod2, out2 = _producer(scorers, first=2, num_batches=3, sampler_state=state["sampler"],
                            rng_state=state["rng"], producer_state=state["producer"])
    (again,) = _run(prod2, out2, 1)

    def key(b):
        return [(g.prompt.task, g.prompt.index, g.pair) for g in b.groups]

    assert key(again) == key(full[2])
    assert again.sampler_state == full[2].sampler_state


def test_unreachable_quota_fails_with_a_clear_error(scorers):
    prod, out = _producer(scorers, num_batches=1, max_prompts_per_step=8, min_pair_yield=1.0,
                          weights=(1.0, 0.0001))
    t = threading.Thread(target=prod.run, daemon=True)
    t.start()
    item = out.get(timeout=120)
    assert isinstance(item, RuntimeError) and "max_prompts_per_step" in str(item)


def test_adaptive_draw_gives_the_low_yield_task_more_prompts(scorers):
    """Math prompts skip more often than chat ones: adaptively, later rounds draw math-heavy; with
    adaptive_task_draw=false each round splits by the remaining quota only."""
    prod, out = _producer(scorers, weights=(0.5, 0.5), num_batches=3)
    batches = _run(prod, out, 3)
    assert prod.rates["math"] < prod.rates["chat"]
    fixed, out2 = _producer(scorers, weights=(0.5, 0.5), num_batches=3, adaptive_task_draw=False)
    _run(fixed, out2, 3)
    first_round = [c for c in fixed.pool.calls if c][0]
    assert first_round.count("math") == first_round.count("chat") == 2   # 4 prompts, needs 4/4
    later = prod.pool.calls[-1]
    assert later.count("math") >= later.count("chat")
    for b in batches:
        assert [g.prompt.task for g in b.groups].count("math") == 4


# ------------------------------------------------------------------- carry, partial, yield-sized draws
class VersionedPool:
    """A fake pool of ``num_workers`` engines for the carry tests: a prompt trains (one correct
    and K-1 wrong samples) when ``index % every == 0``, else all K are wrong; completions are
    stamped with the pool's current weight version (``push`` sets it). Every request's size is
    recorded with the producer's yield estimate at the time (``draws``). With ``park``, the last
    request of a batch is aborted once ``full()`` is true: its samples come back with 2 tokens
    (``finish_reason="abort"``) and are parked; a later request continues them with 3 more tokens
    sampled at the then current version. The version changes only by the producer's ``push`` of
    what :func:`_step_batches` publishes: batch k samples with version k-1, as in the real loop.
    With ``resumed_last`` a wave hands back its requests of parked groups after the others (a
    continuation slower than a fresh request)."""

    def __init__(self, every=1, num_workers=1, per_wave=1, resumed_last=False):
        self.every, self.num_workers, self.per_wave = every, num_workers, per_wave
        self.resumed_last = resumed_last
        self.version, self.batch_index, self.free_workers = 0, 0, 1
        self.draws, self.continued, self.drawn_indices = [], [], []
        self.producer = None

    def versions(self):
        return [self.version]

    def push(self, weights, only_stale=True):
        self.version = weights.version
        return {}

    def take_stats(self):
        return {}

    def reseed(self, seed, batch_index):
        pass

    def state_dict(self):
        return {"expected_len": 1.0, "seen_completions": 0}

    def load_state_dict(self, state):
        pass

    def _sample(self, p, j):
        ok = p.index % self.every == 0 and j == 0
        return Completion(token_ids=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop",
                          text="yes" if ok else "no", weight_version=self.version)

    def _run(self, items, n):
        from megatron_rlhf.rollout.carry import PartialGroup, continue_completion

        prompts, groups = [], []
        for x in items:
            if isinstance(x, PartialGroup):
                self.continued.append(x)
                rest = [Completion(token_ids=(7, 8, 9), logprobs=(-0.7, -0.8, -0.9), finish_reason="stop",
                                   text=self._sample(x.prompt, j).text, weight_version=self.version)
                        for j in range(n)]
                groups.append([continue_completion(c, r) if c.finish_reason == "abort" else c
                               for c, r in zip(x.completions, rest)])
                prompts.append(x.prompt)
            else:
                groups.append([self._sample(x, j) for j in range(n)])
                prompts.append(x)
        return prompts, groups

    def stream(self, n, draw, refresh=None, park=None, full=None):
        """Waves of ``per_wave`` requests (one per free engine): each drawn before any of the
        wave is handed back; then handed back in order (or, with ``park``, the last ones of a
        full batch aborted and parked)."""
        from megatron_rlhf.rollout.carry import PartialGroup

        while True:
            wave = []
            for i in range(self.per_wave):
                self.free_workers = self.per_wave - i
                rates = dict(self.producer.rates) if self.producer else {}
                items = draw()
                if not items:
                    break
                self.draws.append((len(items), rates))
                self.drawn_indices.append((self.batch_index, [getattr(x, "index", -1) for x in items]))
                wave.append(items)
            if not wave:
                return
            if self.resumed_last:
                wave.sort(key=lambda items: any(isinstance(x, PartialGroup) for x in items))
            for items in wave:
                if park is not None and full():
                    for x in items:
                        prompt = x.prompt if isinstance(x, PartialGroup) else x
                        park(PartialGroup(prompt=prompt, completions=tuple(
                            Completion(token_ids=(1, 2), logprobs=(-0.1, -0.2), finish_reason="abort",
                                       text="", weight_version=self.version) for _ in range(n))))
                    continue
                yield self._run(items, n)


def _carry_producer(pool, *, first=0, num_batches=3, bound=100, state=None, ppr=None, max_num_seqs=256,
                    partial=False, prompts_per_step=2, rounding="auto", carry_bound=None, **algo):
    algo.setdefault("carry_surplus", True)   # the carry under test (off by default, config.py says why)
    sampler = MultiTaskSampler({"math": _prompts("math", 200)}, {"math": 1.0}, seed=0)
    if state is not None:
        sampler.load_state_dict(state["sampler"])
    out: queue.Queue = queue.Queue(maxsize=1)
    channel = WeightChannel(PublishedWeights(version=first))   # a resumed run publishes its version
    prod = RolloutProducer(
        pool=pool, sampler=sampler, reward_fns={"math": lambda ps, texts: [float("yes" in t) for t in texts]},
        pair_fn=select_pair, channel=channel, out_queue=out,
        algorithm_cfg=AlgorithmConfig(samples_per_prompt=4, prompts_per_step=prompts_per_step, **algo),
        generator_cfg=GeneratorConfig(prompts_per_request=ppr, max_num_seqs=max_num_seqs,
                                      partial_rollouts=partial, draw_rounding=rounding),
        staleness_bound=bound, first_batch=first, num_batches=num_batches, min_version=first,
        carry_staleness_bound=carry_bound, rng_state=state["rng"] if state else None, producer_state=state["producer"] if state else None,
        seed=0, timeout_s=60)
    pool.producer = prod
    return prod, out, channel


def _step_batches(prod, out, channel, n):
    """Run the producer for ``n`` batches with the real loop's timing under one-step async: the
    learner takes batch k holding version k (published when it finished batch k-1) and trains it
    while batch k+1 is generated, so version k is published as batch k is taken, never earlier.
    With ``bound=1`` batch k+1 waits for it and is generated with version k (batch 0 and 1 with
    version 0), and trained at version k+1: staleness 1, and 2 for what batch k+1 carries on."""
    return _run(prod, out, n, lambda b: channel.publish(PublishedWeights(version=b.index)), timeout_s=60)


def _checkpointed(batch) -> dict:
    """What a checkpoint keeps after ``batch`` (``Run.save``: trainer_state.json), read back."""
    return json.loads(json.dumps({"sampler": batch.sampler_state, "rng": batch.rng_state,
                                  "producer": batch.producer_state}))


def _key(b):
    return [(g.prompt.index, g.weight_version, g.pair) for g in b.groups]


def test_surplus_groups_train_under_one_step_async_and_too_stale_ones_are_requeued_not_lost():
    """A hand-set request of 8 prompts (all trainable) for a quota of 2, one-step async (bound 1,
    carry bound 2 by default): batch 0 (version 0) carries 6 groups. Batch 1 (version 0) trains 2
    of them and draws nothing; batch 2 (generated with version 1, trained at version 2) trains 2
    more at staleness 2 (``rollout/carried_trained``), which the learner's check accepts; at batch
    3 the last 2 would be 3 old: their prompts are requeued and drawn first, and train in batch 3
    at version 2. Every prompt batch 0 drew trains exactly once. A producer resumed from batch 0's
    checkpoint state produces the same batch 1, one resumed from batch 2's the same batch 3."""
    pool = VersionedPool()
    prod, out, ch = _carry_producer(pool, ppr=8, bound=1, num_batches=4)
    b0, b1, b2, b3 = _step_batches(prod, out, ch, 4)
    assert b0.stats["rollout/surplus_carried"] == 6 and b0.stats["pairs/surplus_dropped"] == 0
    drawn0 = pool.drawn_indices[0][1]
    assert b1.stats["rollout/surplus_used"] == b1.stats["rollout/carried_trained"] == 2
    assert b1.stats["prompts/drawn"] == 0 and [g.weight_version for g in b1.groups] == [0, 0]
    # batch 2: two more version-0 groups, trained at version 2 (staleness 2 <= max_carry_staleness)
    assert b2.stats["rollout/carried_trained"] == 2 and b2.stats["prompts/drawn"] == 0
    assert [g.weight_version for g in b2.groups] == [0, 0] and b2.stats["rollout/requeued_stale"] == 0
    learner_batch, stale = _learner_batch(b2, version=2)
    assert learner_batch.num_units == 2 and stale["staleness/max"] == 2 and stale["staleness/dropped_pairs"] == 0
    # batch 3: the last two would be 3 old: requeued, drawn again first (fresh, version 2)
    assert b3.stats["rollout/requeued_stale"] == 2 and b3.stats["rollout/carried_trained"] == 0
    assert b3.stats["rollout/dropped_stale"] == 2   # their samples: discarded, not trained
    (k3, drawn3), = [d for d in pool.drawn_indices if d[0] == 3]
    assert drawn3[:2] == drawn0[-2:] and b3.stats["prompts/drawn"] == 8
    assert [g.prompt.index for g in b3.groups] == drawn0[-2:] and {g.weight_version for g in b3.groups} == {2}
    trained = [g.prompt.index for b in (b0, b1, b2, b3) for g in b.groups]
    assert sorted(trained) == sorted(drawn0) and len(set(trained)) == 8   # nothing lost, nothing twice

    for state, expected in ((b0, b1), (b2, b3)):   # a resumed run starts at its own version
        first = expected.index
        resumed, out2, ch2 = _carry_producer(VersionedPool(), first=first, num_batches=first + 1, bound=1,
                                             ppr=8, state=_checkpointed(state))
        (again,) = _step_batches(resumed, out2, ch2, 1)
        assert [(g.prompt.index, g.pair) for g in again.groups] == [(g.prompt.index, g.pair) for g in expected.groups]
        assert again.stats["rollout/requeued_stale"] == expected.stats["rollout/requeued_stale"]


def _learner_batch(batch, version):
    """The learner's side of ``batch`` at ``version`` (``trainer.loop._learner_batch``, default
    ``async`` section: max_staleness 1, max_carry_staleness null)."""
    from types import SimpleNamespace

    from megatron_rlhf.config import AlgorithmConfig, AsyncConfig
    from megatron_rlhf.rollout.staleness_control import StalenessController
    from megatron_rlhf.trainer.loop import _learner_batch as learner_batch

    cfg = SimpleNamespace(async_=AsyncConfig(), algorithm=AlgorithmConfig(), learner=SimpleNamespace(data_parallel=1))
    run = SimpleNamespace(cfg=cfg, pad_id=0, staleness=StalenessController(cfg.async_))
    return learner_batch(run, batch, version, version + 1)


def test_carry_surplus_off_drops_the_surplus_as_before():
    pool = VersionedPool()
    prod, out, ch = _carry_producer(pool, ppr=8, num_batches=1, carry_surplus=False)
    (b0,) = _step_batches(prod, out, ch, 1)
    assert b0.stats["pairs/surplus_dropped"] == 6 and b0.stats["rollout/surplus_carried"] == 0
    assert b0.producer_state["carry"] == {"surplus": {}, "parked": [], "requeued": {}}


def test_parked_requests_train_under_one_step_async_and_survive_a_checkpoint():
    """Two engines, waves of two requests of 2 prompts, one-step async (bound 1): once the first
    request of a wave fills the quota, the second is aborted and parked (2 tokens each). Batch 0's
    parked prompts continue in batch 1 (still version 0); batch 1's (version 0) continue first in
    batch 2 under version 1: their completions keep the 2 old tokens and logprobs, add 3 new ones
    and span versions 0 -> 1, and they train at version 2 (staleness 2 from the first token:
    ``rollout/partial_trained``), which the learner's check accepts. A producer resumed from
    batch 1's checkpoint state continues the same parked prompts with the same tokens."""
    pool = VersionedPool(num_workers=2, per_wave=2)
    prod, out, ch = _carry_producer(pool, partial=True, num_batches=3, bound=1, ppr=2)
    b0, b1, b2 = _step_batches(prod, out, ch, 3)
    parked = [[p["prompt"]["index"] for p in b.producer_state["carry"]["parked"]] for b in (b0, b1)]
    assert b0.stats["rollout/partial_parked"] == b1.stats["rollout/partial_parked"] == 2
    assert [g.prompt.index for g in b1.groups] == parked[0] and b1.stats["rollout/partial_trained"] == 2
    assert [g.prompt.index for g in b2.groups] == parked[1] and b2.stats["rollout/partial_trained"] == 2
    assert b2.stats["rollout/partial_resumed"] == 2 and b2.stats["rollout/requeued_stale"] == 0
    for g in b2.groups:
        for r in g.rollouts:
            c = r.completion
            assert len(c.logprobs) == len(c.token_ids) == 5
            assert c.token_ids == (1, 2, 7, 8, 9) and c.logprobs == (-0.1, -0.2, -0.7, -0.8, -0.9)
            assert (c.weight_version, c.weight_version_last) == (0, 1)
        assert g.weight_version == 0   # staleness counts from the oldest token
    _, stale = _learner_batch(b2, version=2)
    assert stale["staleness/max"] == 2 and stale["staleness/hist_2"] == 4 and stale["staleness/dropped_pairs"] == 0

    pool2 = VersionedPool(num_workers=2, per_wave=2)
    again, out2, ch2 = _carry_producer(pool2, partial=True, first=2, num_batches=3, bound=1, ppr=2,
                                       state=_checkpointed(b1))
    (b2_again,) = _step_batches(again, out2, ch2, 1)
    assert [x.prompt.index for x in pool2.continued] == parked[1]
    assert all(tuple(c.token_ids) == (1, 2) for x in pool2.continued for c in x.completions)
    assert [g.prompt.index for g in b2_again.groups] == parked[1]


def test_continued_parked_requests_hold_their_quota_slots_and_are_not_aborted_again():
    """A continuation slower than the fresh request beside it: in batch 1 the fresh request comes
    back first, but the two parked requests running hold the quota's two slots, so its groups go
    to the surplus instead of filling the batch (which would abort the continuations a second
    time, and the next batch would find them too old); the continuations train in batch 1 and the
    surplus in batch 2 (staleness 2), which then generates nothing."""
    pool = VersionedPool(num_workers=2, per_wave=2, resumed_last=True)
    prod, out, ch = _carry_producer(pool, partial=True, num_batches=3, bound=1, ppr=2)
    b0, b1, b2 = _step_batches(prod, out, ch, 3)
    parked0 = [p["prompt"]["index"] for p in b0.producer_state["carry"]["parked"]]
    assert len(parked0) == 2 and b1.stats["rollout/partial_parked"] == 0
    assert [g.prompt.index for g in b1.groups] == parked0 and b1.stats["rollout/partial_trained"] == 2
    assert b1.stats["rollout/surplus_carried"] == 2
    assert b2.stats["rollout/carried_trained"] == 2 and b2.stats["prompts/drawn"] == 0
    assert {g.weight_version for g in b2.groups} == {0}   # trained at version 2


def test_parked_requests_older_than_the_carry_bound_are_requeued_not_lost():
    """The same run with ``async.max_carry_staleness: 1`` (= max_staleness, the rule before issue
    35): batch 1's parked prompts (version 0) would train 2 old in batch 2, so their samples are
    discarded and the prompts requeued: drawn again first in batch 2, generated afresh with
    version 1, and trained there."""
    pool = VersionedPool(num_workers=2, per_wave=2)
    prod, out, ch = _carry_producer(pool, partial=True, num_batches=3, bound=1, ppr=2, carry_bound=1)
    b0, b1, b2 = _step_batches(prod, out, ch, 3)
    parked1 = [p["prompt"]["index"] for p in b1.producer_state["carry"]["parked"]]
    assert len(parked1) == 2 and b2.stats["rollout/requeued_stale"] == b2.stats["rollout/dropped_stale"] == 2
    assert [d for d in pool.drawn_indices if d[0] == 2][0][1] == parked1   # first drawn in batch 2
    assert [g.prompt.index for g in b2.groups] == parked1 and b2.stats["rollout/partial_trained"] == 0
    assert all((r.completion.token_ids, r.completion.weight_version) == ((1, 2, 3), 1)
               for g in b2.groups for r in g.rollouts)


def test_the_carry_state_keeps_requeued_prompts():
    """What :meth:`Carry.state_dict` writes (and a checkpoint keeps) brings the requeued prompts back."""
    import json

    from megatron_rlhf.rollout.carry import Carry

    carry = Carry(requeued={"math": _prompts("math", 3)})
    back = Carry.from_state_dict(json.loads(json.dumps(carry.state_dict())))
    assert back.requeued == carry.requeued
    assert back.take_requeued("math", 2) == _prompts("math", 2) and back.take_requeued("math", 5) == _prompts("math", 3)[2:]


@pytest.mark.parametrize("rounding", ["nearest", "down"])
def test_draws_follow_the_measured_yield_within_one_engine_wave(rounding):
    """One engine whose prompts train at a set yield of 1/4 (index % 4 == 0): nothing runs when a
    request is drawn, so each is sized still needed / yield_ema prompts (rounded half up, or
    down with at least 1), at most max_num_seqs // K = 12, with what earlier batches carried
    counted first; replayed here from the recorded draws and estimates. The estimate moves from
    its prior 0.5 toward 1/4."""
    import math

    pool = VersionedPool(every=4)
    prod, out, ch = _carry_producer(pool, num_batches=6, prompts_per_step=4, max_num_seqs=4 * 12,
                                    rounding=rounding)
    half = 0.5 if rounding == "nearest" else 0.0
    batches = _step_batches(prod, out, ch, 6)
    assert all(len(b.groups) == 4 for b in batches)
    carry, k_prev = 0, None
    for (size, rates), (k, indices) in zip(pool.draws, pool.drawn_indices):
        if k != k_prev:   # a new batch: carried groups count first
            used = min(4, carry)
            carry, got, k_prev = carry - used, used, k
            assert batches[k].stats["rollout/surplus_used"] == used
        assert size == min(12, max(1, math.floor((4 - got) / rates["math"] + half + 1e-9))), (k, size, got, rates)
        trained = sum(i % 4 == 0 for i in indices)
        carry += max(0, got + trained - 4)
        got = min(4, got + trained)
    assert pool.draws[0][0] == 8                                     # 4 needed / prior 0.5
    assert 0.1 < prod.rates["math"] < 0.45 and len(pool.draws) >= 6


class HighYieldPool(VersionedPool):
    """Seven prompts in eight train (index % 8 != 7): yield 7/8."""

    def _sample(self, p, j):
        ok = p.index % 8 != 7 and j == 0
        return Completion(token_ids=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop",
                          text="yes" if ok else "no", weight_version=self.version)


@pytest.mark.parametrize("rounding", ["nearest", "down"])
def test_draws_rounded_down_never_train_beyond_the_quota_at_a_high_yield(rounding):
    """Yield 7/8, quota 4: once the estimate is above 4/5 a rounded-down draw is at most the 4
    prompts still needed, so after the prior's first over-draw (8 prompts for 4 at the prior 0.5)
    nothing is carried out, and short batches take small top-up requests; rounded half up, 4 / 0.875
    = 4.57 rounds to 5 and groups beyond the quota keep coming."""
    pool = HighYieldPool()
    prod, out, ch = _carry_producer(pool, num_batches=12, prompts_per_step=4, rounding=rounding)
    batches = _step_batches(prod, out, ch, 12)
    assert all(len(b.groups) == 4 for b in batches)
    assert pool.draws[0][0] == 8
    later = sum(b.stats["rollout/surplus_carried"] for b in batches[3:])
    if rounding == "down":
        assert later == 0
        assert len(pool.draws) > 12 and prod.rates["math"] > 0.8   # top-ups: what rounding down costs
    else:
        assert later > 0


def test_draws_split_the_need_over_the_free_engines():
    """Two free engines share what the batch needs: the first gets half the prompts, the second
    the rest (the first's running prompts count at their expected yield)."""
    import math

    pool = VersionedPool(every=1, num_workers=2, per_wave=2)
    prod, out, ch = _carry_producer(pool, num_batches=1, prompts_per_step=8)
    _step_batches(prod, out, ch, 1)
    (a, _), (b, _) = pool.draws[:2]
    assert a == math.ceil(math.ceil(8 / 0.5) / 2) == 8              # 16 needed, 2 engines
    assert b == math.ceil((8 - a * 0.5) / 0.5) == 8                  # 8 running * 0.5 = 4 expected


def test_hand_set_prompts_per_request_keeps_the_fixed_burst():
    pool = VersionedPool(every=4)
    prod, out, ch = _carry_producer(pool, num_batches=2, ppr=3, prompts_per_step=4)
    _step_batches(prod, out, ch, 2)
    assert {size for size, _ in pool.draws} == {3}


def test_yield_estimate_replaces_its_prior_fast_then_moves_as_an_ema_by_hand():
    """update_yield: prior 0.5 worth 4 prompts; 15 of 16 trainable -> w = max(1 - (31/32)^16,
    16/20) = 0.8, 0.2 * 0.5 + 0.8 * 0.9375 = 0.85; then 2 of 2 after 16 seen -> w = max(1 -
    (31/32)^2 = 0.0615, 2/22 = 0.0909) = 1/11, 0.85 * 10/11 + 1/11 = 0.8636; 0 of 10 after 1000
    seen -> w = 1 - (31/32)^10 = 0.2720, 0.03 * 0.7280 = 0.02184; the floor is 0.02; bad counts
    are refused."""
    from megatron_rlhf.rollout.producer import update_yield

    first = update_yield(0.5, 0, 15, 16)
    assert first == pytest.approx(0.85)
    assert update_yield(first, 16, 2, 2) == pytest.approx(0.85 * 10 / 11 + 1 / 11)
    assert update_yield(0.03, 1000, 0, 10) == pytest.approx(0.02184, abs=1e-5)
    assert update_yield(0.02, 1000, 0, 10) == 0.02
    with pytest.raises(ValueError, match="trainable"):
        update_yield(0.5, 0, 3, 2)
