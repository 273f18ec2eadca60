"""Which actor of the controller's own process is running the current code.

``this_proc()`` in the controller is the controller's own process (see
:mod:`monarch_kernel.actor.client_proc`): its actors run here, each on a thread of its own.
What ``context()``, ``current_actor_name()`` and ``spawn()`` need to know of the running
one lives in a context variable: each message runs in a context of its own (a copy of its
caller's, so that what it prints goes where the caller's output goes), and each task of an
async actor keeps the context it was started in.

Loaded in ranks too (the mesh classes read it), so it imports nothing of the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire import headers as H


@dataclass(frozen=True)
class LocalRun:
    """An actor of the controller's process running one of its messages.

    ``proc``: the name of the controller's process mesh; ``owner_of()``: how the actors
    this one spawns name it as their owner (they report failures nobody waited for to
    it; made when first needed, as it opens the process to ranks); ``slice``: the slice
    the message was sent to (header ``sl``), for ``message_rank``."""

    actor: str
    proc: str
    owner_of: Callable[[], H.Owner]
    slice: Any = None


_current: ContextVar[LocalRun | None] = ContextVar("monarch_kernel_local_actor", default=None)


def current() -> LocalRun | None:
    """The actor of the controller's process running this code, if any."""
    return _current.get()


def enter(run: LocalRun) -> None:
    """Mark the current context as running ``run`` (each message has its own context)."""
    _current.set(run)


def owner() -> H.Owner | None:
    """The owner of actors spawned by the running code: the controller-process actor
    running it, if any (elsewhere the mesh's requester decides)."""
    run = _current.get()
    return run.owner_of() if run is not None else None


__all__ = ["LocalRun", "current", "enter", "owner"]
