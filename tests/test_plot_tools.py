"""tools/plot_run.py and bench/seeds_repro.py: tables and PNGs from metric rows (the grid's
``--dry-run`` end to end is in tests/test_convergence.py, which has a Ray cluster and engine)."""

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


def _cell_json(out: Path, name: str, gain: float, lr: float = 3e-6, wall: float = 600.0, after_se=0.04):
    d = {"cell": {"name": name}, "lr": lr, "metric": "pass@1", "before": 0.6, "before_se": 0.04,
         "after": 0.6 + gain, "after_se": after_se, "gain": gain, "gain_se": 0.05, "z": gain / 0.05,
         "mean@k": None, "kl_k1": 0.01, "staleness_mean": 1.0, "token_mult_prob_error_mean": 1.01,
         "tis_weight_mean": 0.99, "tis_capped_frac": 0.0, "loop_wall_s": wall,
         "load": {"mean": 20.0, "max": 30.0, "nproc": 2}}
    (out / f"{name}.json").write_text(json.dumps(d))


def test_seeds_repro_grid_pilot_choice_and_async_difference(tmp_path):
    """The grid's cells and --only groups; the pilot picks the largest validation gain (ties: the
    smaller lr); async - sync per seed is after_async - after_sync with the two ses combined, and
    over seeds the mean with std/sqrt(n); the table lists every missing cell and the plots exist."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    cells = sr.grid()
    names = [c.name for c in cells]
    assert names[:2] == ["A_sync_s0", "A_async_s0"] and "B_rloo_N16" in names and "P_grpo_lr1e-5" in names
    assert {c.name for c in sr.select(cells, ["A"])} == {f"A_{m}_s{s}" for m in ("sync", "async") for s in (0, 1, 2)}
    assert all(c.group != "ppo" for c in sr.select(cells, None))
    assert [c.name for c in sr.select(cells, ["B_grpo_N4", "P"])][-1] == "B_grpo_N4"
    with pytest.raises(SystemExit, match="unknown"):
        sr.select(cells, ["B_grpo_N3"])
    assert next(c for c in cells if c.name == "B_online_dpo_N1").alias == "A_async_s0"

    for lr, gain in ((1e-6, 0.02), (3e-6, 0.10), (1e-5, 0.10)):
        _cell_json(tmp_path, f"P_grpo_lr{sr.lr_tag(lr)}", gain, lr=lr)
    _cell_json(tmp_path, "P_rloo_lr1e-6", 0.3, lr=1e-6)
    res = sr.read_results(tmp_path)
    assert sr.pilot_choice(res, "grpo", sr.PILOT_LRS)[0] == 3e-6       # tie 3e-6 / 1e-5: the smaller
    assert sr.pilot_choice(res, "rloo", sr.PILOT_LRS)[0] is None       # 2 of 3 pilots missing

    _cell_json(tmp_path, "A_sync_s0", 0.10, wall=900.0, after_se=0.03)
    _cell_json(tmp_path, "A_async_s0", 0.14, wall=600.0, after_se=0.04)
    one = sr.async_vs_sync(sr.read_results(tmp_path))
    assert one["n"] == 1 and one["diff_mean"] == pytest.approx(0.04) and one["diff_se"] == pytest.approx(0.05)
    _cell_json(tmp_path, "A_sync_s1", 0.10, wall=1000.0)
    _cell_json(tmp_path, "A_async_s1", 0.08, wall=500.0)
    two = sr.async_vs_sync(sr.read_results(tmp_path))
    assert two["diff_mean"] == pytest.approx(0.01) and two["diff_se"] == pytest.approx(0.03)   # std 0.0424/sqrt 2
    assert two["wall_ratio_mean"] == pytest.approx((600 / 900 + 0.5) / 2)

    text = sr.write_tables(tmp_path, sr.read_results(tmp_path), cells, sr.PILOT_LRS, dry_run=False,
                           steps=16, pilot_steps=8)
    assert "| A_async_s0 | 0 | async N=1 | 0.600 ± 0.040 -> 0.740 ± 0.040 | +0.140 ± 0.050 (2.8)" in text
    assert "2 seed(s): gain async - sync = +0.010 ± 0.030" in text
    assert "| grpo | 3e-06 |" in text and "**yes**" in text
    missing = text.split("## Not run yet")[1].split("PPO (if")[0].split()
    assert "A_sync_s2" in missing and "B_grpo_N1" in missing and "A_sync_s0" not in missing
    assert "B_online_dpo_N1" not in missing and "B_ppo_N1" not in missing   # read from A_async_s0; optional
    for png in ("gain_vs_N.png", "gain_vs_wall.png"):
        assert (tmp_path / png).stat().st_size > 1000
