"""requirements/gpu.txt installs as written: every line is a pip requirement, Transformer Engine is
installed by its own documented command with --no-build-isolation (a requirements line cannot carry
that flag, and without it TE's PyTorch extension builds against no torch), megatron-core is pinned
to the version the learner is tested with (the same as the CPU stack's). No GPU or network needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def requirement_lines(text: str) -> list[str]:
    """Non-comment, non-blank lines of a requirements file (inline comments stripped)."""
    return [ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


def check_gpu_requirements(text: str) -> dict[str, str]:
    """Names -> specifiers of ``text`` (gpu.txt); raises ValueError on the known-bad patterns."""
    from packaging.requirements import InvalidRequirement, Requirement

    reqs = {}
    for line in requirement_lines(text):
        if line.startswith("-"):
            raise ValueError(f"{line!r}: pip options in gpu.txt apply to the whole install; "
                             "put them in the documented command instead")
        try:
            r = Requirement(line)
        except InvalidRequirement as e:
            raise ValueError(f"{line!r}: not a pip requirement ({e})") from e
        if r.name.lower().replace("_", "-").startswith("transformer-engine"):
            raise ValueError(f"{line!r}: Transformer Engine must be installed with "
                             "--no-build-isolation after torch (see the file's header), not listed")
        reqs[r.name.lower()] = str(r.specifier)
    if not re.search(r"pip install --no-build-isolation \"?transformer-engine\[pytorch\]", text):
        raise ValueError("gpu.txt must document: pip install --no-build-isolation transformer-engine[pytorch]")
    if not reqs.get("megatron-core", "").startswith("=="):
        raise ValueError("megatron-core must be pinned (==) in gpu.txt")
    return reqs


@pytest.mark.timeout(30)
def test_gpu_requirements_parse_pin_megatron_core_like_the_cpu_stack_and_document_the_te_command():
    reqs = check_gpu_requirements((REPO / "requirements" / "gpu.txt").read_text())
    cpu = dict(ln.split("==") for ln in requirement_lines((REPO / "requirements" / "cpu.txt").read_text())
               if "==" in ln)
    assert reqs["megatron-core"] == "==" + cpu["megatron-core"]
    assert reqs["vllm"].startswith("==")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, why", [
    ("transformer-engine[pytorch]\n", "no-build-isolation"),              # the line gpu.txt used to have
    ("transformer_engine[pytorch]==2.20.2\n", "no-build-isolation"),
    ("--no-build-isolation transformer-engine[pytorch]\n", "pip options"),
    ("megatron-core\n", "pinned"),
])
def test_known_bad_gpu_requirement_lines_are_rejected(bad, why):
    good = (REPO / "requirements" / "gpu.txt").read_text()
    text = good.replace("megatron-core==", "megatron-core-x==") if why == "pinned" else good
    with pytest.raises(ValueError, match=why):
        check_gpu_requirements(text + bad)
