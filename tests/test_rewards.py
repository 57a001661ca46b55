"""MathVerifyReward: math-verify answers scored in worker processes, with timeouts."""

import threading
import time

import pytest

from megatron_rlhf.rewards import REWARDS, MathVerifyReward, make_reward
from megatron_rlhf.rewards.math_verify import extract_answer_text

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
              "clips altogether in April and May.\n#### 72")
# 10^(10^(10^10)) cannot be evaluated: parse/verify runs until a timeout stops it
PATHOLOGICAL = "\\boxed{10^{10^{10^{10}}}}"


@pytest.fixture(scope="module")
def reward():
    r = MathVerifyReward(num_workers=2, timeout_s=1.0, grace_s=1.0)
    yield r
    r.close()


@pytest.mark.timeout(120)
def test_known_answer_formats_score_as_expected(reward):
    cases = [  # (completion, gold, expected)
        ("1,000", "1000", 1.0),
        ("The answer is 1000", "1,000", 1.0),
        ("\\boxed{1/2}", "0.5", 1.0),
        ("So she sold \\boxed{0.5} of them.", "1/2", 1.0),
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 72", GSM8K_GOLD, 1.0),  # GSM8K gold: text after '####'
        ("Joan gave 70 - 27 = 43 shells.\n#### 43", "43.0", 1.0),  # float gold, compared numerically
        ("43.0", "43", 1.0),
        ("so the total is 72 clips.", "72", 1.0),  # plain final number, no marker
        # the marker decides, whatever numbers come before it
        ("We have 48/2 = 24. Then 48 + 24 = 72.\n#### 72", "72", 1.0),
        ("We have 48/2 = 24. Then 48 + 24 = 72.\n#### 24", "72", 0.0),
        ("#### 71", "72", 0.0),
        ("\\boxed{1/3}", "0.5", 0.0),
        ("I do not know.", "72", 0.0),
        ("The answer is ####", "72", 0.0),  # marker with nothing after it
        ("", "72", 0.0),
        ("$\\boxed{1/2}$", "0.5", 1.0),
        ("#### $1,000\nSo she has 5 left.", "1000", 1.0),  # first line after the marker
        ("Maria has 3 x 7 = 21 eggs.\n#### 2\nThe answer is 21", "21", 0.0),
        # free text: the LAST number counts, not math-verify's pick of a stray number/expression
        ("Take 5 steps. Then we are done, the result is 12.", "12", 1.0),
        ("Take 5 steps. Then we are done, the result is 12.", "5", 0.0),
        ("Since the equation is represented by the conversion factor 6/3.", "2", 0.0),
        ("she needs 187 - 134 marbles for her second purchase.", "53", 0.0),
        ("The temperature fell to -4 degrees.", "-4", 1.0),
    ]
    got = reward([c for c, _, _ in cases], [g for _, g, _ in cases])
    assert got == [e for _, _, e in cases], [(c, g, e, s) for (c, g, e), s in zip(cases, got) if e != s]


@pytest.mark.timeout(60)
def test_answer_text_is_after_last_marker_else_boxed_else_last_number():
    assert extract_answer_text("a #### 1\nb #### 2 ") == "2"
    assert extract_answer_text("a #### \n\n 72 clips\nmore 5") == "72 clips"
    assert extract_answer_text("x \\boxed{1} then \\boxed{\\frac{1}{2}} ok") == "\\boxed{\\frac{1}{2}} ok"
    assert extract_answer_text("no marker 5, then 1,000.") == "1,000"
    assert extract_answer_text("GL-3 mapping") == "3"
    assert extract_answer_text("7 apples, Citicac1") == "7"
    assert extract_answer_text("no numbers") == ""


@pytest.mark.timeout(120)
def test_calling_from_a_thread_scores_correctly(reward):
    # math-verify's signal.alarm raises off the main thread; the pool must hide that
    out = []
    t = threading.Thread(target=lambda: out.append(reward(["#### 72", "#### 5", "\\boxed{1/2}"],
                                                          ["72", "72", "0.5"])))
    t.start()
    t.join(60)
    assert out == [[1.0, 0.0, 1.0]]


@pytest.mark.timeout(120)
def test_pathological_input_times_out_scores_zero_and_is_counted(reward):
    before = reward.num_timeouts
    t0 = time.monotonic()
    got = reward([PATHOLOGICAL, "#### 72", "#### 3"], ["1", "72", "3"])
    dt = time.monotonic() - t0
    assert got == [0.0, 1.0, 1.0]
    assert reward.num_timeouts == before + 1
    assert dt < 1.0 + 1.0 + 10.0  # timeout + grace + pool restart, not math-verify's own 5 s x2
    assert reward(["#### 72"], ["72"]) == [1.0]  # usable afterwards


@pytest.mark.timeout(120)
def test_dead_worker_rebuilds_the_pool(reward, capfd):
    """kill -9 of every math-verify worker: the pool is rebuilt, the items are scored, and the
    recovery is counted (``num_restarts``: the run's ``recovery/reward_worker_restarts``) and
    logged in one line."""
    import os
    import signal

    reward(["#### 1"], ["1"])  # make sure a pool exists
    before = reward.num_restarts
    for p in list(reward._pool._processes.values()):
        os.kill(p.pid, signal.SIGKILL)
    time.sleep(0.5)
    capfd.readouterr()
    assert reward(["#### 72", "#### 7"], ["72", "7"]) == [1.0, 1.0]
    assert reward.num_restarts > before
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "math-verify" in ln]
    assert len(lines) == reward.num_restarts - before and all(
        "a worker process died; the worker pool is rebuilt (restart" in ln for ln in lines), lines


@pytest.mark.timeout(30)
def test_registry_and_argument_errors():
    assert REWARDS["math_verify"] is MathVerifyReward
    with pytest.raises(KeyError, match="known"):
        make_reward("no_such_reward")
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifyReward(num_workers=0)
    r = MathVerifyReward()
    with pytest.raises(ValueError, match="one gold answer per completion"):
        r(["1", "2"], ["1"])
    r.close()


@pytest.mark.timeout(30)
def test_math_verify_pool_size_follows_the_driver_cores_unless_configured(monkeypatch):
    """Issue 21 item 8: ``rewards.math_verify_workers`` (0 = from the driver node's cores:
    min(32, cores - 1), at least 1); a negative value is refused naming the key."""
    from pathlib import Path

    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.rewards.math_verify import default_num_workers

    assert [default_num_workers(0, cores=c) for c in (1, 2, 3, 16, 33, 64, 192)] == [1, 1, 2, 15, 32, 32, 32]
    assert default_num_workers(6, cores=2) == 6
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)))
    assert default_num_workers(0) == 11
    demo = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml"
    assert load_config(demo).rewards.math_verify_workers == 0
    assert load_config(demo, ["rewards.math_verify_workers=4"]).rewards.math_verify_workers == 4
    with pytest.raises(ConfigError, match="rewards.math_verify_workers"):
        load_config(demo, ["rewards.math_verify_workers=-1"])
