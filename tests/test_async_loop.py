"""The main job's loop end to end on CPU: real vLLM generator + real Megatron learner (Ray actors),
on a tiny random Llama and real MAWPS prompts. One Ray cluster for the module.

Random weights never solve a math problem, so these runs use the ``tests.plugins:char_parity``
reward plug-in (about half the completions score 1): pairing, training, weight sync, staleness and
checkpointing run exactly as in the demo.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import carried, check_staleness

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[1]


def _cfg(model_dir, out_dir, name, *extra):
    from megatron_rlhf.config import load_config

    return load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false", *extra])


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_async_run_staleness_is_0_then_1(ray_cluster, tiny_llama_dir, tmp_path):
    from megatron_rlhf.trainer.loop import train
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS

    res = train(_cfg(tiny_llama_dir, tmp_path, "async3"), quiet=True)
    rows = _rows(res["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_staleness(rows, [0, 1, 1])   # a row training leftovers may reach 2 (max_carry_staleness)
    assert [(r["async/max_staleness"], r["async/max_staleness_reason"], r["staleness/bound"]) for r in rows] == \
        [(1, "fixed", 1)] * 3   # a fixed bound is logged too
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["pairs/count"] == 2 for r in rows)
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["loss/total"] is not None and r["time/train_s"] > 0 and r["time/gen_s"] > 0
    assert rows[1]["time/sync_s"] == 0                                   # batch 2: still version 0
    assert rows[2]["time/sync_s"] > 0 and rows[2]["sync/bytes"] > 0   # batch 3 came after the push of v1
    run = Path(res["run_dir"])
    assert (run / "config.yaml").is_file() and (run / "hf_final" / "config.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2", "step_3"]  # keep_last 2
    # the frozen reference is saved once (version 0, never synced here), shared by both checkpoints
    assert sorted(p.name for p in (run / "checkpoints").glob("reference_v*")) == ["reference_v00000000"]
    assert res["steps"] == 3 and res["async_speedup"] > 0


@pytest.mark.timeout(600)
def test_sync_run_staleness_always_0(generator, tiny_llama_dir, tmp_path):
    from megatron_rlhf.trainer.loop import train

    res = train(_cfg(tiny_llama_dir, tmp_path, "sync3", "async.sync=true"), quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    assert [r["staleness/max"] for r in rows] == [0, 0, 0]
    assert [r["generator/weight_version"] for r in rows] == [0, 1, 2]   # on-policy: fresh weights each batch


@pytest.mark.timeout(900)
def test_papers_n4_bound_3_staleness_0_1_2_3_repeats_and_bound_2_is_refused(generator, tiny_llama_dir, tmp_path):
    """Noukhovitch et al.'s N = 4 (``sync_interval=4, max_staleness=3``) runs the real handshake:
    the generator waits at each sync point, so batches 4..7 all come from version 4 and staleness is
    0,1,2,3 twice, nothing dropped at train time; bound 2 would deadlock and is refused naming both keys."""
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.trainer.loop import train

    with pytest.raises(ConfigError, match=r"async\.max_staleness.*async\.sync_interval"):
        _cfg(tiny_llama_dir, tmp_path, "n4b2", "async.sync_interval=4", "async.max_staleness=2")
    res = train(_cfg(tiny_llama_dir, tmp_path, "n4b3", "run.num_steps=8", "async.sync_interval=4",
                     "async.max_staleness=3", "checkpoint.interval=0", "checkpoint.export_hf=false",
                     "eval.enabled=false"), quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    check_staleness(rows, [0, 1, 2, 3, 0, 1, 2, 3])
    assert [r["generator/weight_version"] for r in rows] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert all(r["staleness/dropped_pairs"] == 0 and (r["staleness/mean"] == r["staleness/max"] or carried(r))
               for r in rows)


@pytest.mark.timeout(600)
def test_auto_bound_rises_while_a_slowed_generator_keeps_the_learner_waiting(generator, tiny_llama_dir, tmp_path):
    """``async.max_staleness=auto`` with the generator side slowed on purpose (a reward that sleeps
    1 s per call, ``tests.plugins:slow_char_parity``, against a tiny learner step of ~0.2 s): the
    learner waits for its batches, so after the warm-up step two votes in a row raise the bound
    (``up:learner_wait``), a later batch is generated under it (``staleness/bound``), and the final
    checkpoint keeps it for a resume. (A step may not wait, e.g. one whose batch came all from
    carried groups: the count then restarts, so the rise's step is not fixed. The learner's wait does
    not fall here: a generator slower than the learner at every batch starves it at any bound, see
    docs/algorithms.md. The off-policy threshold is raised: the tiny random model's policy lag at
    staleness 1 is already 1.03-1.07 in token_mult_prob_error, near the default 1.1.)"""
    from megatron_rlhf.trainer.loop import train

    res = train(_cfg(tiny_llama_dir, tmp_path, "auto", "async.max_staleness=auto", "run.num_steps=7",
                     "async.auto_max_mult_prob_error=1.5", "tasks.0.reward=tests.plugins:slow_char_parity",
                     "checkpoint.interval=0", "checkpoint.export_hf=false", "eval.enabled=false"),
                quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    assert all(isinstance(r["async/max_staleness"], int) and r["async/max_staleness_reason"] for r in rows)
    reasons = [r["async/max_staleness_reason"] for r in rows]
    assert reasons[0] == "warmup" and "up:learner_wait" in reasons, reasons
    up = reasons.index("up:learner_wait")
    assert [r["async/max_staleness"] for r in rows[:up + 1]] == [1] * up + [2] and reasons[up - 1] == "vote_up:learner_wait"
    assert all(r["time/learner_idle_s"] > 0.1 * r["time/step_s"] for r in rows[up - 1:up + 1])   # what the votes read
    assert rows[0]["staleness/bound"] == 1 and any(r["staleness/bound"] == 2 for r in rows[up + 1:]), \
        [r["staleness/bound"] for r in rows]   # the producer took the new bound
    assert all(r["staleness/dropped_pairs"] == 0 for r in rows)
    state = json.loads((Path(res["run_dir"]) / "checkpoints" / "step_7" / "trainer_state.json").read_text())
    assert state["staleness_control"]["bound"] == rows[-1]["async/max_staleness"]


@pytest.mark.timeout(1500)
def test_stopped_run_resumes_at_next_step(generator, tiny_llama_dir, tmp_path):
    """Stop at step 2, resume to 3, re-run the finished run (a no-op), continue to 4. The runs share
    the module's generator (``train`` hands it the resumed weights first); the main job's own
    generator start is test_async_run_staleness_is_0_then_1's."""
    from megatron_rlhf.trainer.loop import train

    first = train(_cfg(tiny_llama_dir, tmp_path, "resume", "run.num_steps=2",
                       "checkpoint.export_hf=false"), quiet=True, generators=[generator])
    assert first["last_step"] == 2
    state = json.loads((Path(first["run_dir"]) / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["weight_version"] == 2
    second = train(_cfg(tiny_llama_dir, tmp_path, "resume", "run.num_steps=3"), quiet=True, generators=[generator])
    assert second["resumed_from_step"] == 2 and second["first_step"] == 1   # the summary covers the whole run
    rows = _rows(second["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["weight_version"] == 3
    # the generator got the resumed weights before generating step 3's batch: on-policy again
    # (but for leftovers of batch 2 the checkpoint carried, which may train 2 versions old)
    assert rows[-1]["generator/weight_version"] == 2 and (rows[-1]["staleness/max"] == 0 or carried(rows[-1]))
    # the same command again: a finished run is a no-op that reports the earlier summary
    again = train(_cfg(tiny_llama_dir, tmp_path, "resume", "run.num_steps=3"), quiet=True, generators=[generator])
    assert again["already_complete"] and again["last_step"] == 3
    assert len(_rows(second["run_dir"])) == 3
    # continuing a finished run: one more step, and its HF export replaces the old one
    old_export = (Path(second["run_dir"]) / "hf_final" / "model.safetensors").stat().st_mtime_ns
    more = train(_cfg(tiny_llama_dir, tmp_path, "resume", "run.num_steps=4"), quiet=True, generators=[generator])
    assert more["steps"] == 4 and more["last_step"] == 4 and more["resumed_from_step"] == 3
    assert (Path(more["run_dir"]) / "hf_final" / "model.safetensors").stat().st_mtime_ns != old_export


@pytest.mark.timeout(600)
def test_vllm_logprobs_match_learner_after_weight_push(ray_cluster, tiny_llama_dir):
    """After a training step and a push, vLLM's teacher-forced logprobs of fixed tokens equal the
    learner's: the weights the generator samples with are the weights the learner trained."""
    import ray
    import torch

    from megatron_rlhf.config import load_config
    from megatron_rlhf.generator.vllm_engine import VLLMGenerator
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.types import LearnerBatch

    cfg = _cfg(tiny_llama_dir, "/tmp", "unused")
    learner = ray.remote(num_cpus=1)(MegatronLearner).remote(
        model_dir=str(tiny_llama_dir), learner_cfg=cfg.learner, algorithm_cfg=cfg.algorithm, seed=0,
        total_steps=2)
    gen = ray.remote(num_cpus=1)(VLLMGenerator).remote(model_dir=str(tiny_llama_dir),
                                                      generator_cfg=cfg.generators, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 24), generator=g)
    mask = torch.zeros(4, 24)
    mask[:, 10:] = 1.0
    batch = LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0,
                         sampling_logprobs=torch.zeros(4, 24))
    before = ray.get(learner.token_logprobs.remote(ids))
    ray.get(learner.train_step.remote(batch))
    after = ray.get(learner.token_logprobs.remote(ids))
    assert (after - before).abs().max().item() > 1e-3   # the step really moved the weights
    ray.get(gen.update_weights.remote(learner.export_weights.remote(), 1))
    vllm_lp = torch.tensor(ray.get(gen.prompt_logprobs.remote(ids.tolist())))
    # fp32 on both sides; vLLM's CPU kernels differ from megatron's in summation order only
    tol = 2e-4
    assert (vllm_lp[:, 1:] - after[:, 1:]).abs().max().item() < tol
    assert ray.get(gen.get_weight_version.remote()) == 1
    for a in (learner, gen):
        ray.kill(a)
