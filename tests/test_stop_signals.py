"""Stopping a run the usual ways writes a checkpoint (issue 17).

A signal to the driver's whole process group (Ctrl-C in a terminal, ``timeout``, ``kill -- -PGID``)
must not kill the embedded Ray cluster or the math-verify pool under the driver: the driver
finishes its step, writes the checkpoint (made slow here by the test hook ``MRLHF_TEST_SLOW_SAVE_S``,
so the Ray head's processes, GCS and raylet included, are checked alive 5 s after the signal while
the driver still uses them), exits 0, and stops them itself. The real ``train.py`` runs as a subprocess in a session of its own, on a
tiny random Llama (``configs/ci_tiny.yaml``, ``tests.plugins:char_parity`` reward).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import checkpoint_steps, metrics_steps
from tests.test_tensorboard import assert_tensorboard_matches_jsonl

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    import psutil

    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _ray_core(pids: set[int]) -> set[int]:
    """The Ray head's long-lived processes among ``pids``: ``ray start``, the GCS, the raylet."""
    import psutil

    out = set()
    for pid in pids:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "gcs_server" in cmd or "raylet/raylet" in cmd or " start --head" in cmd:
            out.add(pid)
    return out


def _train(model_dir: Path, out_dir: Path, log: Path, *extra: str, slow_save_s: float = 0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    env["MRLHF_TEST_SLOW_SAVE_S"] = str(slow_save_s)
    cmd = [sys.executable, "train.py", "--config", "configs/ci_tiny.yaml", f"model.source={model_dir}",
           f"run.output_dir={out_dir}", "run.name=stop", "tasks.0.reward=tests.plugins:char_parity",
           "logging.progress=false", "checkpoint.interval=0", "checkpoint.export_hf=false", *extra]
    with open(log, "ab") as f:   # a session of its own: the group signal reaches this run only
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _signal_group_after_first_step(proc: subprocess.Popen, run: Path, log: Path, sig: int,
                                   timeout_s: float = 600) -> tuple[set[int], int]:
    """Wait for one more metrics row, then send ``sig`` to the run's process group; returns the run's
    helper PIDs (Ray head session + the driver's children) seen just before, and the last step."""
    from megatron_rlhf.runtime import session_pids

    before = len(metrics_steps(run))
    deadline = time.monotonic() + timeout_s
    while len(metrics_steps(run)) <= before:
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no new step in {timeout_s} s\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    head = re.findall(r"local Ray head pid (\d+)", log.read_text())
    assert head, log.read_text()[-3000:]
    helpers = set(session_pids(int(head[-1]))) | _descendants(proc.pid)
    assert len(helpers) >= 4, helpers   # ray start, GCS, raylet, actors, ...
    os.killpg(proc.pid, sig)
    return helpers, metrics_steps(run)[-1]


def _stop_with_group_signal(model_dir: Path, tmp_path: Path, log: Path, num_steps: int,
                            sig: signal.Signals, slow_save_s: float) -> tuple[set[int], int, str]:
    """Start (or resume) the run, send ``sig`` to its whole process group after a step: Ray outlives
    the signal (the checkpoint takes ``slow_save_s``), the driver finishes the step and exits 0.
    Returns the run's helper PIDs, the last step at the signal and the driver log."""
    proc = _train(model_dir, tmp_path, log, f"run.num_steps={num_steps}", slow_save_s=slow_save_s)
    helpers, at = _signal_group_after_first_step(proc, tmp_path / "stop", log, sig)
    core = _ray_core(helpers)
    time.sleep(5)
    assert len(core) == 3 and _alive(core) == core and proc.poll() is None, "Ray died of the group signal"
    rc = _finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert f"signal {sig.name}: finishing this step" in text
    return helpers, at, text


def _finish(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"train.py did not exit within {timeout_s} s\n{log.read_text()[-4000:]}")


@pytest.mark.timeout(1500)
def test_group_sigterm_then_sigint_each_checkpoint_exit_0_and_leave_no_process(tiny_llama_dir, tmp_path):
    run = tmp_path / "stop"
    log = tmp_path / "train.log"
    num_steps = 8   # margin: resumed steps of the tiny model take about a second each

    # 1. SIGTERM to the whole group (timeout, kill -- -PGID) while the run is at step >= 1; the
    #    stop checkpoint is made slow (20 s) so that Ray's processes are seen alive 5 s after the
    #    signal, while the driver still needs them (a 65 s save, which also outlasted the 60 s a
    #    driver survives a dead GCS, passed in session 5; CI time is counted; the save starts after
    #    the signal, so 12 s keeps 7 s of margin past the 5 s check)
    helpers, at, text = _stop_with_group_signal(tiny_llama_dir, tmp_path, log, num_steps, signal.SIGTERM, 12)
    first = metrics_steps(run)
    assert first[-1] >= at and checkpoint_steps(run) == [first[-1]] and first[-1] < num_steps, (first, text[-3000:])
    assert not _alive(helpers), f"left behind: {_alive(helpers)}"

    # 2. the re-run resumes; Ctrl-C (SIGINT to the foreground group) during it does the same (a
    #    10 s save here: the same mechanism as step 1, and CI time is counted)
    helpers, at, text = _stop_with_group_signal(tiny_llama_dir, tmp_path, log, num_steps, signal.SIGINT, 10)
    second = metrics_steps(run)
    assert second[:len(first)] == first and second[len(first)] == first[-1] + 1, second
    assert second[-1] < num_steps and "STOPPED EARLY" in text.rsplit("resuming from", 1)[1], text[-3000:]
    assert checkpoint_steps(run)[-1] == second[-1], (checkpoint_steps(run), second)
    assert not _alive(helpers), f"left behind: {_alive(helpers)}"

    # the two sessions wrote one TensorBoard value per step (a resume to the end after a stop is
    # test_exact_resume's and test_slurm's requeue test's; a third run here cost CI ~2 min)
    assert_tensorboard_matches_jsonl(run)


@pytest.mark.timeout(300)
def test_sigterm_during_start_up_exits_0_stopped_before_step_1_and_leaves_no_process(tiny_llama_dir, tmp_path):
    """SIGTERM to the group while the actors start (the stop handler is installed before anything
    starts): start-up stops, every actor and the Ray head are stopped, exit 0, no report error."""
    from megatron_rlhf.runtime import session_pids

    log = tmp_path / "train.log"
    proc = _train(tiny_llama_dir, tmp_path, log, "run.name=startup", "run.num_steps=2")
    deadline = time.monotonic() + 180
    while not re.search(r"local Ray head pid (\d+)", log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    time.sleep(1.0)   # the actors are starting
    helpers = set(session_pids(int(re.findall(r"local Ray head pid (\d+)", log.read_text())[-1]))) | _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = _finish(proc, log, timeout_s=180)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "signal SIGTERM" in text and "stopped before step 1: nothing trained" in text, text[-3000:]
    assert "Traceback" not in text and "could not write the run report" not in text, text[-3000:]
    assert metrics_steps(tmp_path / "startup") == [] and checkpoint_steps(tmp_path / "startup") == []
    time.sleep(2)
    assert not _alive(helpers), f"left behind: {_alive(helpers)}"


def test_math_verify_pool_workers_outlive_sigterm_and_sigint():
    """The pool's workers ignore a signal to the driver's group (the driver stops them itself)."""
    import psutil

    from megatron_rlhf.rewards import MathVerifyReward

    def spawned() -> set[int]:   # this process's multiprocessing children (other tests' may linger)
        return {c.pid for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())}

    before = spawned()
    with MathVerifyReward(num_workers=1) as reward:
        assert reward(["#### 72"], ["72"]) == [1.0]
        workers = spawned() - before   # the pool's own workers only
        assert workers
        for sig in (signal.SIGTERM, signal.SIGINT):
            for pid in workers:
                os.kill(pid, sig)
        time.sleep(1.0)
        assert _alive(workers) == workers
        assert reward(["#### 5", "#### 3"], ["5", "4"]) == [1.0, 0.0]
        assert reward.num_restarts == 0
    time.sleep(0.5)
    assert not _alive(workers)


@pytest.mark.timeout(60)
def test_sigterm_during_model_conversion_stops_at_once_not_after_it(tiny_llama_dir, tmp_path, monkeypatch):
    """A cold start spends minutes in work that polls nothing (GGUF conversion, reward-model
    training): a SIGTERM there interrupts it at once (``_StopFlag.interrupting``) and the run
    returns "stopped before step 1" with nothing trained, instead of acting after the work ends."""
    import threading

    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.loop import train

    started = threading.Event()

    def slow_conversion(model_cfg):   # a conversion that would take 120 s
        started.set()
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            sum(range(10_000))
        raise AssertionError("the stop signal did not interrupt the conversion")

    monkeypatch.setattr(setup, "resolve_model_dir", slow_conversion)
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}", "run.name=cold",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false"])
    threading.Thread(target=lambda: started.wait(30) and os.kill(os.getpid(), signal.SIGTERM), daemon=True).start()
    t0 = time.monotonic()
    res = train(cfg, quiet=True)
    assert time.monotonic() - t0 < 20
    assert res["stopped_early"] and res["stopped_before_step"] == 1 and res["steps"] == 0
    assert metrics_steps(tmp_path / "cold") == []


def test_local_ray_head_ports_are_distinct():
    """The local Ray head's five ports are picked with every socket bound at once: distinct (picked
    one at a time, two Ray components once got the same port and ``ray start`` exited in CI)."""
    from megatron_rlhf.runtime import _free_ports

    for _ in range(20):
        ports = _free_ports(5)
        assert len(set(ports)) == 5 and all(1024 <= p < 65536 for p in ports)


@pytest.mark.timeout(60)
def test_guard_starts_a_command_again_that_fails_at_start_up_but_not_one_that_fails_later(tmp_path):
    """The SLURM Ray step's guard (``runtime guard --start-retries``): a ``ray start`` that exits
    non-zero within the start window (Ray's fixed 30 s raylet wait, exceeded on a loaded node: it
    failed a resubmitted job in a full local test run) is started again; one that fails after the
    window, or one without retries, is not, and its status comes back."""
    counter = tmp_path / "starts"
    # fails on its first start, succeeds on its second
    flaky = f"import pathlib,sys; p=pathlib.Path({str(counter)!r}); n=len(p.read_text()) if p.exists() else 0; " \
            "p.write_text('x'*(n+1)); sys.exit(3 if n == 0 else 0)"

    def guard(*opts: str, code: str) -> subprocess.CompletedProcess:
        counter.unlink(missing_ok=True)
        return subprocess.run([sys.executable, "-m", "megatron_rlhf.runtime", "guard", *opts, "--",
                               sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=50)

    out = guard("--start-retries", "2", code=flaky)
    assert out.returncode == 0 and counter.read_text() == "xx", out.stderr
    assert "exited with status 3" in out.stderr and "starting it again (1 of 2)" in out.stderr
    out = guard(code=flaky)   # no retries: the first start's status
    assert out.returncode == 3 and counter.read_text() == "x", out.stderr
    out = guard("--start-retries", "2", "--start-window-s", "0", code=flaky)   # failed after the window
    assert out.returncode == 3 and counter.read_text() == "x", out.stderr
    always = "import sys; sys.exit(5)"
    out = guard("--start-retries", "1", code=always)   # retries spent: the last status
    assert out.returncode == 5 and out.stderr.count("starting it again") == 1, out.stderr
    assert guard("--start-retries", code=always).returncode == 64   # a usage error


# ----- the stop is a BaseException (issue 36, principle 3): unit level, no actors ---------------------
@pytest.mark.timeout(30)
def test_the_stop_exception_is_not_caught_by_except_exception():
    from megatron_rlhf.trainer.setup import StoppedBeforeStart as FromSetup
    from megatron_rlhf.utils.stop import StoppedBeforeStart, StopSignal

    assert FromSetup is StoppedBeforeStart and issubclass(StoppedBeforeStart, StopSignal)
    assert issubclass(StopSignal, BaseException) and not issubclass(StopSignal, Exception)
    with pytest.raises(StoppedBeforeStart, match="stopped before step 3"):
        try:
            raise StoppedBeforeStart(3)
        except Exception:   # noqa: BLE001 - what a library does; it must not see the stop
            pytest.fail("except Exception caught the stop")


@pytest.mark.timeout(30)
def test_a_sigterm_inside_a_preflight_check_that_rewraps_exceptions_comes_out_as_the_stop():
    """The issue's 3-in-25 finding: SIGTERM during the pre-flight imports became ``config error:
    model.source`` (exit 2), because a checker's ``except Exception: raise ConfigError`` caught it."""
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.trainer.loop import _StopFlag
    from megatron_rlhf.utils.stop import StoppedBeforeStart

    def check_model_source():   # the shape of a pre-flight check
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # the handler raises here, between two bytecodes
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"config key 'model.source': cannot be read ({e})") from e

    with _StopFlag() as stop, pytest.raises(StoppedBeforeStart, match="stopped before step 1"):
        with stop.interrupting(lambda: 1):
            check_model_source()
    assert stop.requested


@pytest.mark.timeout(60)
def test_a_stop_while_train_py_loads_the_config_exits_0_with_one_line(monkeypatch, capsys):
    """From the first line of train.py: before ``train()`` installs its handler, SIGTERM/SIGINT
    raise the stop too, past a loader's ``except Exception``; exit 0, nothing written."""
    sys.path.insert(0, str(REPO))
    import train

    import megatron_rlhf.config as config

    def load_config(*a, **k):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except Exception as e:  # noqa: BLE001
            raise config.ConfigError("config key 'model.source': rewrapped") from e

    monkeypatch.setattr(config, "load_config", load_config)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert train.main(["--config", "configs/ci_tiny.yaml"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stopped before start-up (nothing was written): nothing trained in this session "
                   "(start again to run it)"]
    assert {s: signal.getsignal(s) for s in before} == before   # the handlers are put back
