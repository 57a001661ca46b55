"""The on-disk rollout-batch format (debug replay, checkpointed in-flight batches): exact round trip."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from megatron_rlhf.rollout.batch_io import list_batches, load_batch, save_batch
from megatron_rlhf.types import RolloutBatch
from megatron_rlhf.types import LearnerBatch
from tests.test_batch_units import _group

pytestmark = pytest.mark.timeout(60)


def _batch(index=3):
    rng = random.Random(7)
    rng.random()
    return RolloutBatch(index=index, weight_version=2, groups=(_group(0), _group(1, loss_rewards=(-1.0, 0.5, 0.5))),
                        sampler_state={"math": {"pos": 5, "epoch": 1}}, rng_state=rng.getstate(),
                        producer_state={"normaliser": {"math": [1, 0.5, 0.25]}},
                        stats={"reward/mean": 0.5, "time/gen_s": 1.25})


def test_saved_batch_loads_back_equal_and_trains_identically(tmp_path):
    b = _batch()
    path = save_batch(b, tmp_path)
    assert path.name == "batch_000003.json.gz" and list_batches(tmp_path) == [path]
    back = load_batch(path)
    assert back == b                                   # frozen dataclasses compare field by field
    r = random.Random()
    r.setstate(back.rng_state)                         # the pair-selection RNG resumes exactly
    r0 = random.Random()
    r0.setstate(b.rng_state)
    assert r.random() == r0.random()
    lb, lb0 = (LearnerBatch.from_groups(x.groups, "group", 0) for x in (back, b))
    assert lb.input_ids.equal(lb0.input_ids) and lb.sampling_logprobs.equal(lb0.sampling_logprobs)


def test_unknown_fields_are_ignored_and_bad_files_name_their_path(tmp_path):
    path = save_batch(_batch(0), tmp_path)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    doc["batch"]["groups"][0]["rollouts"][0]["completion"]["future_field"] = 1
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    assert load_batch(path).groups[0].rollouts[0].completion.token_ids == (10, 11)
    bad = tmp_path / "batch_000001.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="batch_000001"):
        load_batch(bad)
    doc["format"] = 99
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    with pytest.raises(ValueError, match="format 99"):
        load_batch(path)


def test_a_replay_folder_from_another_run_is_refused_before_training_naming_file_and_fix(tmp_path):
    """``run.mode=train_only`` reads batch files another run saved: each is checked up front
    (``trainer.replay.check_replay_dir``) and a folder built for another loss / K, batch size or
    tokenizer, a damaged file or a renamed one is refused naming ``run.replay``, the file and the fix."""
    import dataclasses

    from megatron_rlhf.rollout.batch_io import batch_path
    from megatron_rlhf.trainer.replay import check_replay_dir

    tag = {"loss": "grpo", "samples_per_prompt": 3, "unit": "group"}
    top = max(t for g in _batch().groups for r in g.rollouts for t in (*g.prompt.token_ids, *r.completion.token_ids))
    for k in range(3):
        save_batch(_batch(k), tmp_path / "rollouts", algorithm=tag)
    ok = dict(algorithm=tag, prompts_per_step=2, vocab_size=top + 1)
    assert check_replay_dir(tmp_path, 0, 3, **ok) == (tmp_path / "rollouts").resolve()   # a run folder finds rollouts/
    bad = [({**ok, "algorithm": {**tag, "loss": "online_dpo", "unit": "pair"}}, r"was built for algorithm loss='grpo'.*"
            r"this config trains loss='online_dpo'.*set algorithm.loss"),
           ({**ok, "prompts_per_step": 8}, r"holds 2 prompt groups.*algorithm.prompts_per_step=8: set it to 2"),
           ({**ok, "vocab_size": top}, rf"holds token id {top}, beyond this model's vocabulary \({top} ids\).*another tokenizer")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=r"run.replay: .*batch_000000.json.gz " + msg):
            check_replay_dir(tmp_path, 0, 3, **kw)
    save_batch(dataclasses.replace(_batch(1), index=1), tmp_path / "rollouts", algorithm=tag)
    batch_path(tmp_path / "rollouts", 1).rename(batch_path(tmp_path / "rollouts", 5))
    save_batch(_batch(2), tmp_path / "x", algorithm=tag)
    batch_path(tmp_path / "x", 2).rename(batch_path(tmp_path / "rollouts", 1))   # batch 2's file named 1
    with pytest.raises(ValueError, match=r"batch_000001.json.gz holds batch 2, not 1; .*mixed from two runs"):
        check_replay_dir(tmp_path, 0, 3, **ok)
    data = batch_path(tmp_path / "rollouts", 2).read_bytes()
    batch_path(tmp_path / "rollouts", 2).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"run.replay: .*batch_000002.json.gz: not a readable rollout batch"):
        check_replay_dir(tmp_path, 2, 3, **ok)
    assert check_replay_dir(tmp_path, 0, 1, **ok)   # the batches it is not asked for are not read
