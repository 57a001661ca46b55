"""The house rules of ``megatron_rlhf/`` (../shared/notes/design.md, "Layout"), checked on its
file-level import graph (``tools/import_graph.py``: module-level and function-local imports).

Parses source only (no package is imported): about a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mrlhf_import_graph", REPO / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = import_graph   # dataclasses resolve the module by name
_spec.loader.exec_module(import_graph)

PACKAGE = REPO / "megatron_rlhf"


@pytest.fixture(scope="module")
def graph():
    return import_graph.build_graph(PACKAGE)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.timeout(30)
def test_the_tool_finds_relative_and_function_local_cycles_and_broken_rules(tmp_path):
    # a -> b by `from . import b` (module level); b -> a inside a function: one cycle.
    # c -> d only under TYPE_CHECKING (never runs): no cycle with d -> c.
    # sub/__init__ re-exporting sub/x which imports sub: a package's own re-export, not a cycle.
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from pkg.a import g\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "import pkg.c\n",
        "pkg/sub/__init__.py": "from pkg.sub.x import y\n",
        "pkg/sub/x.py": "from pkg.sub import z\nimport importlib\nm = importlib.import_module('pkg.testing')\n",
        "pkg/testing.py": "",
    })
    g = import_graph.build_graph(pkg)
    assert g.edges["pkg.a"] == {"pkg", "pkg.b"}
    assert "pkg.a" in g.edges["pkg.b"]
    assert "pkg.d" not in g.edges["pkg.c"]
    assert import_graph.find_cycles(g) == [["pkg.a", "pkg.b"]]
    assert import_graph.rule_violations(g, ["sub:testing", "*:testing", "a:c"]) == [
        "*:testing: pkg.sub.x -> pkg.testing", "sub:testing: pkg.sub.x -> pkg.testing"]
    with pytest.raises(ValueError, match="not of the form a:b"):
        import_graph.rule_violations(g, ["generator"])


@pytest.mark.timeout(30)
def test_megatron_rlhf_has_no_file_level_import_cycle(graph):
    assert import_graph.find_cycles(graph) == []


@pytest.mark.timeout(30)
def test_generator_and_learner_never_import_each_other(graph):
    assert import_graph.rule_violations(graph, ["generator:learner", "learner:generator"]) == []


@pytest.mark.timeout(30)
def test_rollout_imports_neither_learner_nor_trainer(graph):
    assert import_graph.rule_violations(graph, ["rollout:learner", "rollout:trainer"]) == []


@pytest.mark.timeout(30)
def test_nothing_below_the_trainer_imports_it(graph):
    assert import_graph.rule_violations(graph, ["*:trainer"]) == []


@pytest.mark.timeout(30)
def test_product_code_never_imports_the_testing_package(graph):
    assert import_graph.rule_violations(graph, ["*:testing"]) == []



# What each package's __init__ docstring says it may import (besides itself), as dotted prefixes
# below megatron_rlhf. trainer/ and testing/ may import anything.
MAY_IMPORT = {
    "errors": (), "types": (), "utils": (), "losses": (),
    "placement": ("errors",),
    "config": ("errors", "placement", "utils"),
    "memory_plan": ("platform", "sync"),
    "runtime": (),
    "convert": ("utils",),
    "platform": ("errors",),
    "sync": ("platform", "utils"),
    "data": ("config", "types", "utils"),
    "rewards": ("convert", "data", "runtime", "utils"),
    "generator": ("sync", "platform", "config", "types", "runtime", "utils", "rollout.carry"),
    "learner": ("losses", "convert", "platform", "sync", "config", "types", "runtime", "utils"),
    "rollout": ("generator", "rewards", "data", "types", "utils"),
}


@pytest.mark.timeout(30)
def test_each_package_imports_only_what_its_init_docstring_allows(graph):
    pkg = graph.package + "."
    outside = []
    for module, deps in graph.edges.items():
        rel = module.removeprefix(pkg)
        home = rel.split(".")[0]
        if home not in MAY_IMPORT:
            continue
        for dep in deps:
            drel = dep.removeprefix(pkg)
            if drel == graph.package or drel.split(".")[0] == home:
                continue
            if not any(drel == a or drel.startswith(a + ".") for a in MAY_IMPORT[home]):
                outside.append(f"{module} -> {dep}")
    assert outside == []
    # every package and top-level module below the trainer has an entry
    homes = {m.removeprefix(pkg).split(".")[0] for m in graph.files if m != graph.package}
    assert homes - set(MAY_IMPORT) == {"trainer", "testing"}
