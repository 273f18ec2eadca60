"""``monarch_kernel.attach(NAME)``: take over a detachable mesh another kernel left
running (see :mod:`monarch_kernel.controller.detach`); the controller's side of the
actor API, loaded on first use only."""

from __future__ import annotations

from monarch_kernel.actor.hosts import watch_faults
from monarch_kernel.actor.meshes import ProcMesh
from monarch_kernel.controller.attach import attach as attach_runtime


def attach(name: str | None = None, *, force: bool = False, path: str | None = None) -> ProcMesh:
    """Take over the detached mesh ``name`` (or the one whose attach file is ``path``)
    and return it: its ranks, their namespaces, its failure policy and ``--setup``
    cells, now driven from here. ``force``: take it from a kernel that still holds it
    (that kernel is told). Raises ``AttachError`` saying why it cannot."""
    if name is None and path is None:
        raise ValueError("attach() needs the mesh's name (or path= of its attach file)")
    runtime = attach_runtime(name, path=path, force=force).runtime
    watch_faults(runtime)
    return ProcMesh(runtime)


__all__ = ["attach"]
