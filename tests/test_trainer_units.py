"""Trainer pieces without actors: the weight handshake, the run summary, the metrics contract."""

import json
import threading
import time
from pathlib import Path

import pytest

from megatron_rlhf.trainer.metrics import REQUIRED_KEYS, MetricsLogger, summarize
from megatron_rlhf.rollout.producer import PublishedWeights, WeightChannel

pytestmark = pytest.mark.timeout(30)


def test_handshake_blocks_until_the_needed_version_is_published():
    ch = WeightChannel(PublishedWeights(version=0))
    assert ch.wait_for(0, timeout_s=1).version == 0          # version 0 is there from the start
    got = {}

    def waiter():
        got["w"] = ch.wait_for(2, timeout_s=10)

    t = threading.Thread(target=waiter)
    t.start()
    ch.publish(PublishedWeights(version=1))
    time.sleep(0.2)
    assert t.is_alive()                                       # version 1 is not enough
    ch.publish(PublishedWeights(version=2, export_s=0.5))
    t.join(timeout=5)
    assert got["w"].version == 2 and got["w"].export_s == 0.5
    ch.publish(PublishedWeights(version=1))                   # an older version never replaces a newer one
    assert ch.latest().version == 2


def test_handshake_timeout_and_close():
    ch = WeightChannel(PublishedWeights(version=0))
    with pytest.raises(TimeoutError, match="async.timeout_s"):
        ch.wait_for(1, timeout_s=0.2)
    ch.close()
    assert ch.wait_for(5, timeout_s=1) is None


def _row(step, **kw):
    row = {k: 0.0 for k in REQUIRED_KEYS}
    row.update(step=step, **kw)
    return row


def test_summary_speedup_is_serial_over_wall():
    rows = [_row(1, **{"reward/mean": 0.1, "time/gen_s": 10.0, "time/train_s": 4.0, "time/sync_s": 1.0,
                       "pairs/count": 2, "pairs/skipped_prompts": 6, "prompts/drawn": 8}),
            _row(2, **{"reward/mean": 0.3, "time/gen_s": 10.0, "time/train_s": 4.0, "time/sync_s": 1.0,
                       "pairs/count": 2, "pairs/skipped_prompts": 2, "prompts/drawn": 4})]
    s = summarize(rows, wall_s=20.0, edge=1)
    assert s["async_speedup"] == pytest.approx(30.0 / 20.0)
    rows[0].update({"eval/step": 0, "time/eval_s": 5.0})   # the eval before step 1 is not step time
    assert summarize(rows, wall_s=25.0, edge=1)["async_speedup"] == pytest.approx(30.0 / 20.0)
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.3)
    assert s["reward_window_steps"] == 1 and summarize(rows, wall_s=1.0)["reward_window_steps"] == min(3, len(rows))
    assert (s["pairs_formed"], s["prompts_skipped"], s["prompts_drawn"]) == (4, 8, 12)


def test_metrics_logger_requires_the_contract_keys(tmp_path):
    from megatron_rlhf.config import LoggingConfig

    log = MetricsLogger(tmp_path, LoggingConfig())
    log.log(_row(1, **{"loss/total": float("nan")}))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss/total"] is None   # NaN -> null
    with pytest.raises(ValueError, match="staleness/max"):
        log.log({"step": 2})


def _run_answering(outs: list[dict]):
    """A Run (no actors) whose learner's train_step answers ``outs`` in turn."""
    from types import SimpleNamespace

    from megatron_rlhf.config import load_config
    from megatron_rlhf.trainer.run import Run

    run = Run(load_config(Path(__file__).resolve().parents[1] / "configs" / "ci_tiny.yaml",
                          ["learner.max_skipped_steps=2"]), say=print)
    run.learner = SimpleNamespace(train_step=SimpleNamespace(remote=lambda batch: None))
    answers = iter(outs)
    run.call = lambda ref, what: next(answers)
    return run


def test_skipped_policy_or_critic_updates_in_a_row_stop_the_run_at_max_skipped_steps():
    """Run.train_step counts a step whose policy update or (ppo) critic step was skipped as
    non-finite; learner.max_skipped_steps of them in a row stop the run, naming which one."""
    from megatron_rlhf.trainer.run import NonFiniteTrainingError

    critic_skip = {"train/skipped_nonfinite": 0.0, "critic/skipped_nonfinite": 1.0, "critic/grad_norm": float("nan")}
    run = _run_answering([critic_skip, {"train/skipped_nonfinite": 1.0}])
    run.train_step(None, 1)
    with pytest.raises(NonFiniteTrainingError, match=r"steps 1\.\.2: the loss or gradient was not finite"):
        run.train_step(None, 2)
    run = _run_answering([critic_skip, {"train/skipped_nonfinite": 0.0, "critic/skipped_nonfinite": 0.0},
                          critic_skip, critic_skip])
    for step in (1, 2, 3):   # step 2 skipped nothing: the count starts again
        run.train_step(None, step)
    with pytest.raises(NonFiniteTrainingError, match=r"steps 3\.\.4: the critic's value loss or gradient .* "
                                                    r"no critic update was applied \(critic/grad_norm nan"):
        run.train_step(None, 4)


def test_train_cli_reports_config_errors_before_any_work(tmp_path, capsys):
    import train

    cfg = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml"
    assert train.main(["--config", str(cfg), "algorithm.beta=0"]) == 2
    assert "algorithm.beta" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_config_error_in_the_data_leaves_no_empty_run_folder(tiny_llama_dir, tmp_path, capsys):
    import train

    cfg = Path(__file__).resolve().parents[1] / "configs" / "ci_tiny.yaml"
    code = train.main(["--config", str(cfg), f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}",
                       "run.name=bad", f"tasks.0.data.path={tmp_path / 'missing.jsonl'}"])
    assert code == 2 and r"tasks[math].data.path" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.timeout(180)
def test_run_can_start_from_a_megatron_checkpoint(tiny_llama_dir, tmp_path):
    """model.source = an hf_to_megatron checkpoint: exported once (exactly) to the HF folder the
    learner and the generators start from, cached for the next run."""
    import torch
    from safetensors.torch import load_file

    from megatron_rlhf.config import ModelConfig
    from megatron_rlhf.convert.pipeline import hf_to_megatron
    from megatron_rlhf.trainer.loop import resolve_model_dir

    ckpt = tmp_path / "ckpt"
    hf_to_megatron(tiny_llama_dir, ckpt, tp=2, pp=1, progress=False)
    cfg = ModelConfig(source=str(ckpt), cache_dir=str(tmp_path / "cache"))
    out = resolve_model_dir(cfg)
    assert out != ckpt and (out / "config.json").is_file()
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    want = load_file(next(Path(tiny_llama_dir).glob("*.safetensors")))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert resolve_model_dir(cfg) == out                                   # cached
    assert resolve_model_dir(ModelConfig(source=str(tiny_llama_dir))) == Path(tiny_llama_dir).resolve()


def test_ray_metrics_exporter_lines_go_to_the_log_and_other_lines_to_the_console(tmp_path):
    """route_ray_system_noise wraps Ray's driver log handler: gcs_server's and raylet's
    "metrics exporter agent" errors (ray-project/ray#59665) are appended to the log file, their
    other lines and every worker line still reach the console handler, unchanged."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from megatron_rlhf.runtime import route_ray_system_noise

    printed, log = [], tmp_path / "ray-system.log"
    noise = ("[2026-12-02 03:35:26,317 E 3771 3771] (gcs_server) gcs_server.cc:1361: Failed to establish "
             "connection to the event+metrics exporter agent. Events and metrics will not be exported.")
    saved = list(dispatcher.handlers)
    try:
        dispatcher.handlers = [("ray_print_logs", printed.append)]
        assert route_ray_system_noise(log)
        dispatcher.emit({"pid": "gcs_server", "is_err": True, "lines": [noise]})
        dispatcher.emit({"pid": "raylet", "is_err": True, "lines": [noise.replace("gcs_server", "raylet"),
                                                                     "raylet.cc: worker died"]})
        dispatcher.emit({"pid": 4242, "is_err": True, "lines": ["metrics exporter agent, said a worker"]})
    finally:
        dispatcher.handlers = saved
    assert [(d["pid"], d["lines"]) for d in printed] == [
        ("raylet", ["raylet.cc: worker died"]), (4242, ["metrics exporter agent, said a worker"])]
    assert log.read_text().splitlines() == [f"(gcs_server) {noise}", f"(raylet) {noise.replace('gcs_server', 'raylet')}"]
    dispatcher.handlers = []
    try:
        assert not route_ray_system_noise(log)   # no handler (log_to_driver=False): nothing to wrap
    finally:
        dispatcher.handlers = saved


def test_step_progress_writes_a_plain_line_per_step_to_a_log_and_a_bar_only_to_a_terminal():
    """A fresh-user finding: the tqdm bar's carriage-return redraws piled up in ``> train.log``."""
    import io

    from megatron_rlhf.trainer.metrics import StepProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, term, off = io.StringIO(), Terminal(), io.StringIO()
    for stream, enabled in ((log, True), (term, True), (off, False)):
        p = StepProgress(16, 2, enabled=enabled, stream=stream)   # resumed after step 2
        p.update(31.25, reward="0.512", stale=1)
        p.update(20.0, reward="0.600", stale=0)
        p.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2, log.getvalue()
    assert lines[0].startswith("[megatron-rlhf] step 3/16: reward=0.512 stale=1 (31.2 s; mean ") and lines[0].endswith(" s/step)")
    assert lines[1].startswith("[megatron-rlhf] step 4/16: reward=0.600 stale=0 (")
    assert "\r" in term.getvalue() and "4/16" in term.getvalue() and "[megatron-rlhf] step" not in term.getvalue()
    assert off.getvalue() == ""


def test_progress_off_a_terminal_writes_plain_lines_at_most_every_every_s_and_a_final_one():
    """The reward model's ``features`` and the converter's tensor bars: in a log, plain lines (a
    fresh-user finding: tqdm's carriage returns piled up in ``> train.log``), on a terminal a bar."""
    import io

    from megatron_rlhf.utils.progress import LineProgress, progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, sparse, term = io.StringIO(), io.StringIO(), Terminal()
    with progress(4000, "features", "tok", stream=log, every_s=0.0) as bar:
        assert isinstance(bar, LineProgress)
        bar.update(1000)
        bar.update(3000)
    assert log.getvalue().splitlines() == [
        "[megatron-rlhf] features: 1,000/4,000 tok (25%, 0 s)", "[megatron-rlhf] features: 4,000/4,000 tok (100%, 0 s)",
        "[megatron-rlhf] features: 4,000/4,000 tok (100%, 0 s)"]   # the last update's line, then close's
    bar = progress(10, "reshard", "tensor", stream=sparse, every_s=3600.0)
    for _ in range(10):
        bar.update(1)
    bar.close()
    bar.close()
    assert sparse.getvalue() == "[megatron-rlhf] reshard: 10/10 tensor (100%, 0 s)\n"   # only the final line, once
    quiet = io.StringIO()
    with progress(5, "x", "tensor", stream=quiet, enabled=False, every_s=0.0) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""
    with progress(3, "hf->megatron", "tensor", stream=term) as bar:
        bar.update(3)
    assert "\r" in term.getvalue() and "3/3" in term.getvalue() and "[megatron-rlhf]" not in term.getvalue()
