"""Which device mesh and which stream are active: the activation stacks
(``mesh.activate()``, ``no_mesh.activate()``, ``stream.activate()``), shared by the
dispatch and the mesh and stream classes.

A mesh entry is a mesh, or None for ``no_mesh`` (plain local torch). Activations nest and
end in reverse order. The stacks are per process, as torch's dispatch mode stack is per
thread: activate and deactivate on the notebook's thread.

:data:`this_thread` says what the thread issuing ops is doing: ``grad_generator`` runs
its backward pass on a thread of its own, handing control back and forth with the
notebook's thread so that one of them issues ops at a time (the stacks above, the
client's buffer and the fake mode are then used by one thread at a time)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: The activation stack, innermost last (None: ``no_mesh``).
stack: list[Any] = []

#: The stream activation stack, innermost last (empty: :data:`default_stream`).
streams: list[Any] = []

#: The ``main`` stream (set by :mod:`.streams` when it is imported).
default_stream: Any = None


class ThisThread(threading.local):
    """Per thread: what a backward pass running on it asks of the ops it issues."""

    #: While above 0 (a backward pass), an op runs on the stream of its tensor inputs,
    #: as the forward op it differentiates did, whatever stream is active.
    follow_inputs: int = 0
    #: The backward pass of a ``grad_generator`` running on this thread stops when this
    #: is set (its generator was dropped, or the notebook was interrupted): the next op
    #: raises :class:`Cancelled`.
    cancel: threading.Event | None = None
    #: The notebook's frames the ops issued on this thread are attributed to (the
    #: ``next()`` of a ``grad_generator`` that asked for them); None: this thread's own.
    frames: tuple[Any, ...] | None = None


#: The calling thread's :class:`ThisThread`.
this_thread = ThisThread()


class Cancelled(BaseException):
    """Raised in a ``grad_generator``'s backward pass to stop it (a ``BaseException``:
    a backward function's ``except Exception`` does not keep it going)."""


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
