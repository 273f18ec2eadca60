"""The live mesh dashboard (ipywidgets over the kernel's comm channel; no extra server).

``%mesh NAME --gpus 4`` shows it at once, while the ranks start; ``NAME.dashboard()``
(or ``dashboard(NAME)``) returns it again: the last expression of a cell, or
``display(...)``.
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.actor import meshes as _meshes
from monarch_kernel.widgets.dashboard import UPDATE_INTERVAL, Dashboard
from monarch_kernel.widgets.state import MeshState

__all__ = ["Dashboard", "MeshState", "UPDATE_INTERVAL", "dashboard", "show", "spawn_with_dashboard"]


def _runtime_of(mesh: Any) -> Any:
    """The MeshRuntime behind a ProcMesh, an ActorMesh (``_runtime``) or itself."""
    for attr in ("runtime", "_runtime"):
        rt = getattr(mesh, attr, None)
        if rt is not None:
            return rt
    return mesh


def dashboard(mesh: Any) -> Dashboard:
    """The dashboard of ``mesh`` (a ProcMesh, ActorMesh or MeshRuntime), created once
    per mesh; every call returns the same widget."""
    rt = _runtime_of(mesh)
    dash = getattr(rt, "_mk_dashboard", None)
    if dash is None or dash._closed:
        dash = Dashboard(rt)
        rt._mk_dashboard = dash
    return dash


_meshes.dashboard_hook = dashboard  # ProcMesh.dashboard()


def show(mesh: Any) -> Dashboard:
    """Display ``mesh``'s dashboard under the current cell now; returns it."""
    dash = dashboard(mesh)
    dash.show()
    return dash


def spawn_with_dashboard(
    hosts: Any,
    per_host: dict[str, int],
    *,
    name: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Any:
    """Like ``hosts.spawn_procs(...)`` but shows the dashboard before the ranks start,
    so their start-up is visible; returns the ready ProcMesh (or raises like
    ``spawn_procs``, with the dashboard showing what went wrong)."""
    from monarch_kernel.actor import ProcMesh
    from monarch_kernel.controller.mesh import MeshRuntime

    if "hosts" in per_host:
        raise ValueError("per_host must not contain 'hosts'; use host_mesh(hosts=N)")
    runtime = MeshRuntime(name, dict(per_host), hosts.hosts, hosts.launcher, env=env)
    runtime.backend = hosts.backend
    dash = show(runtime)
    try:
        runtime.start(timeout=timeout)
    finally:
        dash.update()
        dash.refresh_displays()
    return ProcMesh(runtime)
