"""Command lines of train.py and the tools: dotted overrides may come before, between or after options."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))
pytestmark = pytest.mark.timeout(60)


def test_evaluate_accepts_overrides_after_options():
    import evaluate

    args = evaluate.parse_args(["runs/x/hf_final", "--config", "configs/cpu_demo.yaml",
                                "eval.num_prompts=16", "--out", "x.json", "eval.greedy=true"])
    assert args.model_dir == "runs/x/hf_final" and args.config == "configs/cpu_demo.yaml"
    assert args.overrides == ["eval.num_prompts=16", "eval.greedy=true"] and str(args.out) == "x.json"
    args = evaluate.parse_args(["m", "eval.num_prompts=16", "--config", "c.yaml"])
    assert args.overrides == ["eval.num_prompts=16"] and args.out is None


def test_train_print_config_with_overrides_on_both_sides(capsys):
    import train

    code = train.main(["algorithm.beta=0.05", "--config", str(REPO / "configs" / "cpu_demo.yaml"),
                       "--print-config", "run.num_steps=3"])
    out = capsys.readouterr().out
    assert code == 0 and "num_steps: 3" in out and "beta: 0.05" in out


def test_a_second_ctrl_c_exits_130_with_one_line_and_no_traceback_saying_whether_a_checkpoint_is_intact(
        capsys, monkeypatch, tmp_path):
    """A fresh-user finding: the second Ctrl-C (the first finishes the step and checkpoints)
    printed a KeyboardInterrupt traceback from deep inside the run's shutdown; and before any
    checkpoint existed the line said "the last complete one is intact"."""
    import train

    from megatron_rlhf import runtime
    from megatron_rlhf.trainer import loop

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    monkeypatch.setattr(runtime, "apply_process_env", lambda *a, **k: None)
    argv = ["--config", str(REPO / "configs" / "ci_tiny.yaml"), f"run.output_dir={tmp_path}"]
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 130 and err.startswith("interrupted: stopped at once without a checkpoint") and "Traceback" not in err
    assert "none was written before" in err and "intact" not in err
    from megatron_rlhf.config import load_config

    run_dir = load_config(REPO / "configs" / "ci_tiny.yaml", [f"run.output_dir={tmp_path}"]).run_dir
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json"):   # what makes a checkpoint complete
        (run_dir / "checkpoints" / "step_2" / name).write_text("{}")
    assert train.main(argv) == 130 and "the last complete one is intact" in capsys.readouterr().err


def test_a_reward_that_raises_exits_1_with_one_line_naming_where_and_the_traceback_file(capsys, monkeypatch, tmp_path):
    """A reward function that raises ends the run with one line (the task's reward, where it raised,
    the file holding the whole traceback), not a ``ProducerError`` traceback."""
    import train

    from megatron_rlhf import runtime
    from megatron_rlhf.rollout.producer import ProducerError, RewardError
    from megatron_rlhf.trainer import loop

    def user_reward(completion):
        return {"a": 1}["b"]

    def failing(cfg):
        try:
            try:
                user_reward("x")
            except KeyError as e:
                raise RewardError("the reward of task 'math' (tests.plugins:user_reward) failed: KeyError: 'b'") from e
        except RewardError as e:
            raise ProducerError(str(e)) from e

    monkeypatch.setattr(loop, "train", failing)
    monkeypatch.setattr(runtime, "apply_process_env", lambda *a, **k: None)
    code = train.main(["--config", str(REPO / "configs" / "ci_tiny.yaml"), f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("generation failed: the reward of task 'math' (tests.plugins:user_reward) failed"), err
    assert f"raised at {__file__}:" in err and "in user_reward" in err, err
    saved = list((tmp_path / "ci_tiny" / "logs").glob("error-*.txt"))
    assert len(saved) == 1 and f"traceback in {saved[0]}" in err
    text = saved[0].read_text()
    assert "KeyError" in text and "user_reward" in text and "ProducerError" in text


def test_plan_memory_passes_overrides_after_options_to_the_config(capsys):
    import plan_memory

    code = plan_memory.main(["--config", str(REPO / "configs" / "cpu_demo.yaml"), "algorithm.beta=0.05",
                             "--json", "learner.micro_batch_size=abc"])
    assert code != 0 and "learner.micro_batch_size" in capsys.readouterr().err


def test_time_breakdown_and_its_summary_line_by_hand():
    import train
    from megatron_rlhf.trainer.metrics import time_breakdown

    rows = [{"step": 1, "eval/step": 0, "time/eval_s": 100.0, "time/gen_s": 30.0, "time/train_s": 20.0, "time/sync_s": 1.0},
            {"step": 2, "time/eval_s": 0.0, "time/gen_s": 40.0, "time/train_s": 25.0, "time/sync_s": 2.0},
            {"step": 3, "eval/step": 3, "time/eval_s": 80.0, "time/gen_s": 35.0, "time/train_s": 22.0, "time/sync_s": None}]
    t = time_breakdown(rows, {"model": 60.0, "reward_model": 90.0, "start": 50.0, "export": 5.0},
                       loop_s=400.0, total_s=690.0)
    assert t == {"time/model_s": 60.0, "time/reward_model_s": 90.0, "time/start_s": 50.0, "time/export_s": 5.0,
                 "time/eval_first_s": 100.0, "time/eval_last_s": 80.0, "time/eval_total_s": 180.0,
                 "time/gen_total_s": 105.0, "time/train_total_s": 67.0, "time/sync_total_s": 3.0,
                 "time/loop_s": 400.0, "time/other_s": 5.0, "time/total_s": 690.0}
    assert train._time_lines(t) == [
        "time (s): total 690 = set-up (model 60, reward model 90, start 50) + steps 400 (overlapped inside: "
        "first eval 100, generation 105, training 67, sync 3) + final eval 80, hf export 5, other 5"]
    assert train._time_lines({}) == []
    # a session resumed from step 2 (a fresh-user finding: its line summed every session's rows and
    # showed the first session's eval before step 1 inside this session's 50 s of steps)
    t = time_breakdown(rows, {"start": 30.0}, loop_s=50.0, total_s=200.0, since_step=2)
    assert t == {"time/start_s": 30.0, "time/eval_last_s": 80.0, "time/eval_total_s": 80.0,
                 "time/gen_total_s": 35.0, "time/train_total_s": 22.0, "time/sync_total_s": 0.0,
                 "time/loop_s": 50.0, "time/other_s": 40.0, "time/total_s": 200.0}, t


def test_ray_workers_get_the_checkout_the_driver_imported_first_on_pythonpath():
    """setup.worker_pythonpath: the folder holding the imported ``megatron_rlhf`` goes before the
    driver's own PYTHONPATH entries (kept, in order, not repeated)."""
    import megatron_rlhf
    from megatron_rlhf.trainer.setup import worker_pythonpath

    root = str(Path(megatron_rlhf.__file__).resolve().parents[1])
    assert worker_pythonpath({}) == root
    assert worker_pythonpath({"PYTHONPATH": f"/a{os.pathsep}/b"}) == os.pathsep.join([root, "/a", "/b"])
    assert worker_pythonpath({"PYTHONPATH": f"/a{os.pathsep}{root}"}) == os.pathsep.join(["/a", root])


def _uninstalled_checkout(tmp_path: Path, src: Path = REPO) -> tuple[Path, dict, str]:
    """A plain copy of the repository (``git ls-files``), an interpreter that cannot import the
    project, and its environment: the venv's base interpreter (``sys._base_executable``, the system
    Python the venv was made from) with only the venv's site-packages on ``PYTHONPATH`` (a
    ``PYTHONPATH`` entry does not run ``.pth`` files, so the editable install is not seen), and a
    ``ray`` command on ``PATH`` run by that interpreter (the venv's own ``ray`` script would run the
    venv's Python, which sees the editable install)."""
    import shutil
    import site
    import subprocess

    copy = tmp_path / "checkout"
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        if (src / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, copy / name)
    py = getattr(sys, "_base_executable", sys.executable)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f"#!/bin/sh\nexec {py} -c 'import sys; from ray.scripts.scripts import main; "
                                 f"sys.argv[0] = \"ray\"; sys.exit(main())' \"$@\"\n")
    (bin_dir / "ray").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=site.getsitepackages()[0], PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
               OMP_NUM_THREADS="1")
    return copy, env, py


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_train_runs_from_a_plain_checkout_with_the_package_not_installed(tiny_llama_dir, tmp_path):
    """Issue 21 item 1: from a copy of the repository that no Python can import the package from,
    the tiny async loop (ci_tiny, 2 steps) starts its Ray workers (whose setup hook imports
    ``megatron_rlhf.trainer.watchdog`` before any task runs) and finishes. Fails without the
    ``PYTHONPATH`` that ``setup.init_ray`` gives the workers: ``Failed to execute the setup hook
    method ... No module named 'megatron_rlhf'`` and ``LearnerDiedError`` at start-up."""
    import subprocess

    copy, env, py = _uninstalled_checkout(tmp_path)
    for mod, ok in (("megatron_rlhf", False), ("ray, torch, vllm, megatron.core", True)):  # the set-up holds
        res = subprocess.run([py, "-c", f"import {mod}"], cwd="/", env=env, capture_output=True, text=True,
                             timeout=120)
        assert (res.returncode == 0) == ok, (mod, res.stderr[-2000:])
    res = subprocess.run(["ray", "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "2." in res.stdout, res.stdout + res.stderr
    out = tmp_path / "runs"
    res = subprocess.run([py, "train.py", "--config", "configs/ci_tiny.yaml", f"model.source={tiny_llama_dir}",
                          f"run.output_dir={out}", "run.name=plain", "run.num_steps=2",
                          "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false",
                          "checkpoint.interval=0", "checkpoint.export_hf=false", "eval.enabled=false"],
                         cwd=copy, env=env, capture_output=True, text=True, timeout=400)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    assert "setup hook" not in text, text[-6000:]
    from tests.conftest import metrics_steps

    assert metrics_steps(out / "plain") == [1, 2], text[-3000:]


def test_held_out_summary_line_gives_the_gain_and_its_standard_error_by_hand():
    import train

    f = lambda v: "n/a" if v is None else f"{v:.3f}"   # noqa: E731 (as train.main)
    evals = {"math": {"pass@1": {"first": 0.609, "first_se": 0.043, "first_step": 0,
                                 "last": 0.773, "last_se": 0.037, "last_step": 16},
                      "len_mean_tokens": {"first": 30.0, "first_se": 1.0, "first_step": 0,
                                          "last": 25.0, "last_se": 1.0, "last_step": 16}},
             "chat": {"reward_mean": {"first": 0.3, "first_se": None, "first_step": 0,
                                      "last": 0.2, "last_se": None, "last_step": 16}},
             "one": {"pass@1": {"first": 0.5, "first_se": 0.1, "first_step": 4, "last": 0.5, "last_se": 0.1,
                                "last_step": 4}}}
    lines = train._eval_lines(evals, f)
    # 0.773 - 0.609 = 0.164; sqrt(0.043^2 + 0.037^2) = sqrt(0.001849 + 0.001369) = 0.05673; 2.9 se
    assert lines[1].endswith("-> 0.773 +- 0.037 (step 16); gain +0.164 +- 0.057 (2.9 se)"), lines[1]
    assert "gain" not in lines[2] and "gain" not in lines[3] and len(lines) == 4   # no se; one eval
