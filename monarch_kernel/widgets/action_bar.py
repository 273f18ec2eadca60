"""The dashboard's buttons (Interrupt, Stacks, Restart, Stop) and its status line."""

from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as W

from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.display import prefer_frontend_subshell
from monarch_kernel.widgets.views import TileView


@dataclass(frozen=True)
class BarView:
    """What the buttons and the status line show."""

    stopped: bool  #: the mesh is stopped: every button is off
    dead: list[int]  #: the ranks shown dead
    selected: int | None  #: the selected rank
    confirming: bool  #: the Stop button waits for its second click
    status: str

    @classmethod
    def of(
        cls,
        views: list[TileView],
        stopped: bool,
        selected: int | None,
        confirming: bool,
        status: str,
    ) -> BarView:
        """The bar's view when the tiles show ``views``."""
        dead = [v.rank for v in views if v.state == "dead"]
        return cls(stopped, dead, selected, confirming, status)


class ActionBar:
    """The buttons, then the status line (which wraps; the buttons keep their labels).
    The dashboard wires the buttons' clicks."""

    def __init__(self) -> None:
        self.interrupt_button = W.Button(
            description="Interrupt",
            icon="stop",
            tooltip="Raise KeyboardInterrupt in the user code every rank runs (SIGINT)",
        )
        self.stacks_button = W.Button(
            description="Stacks",
            icon="list",
            tooltip="Every rank's Python stacks now, grouped; the odd ones out highlighted",
        )
        self.restart_button = W.Button(
            description="Restart dead ranks", icon="refresh", disabled=True
        )
        self.stop_button = W.Button(
            description="Stop mesh", icon="power-off", tooltip="Stop every rank of this mesh"
        )
        self.status_html = W.HTML()
        buttons = (self.interrupt_button, self.stacks_button, self.restart_button, self.stop_button)
        for b in buttons:
            b.layout.width = "auto"
            b.layout.flex = "0 0 auto"  # a long status wraps; the buttons keep their labels
            prefer_frontend_subshell(b)
        self.status_html.layout.flex = "1 1 auto"
        self.box = W.HBox([*buttons, self.status_html])

    def put(self, v: BarView) -> int:
        """Show ``v``; returns the messages sent."""
        if v.selected is not None and v.selected in v.dead:
            restart_label = f"Restart rank {v.selected}"
        else:
            restart_label = (
                f"Restart dead ranks ({len(v.dead)})" if v.dead else "Restart dead ranks"
            )
        sent = put(self.interrupt_button, disabled=v.stopped)
        sent += put(self.stacks_button, disabled=v.stopped)
        sent += put(
            self.restart_button, disabled=v.stopped or not v.dead, description=restart_label
        )
        sent += put(
            self.stop_button,
            disabled=v.stopped,
            description="Click again to stop" if v.confirming else "Stop mesh",
            button_style="danger" if v.confirming else "",
        )
        sent += put(
            self.status_html, value=f'<span class="mk-status">{html.escape(v.status)}</span>'
        )
        return sent
