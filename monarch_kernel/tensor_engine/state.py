"""Which device mesh is active: the activation stack (``mesh.activate()``,
``no_mesh.activate()``), shared by the dispatch and the mesh classes.

An entry is a mesh, or None for ``no_mesh`` (plain local torch). Activations nest and end
in reverse order. The stack is per process, as torch's dispatch mode stack is per thread:
activate and deactivate on the notebook's thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The activation stack, innermost last (None: ``no_mesh``).
stack: list[Any] = []


def active() -> Any:
    """The innermost active mesh, None when none is active or ``no_mesh`` is."""
    return stack[-1] if stack else None


#: The ``Tensor`` methods made by modules above ``tensor`` (``reduce``, ``reduce_`` by
#: ``reductions``; ``slice_mesh``, ``to_mesh`` by ``moves``), set when they are imported
#: (the package imports them all).
reducers: dict[str, Callable[..., Any]] = {}
