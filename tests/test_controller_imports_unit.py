"""controller/'s own import graph: no circles, and no part reaches back to the façade.

Edges are the imports of ``monarch_kernel.controller.*`` modules at module level and
under ``if TYPE_CHECKING:`` (imports inside functions are not counted). A part says what
it needs of the mesh in a Protocol instead of importing ``controller.mesh``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import monarch_kernel.controller as controller

PKG = "monarch_kernel.controller"
ROOT = Path(controller.__file__).parent


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")[2:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module != PKG and not node.module.startswith(PKG + "."):
            return []
        # `from pkg import mod` imports the module mod (the package's face aside)
        subs = [f"{node.module}.{a.name}" for a in node.names]
        mods = [m for m in subs if _is_module(m)]
        return mods if node.module == PKG or len(mods) == len(subs) else [node.module]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith(PKG + ".")]
    return []


def _module_level(body: list[ast.stmt]) -> list[str]:
    """Imports in ``body`` and in the blocks of its if/try statements (not functions)."""
    found: list[str] = []
    for node in body:
        found += _imported(node)
        if isinstance(node, ast.If):
            found += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            found += _module_level(node.body) + _module_level(node.finalbody)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join((PKG, *rel[:-1]) if rel[-1] == "__init__" else (PKG, *rel))
        tree = ast.parse(path.read_text())
        graph[name] = {m for m in _module_level(tree.body) if m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each reported once (from its smallest module)."""
    found: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append(path)
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_no_import_circles_in_controller() -> None:
    assert _circles(_graph()) == []


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


#: Features built on whole meshes (detaching one, taking one over): they use the façade
#: as the kernel does, so they sit above it; neither the façade nor a part imports them.
ABOVE_THE_FACADE = {f"{PKG}.detach"} | {
    f"{PKG}.detach.{name}" for name in ("adopt", "attach", "held_output", "release", "takeover")
}


def test_no_part_imports_the_facade() -> None:
    graph = _graph()
    offenders = sorted(
        m for m, deps in graph.items() if f"{PKG}.mesh" in deps and m not in ABOVE_THE_FACADE
    )
    assert offenders == []


def test_nothing_below_the_facade_imports_the_features_above_it() -> None:
    graph = _graph()
    assert set(graph) >= ABOVE_THE_FACADE
    below = sorted(set(graph) - ABOVE_THE_FACADE)
    offenders = [(m, sorted(graph[m] & ABOVE_THE_FACADE)) for m in below]
    assert [o for o in offenders if o[1]] == []
