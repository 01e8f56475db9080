"""lmfleet's subpackages import each other without cycles, counting every import (function-level ones too); the
gateway's layers import only downward at run time; its exceptions share one root.

The graph is read from the source with ``ast``: a node is a subpackage (``lmfleet.gateway``) or a top-level
module (``lmfleet.errors``), an edge ``a -> b`` means some module of ``a`` imports something of ``b``.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

import lmfleet
from lmfleet.errors import LmfleetError
from tests.unit.test_imports import find_cycles  # one Tarjan for both import-graph tests

SRC = Path(lmfleet.__file__).parent


def _unit(module: str) -> str | None:
    """``lmfleet.gateway.app`` -> ``gateway``; ``lmfleet.errors`` -> ``errors``; non-lmfleet -> None."""
    parts = module.split(".")
    if parts[0] != "lmfleet" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imported(tree: ast.AST, module: str, is_package: bool, runtime_only: bool = False) -> set[str]:
    """Every module name an import statement anywhere in ``tree`` refers to (relative imports resolved);
    ``runtime_only``: leaving out those under ``if TYPE_CHECKING:``."""
    out: set[str] = set()
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            # ``from lmfleet import errors``: the names may be submodules
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        src_unit = _unit(module)
        if src_unit is None:
            continue
        graph[src_unit]
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in _imported(tree, module, path.name == "__init__.py"):
            dst = _unit(target)
            if dst is not None and dst != src_unit and ((SRC / dst).is_dir() or (SRC / f"{dst}.py").exists()):
                graph[src_unit].add(dst)
    return dict(graph)


def _edge_sources(a: str, b: str) -> list[str]:
    """The modules of ``a`` that import ``b`` (for the failure message)."""
    out = []
    for path in sorted((SRC / a).rglob("*.py") if (SRC / a).is_dir() else [SRC / f"{a}.py"]):
        module = _module_name(path)
        targets = _imported(ast.parse(path.read_text()), module, path.name == "__init__.py")
        if any(_unit(t) == b for t in targets):
            out.append(str(path.relative_to(SRC.parent)))
    return out


def test_find_cycles_table():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_subpackages_have_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    if cycles:
        lines = []
        for comp in cycles:
            lines.append("cycle among " + ", ".join(comp) + ":")
            for a in comp:
                for b in sorted(graph[a] & set(comp)):
                    lines.append(f"    {a} -> {b}: {', '.join(_edge_sources(a, b))}")
        raise AssertionError("import cycles between lmfleet's subpackages:\n" + "\n".join(lines))


GATEWAY_LAYERS = ("gateway", "build", "app", "admin", "service", "front", "routing", "relay", "observe", "core")
"""The gateway's layers, top to bottom: a module may import (at run time) only from its own layer or one below.
``gateway`` is the package's ``__init__``; build, app and service assemble the layers; admin is the operator's
side, on top of the assembled gateway; a request goes front -> routing -> relay -> observe; core holds the types
every layer shares. Imports under ``if TYPE_CHECKING:`` (annotations) do not count."""


def _gateway_layer(module: str) -> str | None:
    """``lmfleet.gateway.relay.run`` -> ``relay``; ``lmfleet.gateway`` -> ``gateway``; outside the gateway -> None."""
    parts = module.split(".")
    if parts[:2] != ["lmfleet", "gateway"]:
        return None
    return parts[2] if len(parts) > 2 else "gateway"


def _is_module(name: str) -> bool:
    """``name`` is a module or package of lmfleet (not a class or function imported from one)."""
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def gateway_layer_graph() -> dict[tuple[str, str], list[str]]:
    """(layer, layer it imports at run time) -> the imports that make the edge (``module -> imported``)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((SRC / "gateway").rglob("*.py")):
        module = _module_name(path)
        src = _gateway_layer(module)
        for target in sorted(_imported(ast.parse(path.read_text()), module, path.name == "__init__.py",
                                       runtime_only=True)):
            dst = _gateway_layer(target)
            if dst is None or dst == src or not _is_module(target):
                continue
            edges[(src, dst)].append(f"{module} -> {target}")  # type: ignore[index]
    return dict(edges)


def test_every_gateway_module_has_a_layer():
    found = {p.name if p.is_dir() else p.stem for p in (SRC / "gateway").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    missing = sorted(found - set(GATEWAY_LAYERS))
    assert not missing, f"gateway modules without a layer (add them to GATEWAY_LAYERS): {missing}"


def test_gateway_layers_import_only_downward():
    rank = {name: i for i, name in enumerate(GATEWAY_LAYERS)}
    upward = [f"{a} -> {b}: {', '.join(sorted(set(how)))}" for (a, b), how in sorted(gateway_layer_graph().items())
              if rank[b] < rank[a]]
    assert not upward, "upward imports between the gateway's layers (top to bottom: " + " > ".join(
        GATEWAY_LAYERS) + "):\n" + "\n".join(upward)


@pytest.mark.parametrize("path, builtin", [
    ("lmfleet.bench.workload.BenchInputError", ValueError),
    ("lmfleet.check.planner.PlanError", ValueError),
    ("lmfleet.cluster.join.JoinError", ValueError),
    ("lmfleet.cluster.launcher.LauncherError", ValueError),
    ("lmfleet.config.loader.ConfigError", None),
    ("lmfleet.engine.routing.RouterUnavailable", RuntimeError),
    ("lmfleet.models.smollm2.ModelSourceError", RuntimeError),
    ("lmfleet.models.tokenizer.TokenizerLoadError", RuntimeError),
    ("lmfleet.profile.client.ProfileError", None),
    ("lmfleet.serve.apps.DeployError", RuntimeError),
    ("lmfleet.serve.proxy.ProxyError", RuntimeError),
    ("lmfleet.testing.pg_server.PgUnavailable", RuntimeError),
])
def test_exceptions_derive_from_lmfleet_error(path, builtin):
    """One root for lmfleet's exceptions; the builtin base stays where callers catch it."""
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, LmfleetError)
    if builtin is not None:
        assert issubclass(cls, builtin)


if __name__ == "__main__":  # the gateway's layer graph: PYTHONPATH=src python -m tests.unit.test_architecture
    for (a, b), how in sorted(gateway_layer_graph().items(), key=lambda e: GATEWAY_LAYERS.index(e[0][0])):
        print(f"{a:>8} -> {b:<8} {len({h.split(' -> ')[0] for h in how})} modules")


MAX_MODULE_LINES = 450
"""A module a maintainer reads in one sitting; a longer one is split by concern."""


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(SRC.parent)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
