"""The run report (trainer/report.py, tools/report.py): every plot is in the page as a PNG."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlhf.trainer.report import PLOTS, write_report

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _rows():
    rows = []
    for s in range(1, 6):
        r = {"step": s, "weight_version": s, "reward/mean": 0.2 + 0.1 * s, "task/math/reward_mean": 0.1 * s,
             "task/chat/reward_mean": 1.0 + 0.2 * s, "task/math/len_mean_tokens": 40 - s,
             "task/chat/len_mean_tokens": 60 + s, "kl/ref_k1": 0.01 * s, "kl/ref_k3": 0.012 * s,
             "staleness/max": min(s - 1, 1), "staleness/hist_0": 8 if s == 1 else 0,
             "staleness/hist_1": 0 if s == 1 else 8, "staleness/hist_over": 0,
             "time/train_s": 2.0, "time/learner_idle_s": 1.0, "time/step_s": 3.5, "sync/export_s": 0.1,
             "time/gen_s": 2.5, "time/reward_s": 0.3, "time/sync_s": 0.2, "time/generator_idle_s": 0.1,
             "time/eval_s": 0.0}
        if s in (1, 5):
            r.update({"eval/step": 0 if s == 1 else 5, "eval/math/pass@1": 0.3 + 0.02 * s,
                      "eval/math/pass@1/se": 0.04, "eval/math/mean@k": 0.25, "eval/math/mean@k/se": 0.03,
                      "eval/chat/reward_mean": 1.1, "eval/chat/reward_mean/se": 0.2,
                      "eval/math/len_mean_tokens": 35, "eval/math/len_mean_tokens/se": 2.0, "time/eval_s": 4.0})
        rows.append(r)
    return rows


def _images(page: str) -> dict[str, bytes]:
    found = re.findall(r'<img id="plot-([a-z]+)" alt="[a-z]+" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return {name: base64.b64decode(data) for name, data in found}


def test_report_has_every_plot_as_a_png_and_the_eval_table(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (run / "config.yaml").write_text("run:\n  name: run\n")
    (run / "tensorboard").mkdir()
    page = write_report(run).read_text()
    imgs = _images(page)
    assert list(imgs) == list(PLOTS)
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000 for png in imgs.values())
    assert "0.3200 &plusmn; 0.0400 (0)" in page and "0.4000 &plusmn; 0.0400 (5)" in page   # pass@1 before/after
    assert "name: run" in page and f"tensorboard --logdir {run.resolve() / 'tensorboard'}" in page


def test_report_cli_on_a_folder_without_metrics_says_so(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "metrics.jsonl" in out.stderr


def test_wandb_run_resumes_as_the_same_run_after_a_requeue(tmp_path, monkeypatch):
    """The wandb id lives in the run folder: a second logger (a resumed or requeued run) gets it."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import MetricsLogger

    cfg = LoggingConfig(wandb=True, wandb_mode="offline")
    first = MetricsLogger(tmp_path, cfg, {"run": {"name": "x"}})
    run_id = first._wandb.id
    first.close()
    again = MetricsLogger(tmp_path, cfg, {"run": {"name": "x"}})
    assert again._wandb.id == run_id == (tmp_path / "wandb_id").read_text().strip()
    again.close()


@pytest.mark.timeout(30)
def test_the_mismatch_warning_names_intended_policy_lag_when_the_samples_are_stale(tmp_path, capsys):
    """A ``token_mult_prob_error`` above the warning threshold: with samples 7.5 versions old (a
    staleness sweep's N = 16) the warning says part of it is the intended lag; at staleness 0 it
    says the weights may not be synced."""
    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS, MetricsLogger

    log = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, warn_token_mult_prob_error=1.05), {})
    for step, stale in ((1, 7.5), (2, 0.0)):
        row = {k: 0.0 for k in REQUIRED_KEYS}
        row.update({"step": step, "staleness/mean": stale, "logprobs/token_mult_prob_error": 1.06})
        log.log(row)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "step 1" in err[0] and "7.5 weight versions old" in err[0] and "intended policy lag" in err[0]
    assert "step 2" in err[1] and "not synced" in err[1] and "policy lag" not in err[1]
    log.close()
