"""Pre-flight: every check that needs the disk, the model or the machine, run once before any
actor starts (config values themselves are checked when the config loads).

Each failure is a :class:`~megatron_rlhf.config.ConfigError` naming the config key, the path or
value and the fix, instead of an error from deep inside Megatron, vLLM or transformers after the
actors started:

* Before the model is prepared (a cold conversion takes a minute): every ``tasks[].data.path`` and
  ``tasks[].eval_data.path`` is an existing file whose first rows have the task's ``prompt_field``,
  ``answer_field`` and ``filter`` keys (math and plug-in tasks), and every ``tasks[].reward.reward_model`` that is
  no demo name is a folder with a ``config.json`` of a scalar-head model (:func:`check_task_files`).
* ``model.source``: an HF folder needs ``config.json`` of a supported architecture
  (:func:`megatron_rlhf.convert.mapping.supported_model_types`), a tokenizer and readable
  ``*.safetensors`` files (each header is parsed; a truncated or corrupt file is named); any other
  folder must be a Megatron checkpoint.
* ``generators.max_model_len`` at most the model's ``max_position_embeddings``.
* The model splits over ``learner.tensor_parallel`` / ``pipeline_parallel``;
  the weight transport serves the layout (``weight_sync.check_transport_layout``).
* A vLLM engine fits its device (``platform.engine_args.check_engines``): its weights fit the memory
  vLLM may use and its KV cache holds at least one ``generators.max_model_len`` sequence.
* Reward plug-ins (``tasks[].reward: module:function``) import (any error at import, a
  ``SyntaxError`` included, is reported with its task) and are callable.
* ``logging.tensorboard: true`` has the tensorboard package to write with.
* The run folder ``<run.output_dir>/<run.name>`` can be created and written (no file in the way of
  it or of its ``checkpoints`` folder, a writable disk).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megatron_rlhf.config import Config, ConfigError

__all__ = ["check_model_source", "check_task_files", "check_device", "check_layout_before_conversion", "preflight",
           "check_model_folder", "check_output_folder", "import_plugins", "check_logging", "check_prompt_fields",
           "check_regular_file"]


def check_model_source(model_cfg) -> None:
    """``model.source`` before it is resolved: an HF folder (``config.json`` and
    ``*.safetensors``) or a Megatron checkpoint folder.

    Raises:
        ConfigError: neither (names what is missing).
    """
    if model_cfg.source == "smollm2":
        return
    from megatron_rlhf.convert.dist_ckpt import resolve_checkpoint

    src = Path(os.path.expanduser(model_cfg.source)).resolve()
    key = f"config key 'model.source' = {model_cfg.source!r}"
    has_config, has_weights = (src / "config.json").is_file(), any(src.glob("*.safetensors"))
    if has_config and has_weights:
        return
    try:
        resolve_checkpoint(src)
        return
    except FileNotFoundError:
        pass
    if has_config:
        raise ConfigError(f"{key}: {src} has config.json but no *.safetensors weights; save the model "
                          "with safetensors (save_pretrained(..., safe_serialization=True))")
    raise ConfigError(f"{key}: {src} has no config.json, so it is no Hugging Face model folder "
                      "(config.json, *.safetensors, tokenizer files), and no Megatron checkpoint "
                      "either; point model.source at one of those, or use 'smollm2'")


def check_task_files(cfg: Config) -> None:
    """Every task's data files and reward-model folder exist, checked before the model is prepared.

    A demo reward-model name (``smollm2-demo``) is trained on first use later; any other
    ``tasks[].reward.reward_model`` or ``tasks[].eval_reward.reward_model`` must already be a
    folder with a ``config.json``.

    Raises:
        ConfigError: names the key (``tasks[<name>].data.path``, ``tasks[<name>].eval_data.path``,
            ``tasks[<name>].reward.reward_model``, ``tasks[<name>].eval_reward.reward_model``), the
            value and where it looked.
    """
    from megatron_rlhf.data.jsonrecords import resolve_data_path
    from megatron_rlhf.rewards.train import DEMO_REWARD_MODELS, resolve_reward_model

    for task in cfg.tasks:
        try:
            for data, part in ((task.data, "data"), (task.eval_data, "eval_data")):
                if data is None:
                    continue
                key = f"tasks[{task.name}].{part}"
                check_regular_file(data.path, f"{key}.path")
                path = resolve_data_path(data.path, key=f"{key}.path")
                if task.kind != "reward_model":   # chat files have formats of their own (data/chat.py)
                    check_prompt_fields(data, path, key)
            specs = ((task.reward, "reward"), (task.eval_reward, "eval_reward")) if task.kind == "reward_model" else ()
            for spec, part in specs:
                if spec is not None and spec.reward_model not in DEMO_REWARD_MODELS:
                    resolve_reward_model(spec.reward_model, os.path.expanduser(cfg.model.cache_dir),
                                         key=f"tasks[{task.name}].{part}.reward_model")
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from e


def check_regular_file(path: str, key: str) -> None:
    """Refuse a data path whose first existing candidate (absolute; else the repo root, then the
    working directory, as ``data.jsonrecords.resolve_data_path`` tries them) is a FIFO, socket or
    device: reading one would block or never end, and it is no "file not found" either. Only
    ``stat`` is called (opening a FIFO would block).

    Raises:
        ConfigError: names ``key``, the path and what it is.
    """
    import stat

    import megatron_rlhf

    p = Path(path).expanduser()
    repo = Path(megatron_rlhf.__file__).resolve().parents[1]
    for t in [p] if p.is_absolute() else [repo / p, Path.cwd() / p]:
        try:
            mode = t.stat().st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return   # a file is read; a folder is named by resolve_data_path
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
        raise ConfigError(f"config key '{key}' = {path!r}: {t} is not a regular file but {kind}; give a "
                          "JSONL file (copy a stream to a file first)")


def _head_rows(path: Path, n: int) -> tuple[list[dict], int]:
    """The JSON objects among the first ``n`` non-blank lines of a JSONL file (the whole array of a
    ``.json`` file under 64 MiB; nothing for a larger one), and how many lines (entries) were read."""
    import json

    if path.suffix == ".json":
        if path.stat().st_size > 64 << 20:
            return [], 0
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return [], 0   # the loader reports it, naming the line
        return ([r for r in rows[:n] if isinstance(r, dict)], min(n, len(rows))) if isinstance(rows, list) else ([], 0)
    rows, read = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    r = json.loads(line)
                except ValueError:
                    r = None
                rows += [r] if isinstance(r, dict) else []
                read += 1
                if read == n:
                    break
    return rows, read


def check_prompt_fields(data, path: Path, key: str, n: int = 50) -> None:
    """``<key>.prompt_field`` (each part of ``Body+Question``), ``answer_field`` and every ``filter``
    key of ``data`` (a ``DataConfig``) occur in the first ``n`` rows of ``path``: a misspelled field
    would otherwise skip (or filter out) every row and stop the run after the model was prepared.

    Raises:
        ConfigError: names the key, the missing field(s) and the keys the rows do have; or no
            line read is a JSON object (not a JSONL file).
    """
    rows, read = _head_rows(path, n)
    if read and not rows:
        raise ConfigError(f"{key}.path: none of the first {read} lines of {path} is a JSON object; give a "
                          "JSONL file (one JSON object per line) or a .json array of objects")
    if not rows:
        return   # empty or unreadable: the loader names the file and the line
    seen = sorted({k for r in rows for k in r})
    wanted = [("prompt_field", f.strip()) for f in data.prompt_field.split("+")]
    wanted += [("answer_field", data.answer_field)] if data.answer_field else []
    wanted += [("filter", f) for f in (data.filter or {})]   # a misspelled key filters every row out
    missing = [(k, f) for k, f in wanted if not any(f in r for r in rows)]
    if missing:
        what = ", ".join(f"{key}.{k} key {f!r}" if k == "filter" else f"{key}.{k} = {f!r}" for k, f in missing)
        raise ConfigError(f"{what}: no such field in the first {len(rows)} rows of {path}; its rows have "
                          f"the fields {seen}; set {' and '.join(sorted({f'{key}.{k}' for k, _ in missing}))} "
                          "to one of them")


def check_device(cfg: Config) -> None:
    """``model.dtype: bfloat16`` without a GPU runs on CPU where the CPU computes bf16, else is refused;
    a CPU run whose processes outnumber the cores says so (:func:`cpu_core_sharing`).

    bf16 is what the GPU recipes train and sample in (``base_cluster.yaml``, ``smoke-1n8g.yaml``).
    On a machine that sees no CUDA device (``placement.gpus_per_node: 0``) the same bf16 path runs
    on CPU, so that a dtype bug of the GPU path (a cast, a tolerance, a checkpoint or export dtype)
    fails here first: :func:`megatron_rlhf.platform.cpu_bf16_support` decides, natively
    (AVX512-BF16, AMX) or emulated (AVX2: the same bf16 numbers, tens of times slower per GEMM; a
    line says so). Elsewhere it is refused. On a SLURM cluster (``gpus_per_node > 0``) the driver
    may run on a node without GPUs, so nothing is checked there.

    Raises:
        ConfigError: names ``model.dtype``, why this CPU cannot run it and the fp32 override.
    """
    from megatron_rlhf.platform import cpu_bf16_support
    from megatron_rlhf.platform.engine_args import config_device   # cuda on SLURM GPU nodes or when visible

    if (line := cpu_core_sharing(cfg)) is not None:
        print(line, flush=True)
    if cfg.model.dtype != "bfloat16" or config_device(cfg) == "cuda":
        return
    support = cpu_bf16_support()
    if support is None:
        raise ConfigError(
            "config key 'model.dtype' = 'bfloat16' on a machine without a GPU whose CPU has neither "
            "AVX512-BF16/AMX nor AVX2 (torch cannot compute bf16 on it at a usable speed): run it on a "
            "GPU node (bash tools/setup_gpu.sh, then .venv-gpu/bin/python train.py ...), or set "
            "model.dtype=float32")
    if support == "emulated":
        print("[megatron-rlhf] model.dtype=bfloat16 on a CPU without AVX512-BF16/AMX: bf16 is computed "
              "by widening to fp32 (the same bf16 numbers, about 27x slower per GEMM than fp32; "
              "see megatron_rlhf.platform.cpu_bf16_support)", flush=True)


def cpu_core_sharing(cfg: Config, cores: int | None = None) -> str | None:
    """The line a CPU run prints when its learner ranks and vLLM workers outnumber the cores, else None.

    Each learner rank and each vLLM worker is pinned to a core of its own on CPU
    (:func:`megatron_rlhf.runtime.pin_to_core`, ``VLLM_CPU_OMP_THREADS_BIND``); with more processes
    than cores they share cores round robin, so the run is slower, not hung. Nothing on a GPU
    config (``placement.gpus_per_node > 0`` or a visible CUDA device).

    Args:
        cores: cores this process may use (default :func:`megatron_rlhf.runtime.usable_cores`).
    """
    from megatron_rlhf.platform.engine_args import config_device
    from megatron_rlhf.runtime import usable_cores

    if config_device(cfg) == "cuda":
        return None
    cores = usable_cores() if cores is None else cores
    lrn, gen = cfg.learner, cfg.generators
    ranks = lrn.tensor_parallel * lrn.pipeline_parallel * lrn.data_parallel
    workers = gen.num_workers * gen.tensor_parallel
    if ranks + workers <= cores:
        return None
    return (f"[megatron-rlhf] {ranks} learner rank(s) + {workers} vLLM worker(s) on {cores} CPU core(s): "
            "processes share cores, so steps are slower than the layout suggests (not hung)")


def check_layout_before_conversion(cfg: Config) -> None:
    """The learner layout against ``model.source=smollm2`` before its first (cold) conversion: the
    architecture is read from the GGUF header (seconds) so that a bad ``learner.tensor_parallel`` /
    ``pipeline_parallel`` is refused before the ~1 minute conversion, not after it. A no-op for
    other sources and once the converted folder is cached (:func:`check_model_folder` checks it).

    Raises:
        ConfigError: names the model field, the learner key and the divisors to choose from.
    """
    if cfg.model.source != "smollm2":
        return
    from megatron_rlhf.convert.gguf import smollm2_cached, smollm2_gguf_architecture

    if smollm2_cached(cfg.model.cache_dir):
        return
    try:
        arch = smollm2_gguf_architecture()
    except FileNotFoundError as e:
        raise ConfigError(f"config key 'model.source' = 'smollm2': {e}") from e
    _check_learner_layout(cfg, arch)


def _check_learner_layout(cfg: Config, hf) -> None:
    """``learner.tensor_parallel`` / ``pipeline_parallel`` divide the model (``check_divisible``)."""
    from megatron_rlhf.learner.model import check_divisible

    try:
        check_divisible(hf, tensor_parallel=cfg.learner.tensor_parallel,
                        pipeline_parallel=cfg.learner.pipeline_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def preflight(cfg: Config, model_dir: Path) -> dict:
    """Every pre-flight check (module doc) on the resolved HF folder ``model_dir``.

    Returns:
        Task name -> imported reward plug-in (:func:`import_plugins`).
    Raises:
        ConfigError: the first failed check.
    """
    import torch

    from megatron_rlhf.platform.engine_args import check_engines

    check_model_folder(cfg, model_dir)
    check_engines(cfg, model_dir)   # vLLM could not start the engine: weights too big, KV < one sequence
    from megatron_rlhf.generator.weight_sync import check_transport_layout

    try:   # the weight transport serves this learner x engine layout
        check_transport_layout(cfg.generators, cfg.learner, gpu_memory_gib=cfg.placement.gpu_memory_gib
                               if cfg.placement.gpus_per_node > 0 and torch.cuda.is_available() else 0.0)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    plugins = import_plugins(cfg)
    check_logging(cfg)
    check_output_folder(cfg)
    return plugins


def check_logging(cfg: Config) -> None:
    """``logging.tensorboard: true`` needs the tensorboard package (``trainer.metrics`` writes with it).

    Raises:
        ConfigError: it is not installed (names the key and both fixes).
    """
    import importlib.util

    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("config key 'logging.tensorboard' = True needs the tensorboard package, which is "
                          "not installed: pip install tensorboard (it is in requirements/), or set "
                          "logging.tensorboard=false")


def check_model_folder(cfg: Config, model_dir: Path) -> None:
    """config.json, architecture, layout, context length, tokenizer and safetensors headers of
    the HF folder ``model_dir``.

    Raises:
        ConfigError: names ``model.source`` (or the learner / generator key) and the file.
    """
    from megatron_rlhf.convert.mapping import get_arch
    from megatron_rlhf.learner.model import load_hf_config

    key = f"config key 'model.source' = {cfg.model.source!r}"
    try:
        hf = load_hf_config(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ...
        raise ConfigError(f"{key}: {model_dir}/config.json cannot be read: {type(e).__name__}: {e}") from e
    try:
        get_arch(hf)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    _check_learner_layout(cfg, hf)
    positions = _max_positions(hf)
    if positions and cfg.generators.max_model_len > positions:
        raise ConfigError(f"config key 'generators.max_model_len' = {cfg.generators.max_model_len} is "
                          f"invalid: the model ({model_dir}) has max_position_embeddings="
                          f"{hf.max_position_embeddings} ({positions} positions with its RoPE scaling); "
                          f"set it to at most {positions}")
    _check_tokenizer(key, model_dir)
    _check_safetensors(key, model_dir)


def _max_positions(hf) -> int | None:
    """The context the model supports: ``max_position_embeddings`` times the RoPE scaling factor
    of a scaled RoPE (``rope_type`` other than ``default``), as vLLM derives it."""
    positions = getattr(hf, "max_position_embeddings", None)
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0)) if kind not in ("default", None) else 1.0
    return int(positions * factor) if positions else None


def _check_tokenizer(key: str, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a missing tokenizer surfaces as many error types
        files = sorted(p.name for p in Path(model_dir).iterdir() if "token" in p.name or p.suffix == ".model")
        raise ConfigError(f"{key}: no usable tokenizer in {model_dir} (tokenizer files there: "
                          f"{files or 'none'}; expected tokenizer.json or tokenizer.model with "
                          f"tokenizer_config.json): {type(e).__name__}: {str(e)[:300]}") from e


def _check_safetensors(key: str, model_dir: Path) -> None:
    """Parse the header of every weights file (cheap: the tensors are not read)."""
    import json

    from safetensors import safe_open

    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{key}: {index} is not a valid safetensors index ({e})") from e
        files = [Path(model_dir) / n for n in names]
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{key}: {model_dir} holds no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{key}: {f} is listed in {index.name} but missing")
        try:
            with safe_open(str(f), "pt") as h:
                h.keys()
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError
            raise ConfigError(f"{key}: weights file {f} is corrupt or truncated ({e}); re-download or "
                              "re-export the model") from e


def import_plugins(cfg: Config) -> dict:
    """Task name -> the imported ``module:function`` reward plug-in of every plug-in task.

    Raises:
        ConfigError: a plug-in whose import fails in any way (missing module, ``SyntaxError``, an
            exception raised by the module's code), that is missing or not callable, or whose
            signature cannot take ``(completions, answers)``; names the task and the plug-in.
    """
    import importlib
    import inspect

    out = {}
    for task in cfg.tasks:
        if task.kind != "plugin":
            continue
        mod, _, name = task.reward.partition(":")
        head = f"config key 'tasks[{task.name}].reward' = {task.reward!r}"
        try:
            module = importlib.import_module(mod)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's module may raise anything
            where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
            raise ConfigError(f"{head}: importing module {mod!r} failed: {type(e).__name__}: "
                              f"{e}{where}; fix the module or the dotted path") from e
        fn = getattr(module, name, None)
        if fn is None:
            raise ConfigError(f"{head}: module {mod!r} has no {name!r}")
        if not callable(fn):
            raise ConfigError(f"{head}: {mod}.{name} is a {type(fn).__name__}, not a function "
                              "fn(completions, answers) -> rewards")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):   # some builtins and C functions have none: called as is
            sig = None
        if sig is not None:
            try:
                sig.bind([], [])
            except TypeError as e:
                raise ConfigError(f"{head}: {mod}.{name}{sig} cannot be called as fn(completions, answers) "
                                  f"({e}); give it two positional parameters (completions: list[str], "
                                  "answers: list[str]) and return one float per completion") from e
        out[task.name] = fn
    return out


def check_output_folder(cfg: Config) -> Path:
    """Create the run folder (and its parents) and check it is writable.

    Returns:
        The run folder.
    Raises:
        ConfigError: a file where ``run.output_dir``, the run folder or its ``checkpoints`` folder
            must go, or a folder that cannot be created or written (names the path and the cause).
    """
    run_dir = cfg.run_dir
    for path, key in ((run_dir.parent, "run.output_dir"), (run_dir, "run.name"),
                      (run_dir / "checkpoints", "run.name")):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"config key '{key}': {path} is a file, but the run needs a folder there; "
                              f"move the file or choose another {key}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"config key 'run.output_dir': cannot write the run folder {run_dir}: "
                          f"{e.strerror or e} ({e.filename or run_dir}); choose a writable "
                          "run.output_dir") from e
    return run_dir
