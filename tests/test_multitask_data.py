"""Multi-task batches (issue 7): reward forms in the config, loader dispatch by reward kind, the
per-task sampler (quotas, resume) and the adaptive per-round prompt allocation."""

import json
from pathlib import Path

import pytest

from megatron_rlhf.config import (MATH_INSTRUCTION, ConfigError, DataConfig, RewardModelSpec, TaskConfig,
                                  config_to_dict, load_config, save_config)
from megatron_rlhf.data import MultiTaskSampler, allocate_draws, estimate_yield, load_prompts_for_task
from megatron_rlhf.types import Prompt

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "cpu_demo.yaml"


# ------------------------------------------------------------------------------ config
@pytest.mark.timeout(30)
def test_reward_accepts_math_verify_plugin_and_reward_model_mapping_and_sets_kind():
    assert load_config(DEMO).tasks[0].kind == "math_verify"
    cfg = load_config(DEMO, ["tasks.0.reward=tests.plugins:has_digit"])
    assert cfg.tasks[0].reward == "tests.plugins:has_digit" and cfg.tasks[0].kind == "plugin"
    cfg = load_config(DEMO, ["tasks.0.reward={reward_model: smollm2-demo, batch_size: 4}"])
    t = cfg.tasks[0]
    assert t.reward == RewardModelSpec(reward_model="smollm2-demo", batch_size=4) and t.kind == "reward_model"
    assert RewardModelSpec(reward_model="x").batch_size == 8


@pytest.mark.timeout(30)
def test_instruction_defaults_to_math_for_verified_tasks_and_none_for_reward_model_tasks_unless_set():
    assert TaskConfig().instruction == MATH_INSTRUCTION
    assert TaskConfig(reward="tests.plugins:has_digit").instruction == MATH_INSTRUCTION
    rm = {"reward_model": "/somewhere/rm"}
    assert TaskConfig(name="chat", reward=rm).instruction == ""
    assert TaskConfig(name="chat", reward=rm, instruction="Be brief.").instruction == "Be brief."
    assert TaskConfig(instruction="").instruction == ""  # an explicit empty instruction is kept
    cfg = load_config(DEMO, ["tasks.0.reward={reward_model: smollm2-demo}", "tasks.0.instruction=Answer kindly."])
    assert cfg.tasks[0].instruction == "Answer kindly."


@pytest.mark.timeout(30)
@pytest.mark.parametrize("override, match", [
    ("tasks.0.reward={model: x}", r"unknown config key 'tasks\[0\]\.reward\.model' \(allowed: reward_model, batch_size\)"),
    ("tasks.0.reward={batch_size: 2}", r"'tasks\[0\]\.reward\.reward_model' is required"),
    ("tasks.0.reward=3", r"'tasks\[0\]\.reward' = 3 must be a string or a mapping \{reward_model, batch_size\}"),
    ("tasks.0.reward=[math_verify]", r"'tasks\[0\]\.reward'.*must be a string or a mapping"),
    ("tasks.0.reward=smollm2-demo", r"tasks\[math\]\.reward.*\{reward_model: PATH_OR_NAME\}"),
    ("tasks.0.reward={reward_model: x, batch_size: 0}", r"reward\.batch_size"),
    ("tasks.0.eval_reward={reward_model: x}", r"tasks\[math\]\.eval_reward.*only a task scored by a reward model"),
    ("tasks.1.eval_reward=x", r"'tasks\[1\]\.eval_reward' must be a mapping"),
])
def test_bad_reward_forms_raise_config_error_naming_the_key_and_the_accepted_forms(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, [override])


@pytest.mark.timeout(30)
def test_reward_model_task_round_trips_through_saved_yaml(tmp_path):
    cfg = load_config(DEMO, ["tasks.0.reward={reward_model: smollm2-demo}", "tasks.0.instruction=null"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.tasks[0].kind == "reward_model" and again.tasks[0].instruction == ""


@pytest.mark.timeout(30)
def test_math_chat_recipe_loads_without_its_cluster_reward_model_folder(tmp_path):
    """The Qwen recipe names cluster paths; loading must not need them (checked at run start)."""
    cfg = load_config(REPO / "configs" / "online-dpo-qwen2.5-7b-math-chat-2n8g.yaml", [f"model.source={tmp_path}"])
    kinds = {t.name: t.kind for t in cfg.tasks}
    assert kinds == {"math": "math_verify", "chat": "reward_model"}
    assert not Path(cfg.tasks[1].reward.reward_model).expanduser().exists()
    assert [t.weight for t in cfg.tasks] == [0.5, 0.5]
    # the reward model takes one generator-node GPU: 8 engines + the RM do not fit 8 GPUs
    with pytest.raises(ConfigError, match=r"generators.num_workers.*at most 7 engines.*reward-model"):
        load_config(REPO / "configs" / "online-dpo-qwen2.5-7b-math-chat-2n8g.yaml",
                    [f"model.source={tmp_path}", "generators.num_workers=8"])


@pytest.mark.timeout(30)
def test_duplicate_task_names_are_rejected():
    two = ["tasks=[{name: a, data: {path: data/gsm8k/dev.jsonl}}, {name: a, data: {path: data/gsm8k/dev.jsonl}}]"]
    with pytest.raises(ConfigError, match=r"tasks\[\]\.name.*unique"):
        load_config(DEMO, two)


# ------------------------------------------------------------------------------ loader dispatch
@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.timeout(60)
def test_reward_model_task_loads_chat_prompts_without_answer_or_math_instruction(tok):
    chat = TaskConfig(name="chat", data=DataConfig(path="data/chat/hh_helpful_dove/test.jsonl", limit=5),
                      reward={"reward_model": "smollm2-demo"})
    prompts, counts = load_prompts_for_task(chat, tok, 10_000)
    assert counts["kept"] == 5 and len(prompts) == 5
    first = json.loads((REPO / "data/chat/hh_helpful_dove/test.jsonl").read_text().splitlines()[0])
    assert prompts[0].text == first["instruction"].strip()
    assert all(p.answer == "" and p.task == "chat" and MATH_INSTRUCTION not in p.text for p in prompts)
    math = TaskConfig(name="math", data=DataConfig(path="data/gsm8k/dev.jsonl", prompt_field="question",
                                                   answer_field="answer", limit=3))
    mp, _ = load_prompts_for_task(math, tok, 10_000)
    assert all(p.answer and p.text.endswith(MATH_INSTRUCTION) for p in mp)
    mt = TaskConfig(name="mt", data=DataConfig(path="data/chat/mt_bench/question.jsonl"), reward={"reward_model": "x"})
    mtp, c = load_prompts_for_task(mt, tok, 10_000)
    assert c["kept"] == 80 and all(p.answer == "" for p in mtp)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        load_prompts_for_task(mt, tok, 0)


# ------------------------------------------------------------------------------ sampler
def _prompts(task: str, n: int, tag: str = "") -> list[Prompt]:
    return [Prompt(index=i, task=task, token_ids=(1, 2, i), answer=str(i), text=f"{task} {i}{tag}") for i in range(n)]


def _sampler(seed=0, **sizes):
    sizes = sizes or {"math": 7, "chat": 5}
    return MultiTaskSampler({t: _prompts(t, n) for t, n in sizes.items()},
                            {"math": 0.75, "chat": 0.25} if set(sizes) == {"math", "chat"} else {t: 1.0 for t in sizes},
                            seed=seed)


def _keys(ps):
    return [(p.task, p.index) for p in ps]


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_quotas_of_8_with_weights_075_025_are_6_and_2():
    s = _sampler()
    assert s.tasks == ["math", "chat"] and s.weights == {"math": 0.75, "chat": 0.25}
    assert s.quotas(8) == {"math": 6, "chat": 2}


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_resumed_sampler_draws_exactly_what_the_original_draws_next():
    a = _sampler(seed=3)
    a.next("math", 5), a.next("chat", 9), a.next("math", 4)          # chat crosses an epoch
    state = json.loads(json.dumps(a.state_dict()))
    b = _sampler(seed=3)
    b.load_state_dict(state)
    assert b.epochs == a.epochs == {"math": 1, "chat": 1} and b.epoch == 1
    for task, k in [("chat", 3), ("math", 11), ("chat", 6)]:
        assert _keys(b.next(task, k)) == _keys(a.next(task, k))


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_tasks_draw_independently_and_seeds_are_stable():
    a, b = _sampler(seed=1), _sampler(seed=1)
    a.next("math", 3)                                                 # only a draws math first
    assert _keys(a.next("chat", 5)) == _keys(b.next("chat", 5))
    one_epoch = _keys(_sampler(seed=1).next("math", 7))
    assert sorted(one_epoch) == [("math", i) for i in range(7)]      # an epoch visits every prompt once
    assert one_epoch != _keys(_sampler(seed=2).next("math", 7))      # seed changes the order
    with pytest.raises(KeyError, match="unknown task 'code'"):
        a.next("code", 1)


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_loading_state_into_changed_tasks_data_or_seed_raises_value_error():
    state = json.loads(json.dumps(_sampler().state_dict()))
    changed = MultiTaskSampler({"math": _prompts("math", 7, tag="!"), "chat": _prompts("chat", 5)},
                               {"math": 0.75, "chat": 0.25}, seed=0)  # same count, other text
    with pytest.raises(ValueError, match="prompts of task 'math' changed"):
        changed.load_state_dict(state)
    with pytest.raises(ValueError, match="changed"):
        _sampler(math=6, chat=5).load_state_dict(state)
    with pytest.raises(ValueError, match="saved tasks"):
        _sampler(math=7, chat=5, code=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _sampler(seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="differ"):
        MultiTaskSampler({"math": _prompts("math", 2)}, {"chat": 1.0}, seed=0)
    with pytest.raises(ValueError, match="no prompts"):
        MultiTaskSampler({"math": []}, {"math": 1.0}, seed=0)


# ------------------------------------------------------------------------------ allocation
@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
@pytest.mark.parametrize("remaining, rates, budget, want", [
    # need = remaining / rate: 12 and 2 -> 14 * (12/14, 2/14) = 12, 2
    ({"math": 6, "chat": 2}, {"math": 0.5, "chat": 1.0}, 14, {"math": 12, "chat": 2}),
    # need 12 and 3 -> 5 * (0.8, 0.2) = 4, 1: the slow task (rate 0.25) gets 4x the prompts
    ({"math": 3, "chat": 3}, {"math": 0.25, "chat": 1.0}, 5, {"math": 4, "chat": 1}),
    # a finished task gets nothing, its rate is not needed
    ({"math": 0, "chat": 2}, {"chat": 0.3}, 4, {"math": 0, "chat": 4}),
    # need 100 and 1 -> shares 9.90, 0.099 -> 10, 0 -> the starved task takes one: 9, 1
    ({"a": 100, "b": 1}, {"a": 1.0, "b": 1.0}, 10, {"a": 9, "b": 1}),
    # budget below the number of unfinished tasks: one each (total 2 > budget 1)
    ({"a": 1, "b": 1}, {"a": 1.0, "b": 1.0}, 1, {"a": 1, "b": 1}),
    # equal needs, odd budget: the leftover prompt goes to the first name (task_quotas tie-break)
    ({"b": 2, "a": 2}, {"a": 0.5, "b": 0.5}, 5, {"b": 2, "a": 3}),
    ({"a": 0, "b": 0}, {}, 5, {"a": 0, "b": 0}),
])
def test_allocate_draws_matches_hand_computed_splits(remaining, rates, budget, want):
    got = allocate_draws(remaining, rates, budget)
    assert got == want and list(got) == list(remaining)
    if any(remaining.values()):
        active = sum(r > 0 for r in remaining.values())
        assert sum(got.values()) == max(budget, active)


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_allocate_draws_rejects_bad_inputs_naming_the_task():
    with pytest.raises(ValueError, match=r"rates\['chat'\]"):
        allocate_draws({"math": 1, "chat": 1}, {"math": 1.0, "chat": 0.0}, 4)
    with pytest.raises(ValueError, match=r"rates\['chat'\]"):
        allocate_draws({"chat": 1}, {}, 4)
    with pytest.raises(ValueError, match="remaining"):
        allocate_draws({"chat": -1}, {"chat": 1.0}, 4)
    with pytest.raises(ValueError, match="budget"):
        allocate_draws({"chat": 1}, {"chat": 1.0}, -1)


@pytest.mark.timeout(120)   # a session fixture (tiny model, tokenizer) may be built in its setup
def test_estimate_yield_shrinks_toward_the_prior_and_stays_positive():
    assert estimate_yield(0, 0) == 0.5                       # prior only
    assert estimate_yield(0, 8) == pytest.approx(1 / 10)    # (0 + 1) / (8 + 2)
    assert estimate_yield(6, 8) == pytest.approx(7 / 10)
    assert estimate_yield(3, 4, prior=1.0, strength=4.0) == pytest.approx(7 / 8)
    with pytest.raises(ValueError):
        estimate_yield(-1, 2)
