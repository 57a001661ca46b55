"""Debug modes as a pair (slime's rollout-only / train-only; trainer/replay.py): a rollout_only
run saves every batch and never trains; a train_only replay of a live run's saved batches starts
no vLLM engine and reproduces that run's losses step by step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_loop_losses import _cfg, _rows  # the shared tiny-run config and metrics reader

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(600)
def test_rollout_only_saves_every_batch_and_never_trains(generator, tiny_llama_dir, tmp_path):
    from megatron_rlhf.rollout.batch_io import list_batches, load_batch
    from megatron_rlhf.trainer.loop import train

    res = train(_cfg(tiny_llama_dir, tmp_path, "rollouts", "run.mode=rollout_only", "run.num_steps=3",
                     "async.max_staleness=1"), quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss/total"] is None and r["weight_version"] == 0 for r in rows)
    assert all(r["generator/version_max"] == 0 for r in rows)       # no weight ever pushed
    files = list_batches(Path(res["run_dir"]) / "rollouts")
    assert [f.name for f in files] == [f"batch_{k:06d}.json.gz" for k in range(3)]
    b = load_batch(files[2])
    assert b.index == 2 and len(b.groups) == 2 and b.stats["pairs/count"] == rows[2]["pairs/count"]
    assert not (Path(res["run_dir"]) / "hf_final").exists()


@pytest.mark.timeout(900)
def test_train_only_replay_reproduces_the_live_runs_losses_without_vllm(generator, tiny_llama_dir, tmp_path,
                                                                         monkeypatch):
    from megatron_rlhf.trainer import setup as run_mod
    from megatron_rlhf.trainer.loop import train

    live = train(_cfg(tiny_llama_dir, tmp_path, "live", "run.save_rollouts=true", "run.num_steps=3"),
                 quiet=True, generators=[generator])

    def no_engine(*a, **k):
        raise AssertionError("train_only started a vLLM engine")

    monkeypatch.setattr(run_mod, "build_generators", no_engine)
    replay = train(_cfg(tiny_llama_dir, tmp_path, "replay", "run.mode=train_only", f"run.replay={live['run_dir']}",
                        "run.num_steps=3", "eval.enabled=false"), quiet=True)
    a, b = _rows(live["run_dir"]), _rows(replay["run_dir"])
    assert [r["step"] for r in b] == [1, 2, 3] and [r["weight_version"] for r in b] == [1, 2, 3]
    assert [r["staleness/max"] for r in b] == [r["staleness/max"] for r in a]
    for ra, rb in zip(a, b):
        assert rb["loss/total"] == pytest.approx(ra["loss/total"], rel=1e-5, abs=1e-6)
        assert rb["reward/mean"] == ra["reward/mean"]                  # the same batches
    with pytest.raises(Exception, match="run.replay"):                # too few saved batches
        train(_cfg(tiny_llama_dir, tmp_path, "replay5", "run.mode=train_only", f"run.replay={live['run_dir']}",
                   "run.num_steps=5", "eval.enabled=false"), quiet=True)
