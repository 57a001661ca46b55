"""Preference-pair datasets for reward-model training: (prompt, chosen, rejected) examples.

Formats (registered by name in :data:`PREFERENCE_FORMATS`; :func:`detect_preference_format`
picks one from a file's first record):

* ``hh_rlhf`` -- Anthropic HH-RLHF JSONL (Bai et al. 2022), fields ``chosen`` / ``rejected``, each a
  whole dialogue ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``; both share the dialogue up to the last
  ``Assistant:`` turn, which is the compared response. MIT.
* ``dove`` -- DOVE conditional preferences JSONL (Bansal et al. 2024), fields ``i_chosen``,
  ``r_chosen``, ``i_reject``, ``r_reject``; one prompt (``i_chosen == i_reject``), two responses. MIT.
* ``alpaca_eval`` -- AlpacaEval pairwise annotations (Dubois et al. 2023), a JSON array with
  ``instruction``, ``output_1``, ``output_2`` and ``preference`` (1: output_1 preferred, 2: output_2
  preferred, anything else: tie/identical, skipped). CC BY-NC 4.0: read it from ``../shared``,
  never copy it into the repository.

Malformed rows (broken JSON, missing/empty fields, prompts that differ between chosen and
rejected, identical responses) are skipped and counted; ties are counted apart.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.data.jsonrecords import read_json_records

__all__ = ["HALVES", "half_by_group", "PreferenceExample", "PREFERENCE_FORMATS", "detect_preference_format", "load_preferences",
           "find_preference_files", "load_preference_files", "split_by_group", "parse_hh_dialogue"]

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}


@dataclass(frozen=True)
class PreferenceExample:
    """One preference judgement: ``chosen`` is preferred over ``rejected`` as a reply to ``prompt``.

    Attributes:
        prompt: the conversation before the compared reply, as chat messages
            (``{"role", "content"}`` dicts, last one from the user), ready for a chat template.
        chosen: preferred assistant reply (text).
        rejected: dispreferred assistant reply (text).
        source: format/dataset name (``hh_rlhf``, ``dove``, ``alpaca_eval``).
        file: path of the file it came from.
        index: row index in that file (0-based; malformed rows keep their index).
        group: key grouping examples that share a prompt (the first user message); split data by
            it so no prompt is both in training and evaluation (AlpacaEval repeats each instruction
            across models).
    """

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str
    source: str
    file: str
    index: int
    group: str

    def as_tuple(self) -> tuple[list[Message], str, str]:
        """``(prompt messages, chosen, rejected)``."""
        return list(self.prompt), self.chosen, self.rejected


_TURN = re.compile(r"\n\n(Human|Assistant): ?")


def parse_hh_dialogue(text: str) -> list[Message] | None:
    """Split an HH-RLHF dialogue string into chat messages.

    Args:
        text: ``"\\n\\nHuman: q1\\n\\nAssistant: a1\\n\\nHuman: q2\\n\\nAssistant: a2"``.
    Returns:
        ``[{"role": "user", "content": "q1"}, {"role": "assistant", ...}, ...]`` with contents
        stripped, or ``None`` when the text does not start with a Human turn, roles do not
        alternate, or it does not end with an Assistant turn.
    Source: HH-RLHF data format, github.com/anthropics/hh-rlhf README.
    """
    if not isinstance(text, str):
        return None
    parts = _TURN.split(text)
    # parts = [prefix, role1, content1, role2, content2, ...]
    if len(parts) < 5 or parts[0].strip():
        return None
    msgs = []
    for i in range(1, len(parts), 2):
        role = "user" if parts[i] == "Human" else "assistant"
        if msgs and msgs[-1]["role"] == role:
            return None
        msgs.append({"role": role, "content": parts[i + 1].strip()})
    if msgs[0]["role"] != "user" or msgs[-1]["role"] != "assistant":
        return None
    return msgs


def _nonempty_str(x) -> bool:
    return isinstance(x, str) and bool(x.strip())


def _hh_rlhf(rec: dict) -> tuple[list[Message], str, str] | str:
    c, r = parse_hh_dialogue(rec.get("chosen")), parse_hh_dialogue(rec.get("rejected"))
    if c is None or r is None:
        return "malformed"
    if c[:-1] != r[:-1]:
        return "malformed"  # the two dialogues must share everything but the last reply
    if not c[-1]["content"] or not r[-1]["content"] or c[-1]["content"] == r[-1]["content"]:
        return "malformed"
    return c[:-1], c[-1]["content"], r[-1]["content"]


def _dove(rec: dict) -> tuple[list[Message], str, str] | str:
    ic, ir, rc, rr = (rec.get(k) for k in ("i_chosen", "i_reject", "r_chosen", "r_reject"))
    if not all(_nonempty_str(x) for x in (ic, ir, rc, rr)) or ic.strip() != ir.strip():
        return "malformed"
    if rc.strip() == rr.strip():
        return "malformed"
    return [{"role": "user", "content": ic.strip()}], rc.strip(), rr.strip()


def _alpaca_eval(rec: dict) -> tuple[list[Message], str, str] | str:
    ins, o1, o2, pref = (rec.get(k) for k in ("instruction", "output_1", "output_2", "preference"))
    if not all(_nonempty_str(x) for x in (ins, o1, o2)):
        return "malformed"
    if isinstance(pref, bool) or not isinstance(pref, (int, float)):
        return "malformed"
    if o1.strip() == o2.strip() or pref not in (1, 2):
        return "tie"  # preference 0 = identical outputs; 1.5 = tie (alpaca_eval pairwise_evaluator)
    chosen, rejected = (o1, o2) if pref == 1 else (o2, o1)
    return [{"role": "user", "content": ins.strip()}], chosen.strip(), rejected.strip()


PREFERENCE_FORMATS: dict[str, Callable[[dict], tuple[list[Message], str, str] | str]] = {
    "hh_rlhf": _hh_rlhf,
    "dove": _dove,
    "alpaca_eval": _alpaca_eval,
}
"""Format name -> row parser returning ``(prompt, chosen, rejected)`` or ``"malformed"``/``"tie"``."""

_SIGNATURES = {"hh_rlhf": {"chosen", "rejected"}, "dove": {"i_chosen", "r_chosen", "r_reject"},
               "alpaca_eval": {"instruction", "output_1", "output_2", "preference"}}


def detect_preference_format(records: list[dict | None], path: str = "") -> str:
    """Name the format from the keys of the first well-formed record.

    Raises:
        ValueError: no record carries the keys of a known format (the message lists them).
    """
    for rec in records:
        if rec is None:
            continue
        keys = {k for k, v in rec.items() if v is not None}
        for name, sig in _SIGNATURES.items():
            if sig <= keys:
                return name
        break
    raise ValueError(f"{path or 'preference file'}: unknown preference format; expected the keys of "
                     f"one of {{{', '.join(f'{n}: {sorted(s)}' for n, s in _SIGNATURES.items())}}}")


def load_preferences(path: str | Path, fmt: str = "auto", limit: int = 0
                     ) -> tuple[list[PreferenceExample], dict[str, int]]:
    """Load one preference file.

    Args:
        path: JSONL or JSON-array file.
        fmt: a key of :data:`PREFERENCE_FORMATS` or ``"auto"`` (detect from the first record).
        limit: read at most this many rows (0 = all).
    Returns:
        ``(examples, counts)`` with counts ``{"rows", "malformed", "ties", "kept"}``
        (``rows = malformed + ties + kept``).
    Raises:
        ValueError: missing file, unknown ``fmt``, or a file whose format cannot be detected.
    """
    records, _ = read_json_records(path)
    if limit:
        records = records[:limit]
    if fmt == "auto":
        fmt = detect_preference_format(records, str(path))
    if fmt not in PREFERENCE_FORMATS:
        raise ValueError(f"preference format {fmt!r}: expected 'auto' or one of {sorted(PREFERENCE_FORMATS)}")
    parse = PREFERENCE_FORMATS[fmt]
    counts = {"rows": len(records), "malformed": 0, "ties": 0, "kept": 0}
    out = []
    for i, rec in enumerate(records):
        res = "malformed" if rec is None else parse(rec)
        if isinstance(res, str):
            counts["ties" if res == "tie" else "malformed"] += 1
            continue
        prompt, chosen, rejected = res
        first_user = next(m["content"] for m in prompt if m["role"] == "user")
        out.append(PreferenceExample(prompt=tuple(prompt), chosen=chosen, rejected=rejected, source=fmt,
                                     file=str(path), index=i, group=first_user))
        counts["kept"] += 1
    return out, counts


def find_preference_files(root: str | Path) -> list[Path]:
    """All ``*.json`` / ``*.jsonl`` data files under ``root`` (a file is returned as is), sorted.

    Raises:
        ValueError: ``root`` does not exist or holds no data file.
    """
    root = Path(root).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"preference data {str(root)!r} not found: give a file or a folder of "
                         "JSON/JSONL preference files (e.g. ../shared/data/preferences)")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
    if not files:
        raise ValueError(f"preference data folder {str(root)!r} holds no .json/.jsonl file")
    return files


def load_preference_files(paths: list[str | Path]) -> tuple[list[PreferenceExample], dict[str, dict]]:
    """Load many files/folders (formats detected per file).

    Returns:
        ``(examples, counts_per_file)``: examples in path order; counts keyed by file path, plus a
        ``"total"`` entry summing them.
    Raises:
        ValueError: as :func:`find_preference_files` / :func:`load_preferences`.
    """
    out: list[PreferenceExample] = []
    counts: dict[str, dict] = {}
    for root in paths:
        for f in find_preference_files(root):
            ex, c = load_preferences(f)
            out += ex
            counts[str(f)] = c
    counts["total"] = {k: sum(c[k] for c in counts.values()) for k in ("rows", "malformed", "ties", "kept")}
    return out, counts


def split_by_group(examples: list[PreferenceExample], num_eval: int, seed: int
                   ) -> tuple[list[PreferenceExample], list[PreferenceExample]]:
    """Seeded train/eval split that never puts one prompt group on both sides.

    Groups are shuffled with ``random.Random(seed)`` and moved to the eval side until it holds at
    least ``num_eval`` examples; everything else is training data, in shuffled group order.

    Args:
        examples: the pool.
        num_eval: minimum number of evaluation examples.
        seed: shuffle seed.
    Returns:
        ``(train, eval)``.
    Raises:
        ValueError: ``num_eval`` is negative or exceeds ``len(examples)``.
    """
    if not 0 <= num_eval <= len(examples):
        raise ValueError(f"num_eval={num_eval}: must be between 0 and the {len(examples)} examples available")
    groups: dict[str, list[PreferenceExample]] = {}
    for ex in examples:
        groups.setdefault(ex.group, []).append(ex)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    train, ev = [], []
    for k in keys:
        (ev if len(ev) < num_eval else train).extend(groups[k])
    return train, ev


HALVES = ("a", "b")
"""Names of the two disjoint halves of a training side (:func:`half_by_group`)."""


def half_by_group(examples: list[PreferenceExample], half: str, seed: int) -> list[PreferenceExample]:
    """One of two halves of ``examples`` that share no prompt group, for a proxy/gold pair of
    reward models (train one on half ``a``, the other on half ``b``).

    Groups are sorted by name, shuffled with ``random.Random(seed + 1)`` (another order than
    :func:`split_by_group`'s) and dealt alternately: the 1st, 3rd, ... go to ``a``, the 2nd, 4th, ... to
    ``b``; so the halves hold the same number of groups (``a`` one more when odd) and about the same
    number of pairs, each source split at random. Examples keep their order.

    Args:
        examples: the training side (:func:`split_by_group`'s first result).
        half: ``"a"`` or ``"b"``.
        seed: the split seed (the same as the train/eval split's).
    Returns:
        The examples of that half.
    Raises:
        ValueError: ``half`` is not ``"a"`` or ``"b"``.
    """
    if half not in HALVES:
        raise ValueError(f"half={half!r}: expected 'a' or 'b' (two disjoint halves of the training pairs)")
    keys = sorted({ex.group for ex in examples})
    random.Random(seed + 1).shuffle(keys)
    keep = set(keys[HALVES.index(half)::2])
    return [ex for ex in examples if ex.group in keep]
