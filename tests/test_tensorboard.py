"""TensorBoard event files beside metrics.jsonl (``logging.tensorboard``, issue 15 part 4): every
number of a step's row is a scalar at that step, the config is a text, and after a crash and a
resumed run the event files hold exactly one value per step, equal to the final metrics.jsonl.
Read back with tensorboard's own EventAccumulator (what ``tensorboard --logdir`` shows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def tensorboard_scalars(tb_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``tb_dir`` as ``{tag: [(step, value), ...]}`` after
    TensorBoard's purge of orphaned events (nothing sampled away; a tag whose every value was
    purged is left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {tag: pts for tag, pts in out.items() if pts}


def jsonl_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The same view of ``run_dir/metrics.jsonl``: every number but ``step`` (nulls left out)."""
    out: dict[str, list] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                out.setdefault(k, []).append((row["step"], float(v)))
    return out


def assert_tensorboard_matches_jsonl(run_dir: str | Path) -> None:
    """The event files of ``run_dir/tensorboard`` hold exactly the numbers of ``metrics.jsonl``
    (float32 precision), one value per step and tag."""
    tb, js = tensorboard_scalars(Path(run_dir) / "tensorboard"), jsonl_scalars(run_dir)
    assert sorted(tb) == sorted(js)
    for tag, pts in js.items():
        assert [s for s, _ in tb[tag]] == [s for s, _ in pts], tag
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in pts], rel=1e-6), tag


def _row(step: int, session: int, **extra) -> dict:
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS

    row = {k: 0.25 * step + i for i, k in enumerate(REQUIRED_KEYS)}
    row.update(step=step, **{"reward/mean": step + session / 10, "pairs/count": 3 * step,
                             "loss/total": float("nan") if step == 2 else -0.5 * step}, **extra)
    return row


def test_rows_written_are_read_back_as_tensorboard_scalars_equal_to_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, LoggingConfig(), {"run": {"name": "tb_test"}})
    for s in (1, 2, 3):   # eval keys in rows 1 and 3 only, as an eval interval gives them
        log.log(_row(s, 0, **({"eval/step": s - 1, "eval/math/pass@1": 0.125 * s, "eval/math/pass@1/se": 0.01}
                              if s != 2 else {})))
    log.close()
    assert_tensorboard_matches_jsonl(tmp_path)
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert tb["eval/math/pass@1"] == [(1, 0.125), (3, 0.375)]
    assert [s for s, _ in tb["loss/total"]] == [1, 3]            # NaN -> null in the jsonl: not logged
    assert tb["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0)] and "step" not in tb
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    assert text.step == 1 and "name: tb_test" in text.tensor_proto.string_val[0].decode()


def test_resume_after_a_crash_leaves_one_tensorboard_value_per_step_matching_the_jsonl(tmp_path):
    """Rows 1..5 written, the driver dies; the checkpoint of step 2 is the last complete one, so
    the re-run redoes 3.. and writes 3..6 (other values): TensorBoard shows 1..6 once each, steps
    1-2 from the first session and 3-6 from the second, exactly the final metrics.jsonl."""
    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import MetricsLogger

    first = MetricsLogger(tmp_path, LoggingConfig(), {"run": {"name": "a"}})
    for s in range(1, 6):
        first.log(_row(s, 0, **({"eval/math/pass@1": 0.5} if s == 5 else {})))   # a tag only step 5 had
    first._tb.flush()   # "crash": no close
    second = MetricsLogger(tmp_path, LoggingConfig(), {"run": {"name": "b"}}, resume_step=2)
    for s in range(3, 7):
        second.log(_row(s, 1))
    second.close()
    assert_tensorboard_matches_jsonl(tmp_path)
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in tb["reward/mean"]] == pytest.approx([1.0, 2.0, 3.1, 4.1, 5.1, 6.1])
    assert "eval/math/pass@1" not in tb    # purged with the rest of the lost steps
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_tensorboard_off_writes_no_event_files(tmp_path):
    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False))
    log.log(_row(1, 0))
    log.close()
    assert log.tensorboard_dir is None and not (tmp_path / "tensorboard").exists()
