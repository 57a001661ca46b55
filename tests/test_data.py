"""Prompt datasets: formats, malformed rows, length filter, and the seeded sampler."""

import json
from pathlib import Path

import pytest

from megatron_rlhf.config import DataConfig, TaskConfig
from megatron_rlhf.data import DATASETS, PromptSampler, dataset_config, load_task_prompts, skipped_rows_text
from megatron_rlhf.types import Prompt

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _task(name, **data_kw):
    return TaskConfig(name=name, data=DataConfig(**data_kw))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,rows,first_answer", [
    ("mawps", 2065, "43"), ("svamp", 1000, "145"), ("gsm8k_dev", 200, None), ("gsm8k", 7273, "72")])
def test_each_registered_format_loads_from_the_repo_copy(tokenizer, name, rows, first_answer):
    prompts, counts = load_task_prompts(TaskConfig(name=name, data=dataset_config(name)), tokenizer, 2048)
    assert counts["rows"] == rows and counts["malformed"] == 0 and counts["kept"] == rows
    p = prompts[0]
    assert p.index == 0 and p.task == name
    if first_answer is not None:
        assert p.answer == first_answer
    assert "####" not in p.answer and p.answer.replace(".", "").lstrip("-").isdigit()
    instr = TaskConfig().instruction
    assert p.text.endswith("\n\n" + instr)
    # the chat template was applied with a generation prompt, and text round-trips
    decoded = tokenizer.decode(list(p.token_ids))
    assert decoded.startswith("<|im_start|>user\n") and decoded.endswith("<|im_start|>assistant\n")
    assert p.text in decoded


@pytest.mark.timeout(60)
def test_svamp_joins_body_and_question(tokenizer):
    prompts, _ = load_task_prompts(TaskConfig(name="svamp", data=dataset_config("svamp", limit=1)), tokenizer, 2048)
    row = json.loads((REPO / "data/math_word_problems/svamp.jsonl").read_text().splitlines()[0])
    assert prompts[0].text.startswith(row["Body"] + " " + row["Question"] + "\n\n")


@pytest.mark.timeout(60)
def test_repo_copies_equal_the_shared_data():
    if not SHARED.is_dir():
        pytest.skip("../shared/data not present")
    pairs = [("math_word_problems/mawps/test.jsonl", "math_word_problems/mawps.jsonl"),
             ("math_word_problems/svamp/test.jsonl", "math_word_problems/svamp.jsonl"),
             ("gsm8k/train.jsonl", "gsm8k/train.jsonl"), ("gsm8k/dev.jsonl", "gsm8k/dev.jsonl")]
    for src, dst in pairs:
        assert (SHARED / src).read_bytes() == (REPO / "data" / dst).read_bytes(), dst
    for d in ("math_word_problems", "gsm8k"):
        assert (REPO / "data" / d / "LICENSE").is_file() and (REPO / "data" / d / "README.md").is_file()


@pytest.mark.timeout(60)
def test_shared_data_loads_by_absolute_path(tokenizer):
    f = SHARED / "math_word_problems/mawps/test.jsonl"
    if not f.is_file():
        pytest.skip("../shared/data not present")
    prompts, counts = load_task_prompts(
        _task("m", path=str(f), filter={"type": ["singleop", "addsub"]}), tokenizer, 2048)
    assert counts["kept"] == 562 + 395 and counts["filtered"] == 2065 - 957
    assert len(prompts) == 957


@pytest.mark.timeout(60)
def test_malformed_rows_are_skipped_and_counted(tokenizer, tmp_path):
    lines = [
        json.dumps({"input": "Tom has 3 apples. How many?", "target": 3.0, "type": "a"}),
        "",  # blank: ignored, not a row
        "this is not json",
        json.dumps({"input": None, "target": 2}),  # no prompt text
        json.dumps({"input": "No answer here"}),  # no answer
        json.dumps([1, 2, 3]),  # not an object
        json.dumps({"input": "Half of 1?", "target": "1/2", "type": "b"}),  # mixed answer types
        json.dumps({"input": "GSM style", "target": "work...\n#### 1,000", "type": "b"}),
        "{\"input\": \"truncated",
    ]
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    prompts, counts = load_task_prompts(_task("t", path=str(f)), tokenizer, 2048)
    assert counts == {"rows": 8, "malformed": 5, "filtered": 0, "too_long": 0, "kept": 3}
    assert [(p.index, p.answer) for p in prompts] == [(0, "3"), (5, "1/2"), (6, "1,000")]
    assert skipped_rows_text(counts) == " (skipped: 5 malformed)"
    assert skipped_rows_text({**counts, "filtered": 1, "too_long": 2}) == " (skipped: 5 malformed, 1 filtered out, 2 too long)"
    assert skipped_rows_text({"rows": 3, "malformed": 0, "filtered": 0, "too_long": 0, "kept": 3}) == ""


@pytest.mark.timeout(60)
def test_too_long_prompts_are_filtered_and_counted(tokenizer, tmp_path):
    f = tmp_path / "len.jsonl"
    rows = [{"input": "one two " * n, "target": n} for n in (1, 2, 40, 80, 3)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = _task("t", path=str(f))
    task.instruction = ""
    all_prompts, _ = load_task_prompts(task, tokenizer, 10_000)
    lens = [len(p.token_ids) for p in all_prompts]
    limit = sorted(lens)[2]  # keeps the three shortest
    prompts, counts = load_task_prompts(task, tokenizer, limit)
    assert counts["too_long"] == 2 and counts["kept"] == 3
    assert all(len(p.token_ids) <= limit for p in prompts)
    assert [p.answer for p in prompts] == ["1", "2", "3"]


@pytest.mark.timeout(60)
def test_limit_missing_file_and_empty_result_errors(tokenizer, tmp_path):
    prompts, counts = load_task_prompts(TaskConfig(name="m", data=dataset_config("mawps", limit=7)), tokenizer, 2048)
    assert len(prompts) == 7 and counts["rows"] == 7
    with pytest.raises(ValueError, match=r"tasks\[m\]\.data\.path"):
        load_task_prompts(_task("m", path=str(tmp_path / "missing.jsonl")), tokenizer, 2048)
    (tmp_path / "blank.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"tasks\[m\]\.data\.path: .*holds no records \(the file is empty"):
        load_task_prompts(_task("m", path=str(tmp_path / "blank.jsonl")), tokenizer, 2048)
    f = tmp_path / "empty.jsonl"
    f.write_text("not json\n")
    with pytest.raises(ValueError, match=r"tasks\[m\]\.data\.path.*yields no prompt"):
        load_task_prompts(_task("m", path=str(f)), tokenizer, 2048)
    with pytest.raises(KeyError, match="known"):
        dataset_config("nope")
    assert {"mawps", "svamp", "gsm8k"} <= set(DATASETS)


def _prompts(n):
    return [Prompt(index=i, task="t", token_ids=(i,)) for i in range(n)]


@pytest.mark.timeout(30)
def test_sampler_is_seeded_and_each_epoch_is_a_reshuffled_permutation():
    a, b, c = PromptSampler(_prompts(10), seed=1), PromptSampler(_prompts(10), seed=1), PromptSampler(_prompts(10), seed=2)
    ea = [p.index for p in a.next(10)]
    assert ea == [p.index for p in b.next(10)]
    assert ea != [p.index for p in c.next(10)]
    assert sorted(ea) == list(range(10))
    e2 = [p.index for p in a.next(10)]
    assert sorted(e2) == list(range(10)) and e2 != ea
    assert a.epoch == 1
    # a draw crossing the epoch boundary finishes the epoch, then starts the next one
    s = PromptSampler(_prompts(4), seed=0)
    first = [p.index for p in s.next(3)]
    rest = [p.index for p in s.next(3)]
    assert sorted(first + rest[:1]) == [0, 1, 2, 3]
    assert len(s.next(9)) == 9  # more than one epoch at once


@pytest.mark.timeout(30)
def test_sampler_state_dict_resumes_at_the_same_position():
    s = PromptSampler(_prompts(7), seed=5)
    s.next(5)
    s.next(4)  # into epoch 1
    state = s.state_dict()
    expected = [p.index for p in s.next(12)]
    t = PromptSampler(_prompts(7), seed=5)
    t.load_state_dict(dict(state))
    assert [p.index for p in t.next(12)] == expected
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(_prompts(8), seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="no prompts"):
        PromptSampler([], seed=0)
