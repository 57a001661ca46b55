"""Learner throughput metrics (``perf/*``): model FLOPs by hand, the peak table, the summary and
the report's time plot."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pytest import approx

pytestmark = pytest.mark.timeout(60)

# the tiny Llama of the tests: h 128, L 2, f 256, V 512, 4 query heads of 32, 2 KV groups
TINY = SimpleNamespace(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)


def test_model_flops_per_token_by_hand():
    from megatron_rlhf.learner.flops import model_flops_per_token

    # N = 2 * (128*32*(4 + 2*2) + 4*32*128 + 3*128*256) + 128*512 = 360448 matmul parameters
    # F(T) = 2N + 4 * L * H * Q * T = 720896 + 1024 T
    assert model_flops_per_token(TINY, 10) == 720896 + 10240
    assert model_flops_per_token(TINY, 0) == 2 * 360448


def test_throughput_metrics_by_hand_with_and_without_a_peak():
    from megatron_rlhf.learner.flops import throughput_metrics

    # rows of 10 and 20 real tokens, 4 forward-equivalents (1 update + the reference), 0.5 s, 2 ranks
    flops = 4 * (10 * (720896 + 10240) + 20 * (720896 + 20480))
    m = throughput_metrics(TINY, [10, 20], 4, 0.5, 2, None)
    assert m["perf/learner_tokens_per_s"] == approx(60.0) and m["perf/learner_tokens_per_s_per_rank"] == approx(30.0)
    assert m["perf/learner_tflops"] == approx(flops / 0.5 / 1e12)
    assert m["perf/learner_tflops_per_rank"] == approx(flops / 0.5 / 1e12 / 2)
    assert "perf/mfu" not in m                                  # CPU: no peak, no MFU
    m = throughput_metrics(TINY, [10, 20], 4, 0.5, 2, 1e-4)      # a peak of 1e-4 TFLOP/s per device
    assert m["perf/mfu"] == approx(flops / 0.5 / 1e12 / (2 * 1e-4))


def test_peak_table_by_device_name_and_dtype():
    from megatron_rlhf.platform.peaks import device_peak_tflops, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == approx(756.0)
    assert peak_tflops("NVIDIA H200", "torch.bfloat16") == approx(989.4)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float16") == approx(312.0)
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bfloat16") is None      # unknown device
    assert peak_tflops("NVIDIA H100 80GB HBM3", "float64") is None         # unlisted dtype
    assert device_peak_tflops("cpu", "float32") is None                     # no MFU on CPU
    assert device_peak_tflops("cpu", "float32", override=1.5) == 1.5       # learner.peak_tflops


def test_summary_line_and_report_show_the_throughput(tmp_path):
    import importlib.util
    from pathlib import Path

    from megatron_rlhf.trainer.metrics import summarize
    from megatron_rlhf.trainer.report import write_report

    rows = [{"step": s, "reward/mean": 0.5, "pairs/count": 2, "pairs/skipped_prompts": 0,
             "time/train_s": 1.0, "time/step_s": 2.0, "perf/learner_tokens_per_s": 100.0 * s,
             "perf/learner_tflops": 0.01 * s} for s in (1, 2, 3)]
    res = summarize(rows, wall_s=6.0)
    assert res["learner_tokens_per_s_mean"] == approx(200.0) and res["learner_tflops_mean"] == approx(0.02)
    assert res["mfu_mean"] != res["mfu_mean"]                               # NaN: no perf/mfu
    spec = importlib.util.spec_from_file_location("mrlhf_train", Path(__file__).resolve().parents[1] / "train.py")
    train_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_py)
    text = train_py.format_summary({**res, "run_dir": str(tmp_path)})
    assert "learner throughput: 200 tokens/s, 0.020 model TFLOP/s, MFU n/a (device peak unknown" in text
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert 'id="plot-time"' in write_report(tmp_path).read_text()
