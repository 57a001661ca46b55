"""Reward models for chat tasks: the serving worker, resolution by name or path, the demo model
trained on first use into an atomically published cache folder, and checkpointable normalisation."""

import json
import math
from pathlib import Path

import pytest

from megatron_rlhf.rewards import RewardModelWorker, RunningRewardNormalizer, resolve_reward_model
from megatron_rlhf.rewards import train as rm_train

REPO = Path(__file__).resolve().parents[1]
CACHED_DEMO = Path("~/.cache/megatron_rlhf/reward_models").expanduser() / rm_train.DEMO_REWARD_MODELS["smollm2-demo"].folder

PROMPTS = ["What is the capital of France?", "What is the capital of France?",
           "Write a haiku about rain.", "Write a haiku about rain."]
COMPLETIONS = ["The capital of France is Paris.", "idk",
               "Soft rain on the roof / whispers to the sleeping town / puddles hold the sky", "no"]


def _pairs_file(path: Path, n: int, seed: int = 0) -> Path:
    """dove-format pairs (real HH helpful reply vs its words shuffled) written as JSONL."""
    from megatron_rlhf.testing.tiny import word_salad_pairs

    path.write_text("".join(json.dumps(o) + "\n" for o in word_salad_pairs(n, seed)))
    return path


@pytest.fixture
def tiny_demo(tiny_llama_dir, tmp_path, monkeypatch):
    """A demo registry entry that trains a tiny random-Llama reward model in seconds."""
    data = _pairs_file(tmp_path / "pairs.jsonl", 32)
    spec = rm_train.DemoRewardModel(
        name="tiny-demo", folder="tiny-L2-T32",
        train_kwargs=dict(base=str(tiny_llama_dir), data=[str(data)], train_pairs=24, eval_pairs=8, max_len=32,
                          layers=0, feature_layers=(2,), seed=0, feature_cache_dir=str(tmp_path / "feat"),
                          wd_grid=(1.0,)))
    monkeypatch.setitem(rm_train.DEMO_REWARD_MODELS, "tiny-demo", spec)
    return spec


# ------------------------------------------------------------------------------ worker
@pytest.mark.timeout(120)
@pytest.mark.skipif(not (CACHED_DEMO / "rm_report.json").is_file(),
                    reason=f"the cached demo reward model {CACHED_DEMO} is absent (building it takes minutes: "
                           "python tools/train_reward_model.py --out that folder, or run a config using "
                           "reward: {reward_model: smollm2-demo})")
def test_worker_scores_four_prompt_completion_pairs_with_the_cached_demo_reward_model():
    w = RewardModelWorker(resolve_reward_model("smollm2-demo"), cpu_core=-1)
    r = w.score(PROMPTS, COMPLETIONS)
    assert len(r) == 4 and all(isinstance(x, float) and math.isfinite(x) for x in r)
    assert w.score(PROMPTS, COMPLETIONS) == r  # deterministic
    s = w.stats()
    assert s["num_scored"] == 8 and s["num_calls"] == 2 and s["num_non_finite"] == 0 and s["s_per_seq"] > 0
    assert s["max_length"] == 64  # the length the demo head was trained with
    assert w.score([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        w.score(PROMPTS[:2], COMPLETIONS[:1])
    with pytest.raises(ValueError, match="Prompt.text"):
        w.score([[1, 2, 3]], ["x"])


# ------------------------------------------------------------------------------ resolution
@pytest.mark.timeout(30)
def test_resolve_reward_model_errors_name_the_config_key(tmp_path, monkeypatch):
    key = "tasks[chat].reward.reward_model"
    with pytest.raises(ValueError, match=r"tasks\[chat\]\.reward\.reward_model = '/nonexistent/rm': the folder does not exist"):
        resolve_reward_model("/nonexistent/rm", tmp_path, key=key)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_reward_model(str(tmp_path / "empty"), tmp_path, key=key)
    (tmp_path / "empty" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')   # 2 labels by default
    with pytest.raises(ValueError, match=r"tasks\[chat\]\.reward\.reward_model = '.*empty' is not a reward model .*2 labels "
                                         r"\(architectures: LlamaForCausalLM, a causal language model\)"):
        resolve_reward_model(str(tmp_path / "empty"), tmp_path, key=key)
    (tmp_path / "empty" / "config.json").write_text('{"id2label": {"0": "LABEL_0"}}')   # what num_labels=1 saves
    assert resolve_reward_model(str(tmp_path / "empty"), tmp_path) == (tmp_path / "empty").resolve()
    monkeypatch.setitem(rm_train.DEMO_REWARD_MODELS, "nodata-demo", rm_train.DemoRewardModel(
        name="nodata-demo", folder="x", train_kwargs={"data": [str(tmp_path / "no_prefs")]}))
    with pytest.raises(ValueError, match=r"tasks\[chat\]\.reward\.reward_model = 'nodata-demo': not cached .* missing"):
        resolve_reward_model("nodata-demo", tmp_path / "cache", key=key)
    assert not (tmp_path / "cache" / "reward_models" / "x").exists()


@pytest.mark.timeout(300)
def test_demo_reward_model_is_trained_on_first_use_then_served_from_the_cache(tiny_demo, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = resolve_reward_model("tiny-demo", cache)
    assert out == (cache / "reward_models" / "tiny-L2-T32").resolve()
    rep = json.loads((out / "rm_report.json").read_text())
    assert rep["n_eval"] >= 8 and 0 <= rep["accuracy"] <= 1 and rep["se"] >= 0 and rep["n_train"] == 24
    assert rep["out"] == str(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny-L2-T32"]  # no temporary sibling left

    def no_training(**kw):
        raise AssertionError("the cached folder must be reused")

    monkeypatch.setattr(rm_train, "train_reward_model", no_training)
    assert resolve_reward_model("tiny-demo", cache) == out
    r = RewardModelWorker(out).score(PROMPTS, COMPLETIONS)
    assert len(r) == 4 and all(math.isfinite(x) for x in r)


@pytest.mark.timeout(300)
def test_a_crash_while_saving_leaves_no_folder_that_counts_as_cached(tiny_demo, tmp_path, monkeypatch):
    def crash(*a, **k):
        raise RuntimeError("simulated crash after the weights were written")

    monkeypatch.setattr(rm_train, "reload_check", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_reward_model("tiny-demo", cache)
    assert list((cache / "reward_models").iterdir()) == []


@pytest.mark.timeout(30)
def test_training_never_overwrites_a_folder_that_is_not_a_reward_model(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="never overwritten"):
        rm_train.train_reward_model(out=str(tmp_path), base="/nonexistent")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------ normaliser
@pytest.mark.timeout(10)
def test_normalizer_state_survives_json_and_rejects_malformed_state():
    n = RunningRewardNormalizer()
    n.update("chat", [0.1, -2.5, 3.75, 1e-3])
    n.update("math", [0.0, 1.0, 1.0])
    m = RunningRewardNormalizer()
    m.load_state_dict(json.loads(json.dumps(n.state_dict())))
    assert m.state_dict() == n.state_dict() and m.stats("chat") == n.stats("chat")
    for bad in [{}, {"eps": 1e-6, "stats": {"chat": [1]}}, {"eps": 0, "stats": {}},
                {"eps": 1e-6, "stats": {"chat": [2, 0.0, -1.0]}}]:
        with pytest.raises(ValueError, match="load_state_dict"):
            m.load_state_dict(bad)
    assert m.stats("math") == n.stats("math")  # unchanged after a rejected state
