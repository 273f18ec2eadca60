"""The layering of DESIGN.md, checked on the source: a layer imports only those below it.

``shape``/``wire`` <- ``calls`` <- ``rank``/``host``/``launchers`` <- ``controller`` <-
``actor`` <- ``kernel``/``widgets``. ``rank``/``host`` sit on ``calls``, ``wire`` and
``shape`` only (they never import the controller, the actor API, the kernel or the
widgets); the actor API reads the rank's context (``current_rank()`` in user code on a
rank).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "monarch_kernel"

BASE = {"shape", "wire"}
ALLOWED: dict[str, set[str]] = {
    "shape": BASE,
    "wire": BASE,
    "calls": BASE | {"calls"},
    "rank": BASE | {"calls", "rank"},
    "host": BASE | {"calls", "rank", "host"},
    "launchers": BASE | {"calls", "launchers"},
    "controller": BASE | {"calls", "launchers", "controller"},
    "actor": BASE | {"calls", "launchers", "controller", "rank", "actor"},
    "kernel": BASE | {"calls", "launchers", "controller", "rank", "actor", "kernel", "widgets"},
    "widgets": BASE | {"calls", "launchers", "controller", "rank", "actor", "widgets"},
}


def _layer(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return None if rel.name in ("__init__.py", "__main__.py") else rel.stem
    return rel.parts[0]


def _imported_layers(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "monarch_kernel" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if _layer(p) is not None)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_lower_layers(path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{path}: unknown layer {layer!r}; add it to ALLOWED"
    bad = sorted(
        (line, imported)
        for imported, line in _imported_layers(path)
        if imported not in ALLOWED[layer]
    )
    assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports layers above it: {bad}"


def test_every_layer_is_known():
    assert {_layer(p) for p in MODULES} <= set(ALLOWED)
