"""A failed HF export names its path and cause in one line and leaves no temporary folder (issue 36,
principle 2): the learner's shard writer (``learner.weights.write_hf_shards``) and the driver's
swap into ``<run>/hf_final`` (``trainer.run._export_final``), with safetensors' save made to fail
as a full disk does. No actors: the learner's calls run in-process."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)

ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"


def _no_space(*a, **k):
    from safetensors import SafetensorError

    raise SafetensorError(ENOSPC_TEXT)


class _FakeRun:
    """What ``_export_final`` uses of a Run: ``learner.export_hf.remote`` and ``call``; the export
    writes like ``MegatronLearner.export_hf`` on one rank (a temporary sibling, shards, finalize)."""

    def __init__(self, base: Path):
        self.learner, self.base = self, base
        self.export_hf = self

    def remote(self, out_dir: str, base_model_dir: str):
        from megatron_rlhf.learner.weights import finalize_hf_folder, prepare_hf_dir, write_hf_shards

        tmp = prepare_hf_dir(out_dir)   # the learner's ..hf_final.tmp-<pid>.<random>
        shards = write_hf_shards(iter([("w", torch.zeros(4))]), tmp, "stage000", 2**30)
        finalize_hf_folder(tmp, out_dir, base_model_dir, shards)

    def call(self, ref, what):
        return ref


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    return base


def test_a_full_disk_while_writing_shards_names_the_shard_and_the_cause(tmp_path, monkeypatch):
    import safetensors.torch

    from megatron_rlhf.learner.weights import write_hf_shards
    from megatron_rlhf.utils.atomic import AtomicWriteError

    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    with pytest.raises(AtomicWriteError) as e:
        write_hf_shards(iter([("w", torch.zeros(4))]), tmp_path, "stage000", 2**30)
    assert e.value.errno == errno.ENOSPC and e.value.strerror == (
        f"cannot write {tmp_path / 'stage000-00000.safetensors'}: no space left on device: free space, "
        "or set run.output_dir to a larger disk")


def test_a_failed_hf_export_is_one_line_and_leaves_no_tmp_folder_and_the_next_export_clears_strays(
        tmp_path, monkeypatch):
    import safetensors.torch

    from megatron_rlhf.trainer.run import _export_final
    from megatron_rlhf.utils.atomic import AtomicWriteError

    run_dir, base = tmp_path / "run", _base(tmp_path)
    run_dir.mkdir()
    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    with pytest.raises(AtomicWriteError) as e:
        _export_final(_FakeRun(base), run_dir, base)
    msg = e.value.strerror
    assert "\n" not in msg and "no space left on device" in msg and str(run_dir) in msg, msg
    assert sorted(p.name for p in run_dir.iterdir()) == []   # no ..hf_final.tmp-* / .hf_final.tmp-*

    for stray in (".hf_final.tmp-1", "..hf_final.tmp-1.abcd", ".hf_final.old-1"):   # an earlier driver killed mid-export
        (run_dir / stray).mkdir()
        (run_dir / stray / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    _export_final(_FakeRun(base), run_dir, base)
    assert sorted(p.name for p in run_dir.iterdir()) == ["hf_final"]
    assert sorted(p.name for p in (run_dir / "hf_final").iterdir()) == ["config.json", "model.safetensors"]


def test_train_py_prints_a_write_failure_as_one_line_exit_1(monkeypatch, capsys):
    sys.path.insert(0, str(REPO))
    import train

    import megatron_rlhf.trainer.loop as loop
    from megatron_rlhf.trainer.run import export_write_error

    def failing_train(cfg):
        from ray.exceptions import RayTaskError

        from megatron_rlhf.utils.atomic import write_error

        cause = write_error("/r/..hf_final.tmp-1.x/stage000-00000.safetensors", OSError(errno.EROFS, "ro"))
        raise export_write_error(Path("/r/hf_final"), RayTaskError("export_hf", "Traceback\n" * 50, cause)
                                 .as_instanceof_cause())

    monkeypatch.setattr(loop, "train", failing_train)
    assert train.main(["--config", str(REPO / "configs" / "ci_tiny.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["write failed: cannot write /r/..hf_final.tmp-1.x/stage000-00000.safetensors: read-only "
                   "file system: set run.output_dir to a writable folder"], err


def test_a_bf16_export_says_bfloat16_in_its_config_whatever_the_base_model_says(tmp_path):
    """A bf16 learner's HF export from an fp32 base folder: the shards hold bf16 and config.json
    says ``bfloat16`` (it kept the base's ``float32``, found by the bf16 rehearsal on CPU)."""
    import json

    from safetensors import safe_open

    from megatron_rlhf.learner.weights import finalize_hf_folder, prepare_hf_dir, write_hf_shards

    base = _base(tmp_path)
    (base / "config.json").write_text(json.dumps({"dtype": "float32", "torch_dtype": "float32"}))
    out = tmp_path / "hf_final"
    tmp = prepare_hf_dir(out)
    shards = write_hf_shards(iter([("w", torch.ones(4, dtype=torch.bfloat16))]), tmp, "stage000", 2**30)
    finalize_hf_folder(tmp, out, base, shards, dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("w").dtype == torch.bfloat16
