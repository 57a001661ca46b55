"""``async.max_staleness: auto`` (``rollout.staleness_control``), pure Python: the controller fed
metrics rows shaped like the loop's (a real row of the demo's grpo run, ``bench/results``, with its
times and off-policy metrics changed), the config's checks, and the producer's handshake when the
bound is lowered while it waits (a fake pool, no vLLM).

The pipeline is modelled as the loop runs it: the bound set after step s reaches the batch of step
s + 2 (the batch of step s + 1 is already generating), which stamps it in ``staleness/bound``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from megatron_rlhf.config import AsyncConfig, ConfigError, load_config
from megatron_rlhf.rollout.staleness_control import BOUND_STAT, CARRY_BOUND_STAT, REASONS, StalenessController
from megatron_rlhf.types import Completion, Prompt, Rollout, RolloutBatch, RolloutGroup
from tests.test_producer import VersionedPool

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]
# a real row: step 6 of the demo's grpo run at N = 4 (training-bound: the generator idles 24 of 25 s)
TEMPLATE = json.loads((REPO / "bench/results/seeds_repro/B_grpo_N4.json").read_text())["per_step"][5]


def _row(step: int, *, train_s: float = 25.0, gen_s: float = 9.0, mult: float | None = None,
         ess: float | None = None, masked: float | None = None) -> dict:
    """The template row as one step of a run where generation takes ``gen_s`` and training
    ``train_s`` (the slower side sets the step; the faster one idles the difference)."""
    step_s = max(train_s, gen_s)
    row = {**TEMPLATE, "step": step, "time/train_s": train_s, "time/gen_s": gen_s, "time/step_s": step_s,
           "time/learner_idle_s": max(0.0, gen_s - train_s), "time/generator_idle_s": max(0.0, train_s - gen_s)}
    for key, value in (("logprobs/token_mult_prob_error", mult), ("is/ess", ess), ("is/masked_frac", masked)):
        if value is not None:
            row[key] = value
    return row


METRICS = ("mult_prob_error", "is_ess", "is_masked_frac")
WHYS = [f"off_policy:{m}" for m in METRICS] + ["generator_ahead"]
KNOWN = {code.replace("<why>", w).replace("<metric>", m) for code in REASONS for w in WHYS for m in METRICS}
"""Every reason code the documented table (``REASONS``) allows, placeholders filled in."""


class _Run:
    """The controller in the loop: the bound set after step s is stamped on step s + 2's batch."""

    def __init__(self, cfg: AsyncConfig, state: dict | None = None):
        self.changes: list[tuple[int, int]] = []
        self.lines: list[str] = []
        self.ctl = StalenessController(cfg, state=state, on_change=lambda b, c: self.changes.append((b, c)),
                                       log=self.lines.append)
        self.after = [self.ctl.bound]   # the bound in force after step s (index s; 0: the start)
        self.rows: list[dict] = []

    def step(self, **times) -> dict:
        s = len(self.after)
        row = _row(s, **times)
        made_under = self.after[max(0, s - 2)]
        row[BOUND_STAT], row[CARRY_BOUND_STAT] = made_under, made_under + 1
        row.update(self.ctl.update(row))
        assert row["async/max_staleness_reason"] in KNOWN, row["async/max_staleness_reason"]
        self.after.append(row["async/max_staleness"])
        self.rows.append(row)
        return row

    def reasons(self) -> list[str]:
        return [r["async/max_staleness_reason"] for r in self.rows]


SLOW_GENERATOR = {"gen_s": 40.0, "train_s": 25.0, "mult": 1.02}   # the learner waits 15 of 40 s
FAST_GENERATOR = {"gen_s": 9.0, "train_s": 25.0, "mult": 1.02}    # the template's own times


def test_a_slowed_generator_raises_the_bound_one_at_a_time_and_stops_at_the_cap():
    run = _Run(AsyncConfig(max_staleness="auto"))
    assert run.ctl.bound == 1 and run.ctl.floor == 1 and run.ctl.cap == 4
    for _ in range(16):
        run.step(**SLOW_GENERATOR)
    bounds = [r["async/max_staleness"] for r in run.rows]
    assert bounds == sorted(bounds) and bounds[-1] == 4          # up only, to the cap, never past it
    assert run.reasons().count("up:learner_wait") == 3
    assert run.reasons()[0] == "warmup" and run.reasons()[-1] == "at_cap:learner_wait"
    assert "settling" in run.reasons()   # the batches generated under the old bound do not vote
    assert run.changes == [(2, 3), (3, 4), (4, 5)]                # the producer got each move
    assert len(run.lines) == 3 and "async.max_staleness 1 -> 2 (learner_wait: learner waited 38%" in run.lines[0]
    # every move needs async.auto_patience = 2 counted votes under the bound in force
    for i, r in enumerate(run.rows):
        if r["async/max_staleness_reason"].startswith("up:"):
            assert run.rows[i - 1]["async/max_staleness_reason"] == "vote_up:learner_wait"


@pytest.mark.parametrize("cost,reason", [({"mult": 1.25}, "mult_prob_error"), ({"ess": 0.5}, "is_ess"),
                                         ({"masked": 0.2}, "is_masked_frac")])
def test_a_forced_mismatch_lowers_the_bound_to_the_floor_even_while_the_learner_waits(cost, reason):
    run = _Run(AsyncConfig(max_staleness="auto"), state={"bound": 4})
    for _ in range(14):
        run.step(**{**SLOW_GENERATOR, "mult": 1.02, **cost})
    bounds = [r["async/max_staleness"] for r in run.rows]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] == 1
    assert run.reasons().count(f"down:off_policy:{reason}") == 3
    assert run.reasons()[-1] == f"at_floor:off_policy:{reason}"
    assert run.changes == [(3, 4), (2, 3), (1, 2)]


def test_the_floor_is_the_handshake_rule_sync_interval_minus_one():
    cfg = AsyncConfig(max_staleness="auto", sync_interval=4)
    run = _Run(cfg)
    assert run.ctl.bound == 3 == cfg.staleness_bound   # it starts at the floor
    for _ in range(8):
        run.step(**{**FAST_GENERATOR, "mult": 1.3})
    assert all(r["async/max_staleness"] == 3 for r in run.rows) and not run.changes
    assert run.reasons()[-1] == "at_floor:off_policy:mult_prob_error"
    with pytest.raises(ConfigError, match=r"async\.max_staleness_cap.* 3 with async\.max_staleness: auto.*"
                                          r"async\.sync_interval"):
        AsyncConfig(max_staleness="auto", sync_interval=4, max_staleness_cap=2)
    # a restored bound outside this config's range is clamped into it
    assert StalenessController(cfg, state={"bound": 1}).bound == 3
    assert StalenessController(AsyncConfig(max_staleness="auto", max_staleness_cap=2), state={"bound": 4}).bound == 2


def test_hysteresis_no_flapping_on_alternating_steps_warmup_and_settling_do_not_vote():
    run = _Run(AsyncConfig(max_staleness="auto", auto_patience=2))
    assert run.step(**SLOW_GENERATOR)["async/max_staleness_reason"] == "warmup"   # cold start: not a vote
    for _ in range(6):   # a waiting step, then one the generator waited in: the count restarts each time
        run.step(**SLOW_GENERATOR)
        run.step(**{**SLOW_GENERATOR, "gen_s": 26.0})   # the learner waits 4%: no vote ("hold")
    assert {r["async/max_staleness"] for r in run.rows} == {1} and not run.changes
    assert set(run.reasons()[1:]) == {"vote_up:learner_wait", "hold"}
    # two in a row move it; the next batch was made under bound 1: it does not count
    run.step(**SLOW_GENERATOR)
    assert run.step(**SLOW_GENERATOR)["async/max_staleness_reason"] == "up:learner_wait"
    mismatch = {**SLOW_GENERATOR, "mult": 1.5}
    assert run.step(**mismatch)["async/max_staleness_reason"] == "settling"   # measured under the old bound
    assert run.step(**mismatch)["async/max_staleness_reason"] == "vote_down:off_policy:mult_prob_error"
    assert run.step(**mismatch)["async/max_staleness_reason"] == "down:off_policy:mult_prob_error"
    assert run.changes == [(2, 3), (1, 2)]


def test_a_generator_with_slack_brings_the_bound_back_down():
    """Training-bound (the template's own times): a wide bound buys nothing, so it comes down to
    the floor; a learner wait between half the threshold and the threshold holds it."""
    run = _Run(AsyncConfig(max_staleness="auto"), state={"bound": 3})
    for _ in range(10):
        run.step(**FAST_GENERATOR)
    assert run.rows[-1]["async/max_staleness"] == 1 and run.changes == [(2, 3), (1, 2)]
    assert run.reasons().count("down:generator_ahead") == 2 and run.reasons()[-1] == "at_floor:generator_ahead"
    held = _Run(AsyncConfig(max_staleness="auto"), state={"bound": 3})
    for _ in range(6):   # learner waits 7.4% (over 5%, under 10%), the generator 0%: no vote
        held.step(gen_s=27.0, train_s=25.0, mult=1.02)
    assert set(held.reasons()[1:]) == {"hold"} and held.rows[-1]["async/max_staleness"] == 3


def test_a_fixed_bound_is_in_every_row_and_never_moves():
    for cfg, bound in ((AsyncConfig(max_staleness=2, sync_interval=2), 2), (AsyncConfig(sync=True), 0),
                       (AsyncConfig(), 1)):
        run = _Run(cfg)
        for _ in range(5):
            run.step(**SLOW_GENERATOR)
        assert [(r["async/max_staleness"], r["async/max_staleness_reason"]) for r in run.rows] == [(bound, "fixed")] * 5
        assert not run.changes
    # auto in a debug mode (nothing trains against the generator): the floor, fixed
    off = StalenessController(AsyncConfig(max_staleness="auto"), active=False)
    assert off.update(_row(2, **SLOW_GENERATOR)) == {"async/max_staleness": 1, "async/max_staleness_reason": "fixed"}


def test_the_state_resumes_the_bound_and_the_vote_count():
    run = _Run(AsyncConfig(max_staleness="auto"))
    for _ in range(5):
        run.step(**SLOW_GENERATOR)
    assert run.reasons()[-1] == "vote_up:learner_wait"   # a vote counted toward the next rise
    state = json.loads(json.dumps(run.ctl.state_dict()))   # through trainer_state.json
    assert state == {"bound": 2, "votes": 1, "direction": 1}
    resumed = _Run(AsyncConfig(max_staleness="auto"), state=state)
    assert resumed.ctl.bound == 2
    resumed.after = run.after[:]   # continue the same run: the next batches were made under 2
    resumed.ctl._warm = True       # (as if the session's first step were behind it)
    assert resumed.step(**SLOW_GENERATOR)["async/max_staleness_reason"] == "up:learner_wait"
    assert resumed.changes == [(3, 4)]


def test_the_learner_checks_a_batch_against_the_bounds_it_was_generated_under():
    def group(version):
        c = Completion(token_ids=(1, 2), logprobs=(-1.0, -1.0), finish_reason="stop", text="ab",
                       weight_version=version)
        p = Prompt(index=version, task="math", token_ids=(5,))
        return RolloutGroup(prompt=p, rollouts=(Rollout(p, c, 1.0), Rollout(p, c, 0.0)))

    ctl = StalenessController(AsyncConfig(max_staleness="auto"), state={"bound": 3})
    batch = RolloutBatch(index=4, weight_version=1, groups=tuple(group(v) for v in (4, 3, 2, 1)),
                         sampler_state={}, rng_state=None, stats={BOUND_STAT: 2, CARRY_BOUND_STAT: 3})
    kept, metrics, fresh, carry = ctl.split(batch, learner_version=5, unit="group")
    assert (fresh, carry) == (2, 3)   # the stamps, not the bound in force now (3, 4)
    assert [g.prompt.index for g in kept] == [4, 3, 2] and metrics["staleness/dropped_pairs"] == 1
    assert [k for k in metrics if k.startswith("staleness/hist_") and k[-1].isdigit()] == \
        [f"staleness/hist_{d}" for d in range(6)]   # 0 .. carry bound of the cap: the same keys every step
    fixed = StalenessController(AsyncConfig(max_staleness=1))
    assert fixed.bounds(batch) == (1, 2)   # a fixed bound: as configured (replayed batches too)


def test_auto_in_the_config_and_its_errors_name_the_key_and_the_fix():
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", ["async.max_staleness=auto"]).async_
    assert cfg.max_staleness == "auto" and cfg.staleness_bound == 1 and cfg.max_staleness_cap == 4
    assert cfg.carry_staleness_bound == 2
    for override, pattern in [
            (["async.max_staleness=atuo"], r"'async\.max_staleness' = 'atuo'.*did you mean 'auto'"),
            (["async.max_staleness=auto", "async.sync=true"], r"'async\.max_staleness' = 'auto'.*async\.sync=false"),
            (["async.max_staleness=auto", "async.sync_interval=7"], r"'async\.max_staleness_cap' = 4.*>= .* = 6"),
            (["async.max_staleness=auto", "async.max_carry_staleness=3"], r"'async\.max_carry_staleness' = 3.*= 4"),
            (["async.auto_learner_wait_frac=1.0"], r"'async\.auto_learner_wait_frac'.*\(0, 1\)"),
            (["async.auto_max_mult_prob_error=0.9"], r"'async\.auto_max_mult_prob_error'.*>= 1")]:
        with pytest.raises(ConfigError, match=pattern):
            load_config(REPO / "configs" / "ci_tiny.yaml", override)


# ----------------------------------------------------------------------------- the producer's side
class _Pool(VersionedPool):
    """One engine answering "a" / "ab" (char parity: one of each, so every prompt pairs) at the
    version it holds; pushes just take the version (``VersionedPool``'s)."""

    def state_dict(self):
        return {}

    def stream(self, n, draw, refresh=None, **_):
        while prompts := draw():
            yield prompts, [[Completion(token_ids=(1,) * (1 + j % 2), logprobs=(-1.0,) * (1 + j % 2),
                                        finish_reason="stop", text="ab"[:1 + j % 2], weight_version=self.version)
                             for j in range(n)] for _ in prompts]


def test_a_bound_lowered_while_the_producer_waits_makes_it_wait_for_the_newer_weights():
    from megatron_rlhf.config import AlgorithmConfig, GeneratorConfig
    from megatron_rlhf.data.mix import MultiTaskSampler
    from megatron_rlhf.generator.weight_sync import PublishedWeights
    from megatron_rlhf.rollout.pairs import select_pair
    from megatron_rlhf.rollout.producer import RolloutProducer, WeightChannel

    prompts = [Prompt(index=i, task="math", token_ids=(5, 6 + i), text=f"q{i}") for i in range(20)]
    channel, out = WeightChannel(PublishedWeights(version=0)), queue.Queue(maxsize=1)
    prod = RolloutProducer(
        pool=_Pool(), sampler=MultiTaskSampler({"math": prompts}, {"math": 1.0}, seed=0),
        reward_fns={"math": lambda ps, texts: [float(len(t) % 2 == 0) for t in texts]}, pair_fn=select_pair,
        channel=channel, out_queue=out, algorithm_cfg=AlgorithmConfig(samples_per_prompt=2, prompts_per_step=1),
        generator_cfg=GeneratorConfig(prompts_per_request=1), staleness_bound=2, carry_staleness_bound=3,
        first_batch=0, num_batches=4, min_version=0, seed=0, timeout_s=30)
    thread = threading.Thread(target=prod.run, daemon=True)
    thread.start()

    def phase_is(text):
        deadline = time.monotonic() + 20
        while prod.phase != text:
            assert time.monotonic() < deadline, f"producer phase {prod.phase!r}, expected {text!r}"
            time.sleep(0.01)

    try:
        first = [out.get(timeout=20) for _ in range(3)]   # batches 0..2 need version >= 0: at once
        assert [b.stats[BOUND_STAT] for b in first] == [2, 2, 2] and first[0].stats[CARRY_BOUND_STAT] == 3
        phase_is("batch 3: waiting for weight version >= 1")   # 3 - bound 2
        prod.set_bound(1, 2)                                   # lowered while it waits
        channel.publish(PublishedWeights(version=1))
        phase_is("batch 3: waiting for weight version >= 2")   # 3 - bound 1: it waits on
        assert out.empty()
        channel.publish(PublishedWeights(version=2))
        last = out.get(timeout=20)
        assert last.index == 3 and (last.stats[BOUND_STAT], last.stats[CARRY_BOUND_STAT]) == (1, 2)
        assert last.stats["generator/weight_version"] == 2     # staleness 1 when trained at version 3
        with pytest.raises(ValueError, match="integers >= 0"):
            prod.set_bound(-1, 0)
    finally:
        prod.stop_event.set()
        channel.close()
        thread.join(timeout=10)
