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
