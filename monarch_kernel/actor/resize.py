"""Handles that follow their mesh when it grows or shrinks (``ProcMesh.grow``).

A handle on the *whole* mesh (the ``ProcMesh`` that ``%mesh`` binds, an ``ActorMesh``
spawned on it, one a rank or an actor holds) covers the mesh's new shape after a resize;
a slice keeps the ranks it was made of (by their numbers: after a shrink that
renumbered the ranks they may be other processes, or out of range). The handles of each
mesh are kept weakly here. In the notebook the controller's ``MeshRuntime`` is the
requester (``resized`` is called on its ``MeshResized``); in a rank a ``PeerRequester``
that takes on the newer reference the controller sends (``actor.peer.requester``).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from monarch_kernel.shape import Shape


class Following(Protocol):
    """A handle that can take on its mesh's new shape."""

    def _take_shape(self, shape: Shape) -> None: ...


_whole: weakref.WeakSet[Any] = weakref.WeakSet()


def follow(handle: Following, requester: Any, shape: Shape) -> None:
    """Keep ``handle`` (made on ``shape``) up to date if that is its whole mesh."""
    follows = hasattr(requester, "grow") or getattr(requester, "follows_resizes", False)
    if follows and shape == getattr(requester, "shape", None):
        _whole.add(handle)


def resized(requester: object) -> None:
    """``requester``'s mesh changed shape: its whole-mesh handles take the new one."""
    shape = getattr(requester, "shape", None)
    if not isinstance(shape, Shape):
        return
    for handle in list(_whole):
        if getattr(handle, "_requester", None) is requester:
            handle._take_shape(shape)
