"""The one on-disk format of a rollout batch: debug replay (``run.mode: rollout_only`` /
``train_only``) and the untrained batches a checkpoint keeps for an exact resume.

A :class:`~megatron_rlhf.types.RolloutBatch` is written as one gzipped JSON document
``batch_<index:06d>.json.gz``: its dataclass fields by name (prompts, completions with their token
ids, sampling logprobs and weight versions, rewards, pairs), never pickled objects, so a file
outlives code changes that add fields with defaults and can be read by any tool. Non-finite floats
are written as JSON's ``NaN``/``Infinity`` extensions (Python's ``json`` reads them back).

The same encoding of groups (:func:`group_to_dict` / :func:`group_from_dict`) holds what the
producer carries between batches (surplus groups, parked partial requests: ``rollout.carry``)
inside ``producer_state``, so a checkpoint keeps them too.

Writes are atomic (temporary file + fsync + rename, :mod:`megatron_rlhf.utils.atomic`): a crash
never leaves a half-written batch.

A batch is built for one algorithm: a pair per prompt (online_dpo), a group of K
(the policy-gradient losses, group_dpo) or the best completion (best_of_k_sft), with rewards shaped
for it. :func:`save_batch` records that as the document's ``algorithm`` tag
(:func:`algorithm_tag`: loss, K = samples_per_prompt, unit); a resumed run regenerates a pending
batch whose tag differs from its config instead of training it as the wrong kind
(``trainer.setup.load_pending``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

from megatron_rlhf.utils.atomic import atomic_open

__all__ = ["FORMAT_VERSION", "batch_to_dict", "batch_from_dict", "save_batch", "load_batch",
           "batch_path", "list_batches", "group_to_dict", "group_from_dict", "prompt_from_dict",
           "completion_from_dict", "algorithm_tag"]

FORMAT_VERSION = 1


def _plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, recursively (JSON-plain)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _tuples(obj: Any) -> Any:
    """Lists -> tuples, recursively (the random module's state and frozen dataclass fields)."""
    if isinstance(obj, list):
        return tuple(_tuples(x) for x in obj)
    return obj


def _build(cls, data: dict):
    """``cls(**data)`` keeping only the fields ``cls`` has (a file written by a newer version with
    extra fields still loads; missing fields take their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def batch_to_dict(batch) -> dict:
    """A ``RolloutBatch`` as a JSON-plain dict (``{"format": 1, "batch": {...}}``)."""
    return {"format": FORMAT_VERSION, "batch": _plain(batch)}


def batch_from_dict(doc: dict):
    """Inverse of :func:`batch_to_dict`.

    Raises:
        ValueError: not a batch document, or a format version this code cannot read.
    """
    from megatron_rlhf.types import RolloutBatch

    if not isinstance(doc, dict) or "batch" not in doc:
        raise ValueError("not a rollout-batch document (no 'batch' field)")
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"rollout-batch format {doc.get('format')!r}; this code reads format {FORMAT_VERSION}")
    b = dict(doc["batch"])
    b["groups"] = tuple(group_from_dict(g) for g in b["groups"])
    b["rng_state"] = _tuples(b.get("rng_state"))
    return _build(RolloutBatch, b)


def prompt_from_dict(d: dict):
    """A :class:`~megatron_rlhf.types.Prompt` from its JSON-plain dict (``_plain`` of one)."""
    from megatron_rlhf.types import Prompt

    return _build(Prompt, {**d, "token_ids": tuple(d["token_ids"])})


def completion_from_dict(d: dict):
    """A :class:`~megatron_rlhf.types.Completion` from its JSON-plain dict (token ids, sampling
    logprobs, finish reason, text, first and last weight version)."""
    from megatron_rlhf.types import Completion

    d = dict(d)
    for k in ("token_ids", "logprobs"):
        d[k] = tuple(d[k])
    return _build(Completion, d)


def group_to_dict(group) -> dict:
    """A :class:`~megatron_rlhf.types.RolloutGroup` (or any dataclass of prompts and completions,
    e.g. a parked partial group) as the JSON-plain dict this format stores."""
    return _plain(group)


def group_from_dict(g: dict):
    """Inverse of :func:`group_to_dict` for a :class:`~megatron_rlhf.types.RolloutGroup`."""
    from megatron_rlhf.types import Rollout, RolloutGroup

    rollouts = tuple(_build(Rollout, {**r, "prompt": prompt_from_dict(r["prompt"]),
                                      "completion": completion_from_dict(r["completion"])})
                     for r in g["rollouts"])
    return _build(RolloutGroup, {
        **g, "prompt": prompt_from_dict(g["prompt"]), "rollouts": rollouts,
        "pair": tuple(g["pair"]) if g.get("pair") is not None else None,
        "loss_rewards": tuple(g["loss_rewards"]) if g.get("loss_rewards") is not None else None})


def batch_path(folder: str | os.PathLike, index: int) -> Path:
    """``<folder>/batch_<index:06d>.json.gz``."""
    return Path(folder) / f"batch_{index:06d}.json.gz"


def algorithm_tag(algorithm_cfg) -> dict:
    """What a batch was built for: ``{"loss", "samples_per_prompt" (K), "unit"}`` (unit: ``pair``,
    ``group`` or ``best``, ``AlgorithmConfig.unit``)."""
    return {"loss": algorithm_cfg.loss, "samples_per_prompt": algorithm_cfg.samples_per_prompt,
            "unit": algorithm_cfg.unit}


def save_batch(batch, folder: str | os.PathLike, algorithm: dict | None = None) -> Path:
    """Write ``batch`` to :func:`batch_path` ``(folder, batch.index)`` atomically, tagged with the
    ``algorithm`` it was built for (:func:`algorithm_tag`); returns the path.

    Raises:
        AtomicWriteError: names the path and the cause (no temporary file is left).
    """
    path = batch_path(folder, batch.index)
    doc = {**batch_to_dict(batch), **({"algorithm": algorithm} if algorithm is not None else {})}
    with atomic_open(path, "wt", opener=gzip.open, encoding="utf-8") as f:
        json.dump(doc, f)
    return path


def load_batch(path: str | os.PathLike, *, with_algorithm: bool = False):
    """Read a batch written by :func:`save_batch`; with ``with_algorithm`` ``(batch, tag)``, the tag
    None for a file written before batches were tagged.

    Raises:
        ValueError: the file is not a readable rollout batch (names the path).
    """
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
        batch = batch_from_dict(doc)
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as e:   # EOFError: a cut file
        raise ValueError(f"{path}: not a readable rollout batch ({type(e).__name__}: {e})") from e
    return (batch, doc.get("algorithm")) if with_algorithm else batch


def list_batches(folder: str | os.PathLike) -> list[Path]:
    """The batch files of ``folder`` in index order (empty when the folder does not exist)."""
    folder = Path(folder)
    return sorted(folder.glob("batch_*.json.gz")) if folder.is_dir() else []
