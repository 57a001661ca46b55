"""Chat prompt loaders: MT-Bench first turns, HH helpful (dove) and AlpacaEval instructions."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlhf.data.chat import (chat_prompt_token_ids, detect_chat_format, load_chat_prompts,
                                     load_chat_task_prompts)

REPO = Path(__file__).resolve().parents[1]
ALPACA = REPO.parent / "shared" / "data" / "chat" / "alpaca_eval" / "gpt4_1106_preview" / "model_outputs.json"


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.timeout(60)
def test_mt_bench_copy_in_repo_gives_80_first_turn_prompts_with_the_chat_template(tok):
    prompts, counts = load_chat_prompts("data/chat/mt_bench/question.jsonl", task="chat", tokenizer=tok,
                                        max_prompt_tokens=100_000)
    assert counts == {"rows": 80, "filtered": 0, "malformed": 0, "too_long": 0, "kept": 80}
    first = json.loads((REPO / "data/chat/mt_bench/question.jsonl").read_text().splitlines()[0])
    p = prompts[0]
    assert p.text == first["turns"][0] and p.answer == "" and p.task == "chat" and p.index == 0
    want = tok.apply_chat_template([{"role": "user", "content": first["turns"][0]}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(list(p.token_ids)) == want
    assert want.endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(60)
def test_mt_bench_category_filter_and_too_long_prompts_are_counted(tok):
    prompts, counts = load_chat_prompts("data/chat/mt_bench/question.jsonl", task="chat", tokenizer=tok,
                                        max_prompt_tokens=100_000, filter={"category": ["writing"]})
    assert counts["kept"] == 10 and counts["filtered"] == 70
    lens = sorted(len(p.token_ids) for p in prompts)
    prompts2, counts2 = load_chat_prompts("data/chat/mt_bench/question.jsonl", task="chat", tokenizer=tok,
                                          max_prompt_tokens=lens[4], filter={"category": ["writing"]})
    assert counts2["too_long"] == sum(n > lens[4] for n in lens) and counts2["kept"] == 10 - counts2["too_long"]


@pytest.mark.timeout(60)
def test_hh_helpful_dove_copy_gives_500_instruction_prompts(tok):
    prompts, counts = load_chat_prompts("data/chat/hh_helpful_dove/test.jsonl", task="chat", tokenizer=tok,
                                        max_prompt_tokens=100_000)
    assert counts["rows"] == 500 and counts["kept"] == 500
    assert prompts[0].text == "How to make frosting with crisco"


@pytest.mark.timeout(60)
@pytest.mark.skipif(not ALPACA.is_file(), reason="needs ../shared/data/chat/alpaca_eval (CC BY-NC, not in repo)")
def test_alpaca_eval_instructions_are_read_from_shared(tok):
    prompts, counts = load_chat_prompts(ALPACA, task="chat", tokenizer=tok, max_prompt_tokens=100_000, limit=50)
    assert counts["rows"] == 50 and counts["kept"] == 50
    assert prompts[0].text == json.loads(ALPACA.read_text())[0]["instruction"].strip()


@pytest.mark.timeout(60)
def test_malformed_rows_are_skipped_and_counted_and_instruction_is_appended(tok, tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join([json.dumps({"instruction": "Tell me a joke"}), "{broken",
                            json.dumps({"instruction": ""}), json.dumps({"instruction": 7}),
                            json.dumps({"other": "x"}), json.dumps({"instruction": "Say hi"})]) + "\n")
    prompts, counts = load_chat_prompts(f, task="chat", tokenizer=tok, max_prompt_tokens=1000,
                                        instruction="Be brief.")
    assert counts == {"rows": 6, "filtered": 0, "malformed": 4, "too_long": 0, "kept": 2}
    assert [p.index for p in prompts] == [0, 5]
    assert prompts[1].text == "Say hi\n\nBe brief."


@pytest.mark.timeout(60)
def test_task_config_driven_loading_and_empty_result_raises_naming_the_path(tok, tmp_path):
    data = SimpleNamespace(path="data/chat/mt_bench/question.jsonl", prompt_field="input",
                           filter={"category": ["coding"]}, limit=0)
    prompts, counts = load_chat_task_prompts(SimpleNamespace(name="chat", instruction="", data=data), tok, 100_000)
    assert counts["kept"] == 10 and all(p.task == "chat" for p in prompts)
    with pytest.raises(ValueError, match="data.path"):
        load_chat_prompts("data/chat/mt_bench/question.jsonl", task="chat", tokenizer=tok, max_prompt_tokens=3)
    with pytest.raises(ValueError, match=r"tasks\[chat\]\.data\.path=.*not found"):
        load_chat_prompts(tmp_path / "nope.jsonl", task="chat", tokenizer=tok, max_prompt_tokens=10)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"tasks\[chat\]\.data\.path: .*holds no records"):
        load_chat_prompts(tmp_path / "empty.jsonl", task="chat", tokenizer=tok, max_prompt_tokens=10)


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_format_detection_and_missing_chat_template_error(tok):
    assert detect_chat_format([None, {"turns": ["a", "b"]}]) == "mt_bench"
    assert detect_chat_format([{"instruction": "x"}]) == "instruction"
    assert detect_chat_format([{"input": "x"}]) == "field"
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat_template"):
        chat_prompt_token_ids(no_template, "hi")


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_chat_sets_are_in_the_shared_dataset_registry_with_their_licences():
    from megatron_rlhf.data.prompts import DATASETS

    assert {"mt_bench", "hh_helpful", "alpaca_eval"} <= set(DATASETS)
    assert DATASETS["mt_bench"].reward == "reward_model" and "Apache" in DATASETS["mt_bench"].licence
    assert DATASETS["alpaca_eval"].path.startswith("../shared/")  # CC BY-NC: never in the repo
    assert (REPO / DATASETS["hh_helpful"].path).is_file()
