"""Which device mesh and which stream are active: the activation stacks
(``mesh.activate()``, ``no_mesh.activate()``, ``stream.activate()``), shared by the
dispatch and the mesh and stream classes.

A mesh entry is a mesh, or None for ``no_mesh`` (plain local torch). Activations nest and
end in reverse order. The stacks are per process, as torch's dispatch mode stack is per
thread: activate and deactivate on the notebook's thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The activation stack, innermost last (None: ``no_mesh``).
stack: list[Any] = []

#: The stream activation stack, innermost last (empty: :data:`default_stream`).
streams: list[Any] = []

#: The ``main`` stream (set by :mod:`.streams` when it is imported).
default_stream: Any = None

#: While above 0 (a backward pass of ``grad_generator``), an op runs on the stream of its
#: tensor inputs, as the forward op it differentiates did, whatever stream is active.
follow_inputs = [0]


def active() -> Any:
    """The innermost active mesh, None when none is active or ``no_mesh`` is."""
    return stack[-1] if stack else None


def active_stream() -> Any:
    """The innermost active stream (``main`` when none was activated)."""
    return streams[-1] if streams else default_stream


#: The ``Tensor`` methods made by modules above ``tensor`` (``reduce``, ``reduce_`` by
#: ``reductions``; ``slice_mesh``, ``to_mesh`` by ``moves``; ``borrow`` by ``borrows``),
#: set when they are imported (the package imports them all).
reducers: dict[str, Callable[..., Any]] = {}
