"""Bad input by the hundred, generated from the config dataclasses themselves (issue 36, principle 7).

Every leaf key of :class:`megatron_rlhf.config.Config` (walked from the dataclass tree, so a new key
is covered the day it is added) gets wrong types (a string for a number or a bool, a number or a
list for a string, null where null is not allowed, a mapping for a scalar) and out-of-range values
(negative, zero, NaN, +-inf, an unknown choice for a string that has choices). Each must be refused
by ``load_config`` with a ``ConfigError`` naming the key, in one line, writing nothing. Added:
duplicate keys in a YAML file (also in a ``defaults:`` parent), an over-long ``run.name``, data
paths that are a FIFO, a device or a folder (the pre-flight's ``check_task_files``), and a few
cases through ``train.py`` in a subprocess (exit 2, one line, no traceback, no run folder).

A value the config accepts but should refuse is a validation bug: fix it next to the field in
``config.py``. The lists below name the only exceptions, each with its reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from megatron_rlhf.config import Config, ConfigError, RewardModelSpec, load_config

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "ci_tiny.yaml"

# Strings where any text is fine (free names and paths; the paths are checked by the pre-flight
# when the run starts: tests below cover the data path's FIFO/folder cases).
FREE_STRINGS = {
    "run.name",                 # any plain folder name (its form and length are checked below)
    "run.output_dir",           # a path: the pre-flight creates / checks the run folder
    "model.cache_dir",          # a path: created on first use
    "tasks.0.name",             # a free label (unique: checked across tasks)
    "tasks.0.data.path", "tasks.0.eval_data.path",                 # pre-flight: check_task_files
    "tasks.0.data.prompt_field", "tasks.0.data.answer_field",      # pre-flight: check_prompt_fields
    "tasks.0.eval_data.prompt_field", "tasks.0.eval_data.answer_field",
    "tasks.0.instruction",      # free text appended to prompts
    "tasks.0.reward.reward_model",   # a folder or a demo name: rewards.resolve_reward_model
    "tasks.0.eval_reward.reward_model",   # the same
    "logging.wandb_project",    # a free label
    "placement.partition", "placement.account", "placement.network_interface",   # the cluster's names
}
# Numbers where a negative value is meaningful.
NEGATIVE_OK = {
    "generators.cpu_core",               # -1 disables pinning
    "algorithm.group_dpo_threshold",     # a reward threshold: rewards may be negative
}
# Numbers where 0 is meaningful (each field's docstring says what 0 means).
ZERO_OK = {
    "run.seed", "tasks.0.data.limit", "tasks.0.eval_data.limit",   # seed 0; limit 0 = all rows
    "generators.cpu_core", "generators.max_restarts",              # core 0; no restarts
    "learner.max_tokens_per_microbatch", "learner.seq_length_multiple", "learner.ref_sync_interval",  # 0 = off
    "learner.optimizer.min_lr", "learner.optimizer.weight_decay", "learner.optimizer.clip_grad",
    "learner.optimizer.warmup_steps", "learner.optimizer.adam_beta1", "learner.optimizer.adam_beta2",
    "algorithm.nll_coef", "algorithm.group_dpo_alpha", "algorithm.group_dpo_threshold", "algorithm.kl_beta",
    "algorithm.entropy_coef", "algorithm.value_coef", "algorithm.gae_lambda", "algorithm.overlong_buffer",
    "async.max_staleness", "async.watchdog_factor",                # on-policy; watchdog off
    "checkpoint.interval", "eval.interval", "eval.samples",        # only at the end; greedy only
    "rewards.math_verify_workers",                                 # 0 = from the cores
    "placement.gpus_per_node", "placement.cpus_per_node",          # 0 = CPU / from the node
}
# Leaves whose overrides need a section set first (it is null or a string by default).
PREFIX = {"tasks.0.eval_data.": ["tasks.0.eval_data.path=data/math_word_problems/mawps.jsonl"],
          "tasks.0.reward.": ["tasks.0.reward.reward_model=smollm2-demo"],
          "tasks.0.eval_reward.": ["tasks.0.reward.reward_model=smollm2-demo",   # a reward-model task only
                                   "tasks.0.eval_reward.reward_model=smollm2-demo-gold"]}


def _leaves(cls, prefix: str = ""):
    """``(dotted key, type)`` of every leaf field under dataclass ``cls`` (lists of dataclasses
    by their first element ``.0.``; an optional dataclass and a ``str | RewardModelSpec`` by
    their fields too)."""
    from megatron_rlhf.config import _YAML_NAMES

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + _YAML_NAMES.get(f.name, f.name)
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        members = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
        nested = [a for a in members if dataclasses.is_dataclass(a)]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from _leaves(typing.get_args(tp)[0], key + ".0.")
            continue
        if nested:
            yield from _leaves(nested[0], key + ".")
            if len(members) == 1:
                continue
        yield key, tp


def _cases():
    """``(key, yaml value)`` pairs that must be refused, derived from each leaf's type."""
    out = []
    for key, tp in _leaves(Config):
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        optional = union and type(None) in typing.get_args(tp)
        base = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
        kinds = {typing.get_origin(a) or a for a in base}
        vals = ["{a: 1}"] if not kinds & {dict, RewardModelSpec} else []   # a mapping for a scalar
        if not optional:
            vals.append("null")
        if kinds == {bool}:
            vals += ["maybe", "1"]
        if kinds & {int, float} and bool not in kinds:
            vals += ["not_a_number", "true"]
            vals += [] if key in NEGATIVE_OK else ["-1"]
            vals += [] if key in ZERO_OK else ["0"]
        if int in kinds and float not in kinds:
            vals.append("1.5")
        if float in kinds:
            vals += [".nan", ".inf", "-.inf"]
        if str in kinds:
            vals += ["[1, 2]", "12"] if kinds == {str} else ["[1, 2]"]
            if key not in FREE_STRINGS and kinds == {str}:
                vals.append("zz_not_a_choice")
        if list in kinds:
            vals += ["7", "[zz, {a: 1}]"]
        if dict in kinds:
            vals += ["7", "[1]"]
        out += [(key, v) for v in dict.fromkeys(vals)]
    return out


CASES = _cases()


def _key_pattern(key: str) -> str:
    """The key as messages name it: ``tasks.0.x`` is ``tasks[0].x``, ``tasks[math].x`` or ``tasks[].x``."""
    parts = key.split(".")
    if parts[0] == "tasks":
        return r"tasks\[[^\]]*\]\." + re.escape(".".join(parts[2:]))
    return re.escape(key)


def test_the_generated_cases_cover_every_leaf_key_and_number_over_a_hundred():
    keys = {k for k, _ in _leaves(Config)}
    assert {k for k, _ in CASES} == keys
    assert len(CASES) >= 100 and (FREE_STRINGS | NEGATIVE_OK | ZERO_OK) <= keys   # no stale exception


@pytest.mark.timeout(120)
def test_every_generated_bad_value_is_refused_naming_its_key_and_writing_nothing(tmp_path, monkeypatch):
    """All cases in one test (config loading only; ~10 ms each): a failure lists every case the
    config accepted or named wrongly, not just the first."""
    monkeypatch.chdir(tmp_path)   # anything written relative to the working directory lands here
    out_dir = tmp_path / "runs"
    bad = []
    for key, value in CASES:
        pre = next((v for p, v in PREFIX.items() if key.startswith(p)), [])
        try:
            load_config(BASE, [f"run.output_dir={out_dir}", *pre, f"{key}={value}"])
        except ConfigError as e:
            msg = str(e)
            if not re.search(_key_pattern(key), msg) or "Traceback" in msg:
                bad.append(f"{key}={value}: message does not name the key: {msg}")
        except Exception as e:   # noqa: BLE001 - a raw error is the bug this test looks for
            bad.append(f"{key}={value}: raw {type(e).__name__}: {e}")
        else:
            bad.append(f"{key}={value}: accepted")
    assert not bad, f"{len(bad)} of {len(CASES)} cases:\n" + "\n".join(bad)
    assert sorted(os.listdir(tmp_path)) == [], "loading a config wrote something"


def _dup_recipe(tmp_path: Path) -> Path:
    parent = tmp_path / "parent.yaml"
    parent.write_text(f"defaults: {BASE}\nalgorithm:\n  beta: 0.1\n  samples_per_prompt: 4\n  beta: 0.2\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: parent.yaml\nrun: {name: x}\n")
    return child


@pytest.mark.timeout(30)
def test_a_duplicate_yaml_key_is_refused_naming_the_key_file_and_lines_also_in_a_defaults_parent(tmp_path):
    with pytest.raises(ConfigError, match=r"parent\.yaml' line 5: duplicate key 'beta' \(first at line 3"):
        load_config(_dup_recipe(tmp_path))
    with pytest.raises(ConfigError, match=r"duplicate key 'type'"):
        load_config(BASE, ["tasks.0.data.filter={type: [a], type: [b]}"])
    assert load_config(BASE, ["tasks.0.data.filter={<<: {a: [1]}, b: [2]}"]).tasks[0].data.filter == \
        {"a": [1], "b": [2]}   # a YAML merge key is no duplicate


@pytest.mark.timeout(30)
def test_an_over_long_run_name_is_refused_naming_the_key_and_the_limit():
    from megatron_rlhf.config import RUN_NAME_MAX_BYTES

    assert load_config(BASE, ["run.name=" + "n" * RUN_NAME_MAX_BYTES]).run.name
    for name in ("n" * 300, "é" * (RUN_NAME_MAX_BYTES // 2 + 1)):   # bytes count, not characters
        with pytest.raises(ConfigError, match=rf"run\.name.*at most {RUN_NAME_MAX_BYTES} bytes"):
            load_config(BASE, [f"run.name={name}"])


@pytest.mark.timeout(30)
def test_a_data_path_that_is_a_fifo_a_device_or_a_folder_is_refused_by_the_preflight_naming_the_key(tmp_path):
    from megatron_rlhf.trainer.preflight import check_task_files

    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    cases = [(f"tasks.0.data.path={fifo}", r"tasks\[math\]\.data\.path.*not a regular file but a FIFO"),
             ("tasks.0.data.path=/dev/null", r"tasks\[math\]\.data\.path.*not a regular file but a device"),
             (f"tasks.0.data.path={tmp_path}", r"tasks\[math\]\.data\.path.*is a directory"),
             (f"tasks.0.eval_data.path={fifo}", r"tasks\[math\]\.eval_data\.path.*FIFO")]
    for override, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):   # never blocks: only stat() touches the FIFO
            check_task_files(load_config(BASE, [override]))


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args, f"run.output_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(200)
def test_train_py_exits_2_with_one_line_and_no_run_folder_for_generated_and_listed_cases(tmp_path):
    """A few cases end to end: exit 2, one ``config error:`` line naming the key, no traceback, no
    run folder and nothing else written in the working directory."""
    picked = [f"{k}={v}" for k, v in CASES[::max(1, len(CASES) // 3)][:3]]
    cases = [(["--config", str(BASE), o], _key_pattern(o.split("=")[0])) for o in picked]
    cases += [(["--config", str(_dup_recipe(tmp_path))], r"duplicate key 'beta'"),
              (["--config", str(BASE), "run.name=" + "n" * 300], r"run\.name"),
              (["--config", str(BASE), "algorithm.gae_lambda=5"], r"algorithm\.gae_lambda")]
    before = sorted(os.listdir(tmp_path))
    for args, pattern in cases:
        p = _train(tmp_path, *args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("config error:"), (args, p.stderr)
        assert re.search(pattern, lines[0]) and "Traceback" not in p.stderr + p.stdout, (args, p.stderr)
        assert sorted(os.listdir(tmp_path)) == before, f"{args}: wrote {set(os.listdir(tmp_path)) - set(before)}"
