"""Evaluation on held-out prompts (trainer/evaluate.py, tools/evaluate.py).

Unit tests with a fake pool (hand-computed pass@1, mean@k, reward mean and their standard
errors; one weight version per eval; request order; KL to the reference on fresh samples by
hand), the held-out split on real data (eval and training prompts disjoint), and one integration
run on the tiny model: eval rows in metrics.jsonl (one row per step, the eval before step 1 in
row 1, kl_ref ~0 before any update) and tools/evaluate.py agreeing with the in-loop eval of the
final weights.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

from megatron_rlhf.config import EvalConfig, TaskConfig, load_config
from megatron_rlhf.trainer.evaluate import (EvalService, Evaluator, cluster_se, eval_metrics, heldout_order,
                                            mean_se, split_eval_prompts, win_rate_metrics)
from megatron_rlhf.types import Completion, Prompt

REPO = Path(__file__).resolve().parents[1]


def test_mean_se_matches_hand_computed_values():
    # [1, 0, 1, 1]: mean 0.75, sample variance (3 x 0.0625 + 0.5625) / 3 = 0.25, se = 0.5 / 2
    assert mean_se([1, 0, 1, 1]) == pytest.approx((0.75, 0.25))
    assert mean_se([3.0]) == (3.0, 0.0)
    m, se = mean_se([])
    assert math.isnan(m) and math.isnan(se)
    assert mean_se([1e300, -1e300])[1] == math.inf           # overflow is inf, not an error


@pytest.mark.timeout(30)
def test_cluster_se_matches_hand_computed_values_and_reduces_to_mean_se_for_singletons():
    # [1, 1, 0, 0] in clusters a, a, b, b: mean 0.5, cluster totals +1 and -1, G = 2:
    # se^2 = 2 / 1 x (1 + 1) / 4^2 = 0.25 -> 0.5, against s / sqrt(n) = sqrt(1/3) / 2 = 0.289 unclustered
    assert cluster_se([1, 1, 0, 0], ["a", "a", "b", "b"]) == pytest.approx(0.5)
    assert mean_se([1, 1, 0, 0])[1] == pytest.approx(math.sqrt(1 / 3) / 2)
    # outcomes that cancel within each cluster: totals 0 and 0 -> 0
    assert cluster_se([1, 0, 1, 0], ["a", "a", "b", "b"]) == 0
    vals = [1, 0, 1, 1, 0, 1, 0]
    assert cluster_se(vals, list(range(7))) == pytest.approx(mean_se(vals)[1])   # one prompt per cluster
    assert math.isnan(cluster_se([1, 0], ["a", "a"])) and math.isnan(cluster_se([], []))
    with pytest.raises(ValueError, match="cluster ids"):
        cluster_se([1, 0], ["a"])


@pytest.mark.timeout(30)
def test_eval_rows_carry_per_prompt_outcomes_ids_and_the_cluster_robust_se():
    held = {"math": [Prompt(index=10 + i, task="math", token_ids=(1,), answer="7", text=f"m{i}", group=g)
                     for i, g in enumerate(["p", "q", "p", "q"])],
            "chat": [Prompt(index=i, task="chat", token_ids=(1,), text=f"c{i}") for i in range(3)]}
    out = Evaluator(FakePool(), held, {"math": "math_verify", "chat": "reward_model"}, _fns(),
                    EvalConfig(samples=4), 1.0).evaluate(2)
    # greedy correct when the index is even: 10, 12 -> "1010", in eval order, with the row ids
    assert out["eval/math/outcomes"] == "1010" and out["eval/math/ids"] == [10, 11, 12, 13]
    assert out["eval/math/groups"] == ["p", "q", "p", "q"] and out["eval/math/num_clusters"] == 2
    # clusters p = {1, 1}, q = {0, 0}: totals +1, -1 -> se 0.5 (the per-prompt se is 0.289)
    assert out["eval/math/pass@1/se_cluster"] == pytest.approx(0.5)
    assert out["eval/math/pass@1/se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert out["eval/math/mean@k/se_cluster"] == 0   # every prompt's mean@4 is 0.25
    # chat: no cluster ids -> no cluster keys; outcomes are the greedy rewards 0, 1, 2
    assert out["eval/chat/outcomes"] == [0.0, 1.0, 2.0] and out["eval/chat/ids"] == [0, 1, 2]
    assert "eval/chat/groups" not in out and "eval/chat/reward_mean/se_cluster" not in out
    with pytest.raises(ValueError, match="2 ids for 3 prompts"):
        eval_metrics("x", "plugin", [1.0, 0.0, 1.0], [1, 1, 1], None, ids=[0, 1])


def _prompts(task, n, dup_every=0):
    return [Prompt(index=i, task=task, token_ids=(1, 2, 3), answer=str(i % 10),
                   text=f"q{i % dup_every if dup_every else i}") for i in range(n)]


def test_heldout_slice_is_fixed_and_disjoint_from_training():
    tasks = [TaskConfig(name="math")]
    prompts = _prompts("math", 100, dup_every=40)   # texts repeat: q0 appears 3 times
    cfg = EvalConfig(num_prompts=16, holdout_frac=0.2)
    train, held, counts = split_eval_prompts(tasks, {"math": prompts}, cfg, load_eval=None)
    assert len(held["math"]) == 16 and counts["math"]["eval_source"] == "holdout"
    held_texts = {(p.text, p.answer) for p in held["math"]}
    assert not held_texts & {(p.text, p.answer) for p in train["math"]}
    assert counts["math"]["train_removed"] == 100 - len(train["math"]) >= 16
    # the same slice whatever the file order (no seed involved)
    _, held2, _ = split_eval_prompts(tasks, {"math": prompts[::-1]}, cfg, load_eval=None)
    assert [p.index for p in held2["math"]] == [p.index for p in held["math"]]
    # at most holdout_frac of a small task
    _, small, _ = split_eval_prompts(tasks, {"math": prompts[:30]}, cfg, load_eval=None)
    assert len(small["math"]) == 6
    tiny_train, tiny_held, tiny_counts = split_eval_prompts(tasks, {"math": prompts[:3]}, cfg, load_eval=None)
    assert tiny_held["math"] == [] and tiny_train["math"] == prompts[:3]   # too small: trained, not evaluated
    assert tiny_counts["math"]["eval_prompts"] == 0


def test_eval_file_prompts_are_taken_out_of_training():
    task = TaskConfig(name="gsm", eval_data={"path": "data/gsm8k/dev.jsonl"})
    train = _prompts("gsm", 50)
    dev = [Prompt(index=i, task="gsm", token_ids=(1,), answer=str(i % 10), text=f"q{i}") for i in range(40, 60)]
    tr, held, counts = split_eval_prompts([task], {"gsm": train}, EvalConfig(num_prompts=8), lambda t: dev)
    assert counts["gsm"]["eval_source"] == "eval_data" and len(held["gsm"]) == 8
    assert {p.text for p in held["gsm"]} <= {p.text for p in dev}
    assert not {p.text for p in held["gsm"]} & {p.text for p in tr["gsm"]}
    assert [p.text for p in held["gsm"]] == [p.text for p in heldout_order(dev)[:8]]


def test_real_data_eval_and_training_prompts_disjoint(tiny_llama_dir):
    """The trainer's own loading path on real data (MAWPS, ci_tiny's task)."""
    from megatron_rlhf.trainer.setup import load_prompts as _load_prompts

    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [f"model.source={tiny_llama_dir}",
                                                          "eval.num_prompts=32"])
    sampler, counts, _, eval_by_task = _load_prompts(cfg, tiny_llama_dir)
    for task in sampler.tasks:
        train = {(p.text, p.answer) for p in sampler.prompts(task)}
        held = {(p.text, p.answer) for p in eval_by_task[task]}
        assert len(eval_by_task[task]) == 32 == counts[task]["eval_prompts"]
        assert train and not train & held
    # what training draws over several epochs never includes an eval prompt
    drawn = {(p.text, p.answer) for p in sampler.next(sampler.tasks[0], 3 * len(sampler.prompts(sampler.tasks[0])))}
    assert not drawn & {(p.text, p.answer) for p in eval_by_task[sampler.tasks[0]]}


def test_demo_eval_sets_are_the_held_out_arithmetic_file_and_mt_bench(tiny_llama_dir):
    """configs/cpu_demo.yaml: math eval = the 128 rows of 32 products training never sees in either
    order (each row's cluster id is its unordered product); chat
    eval = the 80 MT-Bench questions (another source than the HH training prompts), judged by an
    evaluation reward model trained on other preference pairs than the training one."""
    from megatron_rlhf.rewards.train import DEMO_REWARD_MODELS
    from megatron_rlhf.trainer.setup import load_prompts as _load_prompts

    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", [f"model.source={tiny_llama_dir}"])
    sampler, counts, _, held = _load_prompts(cfg, tiny_llama_dir)
    assert counts["math"]["eval_source"] == counts["chat"]["eval_source"] == "eval_data"
    # SmolLM2's tokenizer keeps all 80 within the prompt budget; the tiny test tokenizer, with
    # longer token strings, drops the 12 longest
    assert len(held["math"]) == 128 and len(held["chat"]) == 68
    chat = cfg.tasks[1]
    proxy, gold = (DEMO_REWARD_MODELS[spec.reward_model].train_kwargs for spec in (chat.reward, chat.eval_reward))
    assert {proxy["half"], gold["half"]} == {"a", "b"}
    assert counts["math"]["train_removed"] == 0 and len(sampler.prompts("math")) == 196
    assert {p.answer for p in held["math"]} and all(p.answer == "" for p in held["chat"])
    # no held-out product is trained on in either order: "6 x 8" held out means 8 x 6 is too
    train_groups = {p.group for p in sampler.prompts("math")}
    assert all(p.group for p in held["math"]) and not {p.group for p in held["math"]} & train_groups


class FakePool:
    """Greedy (temperature 0): math prompt i answers correctly when i is even; sampled: completion
    j of prompt i is correct when (i + j) % 4 == 0. Chat replies are i + 1 tokens long."""

    num_workers = 1

    def __init__(self, version=0, mixed=False):
        self.version, self.mixed, self.pushed = version, mixed, []

    def versions(self):
        return [self.version]

    def push(self, weights, only_stale=True):
        self.pushed.append(weights.version)
        self.version = weights.version
        return {}

    def generate(self, prompts, n, refresh=None, temperature=None):
        out = []
        for p in prompts:
            comps = []
            for j in range(n):
                ok = p.index % 2 == 0 if temperature == 0 else (p.index + j) % 4 == 0
                text = f"#### {p.answer}" if ok else "#### 99999"
                ver = self.version + (1 if self.mixed and j == 1 else 0)
                comps.append(Completion(token_ids=tuple(range(p.index + 1)), logprobs=(0.0,) * (p.index + 1),
                                        finish_reason="stop", text=text, weight_version=ver))
            out.append(comps)
        return out


def _fns():
    def math_fn(ps, texts):
        return [float(t == f"#### {p.answer}") for p, t in zip(ps, texts)]

    def chat_fn(ps, texts):
        return [float(p.index) for p in ps]   # the greedy reply of prompt i scores i
    return {"math": math_fn, "chat": chat_fn}


def test_evaluator_values_and_standard_errors_by_hand():
    from megatron_rlhf.generator.weight_sync import PublishedWeights

    held = {"math": [Prompt(index=i, task="math", token_ids=(1,), answer="7", text=f"m{i}") for i in range(4)],
            "chat": [Prompt(index=i, task="chat", token_ids=(1,), text=f"c{i}") for i in range(3)]}
    pool = FakePool()
    ev = Evaluator(pool, held, {"math": "math_verify", "chat": "reward_model"}, _fns(),
                   EvalConfig(samples=4), sample_temperature=1.0)
    out = ev.evaluate(5, PublishedWeights(version=5, payload="w5"))
    assert pool.pushed == [5] and out["eval/step"] == 5 and out["eval/weight_version"] == 5
    # pass@1: prompts 0 and 2 of 4 -> 0.5, se = sqrt(1/3) / 2
    assert out["eval/math/pass@1"] == pytest.approx(0.5)
    assert out["eval/math/pass@1/se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    # mean@4: exactly one j in 0..3 has (i + j) % 4 == 0 for every i -> 0.25 each, se 0
    assert out["eval/math/mean@k"] == pytest.approx(0.25) and out["eval/math/mean@k/se"] == 0
    # chat: rewards 0, 1, 2 -> mean 1, se = 1 / sqrt(3); lengths 1, 2, 3 tokens
    assert out["eval/chat/reward_mean"] == pytest.approx(1.0)
    assert out["eval/chat/reward_mean/se"] == pytest.approx(1 / math.sqrt(3))
    assert out["eval/chat/len_mean_tokens"] == pytest.approx(2.0)
    assert "eval/chat/pass@1" not in out and "eval/math/reward_mean" not in out
    assert out["eval/math/num_prompts"] == 4 and out["time/eval_s"] >= 0
    # an eval of the version the pool already holds pushes nothing
    ev.evaluate(5, PublishedWeights(version=5, payload="w5"))
    assert pool.pushed == [5]


def test_evaluator_console_lines_start_progress_and_result():
    import time as _time

    class SlowPool(FakePool):
        def generate(self, prompts, n, refresh=None, temperature=None):
            _time.sleep(0.3)
            return super().generate(prompts, n, refresh, temperature)

    held = {"math": [Prompt(index=i, task="math", token_ids=(1,), answer="7", text=f"m{i}") for i in range(4)],
            "chat": [Prompt(index=i, task="chat", token_ids=(1,), text=f"c{i}") for i in range(3)]}
    lines: list[str] = []
    ev = Evaluator(SlowPool(), held, {"math": "math_verify", "chat": "reward_model"}, _fns(),
                   EvalConfig(samples=4), 1.0, log=lines.append, progress_every_s=0.1)
    ev.evaluate(0)
    assert lines[0] == "eval before step 1: math 4, chat 3 held-out prompts, greedy + 4 samples of each math prompt..."
    assert any(ln.startswith("eval before step 1: greedy completions of 7 prompts... ") for ln in lines[1:-1])
    assert any(ln.startswith("eval before step 1: 4 sampled completions of 4 math prompts... ") for ln in lines[1:-1])
    # pass@1 2/4, se sqrt(1/3)/2 = 0.289; mean@4 0.25; chat rewards 0, 1, 2: 1.00 +- 0.58
    assert lines[-1].startswith("eval before step 1: math pass@1 2/4 = 0.500 +- 0.289, mean@4 0.250; "
                                "chat reward 1.00 +- 0.58 (")
    ev.log = None   # silent without a log
    ev.evaluate(3)


def test_evaluator_refuses_completions_of_two_weight_versions():
    held = {"math": [Prompt(index=0, task="math", token_ids=(1,), answer="7", text="m")]}
    ev = Evaluator(FakePool(mixed=True), held, {"math": "math_verify"}, _fns(), EvalConfig(samples=2), 1.0)
    with pytest.raises(RuntimeError, match="weight versions"):
        ev.evaluate(1)


def test_eval_metrics_plugin_task_reports_reward_and_length():
    out = eval_metrics("syn", "plugin", [0.5, 0.7], [3, 5], None)
    assert out["eval/syn/reward_mean"] == pytest.approx(0.6) and out["eval/syn/len_mean_tokens"] == 4


def test_eval_service_serves_requests_in_order_and_cancels_the_rest():
    class Ev:
        def __init__(self):
            self.seen = []

        def start(self, step, weights=None):
            self.seen.append(step)
            return lambda: {"eval/step": step, "time/eval_s": 0.0}

    ev = Ev()
    svc = EvalService(ev)
    a, b = svc.request(0), svc.request(2)
    svc.serve_pending()
    assert ev.seen == [0, 2] and a.result()["eval/step"] == 0 and b.result()["eval/step"] == 2
    c = svc.request(4)
    svc.close()
    stop = threading.Event()
    t = threading.Thread(target=svc.serve_until_closed, args=(stop,))
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and c.result()["eval/step"] == 4
    d = svc.request(6)
    svc.cancel_pending()
    assert d.result(timeout=1) is None


# ------------------------------------------------------------------------------ KL on fresh samples
def test_kl_ref_metrics_match_hand_computed_values():
    """k3 = exp(d) - d - 1 with d = ref - policy, per token; k1 = policy - ref; a non-finite token is
    left out; the se is clustered by prompt, the per-completion sum averaged per prompt."""
    from megatron_rlhf.trainer.evaluate import kl_ref_metrics

    pol = [[-1.0, -0.5], [-2.0], [-0.3, float("nan")]]
    ref = [[-1.5, -0.5], [-1.0], [-0.3, -0.1]]
    out = kl_ref_metrics("m", pol, ref, [0, 1, 1])
    a, b = math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1   # 0.1065, 0.7183; the other tokens: d = 0
    m = (a + b) / 4                                            # 4 finite tokens
    assert out["eval/m/kl_ref"] == pytest.approx(m) and out["eval/m/kl_ref_tokens"] == 4
    assert out["eval/m/kl_ref_k1"] == pytest.approx((0.5 - 1.0) / 4)
    # CR1 by prompt: totals a - 2m and b - 2m (= -(a - 2m)); sqrt(2 / 1 x 2 (a - 2m)^2) / 4
    assert out["eval/m/kl_ref/se"] == pytest.approx(math.sqrt(2 * 2 * (a - 2 * m) ** 2) / 4)
    # per prompt: a, and (b + 0) / 2; two values: se = |x1 - x2| / 2
    assert out["eval/m/kl_ref_seq"] == pytest.approx((a + b / 2) / 2)
    assert out["eval/m/kl_ref_seq/se"] == pytest.approx(abs(a - b / 2) / 2)
    # policy == reference: exactly 0, whatever the values
    same = kl_ref_metrics("m", [[-0.7, -3.0]], [[-0.7, -3.0]], [0])
    assert same["eval/m/kl_ref"] == 0 and same["eval/m/kl_ref_k1"] == 0
    assert kl_ref_metrics("m", [[]], [[]], [0]) == {}
    with pytest.raises(ValueError, match="different lengths"):
        kl_ref_metrics("m", [[-1.0]], [[-1.0, -2.0]], [0])


class KLPool(FakePool):
    """FakePool whose sampled completions are math (5, 6) with sampling logprobs (-1, -0.5) and
    chat (9,) with (-2,)."""

    def generate(self, prompts, n, refresh=None, temperature=None):
        if temperature == 0:
            return super().generate(prompts, n, refresh, temperature)
        self.sampled = [p.task for p in prompts]
        ids = {"math": ((5, 6), (-1.0, -0.5)), "chat": ((9,), (-2.0,))}
        return [[Completion(token_ids=ids[p.task][0], logprobs=ids[p.task][1], finish_reason="stop",
                            text="#### 7" if j == 0 else "#### 1", weight_version=self.version)
                 for j in range(n)] for p in prompts]


class FakeReference:
    """The learner's reference pass: token 5 -> -1.5, 6 -> -0.5, 9 -> -1.0 (column t holds token t's
    logprob); the result waits for ``release``."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()

    def __call__(self, input_ids, loss_mask, temperature):
        self.calls.append((input_ids, loss_mask, temperature))
        table = {5: -1.5, 6: -0.5, 9: -1.0}

        def wait():
            assert self.release.wait(10)
            return {"logprobs": [[table.get(t, 0.0) for t in row] for row in input_ids], "reference_version": 0}
        return wait


def test_evaluator_kl_ref_scores_every_tasks_fresh_samples_with_the_reference_without_blocking():
    held = {"math": [Prompt(index=i, task="math", token_ids=(1, 2), answer="7", text=f"m{i}") for i in range(2)],
            "chat": [Prompt(index=i, task="chat", token_ids=(3,), text=f"c{i}") for i in range(3)]}
    pool, ref = KLPool(version=4), FakeReference()
    ev = Evaluator(pool, held, {"math": "math_verify", "chat": "reward_model"}, _fns(),
                   EvalConfig(samples=2, temperature=0.7, kl_ref=True), 1.0, reference=ref)
    svc = EvalService(ev)
    fut = svc.request(4)
    svc.serve_pending()   # generation and scoring done; the reference pass not answered yet
    assert not fut.done() and pool.sampled == ["math", "math", "chat", "chat", "chat"]
    ids, mask, temperature = ref.calls[0]
    assert temperature == 0.7 and len(ids) == 10                       # 5 prompts x 2 samples
    assert ids[0] == [1, 2, 5, 6] and mask[0] == [0, 0, 1, 1]          # prompt + completion, mask on it
    assert ids[-1] == [3, 9, 0, 0] and mask[-1] == [0, 1, 0, 0]        # right-padded
    ref.release.set()
    out = fut.result(timeout=10)
    a, b = math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2             # math tokens a and 0; chat token b
    assert out["eval/math/kl_ref"] == pytest.approx(a / 2) and out["eval/chat/kl_ref"] == pytest.approx(b)
    assert out["eval/math/kl_ref_k1"] == pytest.approx(0.25) and out["eval/chat/kl_ref_k1"] == pytest.approx(-1.0)
    assert out["eval/math/kl_ref_seq"] == pytest.approx(a) and out["eval/math/kl_ref_tokens"] == 8
    assert out["eval/reference_version"] == 0 and out["time/eval_kl_ref_s"] >= 0
    # math's samples are scored as before (mean@2: one of two correct), chat's are not
    assert out["eval/math/mean@k"] == pytest.approx(0.5) and "eval/chat/mean@k" not in out
    assert "eval/kl_ref_skipped" not in out


def test_kl_ref_is_absent_with_a_reason_without_samples_or_reference_and_off_when_disabled():
    held = {"math": [Prompt(index=0, task="math", token_ids=(1,), answer="7", text="m")],
            "chat": [Prompt(index=0, task="chat", token_ids=(3,), text="c")]}
    kinds = {"math": "math_verify", "chat": "reward_model"}
    lines: list[str] = []
    pool = KLPool()
    out = Evaluator(pool, held, kinds, _fns(), EvalConfig(samples=2, kl_ref=True), 1.0, log=lines.append).evaluate(1)
    assert "no reference model loaded" in out["eval/kl_ref_skipped"] and pool.sampled == ["math"]
    assert not any("kl_ref" in k for k in out if k != "eval/kl_ref_skipped")
    assert lines[1].startswith("eval: no KL to the reference (eval.kl_ref): no reference model")
    out = Evaluator(KLPool(), held, kinds, _fns(), EvalConfig(samples=0, kl_ref=True), 1.0, reference=FakeReference()).evaluate(1)
    assert out["eval/kl_ref_skipped"].startswith("eval.samples=0")
    ref = FakeReference()
    out = Evaluator(KLPool(), held, kinds, _fns(), EvalConfig(samples=2, kl_ref=False), 1.0, reference=ref).evaluate(1)
    assert not any("kl_ref" in k for k in out) and ref.calls == []


# ------------------------------------------------------------------------------ integration
def _cfg(model_dir, out_dir, name, *extra):
    return load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false", *extra])


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_eval_rows_in_metrics_and_tool_agrees_with_loop(ray_cluster, tiny_llama_dir, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mrlhf_tools_evaluate", REPO / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)   # by path: a package named "evaluate" may be installed

    from megatron_rlhf.trainer.loop import train
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS

    cfg = _cfg(tiny_llama_dir, tmp_path, "evalrun", "run.num_steps=3", "eval.interval=2", "eval.num_prompts=12",
               "eval.kl_ref=true")   # off by default (and in ci_tiny.yaml)
    res = train(cfg, quiet=True)
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]                        # still one row per step
    assert [r.get("eval/step") for r in rows] == [0, 2, 3]               # before step 1, interval, end
    assert [r["eval/weight_version"] for r in rows] == [0, 2, 3]
    # KL to the (frozen) reference on each eval's fresh samples: finite, >= 0, ~0 before any update
    # (policy == reference: only the generator's vs the learner's kernels differ), larger after
    kl = [r["eval/math/kl_ref"] for r in rows]
    assert all(math.isfinite(v) and v >= 0 for v in kl) and kl[0] < 1e-4 and kl[-1] > kl[0], kl
    assert all(r["eval/reference_version"] == 0 and r["eval/math/kl_ref_tokens"] > 0 for r in rows)
    assert res["eval"]["math"]["kl_ref"]["first_step"] == 0
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r) and r["time/eval_s"] > 0
        for key in ("eval/math/reward_mean", "eval/math/len_mean_tokens"):
            assert r[key] is not None and r[key + "/se"] is not None
        assert r["eval/math/num_prompts"] == 12
    ev = res["eval"]["math"]["reward_mean"]
    assert ev["first_step"] == 0 and ev["last_step"] == 3
    from megatron_rlhf.trainer.report import PLOTS   # the run's report, written at the end

    page = Path(res["report"]).read_text()
    assert all(f'<img id="plot-{name}"' in page for name in PLOTS)
    # the tool on the exported final weights agrees with the in-loop eval of version 3
    scored = tool.evaluate_folder(Path(res["run_dir"]) / "hf_final", cfg, step=3)
    assert "no reference model" in scored["eval/kl_ref_skipped"] and "eval/math/kl_ref" not in scored
    last = rows[-1]
    for key in ("eval/math/reward_mean", "eval/math/len_mean_tokens"):
        assert abs(scored[key] - last[key]) <= max(last[key + "/se"], 1e-9), (key, scored[key], last[key])


# ------------------------------------------------------------------------------ a failed eval
@pytest.mark.timeout(30)
def test_a_failed_eval_still_writes_its_row_and_every_later_row_then_raises():
    import queue
    from concurrent.futures import Future

    from megatron_rlhf.trainer.evaluate import PendingRows

    written = []
    alive = threading.Thread(target=lambda: None)
    rows = PendingRows(written.append, alive, queue.Queue(), timeout=5.0)
    ok, failed = Future(), Future()
    ok.set_result({"eval/step": 0, "eval/math/pass@1": 0.5, "time/eval_s": 2.0})
    rows.add({"step": 1}, [ok])
    rows.add({"step": 2}, [failed])
    rows.add({"step": 3}, [])
    assert [r["step"] for r in written] == [1]            # row 2 waits for its eval; row 3 behind it
    failed.set_exception(RuntimeError("engine died during the eval"))
    with pytest.raises(RuntimeError, match="engine died"):
        rows.flush()
    assert [r["step"] for r in written] == [1, 2, 3]      # every trained step is in metrics.jsonl
    assert written[0]["eval/math/pass@1"] == 0.5 and written[0]["time/eval_s"] == 2.0
    assert "eval/step" not in written[1] and written[1]["time/eval_s"] == 0.0


@pytest.mark.timeout(60)
def test_an_eval_that_does_not_answer_times_out_naming_its_step_its_phase_and_the_stacks_file():
    """A wait for an eval that runs out says which row waits, what the eval is doing (queued behind
    the producer, generating on its thread, or waiting for the reference pass) and where the stacks
    of every process were written, as the rollout timeout does."""
    import queue

    from megatron_rlhf.trainer.evaluate import (EVAL_FINISHING, EVAL_GENERATING, EVAL_QUEUED, EvalService,
                                                PendingRows)

    release = threading.Event()

    class Hanging:   # Evaluator.start: generation (here: hangs, or returns a finish that hangs)
        def __init__(self, hang_in_start):
            self.hang_in_start = hang_in_start

        def start(self, step, weights):
            if self.hang_in_start:
                release.wait()
            return lambda: release.wait() and {}

    dumped = []
    for phase, hang_in_start, serve in ((EVAL_QUEUED, False, False), (EVAL_GENERATING, True, True),
                                        (EVAL_FINISHING, False, True)):
        svc = EvalService(Hanging(hang_in_start))
        producer = threading.Thread(target=svc.serve_pending if serve else release.wait, daemon=True)
        fut = svc.request(7)
        producer.start()
        rows = PendingRows(lambda row: None, producer, queue.Queue(), timeout=1.5,
                           dump_stacks=lambda why: dumped.append(why) or "stacks of every process: /r/logs/s.txt")
        rows.add({"step": 7}, [fut])
        with pytest.raises(TimeoutError) as info:
            rows.flush()
        assert str(info.value) == (f"no eval result for the row of step 7 within async.timeout_s=2 s: the eval is "
                                   f"{phase}; stacks of every process: /r/logs/s.txt"), info.value
    assert dumped == ["eval timeout"] * 3
    release.set()


@pytest.mark.timeout(30)
def test_a_served_eval_still_waiting_for_its_reference_pass_is_kept_when_the_producer_ends():
    """The final eval's reference pass (eval.kl_ref) may answer after the producer thread ended: a
    served (running) eval is waited for (one the producer never served resolves to no fields)."""
    import queue
    from concurrent.futures import Future

    from megatron_rlhf.trainer.evaluate import PendingRows

    written = []
    ended = threading.Thread(target=lambda: None)   # never started: not alive, as an ended producer
    rows = PendingRows(written.append, ended, queue.Queue(), timeout=10.0)
    served = Future()
    assert served.set_running_or_notify_cancel()
    threading.Timer(1.2, lambda: served.set_result({"eval/step": 3, "eval/math/kl_ref": 0.01,
                                                    "time/eval_s": 1.0})).start()
    rows.add({"step": 3}, [served])
    rows.flush()
    assert written[0]["eval/math/kl_ref"] == 0.01


@pytest.mark.timeout(30)
def test_a_one_step_run_keeps_the_eval_before_step_1_apart_from_the_final_eval(tmp_path):
    """``run.num_steps=1``: row 1 gets both evals. The final eval's fields are the row's own, the one
    before step 1 is kept under ``eval/earlier``, and the summary's first/last and the time table's
    first/last eval are those two evals (they were both the final one)."""
    import queue
    from concurrent.futures import Future

    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.evaluate import EARLIER_EVALS, PendingRows
    from megatron_rlhf.trainer.metrics import MetricsLogger, eval_records, summarize_evals, time_breakdown

    log = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    before, final = Future(), Future()
    before.set_result({"eval/step": 0, "eval/math/pass@1": 0.25, "eval/math/pass@1/se": 0.1, "time/eval_s": 3.0})
    final.set_result({"eval/step": 1, "eval/math/pass@1": 0.5, "eval/math/pass@1/se": 0.1, "time/eval_s": 5.0})
    rows = PendingRows(log.log, threading.Thread(target=lambda: None), queue.Queue(), timeout=5.0)
    row = {"step": 1, "weight_version": 1, "loss/total": 0.1, "reward/mean": 0.0, "pairs/count": 1,
           "pairs/skipped_prompts": 0, "time/gen_s": 1.0, "time/train_s": 1.0, "time/sync_s": 0.0}
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS
    row.update({k: 0.0 for k in REQUIRED_KEYS if k not in row})
    rows.add(row, [before, final])
    written = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(written) == 1 and written[0]["eval/step"] == 1 and written[0]["eval/math/pass@1"] == 0.5
    assert written[0][EARLIER_EVALS][0]["eval/step"] == 0 and written[0]["time/eval_s"] == 8.0
    assert [(e["eval/step"], e["time/eval_s"]) for e in eval_records(written)] == [(0, 3.0), (1, 5.0)]
    s = summarize_evals(written)["math"]["pass@1"]
    assert (s["first"], s["first_step"], s["last"], s["last_step"]) == (0.25, 0, 0.5, 1)
    t = time_breakdown(written, {}, loop_s=10.0, total_s=20.0)
    assert (t["time/eval_first_s"], t["time/eval_last_s"], t["time/eval_total_s"]) == (3.0, 5.0, 8.0)


@pytest.mark.timeout(30)
def test_the_trained_steps_are_checkpointed_before_a_failed_end_of_run_eval_is_raised():
    from megatron_rlhf.trainer.loop import _flush_and_save

    class Rows:
        def __init__(self, error):
            self.error, self.flushed = error, False

        def flush(self):
            self.flushed = True
            if self.error:
                raise self.error

    class FakeRun:
        saves = []

        def save(self, step, version, batch, pending=()):
            self.saves.append((step, version, batch, tuple(pending)))
            return step

        def wait_checkpoint(self):   # checkpoint.async_save: completed before the error is raised
            self.saves.append("waited")

    run = FakeRun()
    assert _flush_and_save(run, Rows(None), 16, 16, "b16", lambda: ("b17",)) == 16
    assert run.saves == [(16, 16, "b16", ("b17",))]
    with pytest.raises(TimeoutError):
        _flush_and_save(run, Rows(TimeoutError("no eval result")), 16, 16, "b16", lambda: ("b17",))
    assert run.saves[-2:] == [(16, 16, "b16", ()), "waited"]   # saved without pending batches, then the error


# ------------------------------------------------------------------------------ unbiased pass@k
def test_unbiased_pass_at_k_by_hand():
    from megatron_rlhf.trainer.evaluate import pass_at_k

    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)            # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)                  # k = 1: c / n
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(3, 3, 2) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    # stable where the binomials are astronomically large
    assert pass_at_k(200, 10, 100) == pytest.approx(1 - math.comb(190, 100) / math.comb(200, 100), rel=1e-12)
    with pytest.raises(ValueError, match="eval.pass_at_k"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_in_the_eval_rows_with_standard_errors():
    # prompt 0: 1 of 4 correct, prompt 1: 2 of 4 -> pass@2 = 1 - C(3,2)/C(4,2) = 0.5 and
    # 1 - C(2,2)/C(4,2) = 5/6: mean 2/3, se = (1/3 / sqrt(2)) / sqrt(2) = 1/6
    out = eval_metrics("m", "math_verify", [1.0, 0.0], [3, 3], [[1, 0, 0, 0], [1, 1, 0, 0]], [1, 2, 4])
    assert out["eval/m/pass@1_unbiased"] == pytest.approx(0.375)
    assert out["eval/m/pass@2_unbiased"] == pytest.approx(2 / 3)
    assert out["eval/m/pass@2_unbiased/se"] == pytest.approx(1 / 6)
    assert out["eval/m/pass@4_unbiased"] == 1.0 and out["eval/m/pass@4_unbiased/se"] == 0.0
    assert "eval/m/pass@2_unbiased" not in eval_metrics("m", "math_verify", [1.0], [3], None, [2])
    # through the Evaluator: FakePool's sampled completion j of prompt i is correct iff (i+j) % 4 == 0
    held = {"math": [Prompt(index=i, task="math", token_ids=(1,), answer="7", text=f"m{i}") for i in range(4)]}
    ev = Evaluator(FakePool(), held, {"math": "math_verify"}, _fns(), EvalConfig(samples=4, pass_at_k=[1, 2]), 1.0)
    out = ev.evaluate(1)
    assert out["eval/math/pass@1_unbiased"] == pytest.approx(0.25)     # = mean@k
    assert out["eval/math/pass@2_unbiased"] == pytest.approx(0.5) and out["eval/math/pass@2_unbiased/se"] == 0
    from megatron_rlhf.trainer.metrics import summarize_evals

    rows = [{"step": 1, "eval/step": 0, **out}, {"step": 2}, {"step": 3, "eval/step": 3, **out}]
    assert summarize_evals(rows)["math"]["pass@2_unbiased"]["last"] == pytest.approx(0.5)


def test_pass_at_k_needs_enough_samples_and_is_off_by_default():
    from megatron_rlhf.config import ConfigError

    assert EvalConfig().pass_at_k == [] and EvalConfig(samples=8, pass_at_k=[1, 4, 8]).pass_at_k == [1, 4, 8]
    for bad in (dict(samples=4, pass_at_k=[8]), dict(samples=4, pass_at_k=[0]), dict(samples=4, pass_at_k=[2, 2])):
        with pytest.raises(ConfigError, match="eval.pass_at_k"):
            EvalConfig(**bad)


@pytest.mark.timeout(30)
def test_win_rate_against_the_baseline_by_hand():
    # prompt 1 wins (0.5 > 0.4), 2 ties (0.2 == 0.2), 3 loses (0.3 < 0.6), 4 has no baseline: left out.
    # outcomes 1, 0.5, 0: mean 0.5, sample variance (0.25 + 0 + 0.25) / 2 = 0.25, se = 0.5 / sqrt(3)
    out = win_rate_metrics("chat", "win_rate", [1, 2, 3, 4], [0.5, 0.2, 0.3, 0.9], {1: 0.4, 2: 0.2, 3: 0.6})
    assert out == {"eval/chat/win_rate_prompts": 3, "eval/chat/win_rate": pytest.approx(0.5),
                   "eval/chat/win_rate/se": pytest.approx(0.5 / math.sqrt(3))}
    assert win_rate_metrics("chat", "win_rate", [7], [1.0], {1: 0.0}) == {}
    with pytest.raises(ValueError, match="2 prompt ids for 1 scores"):
        win_rate_metrics("chat", "win_rate", [1, 2], [0.0], {})


class VersionedChatPool(FakePool):
    """Greedy chat replies say which weight version wrote them (``v0``, ``v5``)."""

    def generate(self, prompts, n, refresh=None, temperature=None):
        return [[Completion(token_ids=(1, 2), logprobs=(0.0, 0.0), finish_reason="stop",
                            text=f"v{self.version}", weight_version=self.version) for _ in range(n)]
                for _ in prompts]


def test_gold_judge_and_win_rates_against_the_starting_policy_survive_a_resume():
    """The training reward model (proxy) prefers every trained reply; the gold judge prefers the
    trained reply of prompts 0 and 1, the starting one of prompt 2, and ties on prompt 3: proxy win
    rate 1.0, gold win rate (1 + 1 + 0 + 0.5) / 4 = 0.625: over-optimisation of the proxy, in
    numbers. A second evaluator given the first eval's row (a resumed run) gives the same."""
    from megatron_rlhf.generator.weight_sync import PublishedWeights

    held = {"chat": [Prompt(index=i, task="chat", token_ids=(1,), text=f"c{i}") for i in range(4)]}
    kinds = {"chat": "reward_model"}
    proxy = {"chat": lambda ps, texts: [0.0 if t == "v0" else 1.0 for t in texts]}
    gold_delta = {0: 0.25, 1: 0.5, 2: -0.5, 3: 0.0}
    gold = {"chat": lambda ps, texts: [p.index + (0.0 if t == "v0" else gold_delta[p.index]) for p, t in zip(ps, texts)]}

    def evaluator():
        return Evaluator(VersionedChatPool(), held, kinds, proxy, EvalConfig(samples=0), 1.0, gold_fns=gold)

    ev = evaluator()
    first = ev.evaluate(0)
    assert first["eval/chat/gold_outcomes"] == [0.0, 1.0, 2.0, 3.0]
    assert first["eval/chat/gold_reward_mean"] == pytest.approx(1.5)
    assert first["eval/chat/win_rate"] == first["eval/chat/proxy_win_rate"] == 0.5   # the same replies
    later = ev.evaluate(5, PublishedWeights(version=5, payload="w5"))
    assert later["eval/chat/proxy_win_rate"] == 1.0 and later["eval/chat/proxy_win_rate/se"] == 0
    assert later["eval/chat/win_rate"] == pytest.approx(0.625)
    assert later["eval/chat/win_rate/se"] == pytest.approx(mean_se([1, 1, 0, 0.5])[1])
    assert later["eval/chat/gold_reward_mean"] == pytest.approx(1.5 + 0.25 / 4)
    resumed = evaluator()
    assert not resumed.set_base([{"step": 3, "eval/step": 2}])   # no eval before step 1 among the rows
    assert "eval/chat/win_rate" not in resumed.evaluate(5, PublishedWeights(version=5, payload="w5"))
    assert resumed.set_base([{"step": 1, **first}])
    again = resumed.evaluate(5, PublishedWeights(version=5, payload="w5"))
    assert {k: again[k] for k in later if "win_rate" in k} == {k: later[k] for k in later if "win_rate" in k}
    with pytest.raises(ValueError, match="not reward-model tasks"):
        Evaluator(VersionedChatPool(), held, {"chat": "math_verify"}, proxy, EvalConfig(), 1.0, gold_fns=gold)
