"""``monarch_kernel.attach(NAME)``: take over a detachable mesh another kernel left
running (see :mod:`monarch_kernel.controller.detach.release`); the controller's side of the
actor API, loaded on first use only."""

from __future__ import annotations

import logging

from monarch_kernel.actor.hosts import watch_faults
from monarch_kernel.actor.meshes import ActorMesh, ProcMesh
from monarch_kernel.controller.detach.attach import attach as attach_runtime
from monarch_kernel.wire import loads

log = logging.getLogger("monarch_kernel.actor")


def attach(name: str | None = None, *, force: bool = False, path: str | None = None) -> ProcMesh:
    """Take over the detached mesh ``name`` (or the one whose attach file is ``path``)
    and return it: its ranks, their namespaces, its failure policy and ``--setup``
    cells, now driven from here. ``force``: take it from a kernel that still holds it
    (that kernel is told). Raises ``AttachError`` saying why it cannot."""
    if name is None and path is None:
        raise ValueError("attach() needs the mesh's name (or path= of its attach file)")
    attached = attach_runtime(name, path=path, force=force)
    runtime = attached.runtime
    watch_faults(runtime)
    attached.finish()  # no job handles here: the ranks' kept results complete nothing
    return ProcMesh(runtime)


def actor_meshes(procs: ProcMesh) -> dict[str, ActorMesh]:
    """The actor meshes spawned on the whole of ``procs`` (a mesh taken over: the ones
    its earlier kernel spawned), by name: handles as ``procs.spawn`` returned them.
    Actors of a slice, or owned by another actor, are re-created on restarts but get
    no handle here."""
    handles = {}
    every = frozenset(procs.ranks())
    for name, spec in procs.runtime.actors.items():
        if spec.ranks != every or spec.owner is not None:
            continue
        try:
            actor_class, _, _ = loads(spec.payload, spec.buffers, f"actor {name!r}")
        except Exception as exc:  # its class no longer unpickles here
            log.warning("actor mesh %r: no handle (%s)", name, exc)
            continue
        handles[name] = ActorMesh(procs, name, actor_class, procs.shape)
    return handles


__all__ = ["actor_meshes", "attach"]
