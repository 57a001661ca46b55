"""Prompt datasets: JSONL rows -> chat-templated, tokenised :class:`~megatron_rlhf.types.Prompt` s.

Formats are registered by name in :data:`DATASETS` (``mawps``, ``svamp``, ``gsm8k``,
``gsm8k_dev``, the generated ``arithmetic_mul1`` / ``arithmetic_add2`` and their ``_eval`` splits); :func:`dataset_config` turns a name into a :class:`DataConfig`, and
:func:`register_dataset` adds one. A task's ``data`` section may also give the fields directly::

    tasks:
      - name: mawps
        data: {path: data/math_word_problems/mawps.jsonl, prompt_field: input,
               answer_field: target, filter: {type: [singleop, addsub]}}

Rules (see :func:`load_task_prompts`): rows are read with ``datasets.load_dataset("json")``
(``data.jsonrecords.read_json_records`` falls back to ``json.loads`` per line when the file has
broken lines or mixed types, so one bad row never loses the file); malformed rows are skipped and
counted; prompts longer than ``max_prompt_tokens`` are filtered and counted.

Sources: Hugging Face ``datasets`` docs, "Load -> JSON";
transformers docs, "Chat templates" (``apply_chat_template(..., add_generation_prompt=True)``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from megatron_rlhf.config import DataConfig, TaskConfig
from megatron_rlhf.data.arithmetic import FILES as ARITHMETIC_FILES
from megatron_rlhf.data.jsonrecords import read_json_records
from megatron_rlhf.data.jsonrecords import resolve_data_path as _resolve
from megatron_rlhf.data.registry import DATASETS, DatasetSpec, register_dataset
from megatron_rlhf.types import Prompt

__all__ = ["DatasetSpec", "DATASETS", "register_dataset", "dataset_config", "resolve_data_path",
           "load_task_prompts", "load_prompts_for_task", "skipped_rows_text", "PromptSampler"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ registry
# DatasetSpec, DATASETS and register_dataset live in data/registry.py (data/chat.py registers there too)
for _spec in (
    DatasetSpec(name="mawps", path="data/math_word_problems/mawps.jsonl", prompt_field="input",
                answer_field="target", licence="MIT (Qwen2.5-Math evaluation data)"),
    DatasetSpec(name="mawps_easy", path="data/math_word_problems/mawps.jsonl", prompt_field="input",
                answer_field="target", filter={"type": ["singleop", "addsub"]},
                licence="MIT (Qwen2.5-Math evaluation data)"),
    DatasetSpec(name="svamp", path="data/math_word_problems/svamp.jsonl",
                prompt_field="Body+Question", answer_field="Answer",
                licence="MIT (Qwen2.5-Math evaluation data)"),
    DatasetSpec(name="gsm8k", path="data/gsm8k/train.jsonl", prompt_field="question",
                answer_field="answer", licence="MIT (OpenAI)"),
    DatasetSpec(name="gsm8k_dev", path="data/gsm8k/dev.jsonl", prompt_field="question",
                answer_field="answer", licence="MIT (OpenAI)"),
    *(DatasetSpec(name=f"arithmetic_{kind}" + ("_eval" if split == "eval" else ""), path=path,
                  prompt_field="input", answer_field="target",
                  licence="generated (megatron_rlhf.data.arithmetic, seed 0)")
      for (kind, split), path in ARITHMETIC_FILES.items()),
):
    register_dataset(_spec)


def dataset_config(name: str, **overrides: Any) -> DataConfig:
    """The :class:`DataConfig` of registered dataset ``name`` (``overrides`` replace fields,
    e.g. ``limit=100``).

    Raises:
        KeyError: ``name`` is not registered (the message lists the names).
    """
    if name not in DATASETS:
        raise KeyError(f"dataset {name!r} is not registered; known: {sorted(DATASETS)}")
    s = DATASETS[name]
    kw = dict(path=s.path, prompt_field=s.prompt_field, answer_field=s.answer_field,
              filter={k: list(v) for k, v in s.filter.items()})
    kw.update(overrides)
    return DataConfig(**kw)


def resolve_data_path(path: str, key: str = "tasks[].data.path") -> Path:
    """Absolute path of a task's data file: ``~`` expanded; a relative path is looked up under the
    repo root first, then the current directory (``data.jsonrecords.resolve_data_path``).

    Raises:
        ValueError: no such file (names ``tasks[].data.path`` and where it looked).
    """
    return _resolve(path, key=key)


# ------------------------------------------------------------------------------ loading
def load_task_prompts(task_cfg: TaskConfig, tokenizer, max_prompt_tokens: int) -> tuple[list[Prompt], dict]:
    """Read a task's JSONL file and build its prompts.

    Per row, in file order: skip blank lines; a row that is not a JSON object, lacks a prompt
    field (each part of ``Body+Question``) as a non-empty string, or lacks a usable answer is
    *malformed* (skipped, counted); rows failing ``data.filter`` are *filtered*; the problem text
    gets ``"\\n\\n" + task_cfg.instruction`` appended, becomes the single user message of the
    tokenizer's chat template (``add_generation_prompt=True``) and is tokenised; prompts with more
    than ``max_prompt_tokens`` tokens are *too_long*. Reading stops once ``data.limit`` prompts
    (if > 0) are kept.

    Gold answers: strings are stripped and, when they contain ``####`` (GSM8K solutions), cut to
    the text after the last ``####``; integral floats are written without the fraction
    (``43.0`` -> ``"43"``), other numbers with ``repr``.

    Args:
        task_cfg: the task (``name``, ``data`` with ``path``, ``prompt_field``, ``answer_field``,
            ``filter``, ``limit``; ``instruction``).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_tokens: longest prompt kept, in tokens (e.g. ``max_model_len - max_new_tokens``).
    Returns:
        ``(prompts, counts)``: prompts with ``index`` = 0-based row number among the file's
        non-blank lines, ``task = task_cfg.name``, ``token_ids``, ``answer``, ``text`` (problem +
        instruction), ``group`` (the row's ``product`` field, else ``""``); counts ``{'rows', 'malformed', 'filtered', 'too_long', 'kept'}`` over the
        rows read (``rows`` = the sum of the other four).
    Raises:
        ValueError: the file is missing, the tokenizer has no chat template,
            ``max_prompt_tokens < 1``, or no prompt is left (message names ``tasks[].data.path``
            and the counts).
    """
    data = task_cfg.data
    if max_prompt_tokens < 1:
        raise ValueError(f"load_task_prompts(max_prompt_tokens={max_prompt_tokens}): must be >= 1 "
                         "(generators.max_model_len - generators.max_new_tokens)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task {task_cfg.name!r}: the tokenizer has no chat_template; use an "
                         "instruct/chat model folder (tokenizer_config.json with chat_template)")
    key = f"tasks[{task_cfg.name}].data.path"
    path = resolve_data_path(data.path, key=key)
    parts = [p.strip() for p in data.prompt_field.split("+")]
    counts = {"rows": 0, "malformed": 0, "filtered": 0, "too_long": 0, "kept": 0}
    prompts: list[Prompt] = []
    batch: list[tuple[int, str, str, str]] = []

    def flush() -> None:
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                  add_generation_prompt=True) for _, t, _, _ in batch]
        ids_list = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for j, ((idx, text, ans, group), ids) in enumerate(zip(batch, ids_list)):
            if data.limit and counts["kept"] >= data.limit:
                counts["rows"] -= len(batch) - j  # past the limit: not read
                break
            if len(ids) > max_prompt_tokens:
                counts["too_long"] += 1
                continue
            counts["kept"] += 1
            prompts.append(Prompt(index=idx, task=task_cfg.name, token_ids=tuple(int(t) for t in ids),
                                  answer=ans, text=text, group=group))
        batch.clear()

    for idx, row in _read_rows(path, key):
        if data.limit and counts["kept"] >= data.limit:
            break
        counts["rows"] += 1
        problem = _problem_text(row, parts)
        answer = _gold_answer(row.get(data.answer_field)) if isinstance(row, dict) else None
        if problem is None or answer is None:
            counts["malformed"] += 1
            continue
        if any(row.get(k) not in allowed for k, allowed in data.filter.items()):
            counts["filtered"] += 1
            continue
        text = f"{problem}\n\n{task_cfg.instruction}" if task_cfg.instruction else problem
        group = row.get("product")   # the arithmetic datasets' unordered problem: the eval's cluster
        batch.append((idx, text, answer, "" if group is None else str(group)))
        if len(batch) >= 256:
            flush()
    if batch:
        flush()
    if not prompts:
        raise ValueError(f"tasks[{task_cfg.name}].data.path = {data.path!r} yields no prompt "
                         f"(counts {counts}); check prompt_field={data.prompt_field!r}, "
                         f"answer_field={data.answer_field!r}, filter={data.filter!r} and "
                         f"max_prompt_tokens={max_prompt_tokens}")
    return prompts, counts


def load_prompts_for_task(task_cfg: TaskConfig, tokenizer, max_prompt_tokens: int) -> tuple[list[Prompt], dict]:
    """A task's prompts, loaded by the loader its reward kind needs (``TaskConfig.kind``).

    * ``reward_model`` tasks: chat prompts with no gold answer (``answer=""``), read by
      ``megatron_rlhf.data.chat.load_chat_task_prompts`` (MT-Bench ``turns``, ``instruction``
      records or ``data.prompt_field``); ``task_cfg.instruction`` defaults to none for them.
    * ``math_verify`` and ``plugin`` tasks: :func:`load_task_prompts` (problem + gold answer).

    Args:
        task_cfg: the task.
        tokenizer: the policy's Hugging Face tokenizer (with a chat template).
        max_prompt_tokens: longest prompt kept, in tokens (``max_model_len - max_new_tokens``).
    Returns:
        ``(prompts, counts)`` with counts ``{'rows', 'malformed', 'filtered', 'too_long', 'kept'}``
        (both loaders use the same keys).
    Raises:
        ValueError: as the chosen loader (missing file, no chat template, no prompt left; the
            message names ``tasks[...].data.path``).
    """
    if task_cfg.kind == "reward_model":
        from megatron_rlhf.data.chat import load_chat_task_prompts

        if max_prompt_tokens < 1:
            raise ValueError(f"load_prompts_for_task(max_prompt_tokens={max_prompt_tokens}): must be >= 1 "
                             "(generators.max_model_len - generators.max_new_tokens)")
        return load_chat_task_prompts(task_cfg, tokenizer, max_prompt_tokens)
    return load_task_prompts(task_cfg, tokenizer, max_prompt_tokens)


def skipped_rows_text(counts: dict) -> str:
    """The nonzero skip counts of :func:`load_prompts_for_task`, for a run's start line.

    Args:
        counts: ``{'rows', 'malformed', 'filtered', 'too_long', 'kept'}`` (``malformed``: no prompt
            or answer, or not a JSON object; ``filtered``: ``data.filter``; ``too_long``: over the
            prompt budget).
    Returns:
        ``" (skipped: 1 malformed, 2 too long)"``, or ``""`` when nothing was skipped.
    """
    parts = [f"{counts[k]} {label}" for k, label in (("malformed", "malformed"), ("filtered", "filtered out"),
                                                     ("too_long", "too long")) if counts.get(k)]
    return f" (skipped: {', '.join(parts)})" if parts else ""


def _read_rows(path: Path, key: str = "tasks[].data.path"):
    """Yield ``(index, row)`` for each non-blank line: ``row`` is the parsed JSON object, or
    ``None`` when the line is not valid JSON / not an object (``data.jsonrecords``: Arrow via
    ``datasets.load_dataset("json")``, line-by-line ``json.loads`` when Arrow refuses the file)."""
    import datasets

    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a refused file logs an error
    try:
        records, _ = read_json_records(path)
    except ValueError as e:   # empty or unreadable file: name the config key
        raise ValueError(f"{key}: {e}") from e
    finally:
        datasets.logging.set_verbosity(level)
    yield from enumerate(records)


def _problem_text(row: Any, parts: list[str]) -> str | None:
    if not isinstance(row, dict):
        return None
    texts = []
    for k in parts:
        v = row.get(k)
        if not isinstance(v, str) or not v.strip():
            return None
        texts.append(v.strip())
    return " ".join(texts)


def _gold_answer(v: Any) -> str | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, str):
        s = v.rsplit("####", 1)[-1].strip()
        return s or None
    return None


# ------------------------------------------------------------------------------ sampling
class PromptSampler:
    """Seeded epoch-based sampling without replacement over a fixed list of prompts.

    Epoch ``e`` visits every prompt once in the order ``random.Random(f"{seed}:{e}").shuffle``;
    a call that crosses the end of an epoch continues in the next, reshuffled, epoch. The position
    (epoch, offset) is the whole state, so a resumed run draws exactly what the first run would
    have drawn next.

    Args:
        prompts: the prompts (at least one).
        seed: sampling seed.
    Raises:
        ValueError: ``prompts`` is empty.
    """

    def __init__(self, prompts: list[Prompt], seed: int):
        if not prompts:
            raise ValueError("PromptSampler: no prompts given (check tasks[].data)")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (``k >= 0``; may span several epochs).

        Raises:
            ValueError: ``k < 0``.
        """
        if k < 0:
            raise ValueError(f"PromptSampler.next(k={k}): k must be >= 0")
        out = []
        while len(out) < k:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), len(self._order) - self.offset)
            out.extend(self.prompts[i] for i in self._order[self.offset:self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict:
        """``{'seed', 'epoch', 'offset', 'num_prompts'}`` (plain ints; JSON/torch.save-able)."""
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset,
                "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the position of ``state`` (from :meth:`state_dict`).

        Raises:
            ValueError: ``state`` misses a key, or was saved with a different number of prompts
                or seed (the data or ``run.seed`` changed: the position would mean other prompts).
        """
        missing = {"seed", "epoch", "offset", "num_prompts"} - set(state)
        if missing:
            raise ValueError(f"PromptSampler.load_state_dict: missing keys {sorted(missing)}")
        if int(state["num_prompts"]) != len(self.prompts) or int(state["seed"]) != self.seed:
            raise ValueError(f"PromptSampler.load_state_dict: saved with num_prompts="
                             f"{state['num_prompts']}, seed={state['seed']}, but this sampler has "
                             f"num_prompts={len(self.prompts)}, seed={self.seed}; resume with the "
                             "same tasks[].data and run.seed")
        if not 0 <= int(state["offset"]) <= len(self.prompts) or int(state["epoch"]) < 0:
            raise ValueError(f"PromptSampler.load_state_dict: bad position {state}")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._permutation(self.epoch)
