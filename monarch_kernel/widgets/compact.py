"""The compact form of a big mesh's rank states: one character per rank.

Above :data:`GRID_MIN_RANKS` ranks the dashboard draws a heat-map grid instead of one tile
per rank (:mod:`~monarch_kernel.widgets.heat_grid`). What it sends the front end for
the whole mesh is then one short string (``"iiibbbe…"``: a state code per rank), re-sent
only when a state changed and at most once per update; the details of a rank (host, pid,
what it runs, its last line or error) are sent only for the rank the pointer is over or
that is selected. So the bytes per update grow by one per rank, not by a tile's worth of
text per rank, and the updates per second do not grow with ranks at all.

Pure Python: unit-testable, shared by the live grid and the static snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from monarch_kernel.widgets.theme import STATES

#: Meshes of at least this many ranks get the heat-map grid; smaller ones one tile per
#: rank. ``MONARCH_KERNEL_GRID_MIN_RANKS`` overrides it (tests, and to compare the two
#: views at one size in ``bench.dashboard_traffic``).
GRID_MIN_RANKS = 64

#: state -> its one-character code (the first letter, but ``stopped``: ``x``).
CODES: dict[str, str] = {
    "starting": "s",
    "idle": "i",
    "busy": "b",
    "paused": "p",
    "error": "e",
    "dead": "d",
    "stopped": "x",
}
#: code -> state (the front end gets this table once, as the grid's ``legend``).
LEGEND: dict[str, str] = {c: s for s, c in CODES.items()}
assert set(CODES) == set(STATES) and len(LEGEND) == len(CODES), "one code per tile state"


def grid_min_ranks() -> int:
    """The threshold in force: :data:`GRID_MIN_RANKS`, or the environment's override."""
    text = os.environ.get("MONARCH_KERNEL_GRID_MIN_RANKS", "")
    try:
        return max(1, int(text)) if text else GRID_MIN_RANKS
    except ValueError:
        return GRID_MIN_RANKS


def use_grid(world: int) -> bool:
    """Whether a mesh of ``world`` ranks is drawn as a heat-map grid."""
    return world >= grid_min_ranks()


def encode(states: Iterable[str]) -> str:
    """Tile states (``idle``, ``dead`` …) in rank order -> the compact string."""
    return "".join(CODES[s] for s in states)


def decode(codes: str) -> list[str]:
    """The compact string -> tile states in rank order (the inverse of :func:`encode`)."""
    return [LEGEND[c] for c in codes]


def grid_columns(world: int, last_dim: int) -> int:
    """Cells per row of the grid: whole hosts (the mesh's last dim) side by side up to
    32 cells, so a host's ranks line up in columns; 32 when one host is wider."""
    if last_dim <= 0 or last_dim > 32:
        return min(32, max(1, world))
    return min(last_dim * max(1, 32 // last_dim), max(1, world))
