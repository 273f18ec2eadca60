"""Kernel display plumbing for widgets written from a background thread.

ipykernel routes messages by the thread and subshell they came from; a dashboard
writes its comms from its own updater thread and is clicked while cells run, so two
details matter: which subshell answers a comm message, and which cell a refreshed
display belongs to.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from monarch_kernel.wire.jsontypes import MimeBundle


def prefer_frontend_subshell(widget: W.Widget) -> None:
    """Let the frontend's choice of subshell stand for messages to ``widget``.

    ipykernel 7 routes a frontend comm message to the subshell that last *sent* on that
    comm (for request/reply widgets). Our comms are written from the dashboard thread
    and created on the main shell, so that would route button clicks to the busy main
    shell; our widgets never wait for replies, so the frontend's subshell is right.
    """
    comm = getattr(widget, "comm", None)
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = lambda data, default: default


class Display:
    """Where a dashboard was displayed, to refresh its static (non-widget) fallback."""

    def __init__(self, display_id: str):
        self.display_id = display_id
        self.kernel: Any = None  # the ipykernel Kernel (None outside a kernel)
        self.parent: Any = None  # the header of the cell it was displayed in
        try:
            from IPython import get_ipython

            shell = get_ipython()
            self.kernel = getattr(shell, "kernel", None)
            if self.kernel is not None:
                self.parent = self.kernel.get_parent("shell")
        except Exception:  # not in a kernel: nothing to refresh
            self.kernel = None

    def update(self, data: MimeBundle) -> None:
        k = self.kernel
        if k is None:
            return
        content = {"data": data, "metadata": {}, "transient": {"display_id": self.display_id}}
        k.session.send(
            k.iopub_socket,
            "update_display_data",
            content,
            parent=self.parent,
            ident=k._topic("update_display_data"),
        )
