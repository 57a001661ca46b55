#!/usr/bin/env python
"""File-level import graph of a Python package: its import cycles and the role rules it breaks.

    python tools/import_graph.py                     # megatron_rlhf/ with the house rules (RULES)
    python tools/import_graph.py megatron_rlhf generator:learner learner:generator '*:trainer'
    python tools/import_graph.py --edges megatron_rlhf   # also print every edge

A rule ``a:b`` says no module under ``PKG.a`` may import a module under ``PKG.b`` (``a`` and ``b``
are dotted paths below the package, matched on whole segments: ``config`` is ``PKG.config`` and
``PKG.config.*``, never ``PKG.configs``); ``*:b`` says no module outside ``PKG.b`` may import it.

What counts as an import: every ``import`` and ``from ... import`` statement anywhere in a file,
module level or inside a function (a function-local import is still a dependency), relative ones
resolved (``from . import x`` names the package and, when ``x`` is a module, ``x``), plus
``importlib.import_module("PKG.x")`` with a constant string. Imports under ``if TYPE_CHECKING:``
are skipped (they never run). Each import maps to the longest module name of the package it
names, so ``from PKG.a.b import f`` is an edge to ``PKG.a.b`` (not to ``PKG.a``'s ``__init__``, or
every package's ``__init__`` would join, and so hide, the cycles among its children).
A cycle is a strongly connected component (Tarjan) of more than one module; one made only of a
package's ``__init__`` and its own submodules is not reported (an ``__init__`` re-exporting its
children is not a design cycle).

Exit code 0 when there is no cycle and no broken rule, 1 otherwise, 2 on bad arguments.
The test ``tests/test_import_graph.py`` asserts the house rules on ``megatron_rlhf/``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The house rules (../shared/notes/design.md, "Layout"): a must not import b.
RULES = (
    "generator:learner",
    "learner:generator",
    "rollout:learner",
    "rollout:trainer",
    "*:trainer",
    "*:testing",
)


@dataclass(frozen=True)
class Graph:
    """The import graph of one package.

    ``edges[m]`` is the set of the package's modules that module ``m`` imports (dotted names,
    ``m`` itself excluded); ``files[m]`` is ``m``'s source file; ``package`` is the root's name.
    """

    package: str
    files: dict[str, Path]
    edges: dict[str, set[str]]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[list[str]]:
    """Each import in ``tree`` as a list of candidate dotted names, most specific first."""
    found: list[list[str]] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                found.append([alias.name])

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append([source])   # the package's ``__init__`` runs (also for ``from PKG import sub``)
            for alias in node.names:
                found.append([f"{source}.{alias.name}", source])

        def visit_Call(self, node: ast.Call) -> None:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (name == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.append([node.args[0].value])
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def build_graph(root: str | Path) -> Graph:
    """Parse every ``*.py`` under the package folder ``root`` and return its :class:`Graph`.

    Raises ``NotADirectoryError`` when ``root`` is not a folder and ``SyntaxError`` (naming the
    file) when a file does not parse.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"import_graph: {root} is not a package folder")
    files = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for candidates in _imported_names(tree, module, path.name == "__init__.py"):
            for name in candidates:
                parts = name.split(".")
                while parts and ".".join(parts) not in files:
                    parts = parts[:-1]
                if parts:
                    target = ".".join(parts)
                    if target != module:
                        deps.add(target)
                    break
        edges[module] = deps
    return Graph(package=root.name, files=files, edges=edges)


def find_cycles(graph: Graph) -> list[list[str]]:
    """The graph's import cycles: strongly connected components of more than one module, each
    sorted, minus those made only of a package ``__init__`` and its own submodules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    # Iterative Tarjan (no recursion limit on deep graphs).
    for start in graph.edges:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    cycles = []
    for component in components:
        packages = [m for m in component if graph.files[m].name == "__init__.py"]
        if packages and all(m == packages[0] or m.startswith(packages[0] + ".") for m in component):
            continue
        cycles.append(component)
    return sorted(cycles)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rule_violations(graph: Graph, rules: tuple[str, ...] | list[str]) -> list[str]:
    """The edges that break ``rules`` (each ``"a:b"`` or ``"*:b"``, see the module docstring), as
    ``"rule: importer -> imported"`` lines, sorted.

    Raises ``ValueError`` naming the rule when one is not of the form ``a:b``.
    """
    broken = []
    for rule in rules:
        a, sep, b = rule.partition(":")
        if not sep or not b or not a:
            raise ValueError(f"import_graph: rule {rule!r} is not of the form a:b (a must not import b)")
        target = f"{graph.package}.{b}"
        for module, deps in graph.edges.items():
            if a == "*":
                if _under(module, target):
                    continue
            elif not _under(module, f"{graph.package}.{a}"):
                continue
            for dep in deps:
                if _under(dep, target):
                    broken.append(f"{rule}: {module} -> {dep}")
    return sorted(broken)


def main(argv: list[str]) -> int:
    """CLI: ``[--edges] [PKG_DIR] [a:b ...]``; prints cycles and broken rules, returns the exit code."""
    show_edges = "--edges" in argv
    args = [a for a in argv if a != "--edges"]
    root = REPO / "megatron_rlhf"
    if args and ":" not in args[0]:
        root = Path(args.pop(0))
    rules = args or list(RULES)
    try:
        graph = build_graph(root)
        broken = rule_violations(graph, rules)
    except (NotADirectoryError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    cycles = find_cycles(graph)
    if show_edges:
        for module in sorted(graph.edges):
            for dep in sorted(graph.edges[module]):
                print(f"edge: {module} -> {dep}")
    for cycle in cycles:
        print("cycle: " + " <-> ".join(cycle))
    for line in broken:
        print("broken rule " + line)
    n_edges = sum(len(d) for d in graph.edges.values())
    print(f"{len(graph.files)} modules, {n_edges} edges, {len(cycles)} cycles, {len(broken)} broken rules")
    return 1 if cycles or broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
