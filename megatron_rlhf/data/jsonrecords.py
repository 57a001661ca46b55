"""Tolerant reading of JSON Lines / JSON-array data files into plain dict records.

Datasets here come as JSONL (one object per line: MT-Bench, HH-RLHF, dove) or as one JSON array
(AlpacaEval ``model_outputs.json`` / ``annotations.json``). Both are read with Hugging Face
``datasets`` (``load_dataset("json", ...)``, Arrow-backed, cached). Arrow refuses a whole file when a
single line is broken JSON or a field changes type between rows; in that case JSONL files are
re-read line by line with the standard ``json`` module so that the bad lines are skipped and counted
instead of failing the run. Arrow replaces invalid UTF-8 bytes silently, so a file that is not valid
UTF-8 skips Arrow and takes the line-by-line path, where such lines count as malformed (plan.md: "Malformed data rows are skipped and counted, never crash").
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json_records", "resolve_data_path"]


def resolve_data_path(path: str | Path, *, key: str = "data.path") -> Path:
    """Resolve a data file path: absolute as is; relative against the repo root, then the CWD.

    Args:
        path: file path (``~`` expanded).
        key: config key named in the error message.
    Returns:
        The existing file's path.
    Raises:
        ValueError: the file exists in neither place, or the path is a directory (the message
            names ``key`` and both tries).
    """
    p = Path(path).expanduser()
    repo = Path(__file__).resolve().parents[2]
    tries = [p] if p.is_absolute() else [repo / p, Path.cwd() / p]
    for t in tries:
        if t.is_file():
            return t if p.is_absolute() else t.resolve()
    folders = [t for t in tries if t.is_dir()]
    if folders:
        raise ValueError(f"{key}={str(path)!r}: {folders[0]} is a directory; give one JSON/JSONL file in it "
                         "(a task reads one file; several files are several tasks)")
    if p.is_absolute():
        raise ValueError(f"{key}={str(path)!r}: file not found; give an existing JSON/JSONL file")
    raise ValueError(f"{key}={str(path)!r}: file not found under the repo root ({repo}) or the "
                     f"working directory ({Path.cwd()}); give an existing JSON/JSONL file")


def read_json_records(path: str | Path) -> tuple[list[dict | None], int]:
    """Read every record of a JSONL or JSON-array file, in file order.

    Args:
        path: a ``.jsonl`` file (one JSON object per line; blank lines ignored) or a ``.json`` file
            holding one array of objects.
    Returns:
        ``(records, num_bad)``: one entry per non-blank line (JSONL) or array element (JSON), the
        parsed ``dict`` or ``None`` where the line is not valid UTF-8, not valid JSON or not an
        object (so row indices stay aligned with the file); ``num_bad`` counts the ``None``
        entries. Text is never altered (no replacement characters).
        Missing keys in a row read through Arrow come back as ``None`` values.
    Raises:
        ValueError: the file is missing, or a ``.json`` file is not a valid JSON array of objects
            (or holds invalid UTF-8: the message gives the line number).
    Source: ``datasets.load_dataset("json", data_files=...)`` (Hugging Face datasets docs, "Load
        JSON"); fallback: ``json.loads`` per line.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} not found")
    raw = p.read_bytes()
    bad_utf8 = _first_invalid_utf8(raw)
    arrow_error: Exception | None = None
    if bad_utf8 is None:  # Arrow would silently replace invalid UTF-8 bytes: never give it such a file
        try:
            import datasets

            ds = datasets.load_dataset("json", data_files=str(p), split="train")
            return [dict(r) for r in ds], 0
        except Exception as err:  # Arrow: broken line, mixed types, array with non-objects, ...
            arrow_error = err
    if raw.lstrip().startswith(b"["):
        if bad_utf8 is not None:
            raise ValueError(f"data file {str(p)!r}: line {bad_utf8} is not valid UTF-8; a JSON array "
                             "file is read whole, so fix or remove that line (JSONL files skip such lines)")
        try:
            rows = json.loads(raw.decode("utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {str(p)!r} is not valid JSON ({e}); fix or remove it") from e
        if not isinstance(rows, list):
            raise ValueError(f"data file {str(p)!r}: expected a JSON array of objects")
        recs = [r if isinstance(r, dict) else None for r in rows]
        return recs, sum(r is None for r in recs)
    recs: list[dict | None] = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None   # malformed: invalid UTF-8 or not JSON; never altered, skipped and counted
        recs.append(obj if isinstance(obj, dict) else None)
    if not recs:
        why = "the file is empty or blank" if not raw.strip() else f"Arrow said: {arrow_error}"
        raise ValueError(f"data file {str(p)!r} holds no records ({why}); give a JSONL file with one "
                         "JSON object per line")
    return recs, sum(r is None for r in recs)


def _first_invalid_utf8(raw: bytes) -> int | None:
    """1-based line number of the first invalid UTF-8 byte in ``raw``, or None when it all decodes."""
    try:
        raw.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return raw.count(b"\n", 0, e.start) + 1
