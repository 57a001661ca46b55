"""Generate docs/configuration.md, the reference of every config key, from the config dataclasses.

    .venv/bin/python tools/config_reference.py            # writes docs/configuration.md
    .venv/bin/python tools/config_reference.py --check    # exit 1 (and say so) when it is stale

The source of truth is the dataclass tree under ``megatron_rlhf.config.Config``: each key's type
and default come from ``dataclasses.fields``; its meaning is the first sentence of the attribute
docstring written under the field (read with ``ast`` from the class's source); the values it
refuses are what the ``_check`` / ``_check_choice`` / ``_fail`` calls of the config modules say
is allowed for that key (the choices of ``_check_choice`` resolved to their values). Field docs
live once, next to the field: to change a line of the reference, edit the field's docstring and
re-run this tool. ``tests/test_config_reference.py`` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = REPO / "docs" / "configuration.md"
COMMAND = ".venv/bin/python tools/config_reference.py"
_CHECKERS = {"_check": (1, 3), "_check_choice": (0, None), "_fail": (0, 2)}
"""Checker function -> (index of its key argument, index of its 'allowed' text or None for choices)."""
_ABBREV = ("al", "e.g", "i.e", "eq", "sec", "App", "Fig", "vs", "cf", "etc", "Tab")


@dataclasses.dataclass(frozen=True)
class Key:
    """One documented config key (``section.sub.name``; list items as ``tasks[]``)."""

    key: str
    type: str
    default: str
    meaning: str
    owner: type


def _md(text: str) -> str:
    """Docstring markup (reST) as one line of Markdown: ``x`` -> `x`, :class:`X` -> `X`."""
    text = re.sub(r":(?:class|attr|data|func|meth|mod):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"\s+", " ", text.replace("``", "`")).strip().replace("|", "\\|")
    parts = text.split("`")  # outside code spans, <x> would be read as an HTML tag
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (not cut after 'et al.', 'e.g.' and the like), as Markdown."""
    text = re.sub(r"\s+", " ", doc).strip()
    for m in re.finditer(r"\.(?=\s+[A-Z`(*\d])", text):
        before = text[: m.start()]
        if re.search(r"(?:^|[\s(])(?:" + "|".join(re.escape(a) for a in _ABBREV) + r")$", before):
            continue
        if before.count("(") > before.count(")") or before.count("``") % 2:
            continue  # inside parentheses or inline code
        return _md(text[: m.end()])
    return _md(text)


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: attribute docstring}`` of a dataclass, read from its source with ``ast``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _render(value) -> str:
    """A default as YAML would spell it (null, true, "text", [..])."""
    if dataclasses.is_dataclass(value):
        return "(section)"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _dataclasses_in(tp) -> list[type]:
    """The dataclass types a (resolved) annotation names: ``X``, ``X | None``, ``list[X]``, ``str | X``."""
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [c for arg in typing.get_args(tp) for c in _dataclasses_in(arg)]


def _is_list(tp) -> bool:
    return typing.get_origin(tp) is list


def collect(cls: type, prefix: str = "", instance=None) -> list[Key]:
    """Every leaf key of the dataclass ``cls`` under ``prefix``; defaults from ``instance`` when a
    parent's default factory built one (e.g. ``tasks[].data.path``), else from the field."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    keys: list[Key] = []
    for f in dataclasses.fields(cls):
        name = f.name.rstrip("_")  # async_ is YAML's async
        key = f"{prefix}{name}"
        if instance is not None:
            default = getattr(instance, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        tp = hints[f.name]
        nested = _dataclasses_in(tp)
        if _is_list(tp) and nested:
            item = default[0] if isinstance(default, list) and default else None
            keys += collect(nested[0], f"{key}[].", item if dataclasses.is_dataclass(item) else None)
            continue
        if nested and (dataclasses.is_dataclass(default) or typing.get_args(tp) == ()):
            keys += collect(nested[0], f"{key}.", default if dataclasses.is_dataclass(default) else None)
            continue
        shown = "required" if default is dataclasses.MISSING else _render(default)
        keys.append(Key(key, _md(str(f.type)), shown, first_sentence(docs.get(f.name, "")), cls))
        for sub in nested:  # e.g. tasks[].reward: a string or a {reward_model: ...} mapping
            keys += collect(sub, f"{key}.")
    return keys


def _key_patterns(call: ast.Call, key_arg: ast.expr, loops: dict[str, list[str]]) -> list[str]:
    """The key(s) a checker call names; ``tasks[{x}]`` -> ``tasks[]``; a loop variable over a tuple
    of strings expands to each of them."""
    if isinstance(key_arg, ast.Constant) and isinstance(key_arg.value, str):
        keys = [key_arg.value]
    elif isinstance(key_arg, ast.JoinedStr):
        keys = [""]
        for part in key_arg.values:
            if isinstance(part, ast.Constant):
                keys = [k + str(part.value) for k in keys]
            elif isinstance(part.value, ast.Name) and part.value.id in loops:
                keys = [k + v for k in keys for v in loops[part.value.id]]
            else:
                keys = [k + "\0" for k in keys]
    else:
        return []
    return [re.sub(r"\[[^\]]*\]", "[]", k) for k in keys if "\0" not in re.sub(r"\[[^\]]*\]", "", k)]


def _allowed_text(node: ast.expr, module=None) -> str:
    """The 'allowed' argument as text; an f-string field naming a constant of ``module`` becomes its
    value, any other field '…'."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_field_text(p, module) for p in node.values)
    if isinstance(node, ast.BinOp):
        return _allowed_text(node.left, module) + _allowed_text(node.right, module)
    return ""


def _field_text(part: ast.expr, module) -> str:
    if isinstance(part, ast.Constant):
        return str(part.value)
    if isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.format_spec is None:
        value = getattr(module, part.value.id, None)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return str(value)
    return "…"


def refusals(modules) -> dict[str, list[str]]:
    """``{key: [what is allowed, ...]}`` from every checker call in the config modules' sources."""
    found: dict[str, list[str]] = {}

    def visit(node, loops):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple) \
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts):
            loops = {**loops, node.target.id: [e.value for e in node.iter.elts]}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CHECKERS:
            key_i, text_i = _CHECKERS[node.func.id]
            if len(node.args) > key_i:
                if text_i is None:  # _check_choice(key, value, choices, note="")
                    text = _choices_text(node, module)
                else:
                    text = _allowed_text(node.args[text_i], module) if len(node.args) > text_i else ""
                for key in _key_patterns(node, node.args[key_i], loops):
                    if text and text not in found.setdefault(key, []):
                        found[key].append(text)
        for child in ast.iter_child_nodes(node):
            visit(child, loops)

    for module in modules:
        visit(ast.parse(inspect.getsource(module)), {})
    return found


def _choices_text(call: ast.Call, module) -> str:
    """``one of a, b, c`` for ``_check_choice``'s choices (a literal tuple or a module constant)."""
    node = call.args[2] if len(call.args) > 2 else None
    try:
        values = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        values = getattr(module, node.id, None) if isinstance(node, ast.Name) else None
    if not values:
        return ""
    note = _allowed_text(call.args[3], module) if len(call.args) > 3 else ""
    return "one of " + ", ".join(f"`{v}`" for v in values) + note


def generate() -> str:
    """The whole of docs/configuration.md as a string (nothing written)."""
    from megatron_rlhf import config as config_mod
    from megatron_rlhf import placement as placement_mod

    keys = collect(config_mod.Config)
    allowed = refusals([config_mod, placement_mod])
    hints = typing.get_type_hints(config_mod.Config)
    lines = [
        "# Configuration reference",
        "",
        f"Generated by `{COMMAND}` from the config dataclasses (`megatron_rlhf.config.Config` and",
        "the classes it holds); do not edit by hand: edit the field's docstring and re-run the",
        "command (`tests/test_config_reference.py` fails while this file is stale).",
        "",
        "A recipe is YAML; `defaults: other.yaml` at its top inherits from that file, and any key can be",
        "overridden on the command line as `dotted.key=value` (the value parsed as YAML; list items by",
        "index: `tasks.0.data.path=...`). Every value is type-checked and validated when the config loads,",
        "before any actor starts; a refused value raises `ConfigError` naming the key, the value and",
        "what is allowed (the last column). `.venv/bin/python train.py --config X.yaml --print-config`",
        "prints the resolved tree; `--check` also runs what a run checks before it starts (paths, the",
        "layout against the model, vLLM's engine fit, plug-ins, data rows) and exits. Meanings are the",
        "first sentence of each field's docstring in the source; the rest of the docstring is there.",
        "",
    ]
    undocumented = [k.key for k in keys if not k.meaning]
    for f in dataclasses.fields(config_mod.Config):
        section = f.name.rstrip("_")
        cls = _dataclasses_in(hints[f.name])[0]
        rows = [k for k in keys if k.key.split(".")[0].split("[")[0] == section]
        lines += [f"## `{section}{'[]' if _is_list(hints[f.name]) else ''}`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            lines += [_md(inspect.cleandoc(cls.__doc__).split("\n\n")[0]), ""]
        lines += ["| key | type | default | meaning | allowed (else refused) |", "|---|---|---|---|---|"]
        for k in rows:
            ok = "; ".join(_md(t) for t in allowed.get(k.key, [])) or ""
            lines.append(f"| `{k.key}` | `{k.type}` | `{k.default}` | {k.meaning or '(no docstring)'} | {ok} |")
        lines.append("")
    lines.append(f"{len(keys)} keys; {len(undocumented)} without a docstring.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Write docs/configuration.md, or with ``--check`` exit 1 when it differs from a fresh render."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is stale: run `{COMMAND}` to refresh it", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
