"""The static views of the dashboard, for frontends without widgets (nbconvert, GitHub):
one self-contained HTML piece with inline styles only, and plain text."""

from __future__ import annotations

import time
from html import escape as esc

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.widgets import compact
from monarch_kernel.widgets.chart_pane import charts_html
from monarch_kernel.widgets.fmt import duration
from monarch_kernel.widgets.heat_grid import static_grid_html
from monarch_kernel.widgets.panes import errors_html, job_html, jobs_title_html
from monarch_kernel.widgets.render import (
    FULL_TILES_MAX,
    alive_count,
    header_html,
    phase_text,
    tile_text,
)
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.theme import COLORS
from monarch_kernel.widgets.views import TileView


def snapshot_html(
    st: MeshState, views: list[TileView], columns: int, charts: bool = True, grid: bool = False
) -> str:
    """A static, self-contained HTML view (inline styles only) for non-widget frontends
    (``charts``: with the metric charts; ``grid``: the heat-map grid, not tiles)."""
    if grid:
        ranks = static_grid_html(compact.encode(v.state for v in views), columns)
    else:
        ranks = _tiles_html(views, columns)
    rt = st.rt
    return (
        # light colours of its own: legible whatever the theme of the page showing it.
        # data-mesh / data-detachable: what the JupyterLab extension reads when it has to
        # freeze a dashboard whose kernel died without retiring it (labextension/src/frozen.ts)
        f'<div class="mk-dash-static" data-mesh="{esc(rt.name)}" '
        f'data-detachable="{int(rt.detach_keep > 0)}" '
        'style="font-family:sans-serif;font-size:12px;'
        'background:#fff;color:#111827;padding:4px">'
        + header_html(st, views)
        + jobs_snapshot_html(st)
        + ranks
        + (charts_html(st) if charts else "")
        + errors_html(st)
        + "</div>"
    )


def _tiles_html(views: list[TileView], columns: int) -> str:
    """One table cell per rank, with its tile's text."""
    cells = []
    for v in views:
        bg, border = COLORS[v.state]
        text = esc(tile_text(v, compact=len(views) > FULL_TILES_MAX)).replace("\n", "<br>")
        cells.append(
            f'<td style="background:{bg};color:#111827;border:2px solid {border};'
            f'padding:3px 5px;font-family:monospace;font-size:11px;vertical-align:top">{text}</td>'
        )
    rows = [
        "<tr>" + "".join(cells[i : i + columns]) + "</tr>" for i in range(0, len(cells), columns)
    ]
    return f'<table style="border-collapse:separate;border-spacing:3px">{"".join(rows)}</table>'


def jobs_snapshot_html(st: MeshState) -> str:
    """The running jobs, for the static snapshot (no buttons there)."""
    shown = st.running.view()
    if not shown:
        return ""
    rows = "".join(f"<div>{job_html(job)}</div>" for job in shown)
    return jobs_title_html(st, shown) + rows


def snapshot_text(st: MeshState, views: list[TileView], grid: bool = False) -> str:
    """The plain-text view: one line per rank (``grid``: one line per state, naming its
    ranks compactly, ``idle: ranks 0-61, 63``)."""
    rt = st.rt
    alive = alive_count(views)
    lines = [
        f"Mesh {rt.name!r} {rt.shape.describe()} ({rt.backend}, "
        f"{phase_text(st, views)}): {alive}/{rt.world} alive, "
        f"up {duration(time.time() - rt.started_at)}"
    ]
    lines += _states_text(views) if grid else [_rank_text(v) for v in views]
    for job in st.running.view():
        lines.append(f"  running: {job.text}")
    if st.recoveries:
        lines.append(f"  {st.recoveries[0].summary}")
    for inc in st.incidents[:3]:
        e = inc.entries[0]
        lines.append(f"  error: {e.title} on ranks {format_ranks(inc.ranks)}")
    return "\n".join(lines)


def _rank_text(v: TileView) -> str:
    """One rank's line of the text view."""
    extra = " ".join(x for x in (v.what, f"step {v.step}" if v.step else "", v.mem) if x)
    return f"  rank {v.rank:<3} {v.state:<8} {extra}".rstrip()


def _states_text(views: list[TileView]) -> list[str]:
    """A big mesh's text view: one line per state naming its ranks (``idle ranks 0-61``)."""
    by_state: dict[str, list[int]] = {}
    for v in views:
        by_state.setdefault(v.state, []).append(v.rank)
    return [
        f"  {state:<8} {'ranks' if len(ranks) > 1 else 'rank'} {format_ranks(ranks)}"
        for state, ranks in by_state.items()
    ]


def summary(st: MeshState, views: list[TileView]) -> dict[str, int]:
    """Ranks by tile state (the states no tile is in are left out)."""
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    return counts
