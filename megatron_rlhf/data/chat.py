"""Chat (non-verifiable) prompt datasets: MT-Bench, HH-RLHF helpful (DOVE), AlpacaEval, any JSONL.

Produces the same :class:`megatron_rlhf.types.Prompt` objects as the math loaders
(``megatron_rlhf.data.prompts``) with ``answer=""``: a chat task is scored by a reward model, not
against a gold answer. Formats are registered by name in :data:`CHAT_FORMATS`;
:func:`detect_chat_format` picks one from the first record:

* ``mt_bench`` -- FastChat MT-Bench ``question.jsonl`` (Zheng et al. 2023): the first of the two
  ``turns`` (the follow-up turn needs the model's own first answer, so it is not a standalone prompt).
  Apache-2.0; a copy ships in ``data/chat/mt_bench/``.
* ``instruction`` -- a record with an ``instruction`` string: DOVE's HH-RLHF helpful ``test.jsonl``
  (MIT, copy in ``data/chat/hh_helpful_dove/``) and AlpacaEval ``model_outputs.json`` (Dubois et al.
  2023; data CC BY-NC 4.0: read it from ``../shared/data/chat/alpaca_eval``, never copied here).
* ``field`` -- any JSONL/JSON file, the prompt read from ``prompt_field``.

Rows that are broken JSON, lack the prompt, or hold an empty/non-string prompt are skipped and
counted as ``malformed``; prompts longer than ``max_prompt_tokens`` after the chat template are
skipped and counted as ``too_long``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rlhf.data.jsonrecords import read_json_records, resolve_data_path
from megatron_rlhf.data.registry import DATASETS, DatasetSpec, register_dataset
from megatron_rlhf.types import Prompt

__all__ = ["CHAT_FORMATS", "CHAT_DATASETS", "detect_chat_format", "chat_prompt_token_ids",
           "load_chat_prompts", "load_chat_task_prompts"]

CHAT_DATASETS = (
    DatasetSpec(name="mt_bench", path="data/chat/mt_bench/question.jsonl", prompt_field="turns",
                answer_field="", reward="reward_model", licence="Apache-2.0 (lm-sys/FastChat)"),
    DatasetSpec(name="hh_helpful", path="data/chat/hh_helpful_dove/test.jsonl", prompt_field="instruction",
                answer_field="", reward="reward_model", licence="MIT (Hritikbansal/dove; HH-RLHF MIT, Anthropic)"),
    DatasetSpec(name="alpaca_eval", path="../shared/data/chat/alpaca_eval/gpt4_1106_preview/model_outputs.json",
                prompt_field="instruction", answer_field="", reward="reward_model",
                licence="CC BY-NC 4.0 data (tatsu-lab/alpaca_eval): read from ../shared, never copied"),
)
"""Chat prompt sets, added to the shared registry ``megatron_rlhf.data.registry.DATASETS`` when this
module is imported (static data, like the math sets there); load them with :func:`load_chat_prompts`
/ :func:`load_chat_task_prompts`, not ``load_task_prompts`` (no gold answer)."""
for _spec in CHAT_DATASETS:
    if _spec.name not in DATASETS:
        register_dataset(_spec)


def _mt_bench(rec: dict, prompt_field: str) -> Any:
    turns = rec.get("turns")
    return turns[0] if isinstance(turns, (list, tuple)) and turns else None


def _instruction(rec: dict, prompt_field: str) -> Any:
    return rec.get("instruction")


def _field(rec: dict, prompt_field: str) -> Any:
    return rec.get(prompt_field)


CHAT_FORMATS: dict[str, Callable[[dict, str], Any]] = {
    "mt_bench": _mt_bench,
    "instruction": _instruction,
    "field": _field,
}
"""Format name -> ``extract(record, prompt_field)`` returning the user prompt (validated by the caller)."""


def detect_chat_format(records: list[dict | None]) -> str:
    """``mt_bench`` if the first well-formed record has ``turns``, ``instruction`` if it has an
    ``instruction`` key, else ``field``."""
    for rec in records:
        if rec is None:
            continue
        if rec.get("turns") is not None:
            return "mt_bench"
        if rec.get("instruction") is not None:
            return "instruction"
        return "field"
    return "field"


def chat_prompt_token_ids(tokenizer, text: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt with the generation prompt, via the tokenizer's template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        text: the user message.
        system_prompt: optional system message (``None``: the template's default, e.g. SmolLM2's).
    Returns:
        ``[prompt_len]`` token ids, ending with the assistant header (``add_generation_prompt=True``).
        The template text is tokenised with ``add_special_tokens=False`` so no second BOS is added.
    Raises:
        ValueError: the tokenizer has no chat template.
    Source: transformers ``PreTrainedTokenizerBase.apply_chat_template`` docs.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template: use a chat/instruct model or set "
                         "tokenizer.chat_template")
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
    msgs.append({"role": "user", "content": text})
    s = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(s, add_special_tokens=False)["input_ids"])


def load_chat_prompts(path: str | Path, *, task: str, tokenizer, max_prompt_tokens: int,
                      fmt: str = "auto", prompt_field: str = "instruction", instruction: str = "",
                      system_prompt: str | None = None, filter: dict[str, list] | None = None,
                      limit: int = 0) -> tuple[list[Prompt], dict[str, int]]:
    """Load a chat prompt file into tokenised :class:`Prompt` objects (``answer=""``).

    Args:
        path: JSONL/JSON file; a relative path resolves against the repo root, then the CWD.
        task: task name stored in each prompt.
        tokenizer: Hugging Face tokenizer with a chat template (the policy's).
        max_prompt_tokens: prompts with more template-applied tokens are skipped (``too_long``).
        fmt: ``"auto"`` or a key of :data:`CHAT_FORMATS`.
        prompt_field: the prompt's field for the ``field`` format.
        instruction: appended to the prompt after a blank line when non-empty.
        system_prompt: optional system message (``None``: the template's default).
        filter: keep only rows whose ``row[field]`` is in the list, e.g. ``{"category": ["writing"]}``.
        limit: stop reading once this many prompts are kept (0 = all), like ``load_task_prompts``.
    Returns:
        ``(prompts, counts)``; ``prompts[i].index`` is the row index in the file; counts are
        ``{"rows", "filtered", "malformed", "too_long", "kept"}`` over the rows read, with
        ``rows = filtered + malformed + too_long + kept`` (same keys as ``load_task_prompts``).
    Raises:
        ValueError: the file is missing, ``fmt`` is unknown, or no prompt is left (the message
            names ``data.path`` and the counts).
    """
    key = f"tasks[{task}].data.path"
    p = resolve_data_path(path, key=key)
    try:
        records, _ = read_json_records(p)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from e
    if fmt == "auto":
        fmt = detect_chat_format(records)
    if fmt not in CHAT_FORMATS:
        raise ValueError(f"chat format {fmt!r}: expected 'auto' or one of {sorted(CHAT_FORMATS)}")
    extract = CHAT_FORMATS[fmt]
    counts = {"rows": 0, "filtered": 0, "malformed": 0, "too_long": 0, "kept": 0}
    prompts: list[Prompt] = []
    for i, rec in enumerate(records):
        if limit and counts["kept"] >= limit:
            break
        counts["rows"] += 1
        if rec is None:
            counts["malformed"] += 1
            continue
        if filter and any(rec.get(k) not in set(v) for k, v in filter.items()):
            counts["filtered"] += 1
            continue
        text = extract(rec, prompt_field)
        if not isinstance(text, str) or not text.strip():
            counts["malformed"] += 1
            continue
        text = text.strip() + (f"\n\n{instruction}" if instruction else "")
        ids = chat_prompt_token_ids(tokenizer, text, system_prompt)
        if len(ids) > max_prompt_tokens:
            counts["too_long"] += 1
            continue
        prompts.append(Prompt(index=i, task=task, token_ids=tuple(ids), answer="", text=text))
        counts["kept"] += 1
    if not prompts:
        raise ValueError(f"tasks[{task}].data.path={str(path)!r} (format {fmt}) yielded no prompt: "
                         f"counts {counts}; check the file, data.filter, and max_prompt_tokens")
    return prompts, counts


def load_chat_task_prompts(task_cfg, tokenizer, max_prompt_tokens: int) -> tuple[list[Prompt], dict]:
    """:func:`load_chat_prompts` driven by a ``TaskConfig`` (same call shape as
    ``megatron_rlhf.data.prompts.load_task_prompts``).

    Uses ``task_cfg.name``, ``task_cfg.instruction`` and ``task_cfg.data.{path, prompt_field,
    filter, limit}``; the format is detected from the file. Raises as :func:`load_chat_prompts`.
    """
    d = task_cfg.data
    return load_chat_prompts(d.path, task=task_cfg.name, tokenizer=tokenizer,
                             max_prompt_tokens=max_prompt_tokens, prompt_field=d.prompt_field,
                             instruction=task_cfg.instruction, filter=d.filter or None, limit=d.limit)
