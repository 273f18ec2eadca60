"""The newest reference this process knows of each mesh (a
:class:`~.requester.MeshRef` per mesh name and key).

A mesh handle pickled into a rank (an actor that keeps a ``ProcMesh`` or an
``ActorMesh`` it was given) carries a ``MeshRef`` as it was then: the mesh's shape, each
rank's address and slot, and the mesh's *generation* (how many times it had been grown
or shrunk). After a resize the controller sends the new reference to every live rank of
its meshes (a ``mesh_ref`` control message); :func:`publish` keeps it when it is newer
than the one known here and tells the listeners (``actor.peer.requester``: its requesters take it
on, and whole-mesh handles over them cover the new shape). A reference unpickled later
is replaced by a newer one known here (:func:`newest`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from monarch_kernel.calls.requester import MeshRef

_latest: dict[tuple[str, str], MeshRef] = {}
_listeners: list[Callable[[MeshRef], None]] = []
_lock = threading.Lock()


def newest(ref: MeshRef) -> MeshRef:
    """``ref``, or a newer reference to the same mesh known here (``ref`` is kept as
    the newest when it is newer than the one known)."""
    key = (ref.mesh, ref.key)
    with _lock:
        known = _latest.get(key)
        if known is not None and known.generation > ref.generation:
            return known
        if known is None or ref.generation > known.generation:
            _latest[key] = ref
    return ref


def publish(ref: MeshRef) -> bool:
    """The controller says ``ref`` is its mesh now: keep it if it is newer than the one
    known here and tell the listeners (True), else nothing (False)."""
    key = (ref.mesh, ref.key)
    with _lock:
        known = _latest.get(key)
        if known is not None and known.generation >= ref.generation:
            return False
        _latest[key] = ref
        listeners = list(_listeners)
    for listen in listeners:
        listen(ref)
    return True


def subscribe(listener: Callable[[MeshRef], None]) -> None:
    """Call ``listener(ref)`` with every newer reference :func:`publish` keeps."""
    with _lock:
        _listeners.append(listener)


__all__ = ["newest", "publish", "subscribe"]
