"""The hang watchdog (issue 16): a step slower than k x the median step is reported once, with
the pending remote calls and the Python stack of every Ray worker and the driver."""

from __future__ import annotations

import socket
import time

import pytest


def _dog(**kw):
    from megatron_rlhf.trainer.watchdog import HangWatchdog

    logs: list[str] = []
    args = dict(factor=3.0, min_steps=3, pending_calls=lambda: ["learner: train_step of step 5 (waiting 9 s)"],
                dump_stacks=lambda: "STACKS", log=logs.append, poll_s=3600)   # checked by hand below
    args.update(kw)
    return HangWatchdog(**args), logs


def _finish_steps(dog, seconds: list[float]) -> None:
    for i, s in enumerate(seconds, 1):
        dog.start_step(i)
        dog._t0 -= s          # as if the step had started s seconds ago
        dog.end_step()


def test_watchdog_reports_a_step_over_k_times_the_median_once_with_calls_and_stacks():
    dog, logs = _dog()
    _finish_steps(dog, [1.0, 2.0, 1.5])          # median 1.5 s, k = 3 -> 4.5 s
    dog.start_step(4)
    dog._t0 -= 4.0
    assert not dog.check() and not logs          # 4 s: not yet
    dog._t0 -= 1.0
    assert dog.check()                           # 5 s > 4.5 s
    assert "step 4 has run 5 s" in logs[0] and "train_step of step 5" in logs[0]
    assert "async.watchdog_factor=3" in logs[0] and "STACKS" in logs[1]
    assert not dog.check() and len(logs) == 2    # once per step
    dog.end_step()
    dog.start_step(5)
    dog._t0 -= 100.0
    assert dog.check() and len(logs) == 4        # a later hung step is reported again
    dog.close()


def test_watchdog_waits_for_min_steps_and_is_off_at_factor_0():
    dog, logs = _dog()
    _finish_steps(dog, [1.0, 1.0])
    dog.start_step(3)
    dog._t0 -= 1000.0
    assert not dog.check() and not logs          # 2 finished steps < min_steps
    dog.close()
    off, _ = _dog(factor=0.0)
    assert off._thread is None


def test_watchdog_factor_is_validated():
    from megatron_rlhf.config import AsyncConfig, ConfigError

    with pytest.raises(ConfigError, match="async.watchdog_factor"):
        AsyncConfig(watchdog_factor=0.5)
    with pytest.raises(ConfigError, match="async.watchdog_min_steps"):
        AsyncConfig(watchdog_min_steps=0)


@pytest.mark.timeout(300)
def test_stack_dump_shows_where_a_busy_ray_actor_is(tmp_path):
    """A Ray actor stuck in a method: its stack (and the driver's) comes back by SIGUSR2 +
    faulthandler, registered by the runtime_env's worker_process_setup_hook."""
    import ray

    from megatron_rlhf.runtime import process_env
    from megatron_rlhf.trainer.watchdog import STACKS_ENV, dump_actor_stacks

    folder = tmp_path / "stacks"
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING", runtime_env={
        "env_vars": {**process_env(), STACKS_ENV: str(folder)},
        "worker_process_setup_hook": "megatron_rlhf.utils.stacks.register_stack_dump"})
    try:
        @ray.remote(num_cpus=0)
        class Sleeper:
            def stuck_in_here(self, s: float) -> None:
                time.sleep(s)

            def ready(self) -> bool:
                return True

        a = Sleeper.remote()
        ray.get(a.ready.remote(), timeout=120)
        ref = a.stuck_in_here.remote(60)
        time.sleep(2)
        text = dump_actor_stacks(folder, wait_s=2)
        assert "in stuck_in_here" in text, text[-3000:]
        assert "--- driver" in text and "in dump_actor_stacks" in text
        ray.kill(a)
        del ref
    finally:
        ray.shutdown()


def test_prune_removes_only_empty_stack_files_and_the_folder_once_empty(tmp_path):
    from megatron_rlhf.trainer.watchdog import prune_empty_stack_files

    folder = tmp_path / "stacks-1"
    folder.mkdir()
    (folder / "host-1.txt").write_text("")
    (folder / "host-2.txt").write_text("Thread 0x1 (most recent call first):\n")
    assert prune_empty_stack_files(folder) == 1
    assert [f.name for f in folder.iterdir()] == ["host-2.txt"]   # a real dump stays
    (folder / "host-2.txt").write_text("")
    assert prune_empty_stack_files(folder) == 1 and not folder.exists()
    assert prune_empty_stack_files(None) == 0 and prune_empty_stack_files(tmp_path / "missing") == 0


@pytest.mark.timeout(180)
def test_stack_dump_reaches_the_math_verify_pool_workers(tmp_path):
    """The driver's math-verify pool workers are not Ray workers: their initializer registers the
    same dump, so the watchdog's text has a section per pool worker, with its stack (idle in the
    pool's worker loop), labelled as such; after the pool is gone its PIDs are not signalled."""
    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.trainer.watchdog import _signal_local, dump_actor_stacks

    folder = tmp_path / "stacks"
    reward = MathVerifyReward(num_workers=1, stacks_dir=folder)
    try:
        assert reward(["The answer is 4.", "5"], ["4", "4"]) == [1.0, 0.0]
        pids = [p.pid for p in reward._pool._processes.values()]
        text = dump_actor_stacks(folder, wait_s=2)
        for pid in pids:
            section = text.split(f"--- math-verify worker {socket.gethostname()}-{pid} ---", 1)
            assert len(section) == 2, text[-3000:]
            assert "concurrent/futures/process.py" in section[1].split("\n--- ", 1)[0], text[-3000:]
        assert "--- driver" in text
    finally:
        reward.close()
    assert _signal_local(str(folder), socket.gethostname()) == []
