"""The daemon's modules import each other in one direction only.

Every module of ``smddp.server`` is imported (so that none is dead or broken on import), and
its imports of other ``smddp.server`` modules are read from the source, those under
``if TYPE_CHECKING:`` and inside functions included: a cycle hidden behind a type-only or a
lazy import is still two rooms that lean on each other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import smddp.server

pytestmark = pytest.mark.timeout(60)

PACKAGE = "smddp.server"


def _modules() -> dict[str, Path]:
    root = Path(smddp.server.__file__).parent
    return {info.name: root / f"{info.name}.py" for info in pkgutil.iter_modules([str(root)])}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``smddp.server`` modules that module ``name`` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = node.module or ""
                targets = [f"{PACKAGE}.{base}".rstrip(".")] + [
                    f"{PACKAGE}.{a.name}" for a in node.names
                ]
            else:
                module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[:2] == ["smddp", "server"] and len(parts) > 2 and parts[2] in known:
                found.add(parts[2])
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_every_module_imports():
    for name in _modules():
        if name == "__main__":
            continue  # runs the daemon when imported
        importlib.import_module(f"{PACKAGE}.{name}")


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_cycle():
    # The graph reader and the cycle finder, on a graph with a known cycle and one without.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = _graph()
    assert "communicator" in graph["registry"]  # a plain import
    assert "communicator" in graph["gpu"]  # one under TYPE_CHECKING
    assert "gpu_runtime" in graph["gpu"]  # one inside a function
