"""Reward model: Bradley-Terry loss, batched scoring, per-task normalisation, and real RM training."""

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_rlhf.rewards.reward_model import (RewardModel, RunningRewardNormalizer, bradley_terry_loss,
                                                length_normalized_rewards)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(10)
def test_bradley_terry_loss_equals_hand_computed_value():
    # d = r_c - r_r = [1, -2]; loss = (log(1 + e^-1) + log(1 + e^2)) / 2 = (0.3132617 + 2.1269280) / 2
    loss, m = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]))
    assert loss.item() == pytest.approx(1.2200948, abs=1e-6)
    assert m == {"rm/accuracy": 0.5, "rm/margin": -0.5}
    with pytest.raises(ValueError, match="same non-empty shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


@pytest.fixture(scope="module")
def tiny_rm_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """A tiny random Llama sequence-classification model (num_labels=1) with the tiny tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_rm")
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    m = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1,
                                                           pad_token_id=tok.pad_token_id)
    torch.nn.init.normal_(m.score.weight, std=1.0)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


PROMPTS = [[{"role": "user", "content": "how many apples"}], "solve the problem",
           [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "one two three four five six seven"}],
           "the quick brown fox"]
REPLIES = ["four apples", "the answer is 7 #### 7", "eight nine ten", "jumps over the lazy dog " * 3]


@pytest.mark.timeout(120)
def test_scores_are_deterministic_and_batched_equals_one_by_one(tiny_rm_dir):
    rm4 = RewardModel(tiny_rm_dir, batch_size=4)
    rm1 = RewardModel(tiny_rm_dir, batch_size=1)
    a, b, c = rm4.score(PROMPTS, REPLIES), rm4.score(PROMPTS, REPLIES), rm1.score(PROMPTS, REPLIES)
    assert a == b
    assert max(abs(x - y) for x, y in zip(a, c)) < 1e-5
    assert len(set(round(x, 4) for x in a)) == 4  # different inputs, different rewards


@pytest.mark.timeout(120)
def test_pooled_score_equals_transformers_sequence_classification_logits(tiny_rm_dir):
    from transformers import AutoModelForSequenceClassification

    rm = RewardModel(tiny_rm_dir, batch_size=4)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir).eval()
    seqs = [rm.encode(p, r) for p, r in zip(PROMPTS, REPLIES)]
    assert all(s[-1] == rm.tokenizer.eos_token_id for s in seqs)  # reward read at the end-of-turn token
    ours = rm.score_token_ids(seqs)
    with torch.no_grad():
        ref = [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in seqs]
    assert max(abs(x - y) for x, y in zip(ours, ref)) < 1e-5


@pytest.mark.timeout(120)
def test_prompt_token_ids_and_chat_messages_score_the_same(tiny_rm_dir):
    from megatron_rlhf.data.chat import chat_prompt_token_ids

    rm = RewardModel(tiny_rm_dir)
    ids = chat_prompt_token_ids(rm.tokenizer, "how many apples")
    assert rm.score([ids], ["four apples"]) == rm.score([PROMPTS[0]], ["four apples"])
    with pytest.raises(ValueError, match="prompts but"):
        rm.score(PROMPTS, REPLIES[:2])
    with pytest.raises(ValueError, match="expected chat messages"):
        rm.score([3.5], ["x"])


@pytest.mark.timeout(120)
def test_long_sequences_are_cut_from_the_left_keeping_the_reply_end(tiny_rm_dir):
    rm = RewardModel(tiny_rm_dir, max_length=8)
    long_prompt = "one two three four five six seven eight nine ten " * 5
    s1 = rm.score([long_prompt], ["seven eight"])
    s2 = rm.score(["different words here " * 5], ["seven eight"])
    assert rm.num_truncated == 2
    full = rm.encode(long_prompt, "seven eight")
    assert s1 == rm.score_token_ids([full[-8:]])
    assert isinstance(s2[0], float)


@pytest.mark.timeout(60)
def test_folder_without_scalar_head_is_rejected_by_the_loader_and_by_its_config_alone(tiny_llama_dir, tiny_rm_dir):
    """``scalar_head_problem`` (read before any actor starts) agrees with the loader: a causal LM
    (transformers' default of 2 labels) is refused, a one-label model passes."""
    from megatron_rlhf.rewards.reward_model import scalar_head_problem

    with pytest.raises(ValueError, match="num_labels"):
        RewardModel(tiny_llama_dir)  # a causal LM config (num_labels defaults to 2)
    with pytest.raises(ValueError, match="config.json"):
        RewardModel("/nonexistent/rm")
    assert "2 labels (architectures: LlamaForCausalLM, a causal language model)" in scalar_head_problem(tiny_llama_dir)
    assert scalar_head_problem(tiny_rm_dir) is None


@pytest.mark.timeout(10)
def test_running_normalizer_merges_batches_exactly_and_round_trips():
    rng = torch.Generator().manual_seed(0)
    xs = (torch.randn(100, generator=rng) * 3 + 5).tolist()
    ys = (torch.randn(40, generator=rng) - 2).tolist()
    norm = RunningRewardNormalizer()
    for i in range(0, 100, 7):
        norm.update("chat", xs[i:i + 7])
    norm.update("math", ys)
    n, mean, std = norm.stats("chat")
    t = torch.tensor(xs, dtype=torch.float64)
    assert n == 100 and mean == pytest.approx(t.mean().item(), abs=1e-9)
    assert std == pytest.approx(t.std(unbiased=False).item(), abs=1e-9)
    z = norm.normalize("chat", xs)
    assert sum(z) / len(z) == pytest.approx(0.0, abs=1e-9)
    other = RunningRewardNormalizer()
    other.load_state_dict(json.loads(json.dumps(norm.state_dict())))
    assert other.normalize("math", [1.0]) == norm.normalize("math", [1.0])
    norm.update("chat", [float("nan")])  # ignored
    assert norm.stats("chat")[0] == 100
    with pytest.raises(KeyError, match="update"):
        norm.normalize("unseen", [1.0])


@pytest.mark.timeout(10)
def test_feature_spec_describes_itself_in_words_not_as_a_repr():
    from megatron_rlhf.rewards.reward_model import FeatureSpec

    assert FeatureSpec((1, 2), ("last", "reply_mean")).describe() == (
        "hidden states 1, 2 (last, reply_mean) + reply embedding mean + log length + log length x prompt embedding")
    assert FeatureSpec((), reply_embedding_mean=False, length_x_prompt_embedding=False).describe() == "log length"


def test_length_normalized_reward_is_reward_per_token():
    assert length_normalized_rewards([2.0, -3.0, 1.0], [4, 3, 0]) == [0.5, -1.0, 1.0]
    with pytest.raises(ValueError):
        length_normalized_rewards([1.0], [1, 2])


def _word_salad_pairs(n: int, seed: int) -> list[dict]:
    """Real HH helpful replies vs the same words shuffled (see ``testing.tiny.word_salad_pairs``):
    to exercise the training/serving mechanics on a tiny random model."""
    from megatron_rlhf.testing.tiny import word_salad_pairs

    return word_salad_pairs(n, seed)


def _train_tool():
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import train_reward_model

    return train_reward_model


@pytest.mark.timeout(300)
def test_pooled_head_serving_features_and_rewards_equal_training_time_ones(tiny_llama_dir, tmp_path):
    """Tiny random Llama (2 layers), 40 train / 16 held-out pairs, features of layers 1 and 2 (last
    token, reply mean), reply embedding mean, length and length x prompt embedding mean, 48 tokens (so some
    sequences are cut): the saved folder, reloaded by RewardModel and fed the pairs' *text*,
    reproduces the tool's cached training features (<= 1e-4) and rewards (<= 1e-3), batched or not."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from megatron_rlhf.rewards.reward_model import FeatureSpec

    tool = _train_tool()
    data = tmp_path / "pairs.jsonl"
    rows = _word_salad_pairs(56, seed=0)
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rep = tool.train_reward_model(out=str(tmp_path / "rm"), base=str(tiny_llama_dir), data=[str(data)],
                                  train_pairs=40, eval_pairs=16, max_len=48, layers=0, feature_layers=(1, 2),
                                  poolings=("last", "reply_mean"), seed=0, feature_cache_dir=str(tmp_path / "feat"), wd_grid=(0.1, 1.0))
    assert rep["features"] == {"layers": [1, 2], "poolings": ["last", "reply_mean"], "reply_embedding_mean": True,
                               "length_feature": True, "length_x_prompt_embedding": True}
    assert rep["feature_dim"] == FeatureSpec((1, 2), ("last", "reply_mean")).dim(128) == (2 * 2 + 2) * 128 + 1
    assert rep["reload_check_feature_max_abs_diff"] < 1e-4 and rep["reload_check_max_abs_diff"] < 1e-3

    # independent check: cached training rows (keyed by file digest:row) vs serving features from text
    cache = Path(rep["feature_cache"])
    with safe_open(str(cache), "pt") as f:
        uids = json.loads(f.metadata()["uids"])
    cached = load_file(str(cache))
    digest = tool._sha256_file(data)[:16]
    rm1, rm4 = RewardModel(tmp_path / "rm", batch_size=1), RewardModel(tmp_path / "rm", batch_size=4)
    assert rm1.max_length == 48  # the training max length is the serving default
    idx = [0, 5, 17, 33, 50]
    prompts = [rows[i]["i_chosen"] for i in idx]
    got_c = rm4.features(prompts, [rows[i]["r_chosen"] for i in idx])
    got_r = rm4.features(prompts, [rows[i]["r_reject"] for i in idx])
    for j, i in enumerate(idx):
        k = uids.index(f"{digest}:{i}")
        assert torch.allclose(got_c[j], cached["chosen"][k], atol=1e-4)
        assert torch.allclose(got_r[j], cached["rejected"][k], atol=1e-4)
    from megatron_rlhf.rewards.reward_model import encode_reward_parts

    reply_len = [len(encode_reward_parts(rm4.tokenizer, p, rows[i]["r_chosen"])[1]) for p, i in zip(prompts, idx)]
    assert torch.allclose(got_c[:, -1], torch.log1p(torch.tensor(reply_len, dtype=torch.float32)))
    # layout: 2 layers x 2 poolings x 128, reply embedding mean [512:640], log-len x prompt embedding [640:768]
    emb = rm4.trunk.get_input_embeddings().weight
    p_ids, r_ids = encode_reward_parts(rm4.tokenizer, prompts[0], rows[idx[0]]["r_chosen"])
    assert torch.allclose(got_c[0, 512:640], emb[r_ids].mean(0), atol=1e-5)
    assert torch.allclose(got_c[0, 640:768], math.log1p(len(r_ids)) * emb[p_ids].mean(0), atol=1e-5)
    s1 = rm1.score(prompts, [rows[i]["r_chosen"] for i in idx])
    s4 = rm4.score(prompts, [rows[i]["r_chosen"] for i in idx])
    assert max(abs(a - b) for a, b in zip(s1, s4)) < 1e-4
    with pytest.raises(ValueError, match="reply_lengths"):
        rm4.score_token_ids([rm4.encode("hi", "there")])


PREFERENCES = REPO.parent / "shared" / "data" / "preferences"


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_reward_model_trained_on_real_alpacaeval_preferences_beats_chance_by_three_standard_errors(tmp_path):
    """Real GPT-4 preference labels (AlpacaEval annotations in ../shared, read in place), seed 0:
    1000 training pairs and n >= 300 held-out pairs (split by instruction, so no held-out prompt is
    seen in training); SmolLM2-135M-Instruct, first 2 layers frozen, 64 tokens, cold feature cache.

    Bar: held-out pairwise accuracy > 0.5 + 3 * sqrt(0.25 / n) (= 0.5866 for n = 300), i.e. more than
    three standard errors above chance. Measured: 0.703 on n = 303 (7.1 s.e.; ~70 s on a busy 2-core
    machine). Much of what this slice teaches is reply length: GPT-4 preferred the longer answer in
    0.686 of these held-out pairs (the report's 'longer reply wins' baseline); the full demo model's
    report shows the learned head beating that baseline on all sources (0.622 vs 0.580, n = 500).
    A second identical run must reuse the feature cache and give the same model.
    """
    if not PREFERENCES.is_dir():
        pytest.skip(f"{PREFERENCES} (the shared preference data) is not available on this machine")
    tool = _train_tool()
    kw = dict(base="smollm2", data=[str(PREFERENCES)], sources=("alpaca_eval",), train_pairs=1000,
              eval_pairs=300, max_len=64, layers=2, feature_layers=(2,), seed=0,
              feature_cache_dir=str(tmp_path / "features"))
    rep = tool.train_reward_model(out=str(tmp_path / "rm"), **kw)
    n = rep["n_eval"]
    bar = 0.5 + 3 * math.sqrt(0.25 / n)
    assert n >= 300 and rep["n_train"] == 1000 and set(rep["eval_by_source"]) == {"alpaca_eval"}
    assert rep["accuracy"] > bar, (n, bar, rep["accuracy"], rep["baseline_longer_reply_wins"])
    assert rep["reload_check_feature_max_abs_diff"] < 1e-3 and rep["reload_check_max_abs_diff"] < 1e-3
    rep2 = tool.train_reward_model(out=str(tmp_path / "rm2"), **kw)
    assert rep2["features_computed"] == 0 and rep2["accuracy"] == rep["accuracy"]
    rm = RewardModel(tmp_path / "rm")
    assert len(rm.score(PROMPTS, REPLIES)) == 4
