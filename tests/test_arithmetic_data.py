"""The generated arithmetic datasets: reproducible from their seed, splits share no problem in
either order (a x b held out: b x a too), the mul1 eval wording-balanced, gold answers right, loadable by the ordinary prompt loader as registered datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.data.arithmetic import FILES, generate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind_split", list(FILES))
def test_committed_file_equals_fresh_generation_with_seed_0(kind_split):
    kind, split = kind_split
    rows = [json.loads(x) for x in (REPO / FILES[kind_split]).read_text().splitlines()]
    assert rows == generate(kind, 0, split)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["mul1", "add2"])
def test_no_eval_problem_is_trained_in_either_order_and_answers_are_right(kind):
    train, held = generate(kind, 0, "train"), generate(kind, 0, "eval")
    trained = {(r["a"], r["b"]) for r in train}
    assert not any((r["a"], r["b"]) in trained or (r["b"], r["a"]) in trained for r in held)
    assert not {r["product"] for r in train} & {r["product"] for r in held}
    for r in train + held:   # the cluster id is the unordered problem
        lo, hi = sorted((r["a"], r["b"]))
        assert r["product"] == (f"{lo} x {hi}" if kind == "mul1" else f"{lo} + {hi}")
    for r in train + held:
        assert int(r["target"]) == (r["a"] * r["b"] if kind == "mul1" else r["a"] + r["b"])
        assert str(r["a"]) in r["input"] and str(r["b"]) in r["input"]
    assert generate(kind, 1, "eval") != held            # the seed decides the split
    assert generate(kind, 0, "eval") == held            # and only the seed


@pytest.mark.timeout(30)
def test_mul1_eval_is_whole_products_in_both_orders_and_wording_balanced():
    from collections import Counter

    from megatron_rlhf.data.arithmetic import WORDINGS

    held = generate("mul1", 0, "eval")
    assert len(held) == 128 and len(generate("mul1", 0, "train")) == 196   # 32 and 49 ordered problems
    ordered = {(r["a"], r["b"]) for r in held}
    assert all((b, a) in ordered for a, b in ordered)                         # both orders held out
    counts = Counter((r["a"], r["b"]) for r in held)
    assert set(counts.values()) == {len(WORDINGS["mul1"])}                    # every wording of each
    by_wording = Counter(next(w for w in WORDINGS["mul1"] if w.format(a=r["a"], b=r["b"]) == r["input"])
                         for r in held)
    assert set(by_wording.values()) == {32}                                   # 128 / 4 wordings
    for seed in (1, 2, 3):   # another seed: another split, still exactly 32 ordered problems
        assert len(generate("mul1", seed, "eval")) == 128


@pytest.mark.timeout(60)
def test_registered_and_loadable(tiny_llama_dir):
    from transformers import AutoTokenizer

    from megatron_rlhf.config import TaskConfig
    from megatron_rlhf.data import load_prompts_for_task
    from megatron_rlhf.data.prompts import dataset_config

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    task = TaskConfig(name="arith", data=dataset_config("arithmetic_mul1"))
    prompts, counts = load_prompts_for_task(task, tok, 256)
    assert counts["kept"] == 196 and prompts[0].answer == json.loads(
        (REPO / FILES[("mul1", "train")]).read_text().splitlines()[0])["target"]
