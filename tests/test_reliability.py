"""Reliability (issue 16): nothing trains on garbage, nothing is written twice or outside the run
folder, and every failure names its cause. Unit-level tests (no Ray, no vLLM; the learner
in-process); the end-to-end ones are in ``tests/test_reliability_loop.py``.

Bad-input tests are tables: a new case is one line.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from pathlib import Path

import pytest

from megatron_rlhf.config import AlgorithmConfig, ConfigError, GeneratorConfig, load_config
from megatron_rlhf.data.mix import MultiTaskSampler
from megatron_rlhf.generator.weight_sync import PublishedWeights
from megatron_rlhf.rollout.pairs import select_pair
from megatron_rlhf.rollout.producer import RewardError, RolloutProducer, WeightChannel
from tests.test_learner_losses import _groups, _params, _vocab, make_learner  # noqa: F401 - fixture
from tests.test_producer import FakePool, _prompts

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------- config (failures 3, 6)
BAD_CONFIG = [  # (override, what the error must say)
    ("run.name=..", r"'run\.name' = '\.\.'.*plain folder name"),
    ("run.name=.", r"'run\.name' = '\.'.*plain folder name"),
    ("run.name=a/b", r"'run\.name'.*plain folder name"),
    ("run.name=", r"'run\.name'.*plain folder name"),
    ("learner.optimizer.lr=.inf", r"'learner\.optimizer\.lr' = inf must be a finite number"),
    ("learner.optimizer.lr=.nan", r"'learner\.optimizer\.lr' = nan must be a finite number"),
    ("learner.optimizer.lr=0", r"'learner\.optimizer\.lr'.*> 0"),
    ("algorithm.kl_beta=-.inf", r"'algorithm\.kl_beta' = -inf must be a finite number"),
    ("async.timeout_s=.inf", r"'async\.timeout_s' = inf must be a finite number"),
    ("algorithm.max_prompts_per_step=1", r"'algorithm\.max_prompts_per_step' = 1.*prompts_per_step \(2\)"),
    ("learner.max_skipped_steps=0", r"'learner\.max_skipped_steps'"),
    ("algorithm.invalid_rewards=ignore", r"'algorithm\.invalid_rewards' = 'ignore'.*one of error, skip"),
    ("logging.warn_token_mult_prob_error=0.5", r"'logging\.warn_token_mult_prob_error'"),
]


@pytest.mark.parametrize("override, message", BAD_CONFIG, ids=[c[0] for c in BAD_CONFIG])
def test_bad_config_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "ci_tiny.yaml", [override])


# ------------------------------------------------------------------------- rewards (failures 1, 7)
def _nan_for_odd(ps, texts):
    return [float("nan") if i % 2 else 1.0 for i in range(len(texts))]


def _inf_once(ps, texts):
    return [float("inf")] + [0.0] * (len(texts) - 1)


def _none_rewards(ps, texts):
    return [None] * len(texts)


def _string_rewards(ps, texts):
    return ["1.0"] * len(texts)


def _one_short(ps, texts):
    return [1.0] * (len(texts) - 1)


def _a_float(ps, texts):
    return 1.0


def _raises(ps, texts):
    raise ZeroDivisionError("the scorer divided by zero")


def _huge(ps, texts):   # finite but huge, two values per group so every loss can train
    return [1e300 * (1 + i % 2) * (-1) ** (i // 2) for i in range(len(texts))]


BAD_REWARDS = [  # (reward function, algorithm.loss, what the error must say)
    (_nan_for_odd, "grpo", r"reward of task 'math' \(nan_for_odd\) failed: reward 1 = nan is not finite"),
    (_nan_for_odd, "rloo", r"reward of task 'math' \(nan_for_odd\) failed: reward 1 = nan is not finite"),
    (_nan_for_odd, "online_dpo", r"reward of task 'math' \(nan_for_odd\) failed: reward 1 = nan"),
    (_inf_once, "ppo", r"reward of task 'math' \(inf_once\) failed: reward 0 = inf is not finite"),
    (_none_rewards, "group_dpo", r"reward of task 'math' \(none_rewards\) failed: reward 0 = None is not a number"),
    (_string_rewards, "best_of_k_sft", r"reward of task 'math' \(string_rewards\) failed: reward 0 = '1\.0' is not a number"),
    (_one_short, "grpo", r"reward of task 'math' \(one_short\) failed: it returned 15 rewards for 16 completions"),
    (_a_float, "grpo", r"reward of task 'math' \(a_float\) failed: it returned float 1\.0, not a list"),
    (_raises, "proximal_rloo", r"reward of task 'math' \(raises\) failed: ZeroDivisionError: the scorer divided"),
]


def _producer(fn, loss="grpo", num_batches=1, **algo):
    fn.reward_name = fn.__name__.lstrip("_")
    sampler = MultiTaskSampler({"math": _prompts("math", 40)}, {"math": 1.0}, seed=0)
    out: queue.Queue = queue.Queue(maxsize=1)
    prod = RolloutProducer(
        pool=FakePool(), sampler=sampler, reward_fns={"math": fn}, pair_fn=select_pair,
        channel=WeightChannel(PublishedWeights(version=0)), out_queue=out,
        algorithm_cfg=AlgorithmConfig(loss=loss, samples_per_prompt=4, prompts_per_step=4, **algo),
        generator_cfg=GeneratorConfig(prompts_per_request=4), staleness_bound=100, first_batch=0,
        num_batches=num_batches, min_version=0, seed=0, timeout_s=60)
    threading.Thread(target=prod.run, daemon=True).start()
    return [out.get(timeout=60) for _ in range(num_batches)]


@pytest.mark.parametrize("fn, loss, message", BAD_REWARDS, ids=[f"{f.__name__}-{l}" for f, l, _ in BAD_REWARDS])
def test_invalid_rewards_stop_the_run_naming_task_function_and_value(fn, loss, message):
    (item,) = _producer(fn, loss)
    assert isinstance(item, RewardError), item
    assert "generation" not in str(item)
    with pytest.raises(RewardError, match=message):
        raise item


def test_loop_reports_a_reward_failure_as_the_reward_of_the_task_not_as_generation():
    """The loop turns what the producer put on its queue into ProducerError: a reward failure keeps
    the producer's message (task and reward function), anything else is a generation failure."""
    from megatron_rlhf.trainer.run import _take
    from megatron_rlhf.rollout.producer import ProducerError

    stop = type("Stop", (), {"requested": False})()
    for item, message in [
            (RewardError("the reward of task 'math' (tests.plugins:x) failed: reward 1 = nan is not finite"),
             r"^the reward of task 'math' \(tests\.plugins:x\) failed: reward 1 = nan"),
            (RuntimeError("engine died"), r"^generation failed: RuntimeError: engine died")]:
        q: queue.Queue = queue.Queue()
        q.put(item)
        with pytest.raises(ProducerError, match=message) as info:
            _take(q, 5.0, stop)
        assert info.value.__cause__ is item


def test_invalid_rewards_skip_mode_skips_and_counts_those_prompts():
    def half_nan(ps, texts):   # the prompts with an even index get one NaN completion
        return [float("nan") if p.index % 2 == 0 and i % 4 == 0 else float(len(t) % 2 + i % 2)
                for i, (p, t) in enumerate(zip(ps, texts))]

    (batch,) = _producer(half_nan, "grpo", invalid_rewards="skip", skip_uniform_groups=False)
    assert not isinstance(batch, BaseException), batch
    assert batch.stats["reward/invalid_prompts"] >= 1
    assert batch.stats["reward/invalid_completions"] == batch.stats["reward/invalid_prompts"]
    assert batch.stats["pairs/skipped_prompts"] >= batch.stats["reward/invalid_prompts"]
    assert all(g.prompt.index % 2 == 1 for g in batch.groups)
    assert all(math.isfinite(r.reward) for g in batch.groups for r in g.rollouts)
    assert math.isfinite(batch.stats["reward/mean"])


@pytest.mark.parametrize("loss", ["online_dpo", "grpo", "rloo", "ppo"])
def test_huge_finite_rewards_never_overflow_the_normaliser(loss):
    (batch,) = _producer(_huge, loss)
    assert not isinstance(batch, BaseException), batch
    for key in ("reward/mean", "task/math/reward_norm_mean", "task/math/reward_per_token"):
        assert math.isfinite(batch.stats[key]), (key, batch.stats[key])
    for g in batch.groups:
        assert all(math.isfinite(r) for r in (g.loss_rewards or g.rewards))


def test_normaliser_statistics_of_1e300_rewards_are_exact_and_finite():
    from megatron_rlhf.rewards.reward_model import RunningRewardNormalizer

    n = RunningRewardNormalizer()
    n.update("t", [1e300, 3e300])
    n.update("t", [-1e300, 1e300])
    count, mean, std = n.stats("t")
    assert count == 4 and mean == pytest.approx(1e300) and std == pytest.approx(math.sqrt(2) * 1e300)
    z = n.normalize("t", [1e300, 3e300, -1.7e308])
    assert z[0] == pytest.approx(0.0, abs=1e-12) and z[1] == pytest.approx(math.sqrt(2))
    assert all(math.isfinite(v) for v in z)
    m = RunningRewardNormalizer()
    m.load_state_dict(json.loads(json.dumps(n.state_dict())))
    assert m.stats("t") == n.stats("t")


# ------------------------------------------------------------------------- data (failure 8)
def test_invalid_utf8_lines_are_skipped_and_counted_never_altered(tmp_path):
    from megatron_rlhf.data.jsonrecords import read_json_records

    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"input": "Caf\xe9 has 0 cr\xe8mes", "target": "1"}\n'
                  b'{"input": "Caf\xc3\xa9 has 2", "target": "2"}\n')
    recs, bad = read_json_records(f)
    assert bad == 1 and recs[0] is None and recs[1] == {"input": "Café has 2", "target": "2"}
    arr = tmp_path / "d.json"
    arr.write_bytes(b'[\n{"input": "ok"},\n{"input": "cr\xe8me"}\n]')
    with pytest.raises(ValueError, match="line 3 is not valid UTF-8"):
        read_json_records(arr)


# ------------------------------------------------------------------------- metrics (failure 2)
CRASHES = [  # (rows on disk when the driver died, step of the last complete checkpoint, rows after the resumed run)
    ([1, 2, 3], 2, [1, 2, 3]),                    # killed after row 3, before its checkpoint
    ([1, 2, 3, 4, 5], 3, [1, 2, 3, 4, 5, 6]),     # checkpoint.interval=3, killed after row 5
    ([1, 2, 3, 3, 4], 4, [1, 2, 3, 4, 5, 6]),     # a duplicate left by an older version
    ([1, 2], 0, [1, 2, 3]),                       # no checkpoint yet: the run starts over
]


def _row(step, tag):
    from megatron_rlhf.trainer.metrics import REQUIRED_KEYS

    return {**{k: 0.0 for k in REQUIRED_KEYS}, "step": step, "weight_version": step, "tag": tag,
            "time/step_s": 1.0}


@pytest.mark.parametrize("on_disk, ckpt_step, after", CRASHES)
def test_metrics_hold_one_row_per_step_after_crash_and_resume(tmp_path, on_disk, ckpt_step, after):
    from megatron_rlhf.config import LoggingConfig
    from megatron_rlhf.trainer.metrics import MetricsLogger, summarize

    lines = [json.dumps(_row(s, "old")) for s in on_disk]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 9, "torn')
    logger = MetricsLogger(tmp_path, LoggingConfig(), resume_step=ckpt_step)
    for s in range(ckpt_step + 1, after[-1] + 1):
        logger.log(_row(s, "new"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == after
    assert [r["tag"] for r in rows] == ["old"] * ckpt_step + ["new"] * (len(after) - ckpt_step)
    (aside,) = tmp_path.glob(f"metrics.crash-resumed_at_step_{ckpt_step}-*.jsonl")
    moved = aside.read_text().splitlines()
    assert len(moved) == len(on_disk) - ckpt_step + 1 and moved[-1] == '{"step": 9, "torn'
    assert summarize(logger.rows, 1.0)["steps"] == len(after) == len(logger.rows)


# ------------------------------------------------------------------------- folders and disk (failure 5)
def _fails_like_a_full_disk(tmp):
    (tmp / "learner").mkdir()
    with open("/dev/full", "wb") as f:          # the kernel answers ENOSPC
        f.write(b"x" * 4096)
        f.flush()


def _iostream_error(tmp):
    (tmp / "learner").mkdir()
    (tmp / "learner" / "part.distcp").write_bytes(b"x" * 10)
    raise RuntimeError("basic_ios::clear: iostream error")


SAVE_FAILURES = [  # (what is in the way or fails, disk free bytes seen after the failure, message)
    ("step_file", None, r"step_2 is a file, not a checkpoint folder"),
    ("enospc", None, r"cannot save checkpoint step 2 into .*\.tmp-step_2-\d+: no space left on device"),
    ("iostream", 1024, r"cannot save checkpoint step 2 into .*: no space left on device \(0\.0 MiB free"),
    ("iostream", None, r"cannot save checkpoint step 2 into .*: RuntimeError: basic_ios::clear"),
]


@pytest.mark.parametrize("case, free, message", SAVE_FAILURES)
def test_failed_save_names_path_and_cause_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, case,
                                                                         free, message):
    import shutil
    from collections import namedtuple

    from megatron_rlhf.trainer.checkpoint import CheckpointError, CheckpointManager

    ckpts = CheckpointManager(tmp_path / "checkpoints", keep_last=2)
    ckpts.save(1, {"step": 1}, lambda tmp: (tmp / "learner").mkdir())
    if case == "step_file":
        (tmp_path / "checkpoints" / "step_2").write_text("not a checkpoint")
    if free is not None:
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - free, free))
    write = _fails_like_a_full_disk if case == "enospc" else _iostream_error if case == "iostream" else None
    with pytest.raises(CheckpointError, match=message):
        ckpts.save(2, {"step": 2}, write or (lambda tmp: None))
    path, state = ckpts.latest()
    assert path.name == "step_1" and state == {"step": 1}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_file_where_the_checkpoint_folder_goes_is_named(tmp_path):
    from megatron_rlhf.trainer.checkpoint import CheckpointError, CheckpointManager

    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*checkpoints.*a file is in the way"):
        CheckpointManager(tmp_path / "checkpoints")


# ------------------------------------------------------------------------- rloo with stale samples
def test_rloo_weights_each_token_by_the_truncated_ratio_to_the_generator():
    import torch

    from megatron_rlhf.losses.rloo import rloo_loss

    lp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    gen = lp.detach() - torch.log(torch.tensor([[1.5, 0.5], [3.0, 1.0]]))  # pi/pi_gen = 1.5, 0.5, 3 -> cap 2
    adv = torch.tensor([1.0, -2.0])
    loss, m = rloo_loss(lp, adv, mask, generator_logprobs=gen, tis_cap=2.0)
    w = torch.tensor([[1.5, 0.5], [2.0, 0.0]])
    expect = (-(1.0 * (1.5 * -1.0 + 0.5 * -2.0)) - (-2.0 * 2.0 * -0.5)) / 2   # sequence_sum / N
    assert float(loss) == pytest.approx(expect)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv[:, None] * w / 2)
    assert float(m["tis/capped_frac"]) == pytest.approx(1 / 3)
    on_policy, _ = rloo_loss(lp, adv, mask, generator_logprobs=lp.detach(), tis_cap=2.0)
    plain, _ = rloo_loss(lp, adv, mask)
    assert float(on_policy) == pytest.approx(float(plain))   # fresh samples: weight 1, plain RLOO


# ------------------------------------------------------------------------- learner (failure 1)
@pytest.mark.timeout(180)
def test_learner_skips_a_step_with_a_nonfinite_loss_and_leaves_weights_unchanged(make_learner, tiny_llama_dir):
    """Rewards of 1e300 are finite in Python but inf in the learner's float32: GRPO's advantages
    and loss become NaN. The update is skipped (no optimizer step), counted, and the next, finite
    batch trains normally."""
    import dataclasses

    import torch

    from megatron_rlhf.types import LearnerBatch

    vocab = _vocab(tiny_llama_dir)
    learner = make_learner(tiny_llama_dir, "grpo")
    groups = _groups(vocab, num_prompts=2)
    huge = [dataclasses.replace(g, loss_rewards=tuple(1e300 * (i % 2) for i in range(len(g.rollouts))))
            for g in groups]
    before = _params(learner)
    m = learner.train_step(LearnerBatch.from_groups(huge, "group", pad_id=1, pad_to_multiple=4))
    assert m["train/skipped_nonfinite"] == 1.0 and m["train/update_ok"] == 0.0
    assert math.isnan(m["grad/norm"]) and learner.weight_version == 1
    assert all(torch.equal(before[n], p) for n, p in _params(learner).items())
    m = learner.train_step(LearnerBatch.from_groups(groups, "group", pad_id=1, pad_to_multiple=4))
    assert m["train/skipped_nonfinite"] == 0.0 and math.isfinite(m["grad/norm"])
    assert any(not torch.equal(before[n], p) for n, p in _params(learner).items())


# ------------------------------------------------------------------------- pre-flight (failures 3, 5, 6)
def _copy_model(src: Path, dst: Path, skip=lambda name: False) -> Path:
    import shutil

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not skip(f.name):
            shutil.copy(f, dst / f.name)
    return dst


def _empty(src, dst):
    dst.mkdir()
    return dst, []


def _config_only(src, dst):
    return _copy_model(src, dst, lambda n: n.endswith(".safetensors")), []


def _gpt2(src, dst):
    d = _copy_model(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=128, n_layer=2, n_head=4)
    (d / "config.json").write_text(json.dumps(cfg))
    return d, []


def _no_tokenizer(src, dst):
    return _copy_model(src, dst, lambda n: "token" in n or n in ("vocab.json", "merges.txt")), []


def _truncated_weights(src, dst):
    d = _copy_model(src, dst)
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d, []


def _plugin(code: str):
    def make(src, dst):
        pkg = dst.parent / "plugins_pf"
        pkg.mkdir(exist_ok=True)
        (pkg / "bad_reward.py").write_text(code)
        return src, [f"tasks.0.reward=bad_reward:score"]
    return make


def _file_at(rel: str, key: str):
    def make(src, dst):
        out = dst.parent / "out"
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("I am a file")
        return src, [f"run.output_dir={out / key}", "run.name=r"]
    return make


PREFLIGHT = [  # (how the model folder / config is broken, what the error must say)
    (_empty, r"'model\.source'.*has no config\.json, so it is no Hugging Face model folder"),
    (_config_only, r"'model\.source'.*has config\.json but no \*\.safetensors"),
    (_gpt2, r"'model\.source'.*model_type='gpt2' is not supported.*llama"),
    (_no_tokenizer, r"'model\.source'.*no usable tokenizer in"),
    (_truncated_weights, r"'model\.source'.*weights file .*\.safetensors is corrupt or truncated"),
    (lambda s, d: (s, ["generators.max_model_len=4096"]),
     r"'generators\.max_model_len' = 4096.*max_position_embeddings=1024 \(1024 positions"),
    (_plugin("def score(:\n"), r"'tasks\[math\]\.reward'.*SyntaxError.*bad_reward\.py, line 1"),
    (_plugin("raise RuntimeError('no GPU here')\n"), r"'tasks\[math\]\.reward'.*RuntimeError: no GPU here"),
    (_plugin("import sys\nsys.exit(3)\n"), r"'tasks\[math\]\.reward'.*SystemExit"),
    (_plugin("score = 0.5\n"), r"bad_reward\.score is a float, not a function"),
    (_plugin("other = 1\n"), r"module 'bad_reward' has no 'score'"),
    (_plugin("def score(completions):\n    return [0.0] * len(completions)\n"),
     r"bad_reward\.score\(completions\) cannot be called as fn\(completions, answers\).*two positional"),
    (_plugin("from json import dumps as score\n"), r"bad_reward\.score\(obj, \*, .*cannot be called as fn"),
    (_file_at("x", "x"), r"'run\.output_dir'.*out/x is a file, but the run needs a folder"),
    (_file_at("o/r", "o"), r"'run\.name'.*o/r is a file, but the run needs a folder"),
    (_file_at("o/r/checkpoints", "o"), r"checkpoints is a file, but the run needs a folder"),
    (_file_at("x", "x/deeper"), r"'run\.output_dir': cannot write the run folder .*Not a directory"),
]


@pytest.mark.parametrize("breaks, message", PREFLIGHT, ids=[str(i) for i in range(len(PREFLIGHT))])
def test_preflight_stops_before_any_actor_naming_key_and_cause(tiny_llama_dir, tmp_path, monkeypatch,
                                                               breaks, message):
    import sys

    import ray

    from megatron_rlhf.trainer.run import Run

    monkeypatch.syspath_prepend(str(tmp_path / "plugins_pf"))
    sys.modules.pop("bad_reward", None)
    model, overrides = breaks(tiny_llama_dir, tmp_path / "model")
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={model}", f"run.output_dir={tmp_path / 'runs'}", "logging.progress=false",
        "tasks.0.reward=tests.plugins:char_parity", *overrides])
    with pytest.raises(ConfigError, match=message):
        Run.open(cfg, quiet=True)
    assert not ray.is_initialized()
    sys.modules.pop("bad_reward", None)


def test_preflight_names_logging_tensorboard_when_the_package_is_missing(tiny_llama_dir, tmp_path, monkeypatch):
    import sys

    import ray

    from megatron_rlhf.trainer.run import Run

    monkeypatch.setitem(sys.modules, "tensorboard", None)   # importlib finds no such package
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path / 'runs'}", "logging.progress=false",
        "tasks.0.reward=tests.plugins:char_parity"])
    with pytest.raises(ConfigError, match=r"'logging\.tensorboard'.*pip install tensorboard.*logging\.tensorboard=false"):
        Run.open(cfg, quiet=True)
    assert not ray.is_initialized()


# ------------------------------------------------------------------------- one run, one folder (issue 25)
def _hold_lock_in_subprocess(run_dir: Path):
    """A second process holding ``run_dir``'s lock (it prints ``held`` once it has it)."""
    import subprocess
    import sys

    code = ("import sys, time; from megatron_rlhf.trainer.run_lock import RunLock; "
            f"RunLock({str(run_dir)!r}).acquire(); print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_train_check_runs_the_preflight_exits_2_naming_the_key_or_0_and_starts_nothing(tiny_llama_dir, tmp_path,
                                                                                        capsys, monkeypatch):
    """``train.py --check`` (a fresh-user finding: ``--print-config`` checks the fields only, so a
    layout the model cannot split or a missing data file passed it): every check a run makes before
    any actor starts, then exit. A bad layout and a missing data file exit 2 with the key; a good
    config exits 0 with the prompt counts; no Ray, and no run folder left behind."""
    import ray
    import train

    from megatron_rlhf import runtime

    monkeypatch.setattr(runtime, "apply_process_env", lambda *a, **k: None)
    base = ["--config", str(REPO / "configs" / "ci_tiny.yaml"), "--check", f"model.source={tiny_llama_dir}",
            f"run.output_dir={tmp_path / 'runs'}", "tasks.0.reward=tests.plugins:char_parity"]
    assert train.main(base + ["learner.pipeline_parallel=7"]) == 2
    assert "pipeline_parallel" in capsys.readouterr().err
    assert train.main(base + [f"tasks.0.data.path={tmp_path / 'nope.jsonl'}"]) == 2
    assert "tasks" in capsys.readouterr().err
    assert train.main(base) == 0
    out = capsys.readouterr().out
    assert "every check before the start passed" in out and "to train" in out
    assert not ray.is_initialized()
    assert not any((tmp_path / "runs").glob("*")), "--check left a run folder"


def test_two_drivers_on_one_folder_the_second_stops_at_once_naming_pid_and_host(tiny_llama_dir, tmp_path):
    import socket
    import time

    from megatron_rlhf.trainer.loop import train
    from megatron_rlhf.trainer.run_lock import RunLock, RunLockedError

    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}", "run.name=shared",
        "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false"])
    holder = _hold_lock_in_subprocess(cfg.run_dir)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunLockedError, match=rf"in use by another driver \(pid {holder.pid} host "
                                                 rf"{socket.gethostname()} since .*run\.name"):
            train(cfg, quiet=True)
        assert time.monotonic() - t0 < 5   # at once: before the model, the prompts or Ray
        assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["run.lock"]   # nothing else written
    finally:
        holder.kill()   # SIGKILL: the kernel releases its lock
        holder.wait()
    with RunLock(cfg.run_dir) as lock:   # a dead holder's lock never blocks
        assert f"pid {__import__('os').getpid()} " in lock.path.read_text()
    assert lock.path.read_text() == ""   # released: no holder recorded


def test_the_run_lock_is_not_kept_by_forked_children(tmp_path):
    """A process pool forked by the driver (math-verify) must not keep the folder locked after
    the driver is gone (flock locks belong to the open file, which a fork would share)."""
    import os
    import signal

    from megatron_rlhf.trainer.run_lock import RunLock

    lock = RunLock(tmp_path / "run").acquire()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:   # the fork hooks ran before os.fork returned here
        os.write(w, b"x")
        signal.pause()
        os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        lock.release()
        RunLock(tmp_path / "run").acquire().release()   # the child does not hold it
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _ckpt_writer(big: bool):
    def write(tmp):
        (tmp / "learner" / "policy").mkdir(parents=True)
        (tmp / "learner" / "learner_state.pt").write_bytes(b"s" * 1000)
        size = (17 * 2**20) if big else 4096   # above / below FULL_HASH_MAX_BYTES
        (tmp / "learner" / "policy" / "__0_0.distcp").write_bytes(bytes(range(256)) * (size // 256))
    return write


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_last_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


DAMAGE = [  # (file of step_2, damage, shard above 16 MiB, what the reason must say)
    ("trainer_state.json", _truncate, False, r"trainer_state\.json is unreadable \(JSONDecodeError"),
    ("learner/policy/__0_0.distcp", _truncate, False, r"__0_0\.distcp is 2048 bytes, the manifest says 4096"),
    ("learner/policy/__0_0.distcp", _truncate, True, r"__0_0\.distcp is 8912896 bytes.*truncated"),
    ("learner/policy/__0_0.distcp", _flip_last_byte, False, r"__0_0\.distcp has other bytes"),
    ("learner/policy/__0_0.distcp", _flip_last_byte, True, r"__0_0\.distcp has other bytes"),
    ("learner/learner_state.pt", Path.unlink, False, r"learner_state\.pt is missing"),
    ("learner/extra.pt", lambda p: p.write_bytes(b"x"), False, r"extra\.pt is not in the manifest"),
    ("MANIFEST.json", _truncate, False, r"MANIFEST\.json is unreadable"),
]


@pytest.mark.parametrize("rel, damage, big, reason", DAMAGE, ids=[f"{d[0]}-{d[1].__name__}-{'big' if d[2] else 'small'}"
                                                                 for d in DAMAGE])
def test_a_damaged_checkpoint_falls_back_to_the_previous_and_is_moved_aside(tmp_path, rel, damage, big, reason):
    from megatron_rlhf.trainer.checkpoint import CheckpointManager

    m = CheckpointManager(tmp_path / "checkpoints", keep_last=3)
    for step in (1, 2):
        m.save(step, {"step": step}, _ckpt_writer(big))
    damage(tmp_path / "checkpoints" / "step_2" / rel)
    found = m.resumable()
    assert found.path.name == "step_1" and found.state == {"step": 1} and found.verified
    ((path, why),) = found.damaged
    assert path.name == "step_2" and __import__("re").search(reason, why), why
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    aside = m.move_aside(path)
    assert aside.name.startswith("step_2.damaged-") and not path.exists()   # moved, never deleted
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert [s for s, _ in m.complete_checkpoints()] == [1] and m.resumable().damaged == []


def test_a_checkpoint_without_manifest_is_trusted_unverified(tmp_path):
    """Written before manifests: trusted (its folder was completed by the atomic rename), flagged."""
    from megatron_rlhf.trainer.checkpoint import MANIFEST, CheckpointManager

    m = CheckpointManager(tmp_path / "checkpoints")
    m.save(1, {"step": 1}, _ckpt_writer(False))
    (tmp_path / "checkpoints" / "step_1" / MANIFEST).unlink()
    found = m.resumable()
    assert found.path.name == "step_1" and not found.verified and found.damaged == []


def _folder_bytes(folder: Path) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def used_run_folder(tiny_llama_dir, tmp_path):
    """A run folder holding an earlier run of 3 steps stopped at step 1: config.yaml, one metrics
    row, and checkpoint step_1 (a stand-in learner file, the real data-sampler position)."""
    from megatron_rlhf.config import save_config
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.checkpoint import CheckpointManager
    from megatron_rlhf.trainer.run import Run

    def cfg(*extra):
        return load_config(REPO / "configs" / "ci_tiny.yaml", [
            f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path}", "run.name=used",
            "tasks.0.reward=tests.plugins:char_parity", "logging.progress=false", *extra])

    run = Run(cfg(), lambda *a: None)
    assert setup.prepare(run) is None
    save_config(run.cfg, run.run_dir / "config.yaml")
    (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    CheckpointManager(run.run_dir / "checkpoints").save(
        1, {"step": 1, "weight_version": 1, "sampler_state": run.sampler.state_dict(), "rng_state": None,
            "producer_state": None, "pending_batches": []}, _ckpt_writer(False))
    return run.run_dir, cfg


REFUSED = [  # (overrides of the second start, what the refusal must say)
    (["eval.num_prompts=8"], r"cannot resume from .*step_1: the training prompts differ from the checkpoint's "
                             r"because eval\.num_prompts: 16 -> 8"),
    (["checkpoint.resume=false"], r"checkpoint\.resume=false, but the run folder .*used already holds a run "
                                  r"\(checkpoints/step_1, config\.yaml, metrics\.jsonl\).*another run\.name, "
                                  r"or set run\.restart=true"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_a_refused_resume_leaves_the_run_folder_byte_for_byte_unchanged(used_run_folder, overrides, message):
    from megatron_rlhf.trainer.loop import train

    run_dir, cfg = used_run_folder
    before = _folder_bytes(run_dir)
    with pytest.raises(ConfigError, match=message) as err:
        train(cfg(*overrides), quiet=True)
    assert "tokenizer" not in str(err.value) and "tasks[math].data" not in str(err.value)
    assert _folder_bytes(run_dir) == before


def test_run_restart_moves_the_old_run_aside_and_starts_fresh(used_run_folder):
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.run import Run

    run_dir, cfg = used_run_folder
    before = _folder_bytes(run_dir)
    run = Run(cfg("checkpoint.resume=false", "run.restart=true"), lambda *a: None)
    assert setup.prepare(run) is None and run.resume_from == (None, None)
    (aside,) = run_dir.parent.glob("used.old-*")
    assert _folder_bytes(aside) == before and list(run_dir.iterdir()) == []


def test_resume_false_on_a_used_folder_is_refused_before_the_model_is_prepared(used_run_folder, monkeypatch):
    """The refusal costs no model conversion (a cold smollm2 one takes about 40 s)."""
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.run import Run

    run_dir, cfg = used_run_folder

    def no_conversion(model_cfg):
        raise AssertionError("the model was prepared before the used run folder was refused")

    monkeypatch.setattr(setup, "resolve_model_dir", no_conversion)
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=false, but the run folder"):
        setup.prepare(Run(cfg("checkpoint.resume=false"), lambda *a: None))


@pytest.mark.parametrize("override, message", [
    ("tasks.0.data.path=data/no_such_file.jsonl", r"tasks\[math\]\.data\.path='data/no_such_file\.jsonl': file not found"),
    ("tasks.0.eval_data={path: /nowhere/eval.jsonl}", r"tasks\[math\]\.eval_data\.path='/nowhere/eval\.jsonl': file not found"),
    ("tasks.0.reward={reward_model: no/such/rm}", r"tasks\[math\]\.reward\.reward_model = 'no/such/rm': the folder does not exist"),
    ("tasks.0.reward={reward_model: {tiny}}", r"reward_model = '.*' is not a reward model \(.*\): its config\.json has 2 labels "
                                              r"\(architectures: LlamaForCausalLM, a causal language model\)"),
    ("tasks.0.data.path=data", r"tasks\[math\]\.data\.path='data': .*data is a directory; give one JSON/JSONL file"),
    ("tasks.0.data.prompt_field=questoin", r"tasks\[math\]\.data\.prompt_field = 'questoin': no such field in the first "
                                           r"\d+ rows of .*; its rows have the fields \[.*'input'.*\]"),
    ("tasks.0.eval_data={path: data/gsm8k/dev.jsonl, prompt_field: question, answer_field: solution}",
     r"tasks\[math\]\.eval_data\.answer_field = 'solution': no such field .*'answer'"),
    ("tasks.0.data.filter={typ: [singleop]}", r"tasks\[math\]\.data\.filter key 'typ': no such field .*'type'"),
    ("tasks.0.data.path=README.md", r"tasks\[math\]\.data\.path: none of the first \d+ lines of .*README\.md is a JSON object"),
], ids=["data_path", "eval_data_path", "reward_model_folder", "causal_lm_as_reward_model", "data_path_is_a_directory",
        "prompt_field", "eval_answer_field", "filter_key", "not_jsonl"])
def test_a_missing_data_file_or_reward_model_folder_is_refused_before_the_model_is_prepared(
        tiny_llama_dir, tmp_path, monkeypatch, override, message):
    """A fresh-user finding: these were refused only after the model was prepared (a cold smollm2
    conversion takes 40-60 s); ``preflight.check_task_files`` runs first."""
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.run import Run

    def no_conversion(model_cfg):
        raise AssertionError("the model was prepared before the missing file was refused")

    monkeypatch.setattr(setup, "resolve_model_dir", no_conversion)
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
        f"model.source={tiny_llama_dir}", f"run.output_dir={tmp_path / 'runs'}", override.replace("{tiny}", str(tiny_llama_dir))])
    with pytest.raises(ConfigError, match=message):
        setup.prepare(Run(cfg, lambda *a: None))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_pending_batch_of_another_loss_is_regenerated_not_trained(tmp_path):
    """A checkpoint's untrained batch was built for online_dpo (pairs); resumed with grpo it is
    dropped and counted, and generation restarts from the position before it."""
    from megatron_rlhf.rollout.batch_io import algorithm_tag, save_batch
    from megatron_rlhf.trainer.setup import load_pending
    from tests.test_batch_io import _batch

    dpo = AlgorithmConfig(loss="online_dpo", samples_per_prompt=4)
    grpo = AlgorithmConfig(loss="grpo", samples_per_prompt=4)
    before = {"sampler_state": {"at": "trained batch"}, "rng_state": None, "producer_state": None}
    state = {"step": 3, "pending_batches": [3], "before_pending": before}
    save_batch(_batch(3), tmp_path / "batches", algorithm=algorithm_tag(dpo))
    assert load_pending(tmp_path, state, grpo) == ([], before, 1)
    assert load_pending(tmp_path, state, AlgorithmConfig(loss="online_dpo", samples_per_prompt=8))[2] == 1  # K
    pending, states, regenerated = load_pending(tmp_path, state, dpo)
    assert [b.index for b in pending] == [3] and states is None and regenerated == 0
    save_batch(_batch(3), tmp_path / "batches")   # untagged (written before the tag): trained as before
    assert load_pending(tmp_path, state, grpo)[2] == 0


WRITE_FAILURES = [  # (errno raised while writing, what the error must say)
    (28, r"cannot write .*summary\.json: no space left on device"),
    (30, r"cannot write .*summary\.json: read-only file system"),
    (13, r"cannot write .*summary\.json: permission denied"),
]


@pytest.mark.parametrize("code, message", WRITE_FAILURES, ids=[str(c) for c, _ in WRITE_FAILURES])
def test_a_failed_atomic_write_names_path_and_cause_and_leaves_the_old_file_and_no_temp(
        tmp_path, monkeypatch, code, message):
    import os

    from megatron_rlhf.utils import atomic

    path = atomic.write_json(tmp_path / "summary.json", {"old": 1})

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomic.os, "fsync", fail)
    with pytest.raises(atomic.AtomicWriteError, match=message):
        atomic.write_json(path, {"new": 2})
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_run_folder_writers_all_go_through_the_atomic_helper():
    """A grep, as the issue asks: no raw file writer in the trainer's and the rollout's run-folder
    code (exceptions: the metrics.jsonl row append and the watchdog's stack-dump log, both
    append-only logs)."""
    import re

    pattern = re.compile(r"\.write_text\(|\.write_bytes\(|\bopen\([^)]*[\"'](w|wb|wt|a|ab)[\"']|json\.dump\(|"
                         r"torch\.save\(|os\.rename\(|os\.replace\(")
    allowed = {("trainer/metrics.py", 'with open(self.path, "a") as f:'),
               ("trainer/watchdog.py", '_stack_file = open(Path(folder) / f"{socket.gethostname()}-{os.getpid()}.txt", "a")'),
               ("rollout/batch_io.py", "json.dump(doc, f)"),            # into atomic_open
               ("trainer/checkpoint.py", "os.rename(tmp, final)"),       # the checkpoint folder
               ("trainer/checkpoint.py", "os.rename(path, dest)"),       # moving a damaged one aside
               ("trainer/run.py", "os.rename(final, old)"), ("trainer/run.py", "os.rename(tmp, final)"),  # hf_final
               ("trainer/setup.py", "os.rename(p, run.restart_aside / p.name)")}
    pkg = REPO / "megatron_rlhf"
    scanned = [*(pkg / "trainer").glob("*.py"), *(pkg / "rollout").glob("*.py"), pkg / "config.py"]
    found = {(str(f.relative_to(pkg)), line.strip()) for f in scanned
             for line in f.read_text().splitlines() if pattern.search(line) and not line.strip().startswith("#")}
    assert found - allowed == set()


# ------------------------------------------------------------------------- waits name what they wait for (issue 36)
@pytest.mark.timeout(60)
def test_a_reward_that_never_returns_times_out_naming_task_reward_and_scoring_and_dumps_the_stacks(tmp_path):
    """The real producer and the loop's wait (``Run.next_batch``), a reward that never returns and
    ``async.timeout_s=2``: the TimeoutError names the task, the reward function and the phase
    (scoring, not generation), and the file in ``logs/`` whose stacks show the reward's frame."""
    import collections
    import re
    import time
    from types import SimpleNamespace

    from megatron_rlhf.trainer.run import Run

    release = threading.Event()

    def never_returns(ps, texts):
        release.wait(120)   # "forever" (released when the test ends)
        return [0.0] * len(texts)

    never_returns.reward_name = "tests.plugins:never_returns"
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [f"run.output_dir={tmp_path}", "async.timeout_s=2"])
    run = Run(cfg, lambda *a: None)
    run.batches, run.pending = queue.Queue(maxsize=1), collections.deque()
    run.producer = RolloutProducer(
        pool=FakePool(), sampler=MultiTaskSampler({"math": _prompts("math", 40)}, {"math": 1.0}, seed=0),
        reward_fns={"math": never_returns}, pair_fn=select_pair, channel=WeightChannel(PublishedWeights(version=0)),
        out_queue=run.batches, algorithm_cfg=AlgorithmConfig(loss="grpo", samples_per_prompt=4, prompts_per_step=4),
        generator_cfg=GeneratorConfig(prompts_per_request=4), staleness_bound=1, first_batch=0, num_batches=1,
        min_version=0, seed=0, timeout_s=60)
    threading.Thread(target=run.producer.run, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as err:
            run.next_batch(SimpleNamespace(requested=False))
    finally:
        release.set()
    msg = str(err.value)
    assert time.monotonic() - t0 < 10
    assert re.fullmatch(r"no rollout batch within async\.timeout_s=2 s: the rollout producer is in scoring: the "
                        r"reward of task 'math' \(tests\.plugins:never_returns\) has not returned for \d+ s \(batch 0: "
                        r"scoring 4 prompts x 4 completions\); if it is only slow, raise async\.timeout_s, else fix "
                        r"the reward function \(it must return\); stacks of every process: \S+", msg), msg
    stacks = Path(msg.rsplit("stacks of every process: ", 1)[1])
    assert stacks.parent == cfg.run_dir / "logs" and stacks.name.startswith("stacks-no_rollout_batch-")
    assert re.search(r"line \d+ in never_returns", stacks.read_text()), stacks.read_text()[-2000:]


def test_train_py_prints_a_timeout_as_one_line_exit_1(monkeypatch, capsys):
    import train

    import megatron_rlhf.trainer.loop as loop

    def timing_out(cfg):
        raise TimeoutError("no rollout batch within async.timeout_s=2 s: the rollout producer is in scoring")

    monkeypatch.setattr(loop, "train", timing_out)
    assert train.main(["--config", str(REPO / "configs" / "ci_tiny.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["timed out: no rollout batch within async.timeout_s=2 s: the rollout producer is in scoring"], err


# ------------------------------------------------------------------------- recoveries are counted (issue 36)
def test_every_recovery_kind_is_counted_once_in_the_row_after_it_and_summed_in_the_summary(tmp_path):
    """``Run.recovery_metrics`` (the row's ``recovery/*``): what happened since the previous row,
    from the math-verify pool's and the generator pool's own counters and the start-up's
    fallbacks and moved files; ``recovery_totals`` (the summary's ``recoveries``) sums the rows."""
    from types import SimpleNamespace

    from megatron_rlhf.trainer.metrics import RECOVERY_KINDS, recovery_totals
    from megatron_rlhf.trainer.run import Run

    run = Run(load_config(REPO / "configs" / "ci_tiny.yaml", [f"run.output_dir={tmp_path}"]), lambda *a: None)
    run.reward, run.pool = SimpleNamespace(num_restarts=0), SimpleNamespace(restarts=0)
    run.checkpoint_fallbacks, run.damaged_moved = 2, 1            # found at start-up
    first = run.recovery_metrics()
    assert first == {"recovery/reward_worker_restarts": 0, "recovery/generator_restarts": 0,
                     "recovery/checkpoint_fallbacks": 2, "recovery/damaged_files": 1}
    run.reward.num_restarts, run.pool.restarts = 2, 1            # during step 2
    second = run.recovery_metrics()
    assert second == {"recovery/reward_worker_restarts": 2, "recovery/generator_restarts": 1,
                      "recovery/checkpoint_fallbacks": 0, "recovery/damaged_files": 0}
    assert set(run.recovery_metrics().values()) == {0}          # nothing new: nothing counted twice
    assert recovery_totals([first, second, {}]) == {"reward_worker_restarts": 2, "generator_restarts": 1,
                                                    "checkpoint_fallbacks": 2, "damaged_files": 1}
    assert set(recovery_totals([])) == set(RECOVERY_KINDS)
