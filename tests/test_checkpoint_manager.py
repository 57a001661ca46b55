"""Atomic, rotating checkpoints: a failed save leaves the last good one intact."""

import json

import pytest

from megatron_rlhf.trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.timeout(30)


def _write(tmp):
    (tmp / "learner").mkdir()
    (tmp / "learner" / "w.bin").write_bytes(b"x" * 10)


def test_save_latest_and_rotation(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    assert m.latest() is None
    for step in (1, 2, 3):
        m.save(step, {"step": step}, _write)
    steps = [s for s, _ in m.complete_checkpoints()]
    assert steps == [2, 3]
    path, state = m.latest()
    assert path.name == "step_3" and state == {"step": 3}


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    m.save(1, {"step": 1}, _write)

    def crash(tmp):
        _write(tmp)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        m.save(2, {"step": 2}, crash)
    path, state = m.latest()
    assert path.name == "step_1" and state["step"] == 1
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "ck").iterdir())
    assert not (tmp_path / "ck" / "step_2").exists()


def test_incomplete_folder_is_ignored(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    m.save(1, {"step": 1}, _write)
    half = tmp_path / "ck" / "step_5"
    half.mkdir()
    (half / "trainer_state.json").write_text(json.dumps({"step": 5}))   # no COMPLETE marker
    assert m.latest()[1]["step"] == 1
