"""tools/plot_run.py and the sweep's plotting: tables and PNGs from metric rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
pytestmark = pytest.mark.timeout(120)


def _write(run: Path, rows):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_run_table_and_png(tmp_path):
    import plot_run

    rows = [{"step": s, "loss/total": 0.7 - 0.01 * s, "kl/ref_k1": 0.001 * s,
             "task/math/reward_mean": 0.1 * s, "task/math/reward_per_token": 0.01 * s,
             "task/chat/reward_mean": None if s == 2 else -0.5 + s, "task/chat/reward_per_token": 0.02}
            for s in (1, 2, 3)]
    rows.append(dict(rows[-1], **{"task/math/reward_mean": 9.0}))   # a resumed step: the last row wins
    _write(tmp_path / "run", rows)
    loaded = plot_run.load_rows(tmp_path / "run")
    assert [r["step"] for r in loaded] == [1, 2, 3] and loaded[-1]["task/math/reward_mean"] == 9.0
    assert plot_run.task_names(loaded) == ["math", "chat"]
    table = plot_run.table(loaded).splitlines()
    assert table[0].startswith("| step | math reward | chat reward")
    assert table[3].split("|")[3].strip() == ""        # step 2 has no chat reward
    assert plot_run.main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


def test_plot_run_missing_folder_is_a_clear_error(tmp_path, capsys):
    import plot_run

    assert plot_run.main([str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_sweep_plot_and_tail_mean(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import offpolicy_sweep

    rows = [{"reward/mean": float(i), "kl/ref_k1": None if i == 3 else 0.1} for i in range(5)]
    assert offpolicy_sweep._tail_mean(rows, "reward/mean", 2) == pytest.approx(3.5)
    assert offpolicy_sweep._tail_mean(rows, "kl/ref_k1", 2) == pytest.approx(0.1)
    res = [{"loss": l, "N": n, "reward": 0.1 * n, "kl": 0.01 * n} for l in ("online_dpo", "ppo") for n in (1, 2)]
    offpolicy_sweep._plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
