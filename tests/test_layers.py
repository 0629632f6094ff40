"""The layers of ARCHITECTURE.md hold (issue 37): no import runs up them, and no import cycle
exists anywhere, the benchmarks and the test and example scripts included.

Bottom up: the shared vocabulary (``irdma._errors``, ``units``, ``placement``, ``xattrs``,
``metrics``, ``_proc``, ``_concurrency``, ``_lazy``, ``_version``) -> ``wire`` -> ``transport``
-> ``meta`` -> ``client`` -> ``train``; ``fs`` (``fs/``) and ``server`` (``server/``) beside
``train``, importing neither it nor each other; ``ops`` (the ``irdma`` command) over all of
them; ``irdma.keras`` (the public Keras API) on top. The package ``irdma`` itself re-exports
lazily (by name, :mod:`irdma._lazy`), so it imports only the bottom.

The import graph is grimp's (every ``import`` statement, the ones inside functions too; those
under ``if TYPE_CHECKING:`` left out), over the installed module names: ``fs/`` and
``server/`` are ``irdma.fs`` and ``irdma.server`` through setup.cfg's ``package_dir``, so the
graph is built over a tree of symbolic links that lays them out as Python will import them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

#: High to low; a set is one layer of siblings (``independent``: they may not import each other).
LAYERS: list[tuple[tuple[str, ...], bool]] = [
    (("keras",), False),
    (("ops",), False),
    (("fs", "server", "train"), True),
    (("client",), False),
    (("meta",), False),
    (("transport",), False),
    (("wire",), False),
    (("_errors", "units", "placement", "xattrs", "metrics", "_proc", "_concurrency", "_lazy", "_version"), False),
]

_PROBE = r"""
import json, sys
import grimp
from grimp import Layer

layers = [Layer(*names, independent=independent) for names, independent in json.loads(sys.argv[1])]
g = grimp.build_graph("irdma", exclude_type_checking_imports=True, cache_dir=None)
bad = []
for dep in g.find_illegal_dependencies_for_layers(layers=layers, containers={"irdma"}):
    for route in dep.routes:
        chain = g.find_shortest_chain(importer=sorted(route.heads)[0], imported=sorted(route.tails)[0])
        bad.append(f"{dep.importer} -> {dep.imported}: " + " -> ".join(chain or []))
mods = sorted(g.modules)
edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in mods}
print(json.dumps({"illegal": sorted(bad), "children": sorted(g.find_children("irdma")), "edges": edges}))
"""


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """grimp's view of the installed package: illegal layer dependencies, the top-level
    modules, every module's direct imports."""
    root = tmp_path_factory.mktemp("layers")
    pkg = root / "irdma"
    pkg.mkdir()
    for entry in os.listdir(os.path.join(REPO, "irdma")):
        if entry != "__pycache__":
            os.symlink(os.path.join(REPO, "irdma", entry), pkg / entry)
    os.symlink(os.path.join(REPO, "fs"), pkg / "fs")
    os.symlink(os.path.join(REPO, "server"), pkg / "server")
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(LAYERS)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


def _cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def test_every_module_of_the_package_is_in_a_layer(graph: dict[str, object]) -> None:
    placed = {f"irdma.{name}" for names, _ in LAYERS for name in names}
    children = set(graph["children"])  # type: ignore[arg-type]
    assert children - placed == set(), "a top-level module of irdma that no layer names: add it to LAYERS"
    assert {"irdma.fs", "irdma.server", "irdma.client", "irdma.wire"} <= children  # the tree is what Python imports


def test_no_import_runs_up_the_layers(graph: dict[str, object]) -> None:
    assert graph["illegal"] == [], "\n".join(graph["illegal"])  # type: ignore[arg-type]


def test_no_import_cycle_in_the_package(graph: dict[str, object]) -> None:
    assert _cycles(graph["edges"]) == []  # type: ignore[arg-type]


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above can fail: a cycle of three and a self-contained pair are found."""
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["e"], "e": ["d"], "f": ["a"]}) == [
        ["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": ["b"], "b": []}) == []


@pytest.mark.parametrize("folder", ["benchmarks", "tests", "examples", "tools"])
def test_no_import_cycle_among_scripts(folder: str) -> None:
    """The scripts of a folder import each other by their bare names (``import rows``); every
    import statement of every file, the ones inside functions too."""
    where = os.path.join(REPO, folder)
    names = {f[:-3] for f in os.listdir(where) if f.endswith(".py")}
    edges: dict[str, list[str]] = {}
    for name in sorted(names):
        with open(os.path.join(where, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        got: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                got |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                got.add(node.module.split(".")[0])
        edges[name] = sorted(got & names - {name})
    assert _cycles(edges) == []
