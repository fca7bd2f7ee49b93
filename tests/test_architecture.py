"""The package's import graph, read from the source: no module imports another that imports it back.

Every ``import`` / ``from ... import`` of a braintrace module counts, including those under
``if TYPE_CHECKING:`` and those inside functions: a type-only or deferred import still ties two
modules together for the reader and for refactoring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "braintrace"

#: Sub-packages whose modules must not import each other in a circle.
ACYCLIC_PACKAGES = ("braintrace._algorithm", "braintrace._audit", "braintrace._compiler", "braintrace._legacy",
                    "braintrace._memory", "braintrace._op", "braintrace.nn")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Map each module of the package at ``root`` to the package's modules it imports (anywhere in its source)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                # ``from pkg import mod`` imports the module ``pkg.mod`` when it exists.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One import cycle among ``nodes`` (as ``[a, b, ..., a]``), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node] & nodes):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(nodes):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_sees_type_checking_and_local_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import a\n")
    (package / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..sub import c\n")
    (package / "sub" / "c.py").write_text("import pkg.sub.a as a\nimport json\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.a"}, "pkg.sub.a": {"pkg.sub.b"},
                     "pkg.sub.b": {"pkg.sub.c"}, "pkg.sub.c": {"pkg.sub.a"}}
    assert find_cycle(graph, set(graph)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]


def test_the_domain_types_sit_in_a_leaf() -> None:
    # The domain types read JAX's types through the adapter, which imports nothing of braintrace.
    graph = import_graph()
    assert graph["braintrace._typing"] == {"braintrace._compatible_imports"}
    assert graph["braintrace._compatible_imports"] == set()


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_no_import_cycle_inside(package: str) -> None:
    graph = import_graph()
    nodes = {m for m in graph if m == package or m.startswith(package + ".")}
    # A package's ``__init__`` re-exports its modules; the cycles that matter are between modules.
    nodes.discard(package)
    cycle = find_cycle(graph, nodes)
    assert cycle is None, "import cycle in " + package + ": " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert find_cycle(graph, {"a", "b", "d"}) is None
