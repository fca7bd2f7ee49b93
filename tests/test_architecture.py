"""The package's shape, read from the source: no module imports another that imports it back, and no
class grows past :data:`MAX_CLASS_LINES` lines.

Every ``import`` / ``from ... import`` of a braintrace module counts, including those under
``if TYPE_CHECKING:`` and those inside functions: a type-only or deferred import still ties two
modules together for the reader and for refactoring. Importing ``a.b.c`` also runs the
``__init__`` of the package ``a.b`` (when the importer is not inside it), so that counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "braintrace"

#: Sub-packages whose modules must not import each other in a circle.
ACYCLIC_PACKAGES = ("braintrace._algorithm", "braintrace._audit", "braintrace._compiler", "braintrace._footprint",
                    "braintrace._legacy", "braintrace._memory", "braintrace._op", "braintrace.nn")


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


def _imported_with(target: str, importer: str) -> list[str]:
    """``target`` and the packages above it whose ``__init__`` importing it runs (those not holding ``importer``)."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [module for module in chain if module != importer and not importer.startswith(module + ".")]


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
                if target:
                    graph[name].update(m for m in _imported_with(target, name) if m in files)
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


def test_importing_a_module_runs_its_package_first(tmp_path: Path) -> None:
    # ``high`` imports only ``low.measure``, but that runs ``low/__init__``, which imports ``high``
    # back through ``low.planner``: a cycle Python meets at import time.
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "high.py").write_text("from pkg.low.measure import size\n")
    (package / "low" / "__init__.py").write_text("from . import measure, planner\n")
    (package / "low" / "measure.py").write_text("size = 1\n")
    (package / "low" / "planner.py").write_text("from pkg import high\n")
    graph = import_graph(package)
    assert graph["pkg.high"] == {"pkg.low", "pkg.low.measure"}
    assert graph["pkg.low"] == {"pkg.low.measure", "pkg.low.planner"}
    assert find_cycle(graph, set(graph)) == ["pkg.high", "pkg.low", "pkg.low.planner", "pkg.high"]


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


def test_no_import_cycle_in_the_whole_package() -> None:
    # Across sub-packages too, the layers point down only: ``_compile → _algorithm → _compiler → _op``,
    # with the memory planner (``_memory``, which compiles learners) above the learners and the
    # measurement of one learner (``_footprint``, which ``learner.memory()`` calls) below them.
    graph = import_graph()
    cycle = find_cycle(graph, set(graph))
    assert cycle is None, "import cycle in braintrace: " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert find_cycle(graph, {"a", "b", "d"}) is None


#: The most lines a class may span (``class`` line to its last line, docstrings included).
MAX_CLASS_LINES = 400


def class_lengths(root: Path = PACKAGE_ROOT) -> dict[str, int]:
    """Every class of the package at ``root`` (nested ones too), by qualified name, with the lines it spans."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}.{child.name}"
                lengths[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}.{child.name}")

    for path in root.rglob("*.py"):
        visit(ast.parse(path.read_text(encoding="utf-8")), _module_name(path, root))
    return lengths


def test_class_lengths_counts_every_class_by_its_qualified_name(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        "class A:\n    x = 1\n\n    class B:\n        y = 2\n\n\ndef f():\n    class C:\n        pass\n")
    assert class_lengths(package) == {"pkg.mod.A": 5, "pkg.mod.A.B": 2, "pkg.mod.f.C": 2}


def test_no_class_is_over_the_line_limit() -> None:
    oversized = {name: n for name, n in class_lengths().items() if n > MAX_CLASS_LINES}
    assert not oversized, (f"classes over {MAX_CLASS_LINES} lines: {oversized}. Move a cohesive piece out into a "
                           f"module of functions (the class keeps thin delegates where its API needs them).")
