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
    assert all(c.group != "Cseeds" for c in sr.select(cells, None))
    picked = [c.name for c in sr.select(cells, ["B_grpo_N4", "P"])]   # grid order: B_grpo_N4 after the PG pilots
    assert picked.index("B_grpo_N4") == picked.index("P_rloo_lr1e-5") + 1
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
    assert "95% t-interval [-0.371, +0.391] (mean ± t_{0.975, 1} = 12.71 × se)" in text   # 0.01 ± 12.706 x 0.03
    assert "unpaired after-after se: no per-prompt outcomes stored" in text
    assert "| grpo | 3e-06 |" in text and "**yes**" in text
    missing = text.split("## Not run yet")[1].split("Optional (")[0].split()
    assert "A_sync_s2" in missing and "B_grpo_N1" in missing and "A_sync_s0" not in missing
    assert "B_online_dpo_N1" not in missing and "C_ppo_N4_s1" not in missing   # read from A_async_s0; optional
    assert "C_ppo_N4_s0" in missing and "C_ppo_N4_s1" in text.split("Optional (")[1]
    for png in ("gain_vs_N.png", "gain_vs_wall.png", "frontier.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_seeds_repro_statistics_match_hand_computed_values():
    """The t multiplier and p, the exact sign-flip and permutation p, and the paired (McNemar) se,
    each against a value computed by hand; grid A's three recorded seeds give the review's numbers."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    # t with df 1 is Cauchy: q_0.975 = tan(0.475 pi) = 12.706; df 2: 4.303 (p = 1 - t / sqrt(2 + t^2))
    assert sr.t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert sr.t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-3)
    assert sr.t_two_sided_p(-4.33, 2) == pytest.approx(1 - 4.33 / (2 + 4.33 ** 2) ** 0.5)
    assert sr.t_two_sided_p(1.0, 1) == pytest.approx(0.5)                 # Cauchy: P(|T| > 1) = 1/2
    # grid A's per-seed differences -7, -3, -5 prompts of 128: mean -5/128, sd 2/128, se 2/128/sqrt 3
    d = [-7 / 128, -3 / 128, -5 / 128]
    iv = sr.t_interval(d)
    assert iv["mean"] == pytest.approx(-0.0390625) and iv["se"] == pytest.approx(2 / 128 / 3 ** 0.5)
    assert iv["lo"] == pytest.approx(-0.0390625 - 4.3027 * iv["se"], abs=1e-5) and iv["hi"] < 0
    assert iv["t"] == pytest.approx(-(3 ** 0.5) * 2.5) and iv["p_two_sided"] == pytest.approx(0.0494, abs=1e-3)
    # sign flips: 3 of 3 negative is the most extreme of 8 patterns (and its mirror two-sided)
    assert sr.sign_flip_p(d) == {"n": 3, "less": 0.125, "greater": 1.0, "two_sided": 0.25}
    # afters 98, 98, 97 vs 105, 101, 102: every async below every sync, 1 of C(6, 3) = 20 splits
    pm = sr.permutation_p([98, 98, 97], [105, 101, 102])
    assert pm["less"] == pytest.approx(0.05) and pm["two_sided"] == pytest.approx(0.1)
    # paired: a right on prompts 0-2, b on 2-3 of 4 (ids aligned out of order): a_only 2, b_only 1,
    # d = [1, 1, 0, -1]: mean 0.25, sd sqrt((0.5625 x 2 + 0.0625 + 1.5625) / 3) = 0.9574, se / 2
    pr = sr.paired_outcome_diff({"outcomes": "1110", "ids": [0, 1, 2, 3], "groups": ["x", "x", "y", "y"]},
                                {"outcomes": "1100", "ids": [3, 2, 1, 0]})
    assert (pr["a_only"], pr["b_only"], pr["n"]) == (2, 1, 4) and pr["diff"] == pytest.approx(0.25)
    assert pr["se"] == pytest.approx((2.75 / 3) ** 0.5 / 2)
    # by product: x = {1, 1}, y = {0, -1}: totals 1.5, -1.5 -> sqrt(2 x 4.5) / 4 = 0.75
    assert pr["se_cluster"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="different prompts"):
        sr.paired_outcome_diff({"outcomes": "1", "ids": [0]}, {"outcomes": "1", "ids": [5]})


def test_seeds_repro_difference_of_gains_never_counts_the_shared_before_twice():
    """rloo N=4 vs N=1 of the grid (before 78/128 in both, after 109 and 123): the old verdicts'
    hypot(gain_se, gain_se) gave z = -1.54; after-after gives -3.04 (the review's table); with
    per-prompt outcomes in both cells the difference is paired; different befores keep the gain ses."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    n4 = {"before": 0.609375, "after": 0.8515625, "after_se": 0.031534, "gain": 0.2421875, "gain_se": 0.053637}
    n1 = {"before": 0.609375, "after": 0.9609375, "after_se": 0.017187, "gain": 0.3515625, "gain_se": 0.046620}
    g = sr.gain_diff(n4, n1)
    assert g["how"] == "after-after" and g["se"] == pytest.approx((0.031534 ** 2 + 0.017187 ** 2) ** 0.5)
    assert g["z"] == pytest.approx(-3.04, abs=0.01) and g["z_double_counted"] == pytest.approx(-1.54, abs=0.01)
    a = dict(n4, outcomes={"after": "1100", "ids": [0, 1, 2, 3]})
    b = dict(n1, outcomes={"after": "1111", "ids": [0, 1, 2, 3]})
    p = sr.gain_diff(a, b)
    # d = [0, 0, -1, -1]: mean -0.5, sample variance 4 x 0.25 / 3, se = sqrt(1/3) / 2
    assert p["how"] == "paired" and p["discordant"] == (0, 2) and p["se"] == pytest.approx((1 / 3) ** 0.5 / 2)
    other = sr.gain_diff(dict(n4, before=0.5), n1)
    assert other["how"] == "gain-gain" and other["se"] == pytest.approx((0.053637 ** 2 + 0.046620 ** 2) ** 0.5)


def test_seeds_repro_cells_keep_per_prompt_outcomes_and_the_table_pairs_them(tmp_path):
    """``eval_outcomes`` takes the first and last eval's outcomes, ids, product ids, versions and
    cluster se from the metrics rows; two A cells that store them get a paired difference."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    ev = {"eval/math/ids": [4, 5, 6, 7], "eval/math/groups": ["1 x 2", "1 x 2", "3 x 3", "3 x 3"]}
    rows = [{"step": 1, "eval/step": 0, "eval/weight_version": 0, "eval/math/outcomes": "0101",
             "eval/math/pass@1/se_cluster": 0.0, **ev},
            {"step": 2, "eval/step": 2, "eval/weight_version": 2, "eval/math/outcomes": "1101", **ev},
            {"step": 3}]
    o = sr.eval_outcomes(rows)
    assert (o["before"], o["after"], o["ids"], o["before_step"], o["after_weight_version"]) == ("0101", "1101", [4, 5, 6, 7], 0, 2)
    assert o["groups"] == ev["eval/math/groups"] and o["before_se_cluster"] == 0.0
    assert sr.eval_outcomes([{"step": 1, "eval/step": 0}]) is None          # a run from before the outcomes
    for name, after in (("A_sync_s0", "1111"), ("A_async_s0", "1101")):
        _cell_json(tmp_path, name, 0.2)
        d = json.loads((tmp_path / f"{name}.json").read_text())
        d["outcomes"] = {"before": "0101", "after": after, "ids": [4, 5, 6, 7], "groups": None}
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    text = sr.write_tables(tmp_path, sr.read_results(tmp_path), sr.grid(), sr.PILOT_LRS, dry_run=False,
                           steps=16, pilot_steps=8)
    assert "paired over prompts (McNemar), discordant 0/1" in text and "stored in 2 of 2 cell files" in text


def test_seeds_repro_papers_estimators_and_n_are_defined_and_every_cell_config_loads():
    """Issue 34's cells (defined, not run): the papers' N (max_staleness = N - 1, N = 1 on-policy),
    PPO and Proximal RLOO with T = 2 and beta = 0.05, on-policy GRPO/RLOO, TIS off at N = 16, Online
    DPO's pilot on the training rows; every cell of the grid gives a config the loader accepts."""
    import argparse

    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    args = argparse.Namespace(steps=16, pilot_steps=8, runs="/tmp/seeds-repro-cfg", dry_run=False,
                              pilot_eval_prompts=64, override=[], eval_samples=1)
    cells = {c.name: c for c in sr.grid()}
    ov = {n: sr.overrides(c, c.lr or 1e-5, args, "smollm2") for n, c in cells.items()}
    for key in ("async.max_staleness=3", "async.sync_interval=4", "algorithm.updates_per_batch=2",
                "algorithm.kl_beta=0.05", "algorithm.carry_surplus=false", "eval.interval=8", "eval.samples=1"):
        assert key in ov["C_ppo_N4_s0"] and key in ov["C_proximal_rloo_N4_s0"], key
    assert "async.sync=true" in ov["C_online_dpo_N1_s0"] and "eval.interval=16" in ov["C_ppo_N16_s0"]
    assert "algorithm.kl_beta=0.05" not in ov["C_online_dpo_N4_s0"] and cells["C_online_dpo_N4_s0"].lr is None
    assert "async.sync=true" in ov["B_grpo_onpolicy"] and "algorithm.is_correction=none" in ov["B_rloo_N16_isnone"]
    assert cells["B_rloo_N16_isnone"].vs == ["B_rloo_N16"] and cells["C_ppo_N2_s1"].vs == ["C_ppo_N1_s1"]
    pilot = ov["P_online_dpo_lr3e-6"]   # a validation slice of the training rows: no eval_data
    assert any(o.startswith("tasks=") and "eval_data" not in o for o in pilot) and cells["P_online_dpo_lr3e-6"].pilot
    assert cells["C_ppo_N4_s1"].group == "Cseeds" and cells["C_ppo_N4_s1"] not in sr.select(list(cells.values()), None)
    for name, c in cells.items():   # the config checks every run would meet at its start
        cfg, _ = sr.load(args, c, c.lr or 1e-5, "smollm2")
        if c.papers_n and not c.sync:
            assert cfg.async_.max_staleness == cfg.async_.sync_interval - 1 == c.n - 1, name


def test_seeds_repro_lag_matched_grid_pairs_async_n_plus_1_and_async_n_with_sync_n_by_hand(tmp_path):
    """Grid L (issue 34, item 6a): sync 16 vs async 17 steps with an eval every 4; ``lag_matched``
    pairs async's last eval (step 17) and its step-16 eval with sync's step 16 over the same prompts,
    per seed and across seeds (t-interval, sign flips), each checked against hand-computed values;
    the table and the gain-vs-wall and frontier plots take the L cells."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    cells = {c.name: c for c in sr.grid()}
    assert [cells[f"L_{m}_s7"].group for m in ("sync", "async")] == ["L", "L"]
    assert (cells["L_async_s0"].step_offset, cells["L_async_s0"].eval_interval, cells["L_sync_s0"].step_offset) == (1, 4, 0)
    assert cells["L48_async_s2"].steps == 48 and cells["L_async_s0"].vs == ["L_sync_s0"]
    assert "algorithm.carry_surplus=false" in cells["L48_async_s2"].extra and cells["L_async_s0"].extra == []
    ids, groups = [0, 1, 2, 3], ["a", "a", "b", "b"]
    spec = {0: ("1100", "1110", "1000"), 1: ("1000", "1110", "1000")}   # sync@16, async@17, async@16
    for seed, (sync16, async17, async16) in spec.items():
        for arm, after, step, inter in (("sync", sync16, 16, []), ("async", async17, 17, [(16, async16)])):
            name = f"L_{arm}_s{seed}"
            _cell_json(tmp_path, name, 0.1, wall=600.0 if arm == "sync" else 450.0)
            d = json.loads((tmp_path / f"{name}.json").read_text())
            d["outcomes"] = {"before": "1000", "after": after, "ids": ids, "groups": groups, "after_step": step,
                             "intermediate": [{"step": s, "outcomes": o} for s, o in inter]}
            d["curve"] = [{"step": 0, "value": 0.25, "gain": 0.0, "wall_s": 0.0, "kl_ref": 0.0},
                          {"step": step, "value": after.count("1") / 4, "gain": after.count("1") / 4 - 0.25,
                           "wall_s": 500.0, "kl_ref": 0.01}]
            d["steps"] = step
            (tmp_path / f"{name}.json").write_text(json.dumps(d))
    lm = sr.lag_matched(sr.read_results(tmp_path), "L", (0, 1))
    s0, s1 = lm["per_seed"]
    # seed 0 matched: d = [0, 0, 1, 0]: mean 0.25, sd 0.5, se 0.25; same step: d = [0, -1, 0, 0]
    assert s0["matched"]["diff"] == pytest.approx(0.25) and s0["matched"]["se"] == pytest.approx(0.25)
    assert s0["same_step"]["diff"] == pytest.approx(-0.25) and (s0["same_step"]["a_only"], s0["same_step"]["b_only"]) == (0, 1)
    assert s1["matched"]["diff"] == pytest.approx(0.5) and s1["same_step"]["diff"] == 0.0
    assert s0["steps"] == (16, 17) and s0["wall_ratio"] == pytest.approx(0.75)
    # across seeds: matched [0.25, 0.5]: mean 0.375, sd 0.17678, se 0.125, t_{0.975,1} = 12.706
    iv = lm["matched"]["interval"]
    assert iv["mean"] == pytest.approx(0.375) and iv["lo"] == pytest.approx(0.375 - 12.7062 * 0.125, abs=1e-3)
    assert lm["matched"]["sign_flip"]["two_sided"] == pytest.approx(0.5)   # ++ and -- of 4 patterns
    assert lm["curve"]["async"] == {0: 0.25, 17: 0.75} and lm["curve_n"]["sync"] == {0: 2, 16: 2}
    text = sr.write_tables(tmp_path, sr.read_results(tmp_path), sr.grid(), sr.PILOT_LRS, dry_run=False,
                           steps=16, pilot_steps=8)
    assert "## L. Lag-matched: sync 16 steps vs one-step async 17 steps" in text
    assert "**2 seeds, matched (async N + 1 - sync N): +0.375, 95% t-interval [-1.213, +1.963]**" in text
    assert "- seed 0 (sync 16 / async 17 steps): matched +0.250 ± 0.250 [cl." in text
    assert "| sync | 0.250 (2) | 0.375 (2) | – |" in text and "## L48." not in text
    assert "L_sync_s2" in text.split("## Not run yet")[1]
    for png in ("gain_vs_wall.png", "frontier.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_seeds_repro_provenance_is_dirty_for_changed_code_not_for_its_own_results_folder(tmp_path, monkeypatch):
    """A cell's ``started.dirty`` flags uncommitted changes of tracked files, but not the results
    folder the harness itself rewrites after every cell (``results.md``, the plots): grid L's
    first run flagged every cell after the first as dirty for exactly that."""
    import subprocess

    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    out = tmp_path / "bench" / "results" / "seeds_repro"
    out.mkdir(parents=True)
    (out / "results.md").write_text("table\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(sr, "REPO", tmp_path)
    assert sr.provenance(out)["dirty"] is False
    (out / "results.md").write_text("table, rewritten after a cell\n")
    assert sr.provenance(out)["dirty"] is False and sr.provenance()["dirty"] is True
    (tmp_path / "code.py").write_text("x = 2\n")
    assert sr.provenance(out)["dirty"] is True
    assert sr.provenance(Path("/elsewhere"))["dirty"] is True   # a folder outside the repository


def test_seeds_repro_eval_curve_kl_ref_frontier_and_wall_plots(tmp_path):
    """A cell's curve: every eval's loop wall (sum of time/step_s through its step), gain and KL on
    fresh samples; the C table and its comparison with N = 1; the frontier and gain-vs-wall PNGs from
    synthetic cell files (a cell without a curve falls back to its end point)."""
    sys.path.insert(0, str(REPO / "bench"))
    import seeds_repro as sr
    import seeds_repro_plots as plots

    ev = lambda s, p, kl: {"eval/step": s, "eval/weight_version": s, "eval/math/pass@1": p,  # noqa: E731
                           "eval/math/pass@1/se": 0.04, "eval/math/kl_ref": kl, "eval/math/kl_ref/se": 0.001,
                           "eval/reference_version": 0}
    rows = [{"step": 1, "time/step_s": 10.0, **ev(0, 0.5, 0.0)}, {"step": 2, "time/step_s": 12.0, **ev(2, 0.6, 0.01)},
            {"step": 3, "time/step_s": 11.0}, {"step": 4, "time/step_s": 9.0, **ev(4, 0.7, 0.02)}]
    curve = sr.eval_curve(rows)
    assert [(c["step"], c["wall_s"]) for c in curve] == [(0, 0.0), (2, 22.0), (4, 42.0)]
    assert [round(c["gain"], 6) for c in curve] == [0.0, 0.1, 0.2] and curve[-1]["kl_ref"] == 0.02
    assert plots.curve_points({"curve": curve}, "kl_ref") == [(0.0, 0.0), (0.01, curve[1]["gain"]), (0.02, curve[2]["gain"])]
    assert plots.curve_points({"loop_wall_s": 600.0, "gain": 0.1}, "wall_s") == [(10.0, 0.1)]
    assert plots.curve_points({"loop_wall_s": 600.0, "gain": 0.1}, "kl_ref") == []

    for name, gain, kl in (("C_online_dpo_N1_s0", 0.2, 0.010), ("C_online_dpo_N4_s0", 0.1, 0.006),
                           ("A_sync_s0", 0.2, None), ("A_async_s0", 0.15, None)):
        _cell_json(tmp_path, name, gain)
        d = json.loads((tmp_path / f"{name}.json").read_text())
        if kl is not None:
            d["kl_ref"] = {"before": 0.0, "after": kl, "after_se": 0.001, "after_seq": kl * 20}
            d["curve"] = [{"step": s, "wall_s": 60.0 * s, "gain": gain * s / 16, "kl_ref": kl * s / 16,
                           "value": 0.6 + gain * s / 16} for s in (0, 8, 16)]
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    text = sr.write_tables(tmp_path, sr.read_results(tmp_path), sr.grid(), sr.PILOT_LRS, dry_run=False,
                           steps=16, pilot_steps=8)
    assert "| online_dpo | 4 | 0 | 3e-06 |" in text and "| 0.0060 ± 0.0010 |" in text
    assert "| C_online_dpo_N4_s0 | C_online_dpo_N1_s0 | -0.100 (" in text
    assert "| A_sync_s0 | 0 | sync |" in text and text.split("| A_sync_s0 |")[1].split("\n")[0].endswith("| – |")
    for png in ("frontier.png", "gain_vs_wall.png", "gain_vs_N.png"):
        assert (tmp_path / png).stat().st_size > 5000, png


def test_staleness_arms_reads_a_run_folder_into_its_table_with_hand_computed_numbers(tmp_path):
    """bench/staleness_arms.py: step and idle means skip step 1, the bound's path collapses
    repeats, generated per trained token = sum generated / sum pairs x (chosen + rejected length),
    the gain's se is the two evals' in quadrature; an unfinished folder exits 2."""
    sys.path.insert(0, str(REPO / "bench"))
    import staleness_arms

    rows = [{"step": s, "loss/total": 0.7, "async/max_staleness": b, "async/max_staleness_reason": f"r{s}",
             "time/step_s": t, "time/learner_idle_s": t / 10, "time/generator_idle_s": 1.0,
             "staleness/mean": st, "rollout/generated_tokens": 1000, "train/num_pairs": 4,
             "response/chosen_len_mean_tokens": 30.0, "response/rejected_len_mean_tokens": 20.0,
             "rollout/carried_trained": 1, "rollout/requeued_stale": s - 1, "staleness/dropped_pairs": 0}
            for s, b, t, st in ((1, 1, 100.0, 0.0), (2, 2, 20.0, 1.0), (3, 2, 30.0, 1.5), (4, 1, 40.0, 2.0))]
    _write(tmp_path / "arm", rows)
    summary = {"wall_s": 300.0, "eval": {"math": {"pass@1": {"first": 0.5, "first_se": 0.03, "last": 0.7, "last_se": 0.04}},
                                         "chat": {"reward_mean": {"first": 0.3, "first_se": 0.1, "last": 0.2, "last_se": 0.1}}}}
    (tmp_path / "arm" / "summary.json").write_text(json.dumps(summary))
    r = staleness_arms.arm_row(tmp_path / "arm")
    assert r["bound"] == "1 -> 2 -> 1" and r["reason"] == "r4"
    assert r["step_s"] == pytest.approx(30.0) and r["learner_idle_s"] == pytest.approx(3.0)
    assert r["staleness"] == pytest.approx(1.125)
    assert r["gen_per_trained"] == pytest.approx(4000 / (4 * 4 * 50))   # 5.0
    assert (r["carried"], r["requeued"]) == (4, 6)
    assert r["math"][4] == pytest.approx(0.2) and r["math"][5] == pytest.approx(0.05)   # se: hypot(0.03, 0.04)
    text = staleness_arms.table([r])
    assert "| arm | 1 -> 2 -> 1 | 30.0 | 3.0 | 1.0 | 1.12 | 5.00 | 4 | 6 | 0 |" in text and "+0.200 ± 0.050 (4.0)" in text
    (tmp_path / "unfinished").mkdir()
    assert staleness_arms.main([str(tmp_path / "unfinished")]) == 2


def test_dtype_arms_reads_speed_mismatch_gain_and_the_share_of_weights_moved_by_hand(tmp_path):
    """bench/dtype_arms.py: means over steps 2.. for time, over every step for throughput and
    mismatch, the largest mismatch, and the share of exported weights that differ from the base
    rounded to the export's dtype (a change below bf16's spacing does not count)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "bench"))
    import dtype_arms

    rows = [{"step": s, "loss/total": 0.7, "time/step_s": t, "time/train_s": t / 2, "time/gen_s": t / 4,
             "throughput/gen_tokens_per_s": g, "logprobs/vllm_gap_abs_mean": gap,
             "logprobs/token_mult_prob_error": m}
            for s, t, g, gap, m in ((1, 90.0, 100.0, 0.01, 1.01), (2, 20.0, 200.0, 0.03, 1.03), (3, 30.0, 300.0, 0.02, 1.02))]
    run = tmp_path / "bf16"
    _write(run, rows)
    (run / "config.yaml").write_text("model:\n  dtype: bfloat16\n")
    (run / "summary.json").write_text(json.dumps({"wall_s": 200.0, "eval": {"math": {"pass@1": {
        "first": 0.5, "first_se": 0.03, "last": 0.6, "last_se": 0.04}}}}))
    base = tmp_path / "base"
    base.mkdir()
    w = torch.tensor([1.0, 1.0, 2.0, 4.0])
    save_file({"w": w, "only_base": torch.zeros(3)}, str(base / "model.safetensors"))
    (run / "hf_final").mkdir()
    # 1.0 + 1e-4 rounds back to 1.0 in bf16 (spacing 2^-7 at 1): unchanged; 2.0 -> 2.5 moved
    final = torch.tensor([1.0 + 1e-4, 1.0, 2.5, 4.0]).to(torch.bfloat16)
    save_file({"w": final}, str(run / "hf_final" / "model.safetensors"))
    r = dtype_arms.dtype_row(run, base)
    assert r["dtype"] == "bfloat16" and r["changed"] == pytest.approx(0.25)
    assert (r["step_s"], r["train_s"], r["gen_s"]) == pytest.approx((25.0, 12.5, 6.25))
    assert r["gen_tokens_per_s"] == pytest.approx(200.0)
    assert (r["gap_mean"], r["gap_max"]) == pytest.approx((0.02, 0.03))
    assert (r["mult_mean"], r["mult_max"]) == pytest.approx((1.02, 1.03))
    fp32 = dict(r, run="fp32", dtype="float32", step_s=50.0, train_s=25.0, gen_tokens_per_s=100.0)
    text = dtype_arms.table([fp32, r])
    assert "| bf16 | bfloat16 | 25.0 | 12.5 | 6.2 | 200 | 0.0200, 0.0300 | 1.020, 1.030 |" in text
    assert "+0.100 ± 0.050 (2.0)" in text and "| 25.0% | 200 |" in text
    assert "bf16 / fp32: step time 0.50x, training 0.50x, generation throughput 2.00x" in text
    (tmp_path / "unfinished").mkdir()
    assert dtype_arms.main([str(tmp_path / "unfinished")]) == 2
