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
