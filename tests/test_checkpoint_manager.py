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


def test_rotation_deletes_only_references_no_kept_checkpoint_names(tmp_path):
    """reference_vK folders beside the step folders live while a kept step's
    ``learner/reference.json`` names them (megatron_rlhf/learner/checkpoint.py writes it)."""
    m = CheckpointManager(tmp_path / "ck", keep_last=2)

    def writer(version):
        def write(tmp):
            ref = m.root / f"reference_v{version:08d}"
            ref.mkdir(exist_ok=True)
            (tmp / "learner").mkdir()
            rel = __import__("os").path.relpath(ref, tmp / "learner")
            (tmp / "learner" / "reference.json").write_text(json.dumps({"version": version, "dir": rel}))
        return write

    m.save(1, {"step": 1}, writer(0))
    m.save(2, {"step": 2}, writer(0))
    m.save(3, {"step": 3}, writer(3))
    assert sorted(p.name for p in m.root.glob("reference_v*")) == ["reference_v00000000", "reference_v00000003"]
    (m.root / "reference_v00000007").mkdir()   # orphan of a failed save
    m.save(4, {"step": 4}, writer(3))          # keeps 3 and 4: both name v3
    assert [p.name for p in m.root.glob("reference_v*")] == ["reference_v00000003"]


def test_a_started_checkpoint_is_complete_and_rotated_only_at_finish(tmp_path):
    """checkpoint.async_save: between start (the learner's writers run) and finish the checkpoint
    is a .tmp folder: not a checkpoint for resume, and keep_last still keeps every complete one;
    a writer that fails at finish leaves the last complete checkpoint and no .tmp folder."""
    from megatron_rlhf.trainer.checkpoint import CheckpointError

    m = CheckpointManager(tmp_path / "ck", keep_last=1)
    m.save(1, {"step": 1}, _write)
    pending = m.start(2, {"step": 2}, _write)
    assert pending.tmp.is_dir() and not (pending.tmp / "COMPLETE").exists()
    assert [s for s, _ in m.complete_checkpoints()] == [1] and m.latest()[1] == {"step": 1}
    waited = []
    assert m.finish(pending, lambda: waited.append(True)).name == "step_2"
    assert waited == [True] and [s for s, _ in m.complete_checkpoints()] == [2]   # step_1 rotated now
    assert json.loads((tmp_path / "ck" / "step_2" / "trainer_state.json").read_text()) == {"step": 2}

    def failed_writer():
        raise OSError("writer exited")

    with pytest.raises(CheckpointError, match=r"cannot save checkpoint step 3 into .*\.tmp-step_3-\d+: "
                                              r"OSError: writer exited; the last complete checkpoint is intact"):
        m.finish(m.start(3, {"step": 3}, _write), failed_writer)
    assert [s for s, _ in m.complete_checkpoints()] == [2]
    assert not list((tmp_path / "ck").glob(".tmp-*"))
