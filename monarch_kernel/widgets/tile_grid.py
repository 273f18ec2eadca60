"""The grid of rank tiles: one button per rank, clicked to select it."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as W

from monarch_kernel.widgets import render
from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.display import prefer_frontend_subshell
from monarch_kernel.widgets.views import TileView


class TileGrid:
    """``world`` tiles in rows of ``columns``; compact ones for big meshes."""

    def __init__(
        self, world: int, columns: int, compact: bool, on_select: Callable[[int], None]
    ) -> None:
        self.compact = compact
        self._on_select = on_select
        # a full tile holds render.TILE_CHARS characters a line at the tile font
        width, height = (104, 44) if compact else (184, 108)
        tile_layout = W.Layout(width=f"{width}px", height=f"{height}px", margin="0")
        #: One button per rank, in rank order.
        self._layout = tile_layout
        self.tiles: list[W.Button] = [self._tile(r) for r in range(world)]
        self.box = W.GridBox(
            self.tiles,
            layout=W.Layout(
                grid_template_columns=f"repeat({columns}, {width}px)",
                grid_gap="4px",
                margin="2px 8px 4px 0",
                # rows keep the tiles' height when the detail pane beside the grid is
                # taller (stretched rows left a blank gap between tiles)
                align_content="flex-start",
            ),
        )

    def _tile(self, r: int) -> W.Button:
        tile = W.Button(description=f"rank {r}", layout=self._layout)
        tile.add_class("mk-tile")
        tile.on_click(lambda _b, r=r: self._on_select(r))
        prefer_frontend_subshell(tile)
        return tile

    def resize(self, world: int) -> None:
        """The mesh grew or shrank (``%mesh grow``): ``world`` tiles from now on."""
        if world == len(self.tiles):
            return
        self.tiles = self.tiles[:world] + [self._tile(r) for r in range(len(self.tiles), world)]
        self.box.children = tuple(self.tiles)

    def put(self, r: int, v: TileView, selected: int | None) -> int:
        """Show ``v`` on rank ``r``'s tile; returns the messages sent."""
        classes = ("mk-tile", f"mk-s-{v.state}") + (("mk-selected",) if r == selected else ())
        return put(
            self.tiles[r],
            description=render.tile_text(v, self.compact),
            tooltip=render.tile_tooltip(v),
            _dom_classes=classes,
        )
