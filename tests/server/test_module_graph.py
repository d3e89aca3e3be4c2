"""The daemon's modules, and the client's, the backend's and the shared ones, import each
other in one direction only.

Every module of ``smddp.server`` and ``smddp.client`` is imported (so that none is dead or
broken on import), and its imports of other smddp modules are read from the source, those
under ``if TYPE_CHECKING:`` and inside functions included: a cycle hidden behind a type-only
or a lazy import is still two rooms that lean on each other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import smddp
import smddp.backend
import smddp.client
import smddp.core
import smddp.server

pytestmark = pytest.mark.timeout(60)

PACKAGE = "smddp.server"


def _modules() -> dict[str, Path]:
    root = Path(smddp.server.__file__).parent
    return {info.name: _source(root, info.name) for info in pkgutil.iter_modules([str(root)])}


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


# The packages whose modules join the whole-tree graph (the generated stubs, smddp.v1, are
# left out: they import nothing of ours).
PACKAGES = {
    "smddp": smddp,
    "smddp.core": smddp.core,
    "smddp.client": smddp.client,
    "smddp.backend": smddp.backend,
    "smddp.server": smddp.server,
}


def _tree_modules() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name, each package's ``__init__`` included."""
    found: dict[str, Path] = {}
    for package, module in PACKAGES.items():
        root = Path(module.__file__ or "").parent
        found[package] = root / "__init__.py"
        for info in pkgutil.iter_modules([str(root)]):
            if not info.ispkg:
                found[f"{package}.{info.name}"] = _source(root, info.name)
    return found


def _source(root: Path, name: str) -> Path:
    """A module's source: its .py, or for the C extension (smddp.core._fastregion) its stub, which
    imports what its source would."""
    path = root / f"{name}.py"
    return path if path.exists() else root / f"{name}.pyi"


def _tree_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its source.

    ``from a.b import c`` counts as an import of ``a.b.c`` where that is a module, else of
    ``a.b``; ``import a.b`` of ``a.b``. Relative imports are resolved against ``name``'s
    package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}".rstrip(".")
            targets = []
            for a in node.names:
                sub = f"{module}.{a.name}"
                targets.append(sub if sub in known else module)
        else:
            continue
        found.update(t for t in targets if t in known)
    found.discard(name)
    return found


def _tree_graph() -> dict[str, set[str]]:
    modules = _tree_modules()
    return {name: _tree_imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_imports():
    for name in _modules():
        if name == "__main__":
            continue  # runs the daemon when imported
        importlib.import_module(f"{PACKAGE}.{name}")
    root = Path(smddp.client.__file__ or "").parent
    for info in pkgutil.iter_modules([str(root)]):
        importlib.import_module(f"smddp.client.{info.name}")


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_in_the_whole_tree():
    # client/, backend/ and core/ too, and across them: the client never leans on the
    # backend, nor the shared modules on either (TYPE_CHECKING and lazy imports included).
    cycle = _cycle(_tree_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_layers_point_one_way():
    graph = _tree_graph()
    for name, imports in graph.items():
        if name.startswith("smddp.client"):
            assert not {i for i in imports if i.startswith(("smddp.backend", "smddp.server"))}, name
        if name.startswith("smddp.server"):
            assert not {i for i in imports if i.startswith(("smddp.backend", "smddp.client"))}, name
        if name.startswith("smddp.core"):
            # What every side shares leans on none of them, nor on the root package.
            assert all(i.startswith("smddp.core") for i in imports), (name, imports)


def test_the_tree_reader_sees_every_kind_of_import():
    graph = _tree_graph()
    assert "smddp.client.engine" in graph["smddp.client.communicator"]  # a plain import
    assert "smddp.client.cuda_ops" in graph["smddp.client.communicator"]  # TYPE_CHECKING
    assert "smddp.client.communicator" in graph["smddp.client"]  # from a package's __init__
    assert "smddp.client" in graph["smddp.backend.process_group"]  # from smddp.client import X
    assert "smddp.core.launch_env" in graph["smddp"]  # from smddp import module
    assert "smddp.core.wire" in graph["smddp.server.communicator"]  # across packages


def test_the_checker_sees_a_cycle():
    # The graph reader and the cycle finder, on a graph with a known cycle and one without.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = _graph()
    assert "communicator" in graph["registry"]  # a plain import
    assert "communicator" in graph["gpu"]  # one under TYPE_CHECKING
    assert "gpu_runtime" in graph["gpu_supply"]  # one inside a function


ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
# Folders a module named in the page may live in, tried in order for a bare ``name.py``.
ROOMS = (
    ".", "server", "client", "backend", "core", "compat/smddp", "scripts", "benchmarks",
    "deploy/systemd", "protos/smddp/v1",
)  # fmt: skip


def _drawn_map(label: str) -> dict[str, set[str]]:
    """The module map the architecture page draws for ``server/`` or ``client/``: each
    module, then the modules of the same folder it imports ("a → b, c"; "no X/ imports: ...")."""
    text = ARCHITECTURE.read_text()
    start = text.index("```\n", text.index(f"Module map of `{label}/`")) + 4
    drawn: dict[str, set[str]] = {}
    for line in text[start : text.index("```", start)].splitlines():
        if line.startswith(f"no {label}/ imports: "):
            for name in line.split(": ", 1)[1].split(", "):
                drawn[name] = set()
            continue
        name, _, targets = line.partition(" → ")
        drawn[name] = {re.sub(r" \(.*\)$", "", t) for t in targets.split(", ")}
    return drawn


@pytest.mark.parametrize("label", ["server", "client"])
def test_the_architecture_page_draws_the_imports_there_are(label: str) -> None:
    package = f"smddp.{label}"
    graph = _tree_graph()
    real = {
        ("__init__" if name == package else name[len(package) + 1 :]): {
            i[len(package) + 1 :] for i in imports if i.startswith(package + ".")
        }
        for name, imports in graph.items()
        if name == package or name.startswith(package + ".")
    }
    drawn = _drawn_map(label)
    if "__init__" not in drawn:
        real.pop("__init__", None)
    assert drawn == real, "docs/architecture.md's map of {}/ differs from the code: {}".format(
        label,
        {
            m: (sorted(drawn.get(m, ())), sorted(real.get(m, ())))
            for m in drawn.keys() | real.keys()
            if drawn.get(m) != real.get(m)
        },
    )


def test_every_module_the_architecture_page_names_exists() -> None:
    root = ARCHITECTURE.parents[1]
    missing = []
    for ref in sorted(set(re.findall(r"`([\w/]+\.(?:py|c|sh|proto))`", ARCHITECTURE.read_text()))):
        if "/" in ref:
            found = (root / ref).exists() or any((root / room / ref).exists() for room in ROOMS)
        else:
            found = any((root / room / ref).exists() for room in ROOMS)
        if not found:
            missing.append(ref)
    assert missing == [], f"docs/architecture.md names files that do not exist: {missing}"
