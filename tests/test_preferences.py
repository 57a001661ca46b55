"""Preference-pair loaders: HH-RLHF, dove, AlpacaEval judgements; malformed rows skipped and counted."""

import json
from pathlib import Path

import pytest

from megatron_rlhf.data.preferences import (detect_preference_format, half_by_group, find_preference_files, load_preference_files,
                                            load_preferences, parse_hh_dialogue, split_by_group)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "preferences"


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.timeout(30)
def test_hh_rlhf_rows_become_prompt_messages_plus_final_replies_and_bad_rows_are_counted(tmp_path):
    good = {"chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how to bake?\n\nAssistant: Use an oven.",
            "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how to bake?\n\nAssistant: No idea."}
    rows = [good,
            "{not json",                                                   # broken JSON
            {"chosen": good["chosen"]},                                     # missing rejected
            {"chosen": good["chosen"], "rejected": good["chosen"]},        # identical replies
            {"chosen": good["chosen"], "rejected": "\n\nHuman: other\n\nAssistant: x"},  # prefix differs
            {"chosen": "no turns at all", "rejected": "no turns"},
            {"chosen": "\n\nHuman: q\n\nAssistant: ", "rejected": "\n\nHuman: q\n\nAssistant: a"}]  # empty reply
    ex, counts = load_preferences(_write_jsonl(tmp_path / "hh.jsonl", rows))
    assert counts == {"rows": 7, "malformed": 6, "ties": 0, "kept": 1}
    e = ex[0]
    assert e.source == "hh_rlhf" and e.index == 0
    assert list(e.prompt) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "how to bake?"}]
    assert (e.chosen, e.rejected) == ("Use an oven.", "No idea.")
    assert e.as_tuple() == (list(e.prompt), "Use an oven.", "No idea.")


@pytest.mark.timeout(10)
def test_parse_hh_dialogue_rejects_non_alternating_roles():
    assert parse_hh_dialogue("\n\nHuman: a\n\nHuman: b\n\nAssistant: c") is None
    assert parse_hh_dialogue("\n\nAssistant: a\n\nHuman: b") is None
    assert parse_hh_dialogue(None) is None


@pytest.mark.timeout(30)
def test_dove_rows_need_the_same_prompt_and_distinct_replies(tmp_path):
    rows = [{"i_chosen": "Q1", "r_chosen": "good", "i_reject": "Q1", "r_reject": "bad"},
            {"i_chosen": "Q2", "r_chosen": "a", "i_reject": "Q3", "r_reject": "b"},
            {"i_chosen": "Q4", "r_chosen": "same", "i_reject": "Q4", "r_reject": "same"},
            {"i_chosen": "Q5", "r_chosen": 5, "i_reject": "Q5", "r_reject": "b"}]
    ex, counts = load_preferences(_write_jsonl(tmp_path / "dove.jsonl", rows))
    assert counts == {"rows": 4, "malformed": 3, "ties": 0, "kept": 1}
    assert ex[0].as_tuple() == ([{"role": "user", "content": "Q1"}], "good", "bad")


@pytest.mark.timeout(30)
def test_alpaca_eval_preference_2_means_output_2_wins_and_ties_are_counted_apart(tmp_path):
    rows = [{"instruction": "I1", "output_1": "o1", "output_2": "o2", "preference": 2},
            {"instruction": "I2", "output_1": "o1", "output_2": "o2", "preference": 1.0},
            {"instruction": "I3", "output_1": "same", "output_2": "same", "preference": 0},
            {"instruction": "I4", "output_1": "x", "output_2": "y", "preference": 1.5},
            {"instruction": "I5", "output_1": "x", "output_2": "y", "preference": None}]
    p = tmp_path / "annotations.json"
    p.write_text(json.dumps(rows))
    ex, counts = load_preferences(p)
    assert counts == {"rows": 5, "malformed": 1, "ties": 2, "kept": 2}
    assert (ex[0].chosen, ex[0].rejected) == ("o2", "o1")
    assert (ex[1].chosen, ex[1].rejected) == ("o1", "o2")


@pytest.mark.timeout(10)
def test_unknown_format_raises_value_error_listing_the_expected_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown preference format"):
        detect_preference_format([{"foo": 1}], "x.jsonl")
    with pytest.raises(ValueError, match="not found"):
        load_preferences(tmp_path / "missing.jsonl")


@pytest.mark.timeout(30)
def test_split_by_group_is_seeded_and_never_shares_a_prompt(tmp_path):
    rows = [{"instruction": f"I{i % 20}", "output_1": f"a{i}", "output_2": f"b{i}", "preference": 1 + i % 2}
            for i in range(100)]
    p = tmp_path / "a.json"
    p.write_text(json.dumps(rows))
    ex, _ = load_preferences(p)
    tr, ev = split_by_group(ex, 30, seed=3)
    assert len(ev) >= 30 and len(tr) + len(ev) == 100
    assert not {e.group for e in tr} & {e.group for e in ev}
    tr2, ev2 = split_by_group(ex, 30, seed=3)
    assert [e.index for e in ev] == [e.index for e in ev2]
    assert [e.index for e in split_by_group(ex, 30, seed=4)[1]] != [e.index for e in ev]


@pytest.mark.timeout(60)
def test_the_proxy_and_gold_halves_of_the_demo_pairs_share_no_prompt_and_split_each_source():
    """The demo's proxy (half a) and evaluation (half b) reward models train on halves of the same
    training side that share no prompt group, cover it, and hold about half of each source."""
    from megatron_rlhf.rewards.train import DEFAULT_DATA, DEFAULTS, DEMO_REWARD_MODELS

    ex, _ = load_preference_files([DEFAULT_DATA])
    train, ev = split_by_group(ex, DEFAULTS["eval_pairs"], seed=0)
    a, b = half_by_group(train, "a", 0), half_by_group(train, "b", 0)
    ga, gb = {e.group for e in a}, {e.group for e in b}
    assert not ga & gb and not (ga | gb) & {e.group for e in ev}
    assert sorted(e.index for e in a + b) == sorted(e.index for e in train)
    for src in ("hh_rlhf", "dove"):
        na, nb = (sum(e.source == src for e in h) for h in (a, b))
        assert abs(na - nb) <= 0.15 * (na + nb), (src, na, nb)
    assert [e.index for e in half_by_group(train, "a", 0)] == [e.index for e in a]   # seeded
    with pytest.raises(ValueError, match="expected 'a' or 'b'"):
        half_by_group(train, "c", 0)
    proxy, gold = (DEMO_REWARD_MODELS[n].train_kwargs for n in ("smollm2-demo-proxy", "smollm2-demo-gold"))
    assert (proxy["half"], gold["half"]) == ("a", "b") and proxy["seed"] == gold["seed"] == 0
    assert proxy["eval_pairs"] == gold["eval_pairs"]   # one held-out set measures both


@pytest.mark.timeout(120)
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data/preferences")
def test_real_shared_preference_sets_load_with_documented_counts():
    ex, counts = load_preference_files([SHARED])
    by_name = {Path(k).parent.name if "alpaca" not in k else "alpaca": v for k, v in counts.items()}
    assert by_name["hh_rlhf_harmless_base"]["rows"] == 2312            # README: 2,312 records
    assert by_name["dove_hh_helpful_chatgpt"] == {"rows": 363, "malformed": 0, "ties": 0, "kept": 363}
    alpaca = [v for k, v in counts.items() if "alpaca_eval_gpt4" in k]
    assert sum(c["rows"] for c in alpaca) == 4025 and sum(c["ties"] for c in alpaca) == 26  # README: 26 pref 0
    # hh harmless: 13 rows have an empty final reply or an unparseable dialogue
    assert by_name["hh_rlhf_harmless_base"]["malformed"] == 13
    assert counts["total"]["kept"] == len(ex) == 2299 + 363 + 3999


@pytest.mark.timeout(60)
def test_the_demo_reward_model_data_is_in_the_repo_with_its_licences_and_no_alpacaeval():
    from megatron_rlhf.rewards.train import DEFAULT_DATA, REPO

    assert DEFAULT_DATA.resolve().is_relative_to(REPO.resolve())   # a fresh clone trains it by itself
    files = find_preference_files(DEFAULT_DATA)
    assert not any("alpaca" in str(f).lower() for f in files)     # CC BY-NC: never in the repo
    for f in files:
        assert (f.parent / "LICENSE").is_file() and (f.parent / "README.md").is_file(), f
    ex, counts = load_preference_files([DEFAULT_DATA])
    assert counts["total"]["rows"] == 2312 + 363 and counts["total"]["kept"] == len(ex) >= 2600
