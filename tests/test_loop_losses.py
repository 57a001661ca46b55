"""Every loss of ``algorithm.loss`` trains 3 steps in the real async loop on CPU (vLLM generator +
Megatron learner as Ray actors, tiny random Llama, real MAWPS prompts), and a math + chat mix runs
with a reward-model actor. One Ray cluster and ONE generator for the whole module: ``train`` is
handed the shared generator and resets it to the base weights at the start of every run.

Random weights never solve a math problem, so the math task scores with the
``tests.plugins:char_parity`` plug-in (about half the completions score 1); the chat task in the
mixed run is scored by a tiny random sequence-classification reward model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import check_staleness

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[1]

LOSS_KEYS = {
    "online_dpo": ["dpo/margin", "dpo/accuracy", "loss/nll"],
    "group_dpo": ["dpo/margin", "dpo/accuracy"],
    "grpo": ["pg/clip_frac", "adv/mean", "kl/ref_k3"],
    "ppo": ["pg/clip_frac", "value/loss", "adv/mean"],
    "rloo": ["adv/mean", "kl/ref_k3"],
    "proximal_rloo": ["pg/clip_frac", "adv/mean"],
    "best_of_k_sft": ["loss/total"],
}
# The off-policy corrections and KL choices ride on these runs (one run per loss is the cost; one
# extra grpo run covers the rest): token_tis (default) in ppo and group_dpo's GRPO part, token_mask
# in grpo, sequence_tis in rloo, sequence_mask in proximal_rloo, none in grpo_kl_in_reward; KL
# k3 in the loss (grpo default), k2 in the loss (grpo), k1 in the reward (ppo default), k3 in the
# reward (rloo), k3 in the loss for proximal_rloo (kl_in_reward: false), k1 in grpo's reward.
EXTRA = {
    "online_dpo": ["algorithm.nll_coef=0.1"],
    "group_dpo": ["algorithm.group_dpo_alpha=0.5"],
    "grpo": ["algorithm.kl_beta=0.01", "algorithm.updates_per_batch=2", "algorithm.kl_estimator=k2",
             "algorithm.is_correction=token_mask", "algorithm.is_bounds=[0.99, 1.01]"],
    "ppo": ["algorithm.kl_beta=0.01"],
    "rloo": ["algorithm.kl_beta=0.01", "algorithm.kl_estimator=k3", "algorithm.is_correction=sequence_tis"],
    "proximal_rloo": ["algorithm.updates_per_batch=2", "algorithm.kl_beta=0.01", "algorithm.kl_in_reward=false",
                      "algorithm.is_correction=sequence_mask", "algorithm.is_bounds=[0.9, 1.1]"],
    "best_of_k_sft": [],
    "grpo_kl_in_reward": ["algorithm.loss=grpo", "algorithm.kl_beta=0.01", "algorithm.kl_in_reward=true",
                          "algorithm.kl_estimator=k1", "algorithm.is_correction=none"],
}
LOSS_KEYS["grpo_kl_in_reward"] = ["pg/clip_frac", "adv/mean", "reward/kl_penalty_mean"]
for _run in ("grpo", "ppo", "rloo", "proximal_rloo"):
    LOSS_KEYS[_run] = LOSS_KEYS[_run] + ["is/masked_frac", "is/weight_mean", "is/weight_max", "is/ess"]
LOSS_KEYS["grpo"] += ["loss/kl_ref", "kl/ref_k2"]
LOSS_KEYS["proximal_rloo"] += ["loss/kl_ref"]
LOSS_KEYS["rloo"] += ["reward/kl_penalty_mean"]


def _cfg(model_dir, out_dir, name, *extra):
    from megatron_rlhf.config import load_config

    return load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false",
        "checkpoint.export_hf=false", "checkpoint.interval=0",
        "eval.enabled=false", *extra])   # the eval's own tests: tests/test_evaluate.py


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss", list(LOSS_KEYS))
def test_each_loss_trains_3_steps_in_the_async_loop(generator, tiny_llama_dir, tmp_path, loss):
    from megatron_rlhf.trainer.loop import train
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS

    name = loss if loss in ("online_dpo", "group_dpo", "grpo", "ppo", "rloo", "proximal_rloo",
                            "best_of_k_sft") else None
    res = train(_cfg(tiny_llama_dir, tmp_path, loss, *([f"algorithm.loss={name}"] if name else []),
                     *EXTRA[loss]), quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_staleness(rows, [0, 1, 1])
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert [r["generator/weight_version"] for r in rows] == [0, 0, 1]   # the shared generator was reset
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["pairs/count"] == 2 and r["train/num_units"] == 2
        for key in ["loss/total", "kl/ref_k3", "kl/ref_k1", "rollout/entropy_mc", "grad/norm",
                    "logprobs/vllm_gap_abs_mean", "perf/learner_tokens_per_s", "perf/learner_tflops",
                    *LOSS_KEYS[loss]]:
            assert r.get(key) is not None and math.isfinite(r[key]), (loss, key, r.get(key))
        assert r["train/updates"] == (2 if "algorithm.updates_per_batch=2" in EXTRA[loss] else 1)
        assert r["perf/learner_tokens_per_s"] > 0 and r["perf/learner_tflops"] > 0
        assert "perf/mfu" not in r                      # CPU: no known peak, no MFU
        if "is/masked_frac" in LOSS_KEYS[loss]:
            assert 0.0 <= r["is/masked_frac"] <= 1.0 and 0.0 <= r["is/ess"] <= 1.0 + 1e-6
    if loss in ("grpo", "proximal_rloo"):   # T=2: the second update moves away from pi_old
        assert any(r["pg/ratio_max"] != 1.0 for r in rows)
    if loss == "grpo_kl_in_reward":         # no correction: no is/* metrics; the KL is in the reward
        assert all("is/masked_frac" not in r and "loss/kl_ref" not in r for r in rows)


@pytest.mark.timeout(600)
def test_math_and_chat_mix_with_a_reward_model_actor(generator, tiny_llama_dir, tmp_path):
    import yaml

    from megatron_rlhf.config import load_config
    from megatron_rlhf.testing.tiny import make_tiny_reward_model
    from megatron_rlhf.trainer.loop import train

    rm_dir = make_tiny_reward_model(tmp_path / "rm")
    gold_dir = make_tiny_reward_model(tmp_path / "rm_gold", seed=1)   # another judge: eval only
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(yaml.safe_dump({
        "defaults": str(REPO / "configs" / "ci_tiny.yaml"),
        "tasks": [
            {"name": "math", "weight": 0.75, "reward": "tests.plugins:char_parity",
             "data": {"path": "data/math_word_problems/mawps.jsonl", "prompt_field": "input",
                      "answer_field": "target", "filter": {"type": ["singleop", "addsub"]}}},
            {"name": "chat", "weight": 0.25, "reward": {"reward_model": str(rm_dir)},
             "eval_reward": {"reward_model": str(gold_dir)},
             "data": {"path": "data/chat/hh_helpful_dove/test.jsonl"}}],
        "algorithm": {"prompts_per_step": 4},
    }))
    cfg = load_config(recipe, [f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}",
                               "run.name=mix", "logging.progress=false", "checkpoint.interval=2",
                               "checkpoint.export_hf=false"])
    res = train(cfg, quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    assert len(rows) == 3
    for r in rows:
        assert r["task/math/units"] == 3 and r["task/chat/units"] == 1
        assert r["task/chat/reward_mean"] is not None and r["task/math/reward_mean"] is not None
        assert r["task/chat/reward_mean"] not in (0.0, 1.0)         # scalar RM scores, not 0/1
    state = json.loads((Path(res["run_dir"]) / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert set(state["sampler_state"]["tasks"]) == {"math", "chat"}
    assert set(state["producer_state"]["normalizer"]["moments"]) == {"math", "chat"}
    # the evaluation reward model scores the held-out chat replies beside the training one; win
    # rates against the starting policy's replies are 0.5 at the eval before step 1 (the same replies)
    first, last = rows[0], rows[-1]
    assert first["eval/step"] == 0 and last["eval/step"] == 3
    n = first["eval/chat/num_prompts"]
    assert n > 0 and len(first["eval/chat/gold_outcomes"]) == n
    assert first["eval/chat/gold_outcomes"] != first["eval/chat/outcomes"]     # two different judges
    assert first["eval/chat/win_rate"] == first["eval/chat/proxy_win_rate"] == 0.5
    assert first["eval/chat/win_rate_prompts"] == n and first["eval/chat/win_rate/se"] == 0
    for key in ("win_rate", "proxy_win_rate"):
        assert 0 <= last[f"eval/chat/{key}"] <= 1 and last[f"eval/chat/{key}_prompts"] == n
    assert math.isfinite(last["eval/chat/gold_reward_mean"]) and "eval/math/win_rate" not in last


@pytest.mark.timeout(600)
def test_overlong_mask_trains_grpo_without_truncated_completions(generator, tiny_llama_dir, tmp_path):
    """algorithm.overlong=mask in the real loop: the random model's completions mostly hit
    max_new_tokens; those rows reach the learner with an all-zero loss mask (no trained tokens),
    only groups with an untruncated completion train, and the counts are per task."""
    from megatron_rlhf.trainer.loop import train

    from megatron_rlhf.rollout.batch_io import list_batches, load_batch

    res = train(_cfg(tiny_llama_dir, tmp_path, "overlong_mask", "algorithm.loss=grpo", "algorithm.overlong=mask",
                     "algorithm.samples_per_prompt=8", "eval.enabled=false", "run.save_rollouts=true"),
                quiet=True, generators=[generator])
    rows = _rows(res["run_dir"])
    batches = [load_batch(p) for p in list_batches(Path(res["run_dir"]) / "rollouts")]
    assert [r["step"] for r in rows] == [1, 2, 3] and len(batches) == 3
    for r, b in zip(rows, batches):
        assert r["pairs/count"] == 2 and r["train/num_sequences"] == 16   # 2 groups of 8 rows
        if "task/math/overlong_frac" in r:   # counted where generated: a batch of carried groups alone has none
            assert 0 < r["task/math/overlong_frac"] <= 1 and r["task/math/overlong_masked"] >= 1
        # the learner trained exactly the untruncated completions' tokens
        comps = [x.completion for g in b.groups for x in g.rollouts]
        assert any(c.finish_reason == "stop" for c in comps)
        assert r["train/tokens"] == sum(len(c.token_ids) for c in comps if c.finish_reason == "stop")
        assert math.isfinite(r["loss/total"]) and math.isfinite(r["grad/norm"])
    assert any("task/math/overlong_frac" in r for r in rows), rows
