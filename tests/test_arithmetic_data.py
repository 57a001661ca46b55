"""The generated arithmetic datasets: reproducible from their seed, splits share no problem,
gold answers right, loadable by the ordinary prompt loader as registered datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.data.arithmetic import FILES, generate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind_split", list(FILES))
def test_committed_file_equals_fresh_generation_with_seed_0(kind_split):
    kind, split = kind_split
    rows = [json.loads(x) for x in (REPO / FILES[kind_split]).read_text().splitlines()]
    assert rows == generate(kind, 0, split)


@pytest.mark.parametrize("kind", ["mul1", "add2"])
def test_splits_share_no_problem_and_answers_are_right(kind):
    train, held = generate(kind, 0, "train"), generate(kind, 0, "eval")
    assert not {(r["a"], r["b"]) for r in train} & {(r["a"], r["b"]) for r in held}
    for r in train + held:
        assert int(r["target"]) == (r["a"] * r["b"] if kind == "mul1" else r["a"] + r["b"])
        assert str(r["a"]) in r["input"] and str(r["b"]) in r["input"]
    assert generate(kind, 1, "eval") != held            # the seed decides the split
    assert generate(kind, 0, "eval") == held            # and only the seed


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
