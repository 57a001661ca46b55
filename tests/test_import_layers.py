"""The learner and the generator never import each other (issue 33): file-level AST over every
import statement, function-local ones included. The weights' wire format they share lives in
``megatron_rlhf/sync/``, which imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_rlhf"


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]   # from megatron_rlhf import learner
        elif isinstance(node, ast.ImportFrom):   # relative: resolve against the file's package
            base = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-node.level])
            mod = f"{base}.{node.module}" if node.module else base
            out += [(node.lineno, mod)] + [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _crossings(src: str, banned: tuple[str, ...]) -> list[str]:
    return [f"{f.relative_to(PKG.parent)}:{line} imports {m}" for f in sorted((PKG / src).rglob("*.py"))
            for line, m in _imports(f) if any(m == b or m.startswith(b + ".") for b in banned)]


@pytest.mark.timeout(30)
def test_no_generator_module_imports_the_learner_nor_the_reverse_nor_the_wire_format_either():
    assert _crossings("generator", ("megatron_rlhf.learner",)) == []
    assert _crossings("learner", ("megatron_rlhf.generator",)) == []
    assert _crossings("sync", ("megatron_rlhf.learner", "megatron_rlhf.generator")) == []


@pytest.mark.timeout(30)
def test_the_import_scan_sees_function_local_and_from_package_imports(tmp_path):
    f = PKG / "generator" / "broadcast_sync.py"
    found = dict((m, ln) for ln, m in _imports(f))
    assert "megatron_rlhf.sync.wire" in found and "megatron_rlhf.platform" in found   # the latter only function-local
    probe = tmp_path / "x.py"
    probe.write_text("def f():\n    from megatron_rlhf import learner\n    import megatron_rlhf.learner.weights\n")
    assert {m for _, m in _imports(probe)} >= {"megatron_rlhf.learner", "megatron_rlhf.learner.weights"}
