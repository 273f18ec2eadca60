"""Patching a module of another library as soon as it is imported, not before.

A rank starts without importing IPython's display functions or FSDP2 (start-up time), yet
must patch them before a cell uses them: :func:`when_imported` patches a module now if it
is loaded, else right after its first import has executed it (one ``sys.meta_path``
finder serves every module named).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

#: What is done to a module once it is loaded (must be idempotent: it may run again).
Patch = Callable[[ModuleType], None]


def when_imported(fullname: str, patch: Patch) -> None:
    """Call ``patch(module)`` on module ``fullname``: now if it is loaded, else as soon as
    its first import has executed it."""
    loaded = sys.modules.get(fullname)
    if loaded is not None:
        patch(loaded)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterExec)), None)
    if finder is None:
        finder = _AfterExec()
        sys.meta_path.insert(0, finder)
    finder.patches[fullname] = patch


class _AfterExec(importlib.abc.MetaPathFinder):
    """Finds the modules to patch with the normal path finder and wraps their loader's
    ``exec_module`` so that the patch runs right after it."""

    def __init__(self) -> None:
        self.patches: dict[str, Patch] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
