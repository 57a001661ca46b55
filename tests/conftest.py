"""Shared test setup: process environment, tiny models built once per session, markers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rlhf.runtime import apply_process_env

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def metrics_steps(run_dir: Path) -> list[int]:
    """The ``step`` of every row of ``run_dir/metrics.jsonl`` in file order ([] before the first row)."""
    import json

    f = Path(run_dir) / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip()]


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the ``run_dir/checkpoints/step_N`` folders, ascending."""
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in d.glob("step_*") if p.is_dir()) if d.is_dir() else []


def carried(row: dict) -> int:
    """Groups a metrics row trained from an earlier batch's leftovers (``rollout/carried_trained``
    + ``rollout/partial_trained``)."""
    return (row.get("rollout/carried_trained") or 0) + (row.get("rollout/partial_trained") or 0)


def check_staleness(rows: list[dict], fresh: list[int]) -> None:
    """Assert each row's ``staleness/max`` is ``fresh[i]``, the staleness of the work its batch
    generated (what the handshake gives), except that a row training leftovers of the batch before
    (:func:`carried`) may reach one version more than that batch had: carried work trains within
    ``async.max_carry_staleness`` (default max_staleness + 1, docs/algorithms.md#leftovers-carried-and-parked-work)."""
    got = [r["staleness/max"] for r in rows]
    for i, (r, s) in enumerate(zip(rows, got)):
        top = max(fresh[i], fresh[i - 1] + 1) if i > 0 and carried(r) else fresh[i]
        assert fresh[i] <= s <= top, f"step {r['step']}: staleness/max {got} (fresh work {fresh}, carried {carried(r)})"
    assert len(got) == len(fresh), (got, fresh)


_CONFIG: dict = {}
"""``{"config": pytest.Config}`` of this process, for :func:`pytest_runtest_logreport`."""


def pytest_configure(config):
    _CONFIG["config"] = config
    if os.environ.get("MRLHF_TEST_TMP"):
        tmp = Path(os.environ["MRLHF_TEST_TMP"])
        tmp.mkdir(parents=True, exist_ok=True)
    else:  # one folder per pytest process: concurrent runs on one machine never share vLLM sockets
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="mrlhf_tests_"))
    apply_process_env(str(tmp))


def pytest_runtest_logreport(report):
    """A failure is named the moment it happens (``[failed] nodeid (phase, s): last error line``),
    not only in the end summary: a CI run stopped by ``.ci/run``'s time limit prints no summary
    (session 11's CI log showed two ``F`` and no names). On the xdist controller this sees every
    worker's reports; on a worker it does nothing (the controller prints)."""
    if not report.failed or report.when not in ("setup", "call", "teardown"):
        return
    config = _CONFIG.get("config")
    if config is None or hasattr(config, "workerinput"):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    text = getattr(report, "longreprtext", "") or ""
    errors = [ln for ln in text.splitlines() if ln.startswith("E ")]
    last = (errors[-1][1:].strip() if errors else (text.strip().splitlines() or [""])[-1])[:300]
    if reporter is not None:
        reporter.write_line(f"\n[failed] {report.nodeid} ({report.when}, {report.duration:.0f} s): {last}")


# Under pytest-xdist (the README's ``-n 2 --dist loadfile``) a test module runs whole on one worker,
# so its module-scoped Ray cluster and vLLM engine are built once. Longest modules first, so the two
# workers finish together (per-module times of full runs, sessions 6-10), except
# that the two modules starting a real SLURM on this machine go first and last: they take turns
# anyway (``tests.test_slurm.running_slurm`` holds a machine-wide lock), so they should not meet.
_LONGEST_FIRST = ["test_slurm", "test_weight_broadcast", "test_exact_resume", "test_stop_signals",
                  "test_convergence", "test_loop_losses", "test_cli_args", "test_async_loop",
                  "test_generator_pool", "test_learner_parallel", "test_replay", "test_convert_tools",
                  "test_reliability_loop"]
_LAST = ["test_recipe_rehearsal"]


def _module(item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


def pytest_collection_modifyitems(config, items):
    import torch

    if hasattr(config, "workerinput"):   # an xdist worker (workers collect; the controller only schedules)
        rank = {m: i for i, m in enumerate(_LONGEST_FIRST)}
        rank.update({m: len(rank) + 1 + i for i, m in enumerate(_LAST)})
        items.sort(key=lambda it: rank.get(_module(it), len(_LONGEST_FIRST)))   # stable: file order within
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 128, 4 heads / 2 KV heads, head_dim 32, untied)."""
    from megatron_rlhf.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    """Same as ``tiny_llama_dir`` with tied input/output embeddings (like SmolLM2)."""
    from megatron_rlhf.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module (loopback only, 4 logical CPUs on 2 cores: actors
    of these tests mostly wait on each other)."""
    import ray

    from megatron_rlhf.runtime import process_env

    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def generator_cfg(tiny_llama_dir):
    """The ``generators`` section the module's shared :func:`generator` is built with:
    ``configs/ci_tiny.yaml``'s. A test module overrides it with a fixture of the same name."""
    from megatron_rlhf.config import load_config

    return load_config(REPO / "configs" / "ci_tiny.yaml", [f"model.source={tiny_llama_dir}"]).generators


@pytest.fixture(scope="module")
def generator(ray_cluster, tiny_llama_dir, generator_cfg):
    """One vLLM generator actor (tiny random Llama, float32, seed 0) for every run of the module:
    ``train(cfg, generators=[generator])`` resets it to the base weights at the start of each run."""
    import ray

    from megatron_rlhf.generator.vllm_engine import VLLMGenerator

    gen = ray.remote(num_cpus=1, max_restarts=0)(VLLMGenerator).remote(
        model_dir=str(tiny_llama_dir), generator_cfg=generator_cfg, dtype="float32", seed=0, cpu_core=-1)
    ray.get(gen.__ray_ready__.remote(), timeout=600)
    yield gen
    ray.kill(gen)


@pytest.fixture
def groups():
    """Single-process torch.distributed (gloo) + megatron parallel state, released afterwards."""
    from megatron_rlhf.learner import parallel
    from megatron_rlhf.platform import get_platform

    platform = get_platform()
    platform.install(function_mode=False)
    g = parallel.acquire(backend=platform.dist_backend)
    platform.seed(0)
    yield g
    parallel.release()
