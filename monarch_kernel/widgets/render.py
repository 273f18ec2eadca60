"""Text and HTML of the dashboard's header and rank tiles, computed from a
:class:`MeshState`.

Used twice: by the live widgets (one piece of HTML per widget, re-sent only when it
changed) and for the static snapshot (:mod:`~monarch_kernel.widgets.snapshot`). The other
parts' HTML is in :mod:`~monarch_kernel.widgets.panes` (jobs, detail, incidents) and
:mod:`~monarch_kernel.widgets.chart_pane` (SVG charts); the colours in
:mod:`~monarch_kernel.widgets.theme`.
"""

from __future__ import annotations

import time
from html import escape as esc
from typing import TYPE_CHECKING

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.state.records import MeshPhase
from monarch_kernel.widgets.fmt import duration, rate_text
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.theme import COLORS, STATES
from monarch_kernel.widgets.views import TileView

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

#: Meshes up to this many ranks get full tiles; bigger ones compact tiles.
FULL_TILES_MAX = 16

#: Characters on one line of a full tile (its width at the tile font); longer facts are
#: cut at a word boundary with an ellipsis, never mid-word and never spilling out.
TILE_CHARS = 25
#: Tile states a rank is up and answering in (the header's "alive" count).
UP_STATES = ("idle", "busy", "paused", "error")


def clip(text: str, n: int = TILE_CHARS) -> str:
    """``text`` in at most ``n`` characters: whole words and ``…`` when it is longer."""
    if len(text) <= n:
        return text
    cut = text[: n - 1]
    space = cut.rfind(" ")
    if space >= n // 2:  # a word boundary not too far back
        cut = cut[:space]
    return cut.rstrip(" ·,:;") + "…"


def tile_text(v: TileView, compact: bool) -> str:
    """The text on a tile (one fact per line; the tooltip has everything)."""
    if compact:
        second = v.what if v.state in ("busy", "paused", "error", "dead") else ""
        if v.step:
            second = f"step {v.step}" if not second else f"{second[:10]} · {v.step}"
        return f"{v.rank} {v.state}\n{clip(second, 14)}"
    # multi-dim meshes: the position too, e.g. "rank 5 (1,1)" for hosts=1, gpus=1
    where = ""
    if v.coords.count("=") > 1:
        where = " (" + ",".join(c.split("=")[1] for c in v.coords.split(", ")) + ")"
    lines = [f"rank {v.rank}{where} · {v.state}", v.what or " "]
    # the pid matters more than a long host name: the host is what gets clipped
    pid = f" · pid {v.pid}" if v.pid else ""
    lines.append(clip(v.host, TILE_CHARS - len(pid)) + pid)
    # its GPU's utilisation, memory and power where its host agent samples them, else
    # the rank's own memory
    if v.gpu:
        lines.append(f"{v.device} {v.gpu}" if v.device else f"GPU {v.gpu}")
    else:
        lines.append(" · ".join(x for x in (v.device, v.mem) if x) or " ")
    # the tensor engine's ops issued to the rank (and those it has yet to run) take the
    # place of "seen" (the tooltip keeps it): the tile has room for one line of facts
    last = v.ops or (f"seen {v.seen}" if v.seen else "")
    lines.append(" · ".join(x for x in (f"step {v.step}" if v.step else "", last) if x) or " ")
    if v.state in UP_STATES and (v.rate_in is not None or v.rate_out is not None):
        lines.append(f"in {rate_text(v.rate_in)} · out {rate_text(v.rate_out)}")
    return "\n".join(clip(line) for line in lines)


def tile_tooltip(v: TileView) -> str:
    parts = [
        f"rank {v.rank} ({v.coords})" if v.coords else f"rank {v.rank}",
        f"state: {v.state}" + (f" — {v.what}" if v.what else ""),
        f"host {v.host}, pid {v.pid or '?'}, device {v.device or '?'}",
    ]
    if v.mem:
        parts.append(f"memory: {v.mem}")
    if v.gpu_tip:
        parts.append(v.gpu_tip)
    if v.step:
        parts.append(f"step: {v.step}")
    if v.seen:
        parts.append(f"last heard from: {v.seen} ago")
    if v.ops:
        parts.append(f"tensor engine: {v.ops} (by its last report)")
    parts.append(
        f"controller in (from rank): {rate_text(v.rate_in)}; out (to rank): {rate_text(v.rate_out)}"
    )
    if v.restarts:
        parts.append(f"restarts: {v.restarts}")
    parts.append("click: show recent output and last error")
    return "\n".join(parts)


#: Characters of one fact in a grid cell's hover text (its box stays narrow).
DETAIL_CHARS = 80


def cell_detail(st: MeshState, v: TileView) -> str:
    """What hovering rank ``v.rank``'s grid cell shows under ``rank N · state``: where it
    runs, what it does, its last output line and its last error, one fact a line."""
    lines = [v.coords] if v.coords else []
    where = f"host {v.host} · pid {v.pid or '?'}"
    lines.append(where + (f" · {v.device}" if v.device else ""))
    found = st.last_error.get(v.rank)
    if v.what and (found is None or v.what != found[1].title):  # the error comes below
        lines.append(clip(v.what, DETAIL_CHARS))
    seen = f"seen {v.seen} ago" if v.seen else ""
    facts = " · ".join(x for x in (v.mem, f"step {v.step}" if v.step else "", seen) if x)
    if facts:
        lines.append(facts)
    if v.gpu_tip:
        lines.append(clip(v.gpu_tip, DETAIL_CHARS))
    if v.ops:
        lines.append(f"tensor engine: {v.ops}")
    if v.restarts:
        lines.append(f"restarts: {v.restarts}")
    last = [line for line in st.output_lines(v.rank, 3) if line.strip()]
    if last:
        lines.append("last line: " + clip(last[-1].strip(), DETAIL_CHARS))
    if found is not None:
        lines.append("last error: " + clip(found[1].title, DETAIL_CHARS))
    lines.append("click: recent output and last error")
    return "\n".join(lines)


#: Phases shown as a badge in the header (coloured by the CSS); others are plain text.
PHASE_BADGES = (MeshPhase.RECOVERING, MeshPhase.STOPPING)


def phase_text(st: MeshState, views: list[TileView]) -> str:
    """The mesh's phase in words: ``running``, or what it does while it recovers
    (``recovering: restarting ranks 1, 3…``)."""
    phase = st.mesh_state
    if phase is MeshPhase.RECOVERING:
        starting = [v.rank for v in views if v.state == "starting"]
        if starting:
            many = "ranks" if len(starting) > 1 else "rank"
            return f"recovering: restarting {many} {format_ranks(starting)}…"
        return "recovering: restarting ranks…"
    if phase is MeshPhase.STOPPED and st.rt.released:
        # let go by this kernel (it shut down, or another one took the mesh over): the
        # ranks run on, so the last state shown must not say they stopped
        return "detached: runs on without this kernel"
    return str(phase.value)


def phase_html(st: MeshState, views: list[TileView]) -> str:
    text = esc(phase_text(st, views))
    if st.mesh_state not in PHASE_BADGES:
        return text
    return f'<span class="mk-phase mk-phase-{st.mesh_state.value}">{text}</span>'


def header_html(st: MeshState, views: list[TileView], status: str = "") -> str:
    rt = st.rt
    # "alive" counts the ranks whose tiles say they are up, so the header never says
    # 4/4 while tiles still say "starting"
    alive = alive_count(views)
    counts = dict.fromkeys(STATES, 0)
    for v in views:
        counts[v.state] += 1
    chips = "".join(
        f'<span class="mk-chip mk-s-{s}" style="border:1px solid {COLORS[s][1]}">{n} {s}</span>'
        for s, n in counts.items()
        if n
    )
    up = duration(time.time() - rt.started_at)
    status_html = f' · <span class="mk-muted">{esc(status)}</span>' if status else ""
    if rt.state.ended:  # a stopped mesh moves no data: no stale rate
        transfer = ""
    else:
        r_in, r_out = st.throughput.total
        transfer = f" · transfer in {rate_text(r_in)} / out {rate_text(r_out)}"
    return (
        f'<div class="mk-head"><b style="font-size:14px">{esc(rt.name)}</b> · '
        f"{esc(rt.shape.describe())} · {esc(rt.backend)} · "
        f"{phase_html(st, views)} · up {up} · <b>{alive}/{rt.world}</b> alive"
        f"{transfer}{status_html}<br>{chips}</div>"
    )


def alive_count(views: list[TileView]) -> int:
    """Ranks that are up (idle, busy or failed a request), as their tiles show them."""
    return sum(1 for v in views if v.state in UP_STATES)


def hosts_html(rt: MeshRuntime) -> str:
    """Machines that join by themselves (join backend, Ray, Slurm, Lightning): "2/4 hosts
    joined", then one line per host (the command still to run, what the engine is doing,
    where it joined from, or why it was lost) and any notice. Empty for local meshes."""
    from monarch_kernel.launchers.base import RemoteHostHandle

    handles = [(h, h.handle) for h in rt.hosts if isinstance(h.handle, RemoteHostHandle)]
    if not handles:
        return ""
    joined = sum(1 for _, hd in handles if hd.joined)
    rows = []
    for host, hd in handles:
        if host.lost:
            text, cls = f"lost: {host.lost}", "mk-bad"
        else:
            text, cls = hd.status(), "" if hd.joined else "mk-wait"
        if not hd.joined and "run on that machine: " in text:
            head, _, cmd = text.partition("run on that machine: ")
            body = f'{esc(head)}run on that machine: <code class="mk-cmd">{esc(cmd)}</code>'
        else:
            body = esc(text)
        rows.append(f'<div class="mk-host {cls}">host {host.index}: {body}</div>')
    notices = dict.fromkeys(n for _, hd in handles if (n := hd.notice()))
    notes = "".join(f'<div class="mk-notice">⚠ {esc(n)}</div>' for n in notices)
    title = f"{joined}/{len(handles)} hosts joined"
    return f'<div class="mk-sec mk-hosts"><b>{title}</b>{"".join(rows)}{notes}</div>'


def grid_columns(st: MeshState) -> int:
    """Tiles per row: the mesh's last dim (gpus), wrapped at 8 for wide meshes."""
    sizes = list(st.rt.shape.sizes) or [1]
    last = sizes[-1]
    return last if last <= 8 else 8
