"""The live mesh dashboard (ipywidgets over the kernel's comm channel; no extra server).

``%mesh NAME --gpus 4`` shows it at once, while the ranks start (``spawn_procs(...,
on_starting=show)``); ``NAME.dashboard()`` (or ``dashboard(NAME)``) returns it again: the
last expression of a cell, or ``display(...)``.

One dashboard per mesh: this package keeps the map (weakly keyed by the mesh's
:class:`~monarch_kernel.controller.mesh.MeshRuntime`); nothing is stored on the mesh.
"""

from __future__ import annotations

from monarch_kernel.actor.meshes import ActorMesh, ProcMesh, procs_of, set_dashboard_factory
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.widgets.dashboard import UPDATE_INTERVAL, Dashboard, dashboard_of, existing
from monarch_kernel.widgets.state import MeshState

__all__ = ["Dashboard", "MeshState", "UPDATE_INTERVAL", "dashboard", "refresh", "show"]

Mesh = ProcMesh | ActorMesh | MeshRuntime


def _runtime_of(mesh: Mesh) -> MeshRuntime:
    """The MeshRuntime behind a ProcMesh or an ActorMesh (or the runtime itself)."""
    if isinstance(mesh, MeshRuntime):
        return mesh
    if isinstance(mesh, ProcMesh):
        return mesh.runtime
    if isinstance(mesh, ActorMesh):
        return procs_of(mesh).runtime
    raise TypeError(f"not a mesh: {mesh!r} (a ProcMesh, ActorMesh or MeshRuntime)")


def dashboard(mesh: Mesh) -> Dashboard:
    """The dashboard of ``mesh`` (a ProcMesh, ActorMesh or MeshRuntime), created once
    per mesh; every call returns the same widget (a new one after it was closed)."""
    return dashboard_of(_runtime_of(mesh))


set_dashboard_factory(dashboard)  # ProcMesh.dashboard()


def show(mesh: Mesh) -> Dashboard:
    """Display ``mesh``'s dashboard under the current cell now; returns it.

    Fits ``HostMesh.spawn_procs(..., on_starting=show)``: shown before the ranks start,
    so their start-up is visible.
    """
    dash = dashboard(mesh)
    dash.show()
    return dash


def refresh(mesh: Mesh) -> Dashboard | None:
    """Bring ``mesh``'s dashboard up to date now and re-send its displays' static
    fallback (after the mesh started, or failed to); returns it, or None if the mesh
    has no open dashboard (none is created)."""
    dash = existing(_runtime_of(mesh))
    if dash is not None:
        dash.refresh()
    return dash
