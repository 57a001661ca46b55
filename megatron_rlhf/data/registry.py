"""The registry of prompt datasets known by name (``tasks[].data: NAME``): :class:`DatasetSpec`,
:data:`DATASETS` and :func:`register_dataset`. The math sets register in ``data/prompts.py``, the
chat sets in ``data/chat.py``; both import this module, which imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DatasetSpec", "DATASETS", "register_dataset"]


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A prompt dataset known by name: where it lives and which fields hold problem and answer.

    Attributes:
        name: registry key.
        path: JSONL path (relative paths resolve against the repo root, then the CWD).
        prompt_field: field with the problem text, or fields joined with ``+`` (``Body+Question``).
        answer_field: field with the gold answer; text after the last ``####`` is used if present.
        filter: default row filter ``{field: [allowed values]}``.
        reward: the reward function name the dataset is meant for.
        licence: licence of the data file.
    """

    name: str
    path: str
    prompt_field: str
    answer_field: str
    filter: dict[str, list[Any]] = field(default_factory=dict)
    reward: str = "math_verify"
    licence: str = ""


DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(spec: DatasetSpec, *, overwrite: bool = False) -> DatasetSpec:
    """Add ``spec`` to :data:`DATASETS`.

    Raises:
        ValueError: the name is taken and ``overwrite`` is False.
    """
    if spec.name in DATASETS and not overwrite:
        raise ValueError(f"dataset {spec.name!r} is already registered; pass overwrite=True to replace it")
    DATASETS[spec.name] = spec
    return spec
