"""The heat-map grid of a big mesh: one small cell per rank, coloured by its state.

Used instead of the tiles (:mod:`~monarch_kernel.widgets.tile_grid`) from
:data:`~monarch_kernel.widgets.compact.GRID_MIN_RANKS` ranks on. The front end
(``static/heat_grid.js``, an anywidget module served by this package: nothing to
install in JupyterLab) draws the cells from ``states``, one character per rank
(:mod:`~monarch_kernel.widgets.compact`); hovering a cell asks the kernel for that
rank's details, clicking it selects the rank (the detail pane shows its output and last
error, as a tile's click does). Without anywidget the grid is static HTML cells with a
tooltip each.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape as esc
from typing import Any

import ipywidgets as W

from monarch_kernel.widgets import compact
from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.display import prefer_frontend_subshell
from monarch_kernel.widgets.live_chart import AVAILABLE, _asset

if AVAILABLE:
    import anywidget
    import traitlets

    class HeatGridWidget(anywidget.AnyWidget):
        """The grid's widget model: ``states`` (a code per rank), ``legend`` (code ->
        state), ``columns`` and the ``selected`` rank (-1: none)."""

        _esm = traitlets.Unicode(_asset("heat_grid.js")).tag(sync=True)
        _css = traitlets.Unicode(_asset("heat_grid.css")).tag(sync=True)
        states = traitlets.Unicode("").tag(sync=True)
        legend = traitlets.Dict(compact.LEGEND).tag(sync=True)
        columns = traitlets.Int(32).tag(sync=True)
        selected = traitlets.Int(-1).tag(sync=True)


class HeatGrid:
    """The grid's part of the dashboard (the counterpart of ``TileGrid``).

    ``on_select(rank)``: a cell was clicked; ``detail_of(rank)``: the text a hover on
    that rank shows (called on whichever thread the kernel handles the comm message on;
    it takes the dashboard's lock itself).
    """

    def __init__(
        self,
        columns: int,
        on_select: Callable[[int], None],
        detail_of: Callable[[int], str],
    ) -> None:
        self.columns = columns
        self._on_select = on_select
        self._detail_of = detail_of
        #: No tile buttons: the dashboard's ``tiles`` is empty for a grid.
        self.tiles: list[W.Button] = []
        self.live = AVAILABLE
        self.details_sent = 0  # hover answers sent (for tests and the traffic bench)
        self.widget: W.DOMWidget
        if AVAILABLE:
            self.widget = HeatGridWidget(columns=columns)
            self.widget.on_msg(self._on_front_end)
            prefer_frontend_subshell(self.widget)
        else:  # pragma: no cover - anywidget is a dependency
            self.widget = W.HTML()
        self.widget.add_class("mk-heat-grid-widget")
        self.box = self.widget

    def _on_front_end(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        rank = content.get("rank")
        if not isinstance(rank, int) or rank < 0:
            return
        if content.get("type") == "select":
            self._on_select(rank)
        elif content.get("type") == "hover":
            self.details_sent += 1
            self.widget.send({"type": "detail", "rank": rank, "text": self._detail_of(rank)})

    def resize(self, world: int) -> None:
        """The mesh grew or shrank: the states string says how many cells there are."""

    def put(self, states: str, selected: int | None) -> int:
        """Show ``states`` (one code per rank); returns the messages sent (0 or 1)."""
        sel = -1 if selected is None else selected
        if self.live:
            return put(self.widget, states=states, selected=sel)
        return put(self.widget, value=static_grid_html(states, self.columns, sel))


def static_grid_html(states: str, columns: int, selected: int = -1) -> str:
    """The grid as self-contained HTML (inline styles, a tooltip per cell): the static
    snapshot's, and the live grid's without anywidget."""
    from monarch_kernel.widgets.theme import COLORS

    cells = []
    for r, code in enumerate(states):
        state = compact.LEGEND[code]
        bg, border = COLORS[state]
        ring = "outline:2px solid #111827;" if r == selected else ""
        cells.append(
            f'<span title="rank {r}: {esc(state)}" data-rank="{r}" data-state="{esc(state)}" '
            f'style="display:inline-block;width:10px;height:10px;margin:1px;border-radius:2px;'
            f'background:{border};border:1px solid {border};{ring}"></span>'
            if state not in ("starting", "stopped")
            else f'<span title="rank {r}: {esc(state)}" data-rank="{r}" '
            f'data-state="{esc(state)}" style="display:inline-block;width:10px;height:10px;'
            f'margin:1px;border-radius:2px;background:{bg};border:1px dashed {border};{ring}">'
            "</span>"
        )
    rows = [
        '<div style="line-height:0">' + "".join(cells[i : i + columns]) + "</div>"
        for i in range(0, len(cells), columns)
    ]
    return f'<div class="mk-heat-static">{"".join(rows)}</div>'
