"""docs/configuration.md is generated from the config dataclasses and never drifts from them.

Refresh it with ``.venv/bin/python tools/config_reference.py`` (``--check`` exits 1 when stale).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_rlhf.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mrlhf_config_reference", REPO / "tools" / "config_reference.py")
ref = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ref  # its dataclass needs its module registered
_spec.loader.exec_module(ref)

pytestmark = pytest.mark.timeout(60)


def test_configuration_md_is_the_tools_output_for_the_current_config():
    on_disk = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert on_disk == ref.generate(), (
        "docs/configuration.md is stale (the config dataclasses changed): run "
        "`.venv/bin/python tools/config_reference.py` and commit the result")


def test_every_config_field_has_a_row_with_its_default():
    text = ref.generate()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    for key in ("run.num_steps", "tasks[].data.path", "tasks[].reward.reward_model", "learner.optimizer.lr",
                "async.max_staleness", "placement.network_interface", "rewards.math_verify_workers"):
        assert key in rows, key
    assert "| `10` |" in rows["run.num_steps"] and "| `1` |" in rows["async.max_staleness"]
    assert '"data/math_word_problems/mawps.jsonl"' in rows["tasks[].data.path"]  # the factory's default


@pytest.mark.parametrize("override,listed", [
    ("generators.draw_rounding=sideways", "one of `auto`, `down`, `nearest`"),
    ("algorithm.loss=ddpo", "`best_of_k_sft`"),
    ("learner.tensor_parallel=0", "an integer >= 1"),
    ("placement.ray_port=80", "a port in [1024, 65535]"),
])
def test_the_allowed_column_states_what_load_config_refuses(override, listed):
    key = override.split("=")[0]
    row = next(line for line in ref.generate().splitlines() if line.startswith(f"| `{key}` |"))
    assert listed in row.split("|")[-2]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_first_sentence_is_not_cut_after_et_al_or_eg():
    assert ref.first_sentence("Loss of Guo et al. 2024. More.") == "Loss of Guo et al. 2024."
    assert ref.first_sentence("Keep rows, e.g. ``{a: [b]}``. Else.") == "Keep rows, e.g. `{a: [b]}`."
    assert ref.first_sentence("A (see x. Y) b. C.") == "A (see x. Y) b."
