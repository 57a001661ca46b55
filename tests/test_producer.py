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
from megatron_rlhf.trainer.rollout import RolloutProducer, WeightChannel
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


def _run(prod, out, n):
    t = threading.Thread(target=prod.run, daemon=True)
    t.start()
    batches = []
    for _ in range(n):
        item = out.get(timeout=120)
        if isinstance(item, BaseException):
            raise item
        batches.append(item)
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
    prod, out = _producer(scorers, num_batches=1, max_prompts_per_step=8, weights=(1.0, 0.0001))
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
