"""Config loading: YAML + defaults inheritance + overrides, typed validation naming the key."""

from pathlib import Path

import pytest

from megatron_rlhf.config import ConfigError, config_to_dict, load_config, save_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(30)


def test_cpu_demo_loads_and_round_trips(tmp_path):
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml")
    assert cfg.algorithm.loss == "online_dpo" and cfg.async_.sync is False
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert config_to_dict(again) == config_to_dict(cfg)
    assert "async" in config_to_dict(cfg) and "async_" not in config_to_dict(cfg)


def test_defaults_inheritance_and_overrides(tmp_path):
    cfg = load_config(REPO / "configs" / "ci_tiny.yaml", ["run.num_steps=7", "async.sync=true",
                                                         "tasks.0.data.limit=5", "learner.optimizer.lr=1e-3"])
    assert cfg.run.num_steps == 7 and cfg.async_.sync and cfg.async_.staleness_bound == 0
    assert cfg.tasks[0].data.limit == 5 and cfg.learner.optimizer.lr == 1e-3
    assert cfg.algorithm.samples_per_prompt == 4          # from ci_tiny
    assert cfg.algorithm.beta == 0.1                      # inherited from cpu_demo


@pytest.mark.parametrize("override, key", [
    ("algorithm.beta=-1", "algorithm.beta"),
    ("algorithm.betta=0.1", "algorithm.betta"),
    ("run.num_steps=abc", "run.num_steps"),
    ("async.sync=maybe", "async.sync"),
    ("generators.max_model_len=50", "generators.max_model_len"),
    ("algorithm.samples_per_prompt=1", "algorithm.samples_per_prompt"),
    ("tasks.0.reward=nonsense", "reward"),
    ("learner.optimizer.lr_decay=exp", "learner.optimizer.lr_decay"),
    ("model.source=", "model.source"),            # empty: not the working directory
    ("learner.pack_sequences=maybe", "learner.pack_sequences"),
])
def test_bad_values_raise_error_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(REPO / "configs" / "cpu_demo.yaml", [override])


def test_async_save_is_a_boolean():
    assert load_config(REPO / "configs" / "cpu_demo.yaml", ["checkpoint.async_save=true"]).checkpoint.async_save
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["checkpoint.async_save=maybe"])


def test_pack_sequences_defaults_on_and_is_validated_in_the_dataclass():
    from megatron_rlhf.config import LearnerConfig

    assert LearnerConfig().pack_sequences is True
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", ["learner.pack_sequences=false"])
    assert cfg.learner.pack_sequences is False
    with pytest.raises(ConfigError, match=r"learner\.pack_sequences"):
        LearnerConfig(pack_sequences="yes")


@pytest.mark.parametrize("override, key", [
    ("learner.optimizer.lr=inf", "learner.optimizer.lr"),
    ("learner.optimizer.lr=1e999", "learner.optimizer.lr"),
    ("learner.optimizer.lr=-inf", "learner.optimizer.lr"),
    ("learner.optimizer.lr=nan", "learner.optimizer.lr"),
    ("learner.optimizer.lr=.inf", "learner.optimizer.lr"),
    ("algorithm.beta=1e400", "algorithm.beta"),
    ("algorithm.beta=" + "9" * 400, "algorithm.beta"),
    ("learner.optimizer.clip_grad=inf", "learner.optimizer.clip_grad"),
])
def test_non_finite_numbers_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*finite"):
        load_config(REPO / "configs" / "cpu_demo.yaml", [override])


def test_non_finite_number_in_yaml_refused(tmp_path):
    for text in ("1e400", "inf", ".nan"):
        path = tmp_path / "c.yaml"
        path.write_text(f"defaults: {REPO / 'configs' / 'cpu_demo.yaml'}\nalgorithm:\n  beta: {text}\n")
        with pytest.raises(ConfigError, match=r"algorithm\.beta.*finite"):
            load_config(path)


def test_missing_file_and_bad_yaml_are_refused_in_one_line_with_the_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("run:\n  name: x\n bad: [\n")   # an indentation slip on line 3
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "\n" not in str(e.value) and "line 3, column 2: did not find expected key" in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        load_config(None, ["async.max_staleness=[1"])
    assert "\n" not in str(e.value) and "line" not in str(e.value).split("YAML:")[1], e.value
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["novalue"])
    with pytest.raises(ConfigError, match=r"'async.max_staleness' = true must be an integer >= 0 or auto"):
        load_config(None, ["async.max_staleness=true"])


def test_a_key_of_another_section_and_a_missing_defaults_file_are_named_with_the_fix(tmp_path):
    """Fresh-user findings: ``run.resume=false`` (the key is ``checkpoint.resume``) and following
    the empty-config hint's ``defaults: cpu_demo.yaml`` in another folder."""
    with pytest.raises(ConfigError, match=r"unknown config key 'run.resume' \(did you mean 'checkpoint.resume'\?"):
        load_config(None, ["run.resume=false"])
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "empty.yaml")
    hint = str(e.value).split("'defaults: ", 1)[1].split("'", 1)[0]
    assert Path(hint).is_file() and Path(hint).name == "cpu_demo.yaml", e.value
    (tmp_path / "d.yaml").write_text("defaults: cpu_demo.yaml\n")
    with pytest.raises(ConfigError, match=r"does not exist \(named by 'defaults:' in .*d\.yaml'; a relative path"):
        load_config(tmp_path / "d.yaml")


def test_defaults_cycle_detected(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_plugin_reward_path_accepted():
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", ["tasks.0.reward=tests.plugins:has_digit"])
    assert cfg.tasks[0].reward == "tests.plugins:has_digit"


def test_eval_interval_must_be_a_multiple_of_the_sync_interval():
    with pytest.raises(ConfigError, match=r"eval\.interval"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["eval.interval=3", "async.sync_interval=2",
                                                         "async.max_staleness=2"])
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", ["eval.interval=4", "async.sync_interval=2",
                                                           "async.max_staleness=2"])
    assert cfg.eval.interval == 4 and cfg.tasks[0].eval_data.path.endswith("mul1_eval.jsonl")
    with pytest.raises(ConfigError, match=r"eval\.samples"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["eval.samples=-1"])


def test_config_diff_lists_changed_keys_old_to_new():
    from megatron_rlhf.config import config_diff

    old = config_to_dict(load_config(REPO / "configs" / "cpu_demo.yaml"))
    new = config_to_dict(load_config(REPO / "configs" / "cpu_demo.yaml",
                                     ["run.num_steps=99", "algorithm.beta=0.05", "tasks.0.data.limit=5"]))
    assert config_diff(old, old) == []
    diff = config_diff(old, new)
    assert f"run.num_steps: {old['run']['num_steps']!r} -> 99" in diff
    assert "algorithm.beta: 0.1 -> 0.05" in diff
    assert any(d.startswith("tasks.0.data.limit: ") and d.endswith("-> 5") for d in diff)
    assert len(diff) == 3
    assert config_diff({"a": {"b": 1}}, {"a": {"c": 2}}) == ["a.b: 1 -> <absent>", "a.c: <absent> -> 2"]
    assert config_diff({"t": [1, 2]}, {"t": [1]}) == ["t: [1, 2] -> [1]"]


def test_resume_with_changed_config_names_the_keys(tmp_path):
    from megatron_rlhf.trainer.setup import config_changes as _config_changes

    cfg = load_config(REPO / "configs" / "cpu_demo.yaml")
    assert _config_changes(cfg, tmp_path / "config.yaml") == []          # a new run: nothing to compare
    save_config(cfg, tmp_path / "config.yaml")
    assert _config_changes(cfg, tmp_path / "config.yaml") == []
    changed = load_config(REPO / "configs" / "cpu_demo.yaml", ["learner.optimizer.lr=1e-5"])
    assert _config_changes(changed, tmp_path / "config.yaml") == ["learner.optimizer.lr: 3e-06 -> 1e-05"]


def test_tensor_parallel_suggestions_divide_every_split_dimension():
    from types import SimpleNamespace

    from megatron_rlhf.learner.model import check_divisible

    model = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                            num_hidden_layers=4)
    check_divisible(model, tensor_parallel=3, pipeline_parallel=2)
    with pytest.raises(ValueError, match=r"learner\.tensor_parallel=2.*one of \[1, 3\]$"):
        check_divisible(model, tensor_parallel=2, pipeline_parallel=1)
    with pytest.raises(ValueError, match=r"learner\.pipeline_parallel=3.*one of \[1, 2, 4\]$"):
        check_divisible(model, tensor_parallel=1, pipeline_parallel=3)


@pytest.mark.timeout(120)
def test_a_bad_tensor_parallel_for_smollm2_is_refused_before_its_cold_conversion(tmp_path, monkeypatch):
    """``model.source=smollm2`` with an empty cache: ``learner.tensor_parallel=2`` (SmolLM2 has 9
    heads) is refused from the GGUF header, naming the key and the divisors, before the minute-long
    conversion starts (it is never called)."""
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.run import Run

    def no_conversion(model_cfg):
        raise AssertionError("the model was converted before the layout was checked")

    monkeypatch.setattr(setup, "resolve_model_dir", no_conversion)
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", [f"model.cache_dir={tmp_path / 'cache'}",
                                                           f"run.output_dir={tmp_path / 'runs'}",
                                                           "learner.tensor_parallel=2"])
    with pytest.raises(ConfigError, match=r"num_attention_heads=9 is not divisible by learner\.tensor_parallel=2.*"
                                          r"one of \[1, 3\]"):
        setup.prepare(Run(cfg, lambda *a: None))
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct-hf").exists()


def test_a_budget_that_cannot_fill_a_batch_at_the_minimum_yield_is_refused_with_the_numbers():
    """The cluster recipes' former budget: 64 prompts per step, 512 at most; at a pair yield of 5%
    a batch needs 1280 prompts (issue 23); and a fixed burst whose first wave spends the budget."""
    with pytest.raises(ConfigError, match=r"'algorithm\.max_prompts_per_step' = 512 .*64 / 0\.05 = 1280"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["algorithm.prompts_per_step=64",
                                                         "algorithm.max_prompts_per_step=512"])
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml", ["algorithm.prompts_per_step=64",
                                                           "algorithm.max_prompts_per_step=512",
                                                           "algorithm.min_pair_yield=0.125"])
    assert cfg.algorithm.max_prompts_per_step == 512   # a stated higher yield is trusted
    with pytest.raises(ConfigError, match=r"'generators\.prompts_per_request' = 64 .*8 x 64 = 512 prompts"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["generators.num_workers=8", "generators.prompts_per_request=64",
                                                         "algorithm.max_prompts_per_step=512"])
    assert load_config(REPO / "configs" / "cpu_demo.yaml").generators.prompts_per_request is None


def test_partial_rollouts_default_to_the_inflight_setting():
    on = load_config(REPO / "configs" / "cpu_demo.yaml", ["generators.inflight_updates=true"])
    off = load_config(REPO / "configs" / "cpu_demo.yaml")
    assert on.generators.partial_rollouts is True and off.generators.partial_rollouts is False
    forced = load_config(REPO / "configs" / "cpu_demo.yaml", ["generators.inflight_updates=true",
                                                              "generators.partial_rollouts=false"])
    assert forced.generators.partial_rollouts is False


def test_a_misspelled_key_is_refused_with_the_closest_allowed_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.samples_per_promt' "
                                          r"\(did you mean 'algorithm\.samples_per_prompt'\? allowed: "):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["algorithm.samples_per_promt=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'run\.zzz' \(allowed: "):   # nothing close
        load_config(REPO / "configs" / "cpu_demo.yaml", ["run.zzz=1"])


def test_a_misspelled_value_is_refused_with_the_closest_allowed_value():
    with pytest.raises(ConfigError, match=r"config key 'algorithm\.loss' = 'online_dop' is invalid: "
                                          r"did you mean 'online_dpo'\? one of .*grpo"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["algorithm.loss=online_dop"])
    with pytest.raises(ConfigError, match=r"'algorithm\.loss' = 'dpo' is invalid: did you mean 'online_dpo' or 'group_dpo'\?"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["algorithm.loss=dpo"])   # one word of it, not 'ppo'
    with pytest.raises(ConfigError, match=r"'generators\.draw_rounding' = 'up' is invalid: one of auto, down, "
                                          r"nearest$"):   # nothing close
        load_config(REPO / "configs" / "cpu_demo.yaml", ["generators.draw_rounding=up"])
    with pytest.raises(ConfigError, match=r"'tasks\[math\]\.reward' = 'math_verfy' is invalid: did you mean "
                                          r"'math_verify'\? 'math_verify', a plug-in"):
        load_config(REPO / "configs" / "cpu_demo.yaml", ["tasks.0.reward=math_verfy"])


def test_an_empty_config_file_or_a_directory_is_refused_not_run_on_defaults(tmp_path):
    from megatron_rlhf.config import ConfigError, load_config

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml' is empty: give at least one section"):
        load_config(empty, [])
    with pytest.raises(ConfigError, match=r"is a directory: pass a YAML file"):
        load_config(tmp_path, [])
    child = tmp_path / "child.yaml"   # an empty parent is only an empty set of defaults
    (tmp_path / "parent.yaml").write_text("")
    child.write_text("defaults: parent.yaml\nrun:\n  name: x\n")
    assert load_config(child, []).run.name == "x"
