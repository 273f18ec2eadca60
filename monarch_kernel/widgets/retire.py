"""A dashboard whose kernel is going away leaves a readable snapshot behind.

A dashboard is a widget: its output in the notebook is a reference to a widget model
that lives in the kernel. Once the kernel is gone (``Restart Kernel``, shutdown) the
frontend has nothing to draw it from, and a reloaded notebook shows broken widgets.
So when the kernel shuts down, :func:`retire_all` replaces every dashboard display
(``update_display_data`` on its display id) with a static HTML snapshot of its last
state and one line saying why it is static, and how to see the mesh live again when it
runs on (a ``--detachable`` mesh: ``%mesh attach NAME``). The snapshot is bounded
(:data:`MAX_SNAPSHOT_CHARS`: past that the charts are left out).
"""

from __future__ import annotations

import html
import logging
import time

from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.widgets.dashboard import Dashboard, open_dashboards
from monarch_kernel.wire.jsontypes import MimeBundle

log = logging.getLogger("monarch_kernel.widgets")

#: The largest snapshot (characters of HTML) a retired dashboard leaves in the notebook.
MAX_SNAPSHOT_CHARS = 300_000


def why_static(runtime: MeshRuntime, when: float) -> str:
    """The line above a retired dashboard's snapshot."""
    at = time.strftime("%H:%M:%S", time.localtime(when))
    name = runtime.name
    if runtime.detach_keep > 0:
        return (
            f"The kernel that showed this dashboard shut down at {at}; mesh {name!r} runs on "
            f"without it (detachable): run %mesh attach {name} to see it live again. "
            "Its last state:"
        )
    return (
        f"The kernel that showed this dashboard shut down at {at}, stopping mesh {name!r}. "
        "Its last state:"
    )


def retired_bundle(dash: Dashboard, why: str) -> MimeBundle:
    """The static bundle that replaces ``dash``'s displays: ``why``, then its snapshot
    (of the state with every event so far: the last metrics too)."""
    try:
        dash.update()
    except Exception:  # its widgets' comms may be closing: the state drained anyway
        log.debug("dashboard update before retiring failed", exc_info=True)
    snap_html, snap_text = dash.snapshot()
    if len(snap_html) > MAX_SNAPSHOT_CHARS:
        snap_html, snap_text = dash.snapshot(charts=False)
    line = (
        '<div class="mk-dash-retired" style="font-family:sans-serif;font-size:13px;'
        f'padding:4px 0;color:inherit"><b>{html.escape(why)}</b></div>'
    )
    return {"text/html": line + snap_html, "text/plain": f"{why}\n{snap_text}"}


def retire_all(when: float | None = None) -> int:
    """Replace the displays of every open dashboard of this kernel with their static
    snapshot (see the module docstring); how many dashboards were retired."""
    when = time.time() if when is None else when
    n = 0
    for dash in open_dashboards():
        try:
            if dash.retire(retired_bundle(dash, why_static(dash.runtime, when))):
                n += 1
        except Exception:  # the others are still retired
            log.exception("retiring the dashboard of mesh %s failed", dash.runtime.name)
    return n
