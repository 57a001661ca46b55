"""Command lines of train.py and the tools: dotted overrides may come before, between or after options."""

from __future__ import annotations

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
