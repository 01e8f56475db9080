"""No import cycles between lmfleet's modules.

An AST walk over every module under src/lmfleet builds the graph of imports between lmfleet modules
(absolute ``lmfleet.*`` and relative), then looks for cycles. Imports at module level form one graph;
imports inside functions (deferred until called) are added for a second, stricter graph: a cycle there
still means two modules that cannot be understood or tested apart.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "lmfleet"

def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(importer: str, is_package: bool, node: ast.AST) -> list[str]:
    """lmfleet modules an import statement loads (the module itself for ``from pkg import module``)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(importer, is_package, node)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:  # `import lmfleet.a.b` or a name inside a module
            name = name.rpartition(".")[0]
        if name.startswith("lmfleet") and name != importer:
            out.append(name)
    return out


def _is_deferred(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def _parse(path: Path) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's spurious ``SystemError: AST constructor recursion depth
    mismatch`` (python/cpython#106905, seen in threaded programs): raised by the interpreter, not by the source
    (it failed once in CI on a file that parses everywhere else, after ~2,200 tests in the same process)."""
    text = path.read_text()
    was_enabled = gc.isenabled()
    for attempt in range(3):
        gc.disable()  # a collection's finalizers running inside the conversion are a suspect; keep them out
        try:
            return ast.parse(text, str(path))
        except SystemError:
            if attempt == 2:
                raise
        finally:
            if was_enabled:
                gc.enable()
    raise AssertionError("unreachable")


def import_graph(*, deferred: bool) -> dict[str, set[str]]:
    """module -> lmfleet modules it imports (``deferred``: count imports inside functions too).

    ``if TYPE_CHECKING:`` imports are left out: they never run.
    """
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = _parse(path)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        edges: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            guard = parents.get(node)
            if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test):
                continue
            if not deferred and _is_deferred(node, parents):
                continue
            edges.update(_targets(name, path.name == "__init__.py", node))
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted module lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for c in cycles:
        edges = sorted(f"{a} -> {b}" for a in c for b in graph[a] if b in c)
        lines.append(f"cycle {' <-> '.join(c)}: " + "; ".join(edges))
    return "\n".join(lines)


def test_the_walk_sees_the_package():
    graph = import_graph(deferred=False)
    assert "lmfleet.store.ledger" in graph and "lmfleet.cli.main" in graph
    assert "lmfleet.provenance" in graph["lmfleet.store.ledger"]  # absolute import seen


def test_find_cycles_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "with-function-imports"])
def test_no_import_cycles(deferred):
    graph = import_graph(deferred=deferred)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (break each by moving what both sides need into a third module):\n" + \
        _describe(cycles, graph)
