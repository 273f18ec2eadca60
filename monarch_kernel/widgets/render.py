"""Text and HTML for the dashboard's parts, computed from a :class:`MeshState`.

Used twice: by the live widgets (one piece of HTML per widget, re-sent only when it
changed) and for the static snapshot that frontends without widgets show (nbconvert,
GitHub), which uses inline styles only.
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.records import MeshPhase
from monarch_kernel.widgets import charts
from monarch_kernel.widgets.fmt import rate_text
from monarch_kernel.widgets.incidents import Incident
from monarch_kernel.widgets.state import JobView, MeshState, Recovery, TileView, duration

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

#: state -> (background, border)
COLORS = {
    "starting": ("#e5e7eb", "#9ca3af"),
    "idle": ("#dcfce7", "#16a34a"),
    "busy": ("#dbeafe", "#2563eb"),
    "paused": ("#fef9c3", "#ca8a04"),  # a debugger holds the rank
    "error": ("#ffedd5", "#ea580c"),
    "dead": ("#fee2e2", "#dc2626"),
    "stopped": ("#f3f4f6", "#9ca3af"),
}
STATES = ("starting", "idle", "busy", "paused", "error", "dead", "stopped")
#: Meshes up to this many ranks get full tiles; bigger ones compact tiles.
FULL_TILES_MAX = 16

#: state -> the JupyterLab CSS variable of its colour (light, dark and high-contrast
#: themes each define these), with a fallback for frontends without JupyterLab's theme.
STATE_VARS = {
    "starting": "var(--jp-border-color1, #9ca3af)",
    "idle": "var(--jp-success-color1, #16a34a)",
    "busy": "var(--jp-brand-color1, #2563eb)",
    # JupyterLab's themes have no yellow: a fixed one (it only tints, text stays legible)
    "paused": "#ca8a04",
    "error": "var(--jp-warn-color1, #ea580c)",
    "dead": "var(--jp-error-color1, #dc2626)",
    "stopped": "var(--jp-border-color1, #9ca3af)",
}

# Every colour of the live dashboard comes from JupyterLab's theme variables (--jp-*), so
# light, dark and high-contrast themes are all legible: text is the theme's font colour on
# the theme's layout colour, and a state only tints a tile's background (at most 16%) and
# colours its border. The fallbacks after each variable are for frontends without them.
CSS = (
    """
<style>
.mk-dash { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #111827); }
.mk-dash .mk-head { padding: 4px 2px; line-height: 1.6; }
.mk-dash .mk-hosts { padding: 2px; line-height: 1.5; }
.mk-dash .mk-host.mk-wait, .mk-dash .mk-notice { color: var(--jp-warn-color0, #92400e); }
.mk-dash .mk-host.mk-bad { color: var(--jp-error-color0, #b91c1c); }
.mk-dash .mk-cmd { user-select: all; background: var(--jp-layout-color2, #f3f4f6);
  color: var(--jp-content-font-color1, #111827); padding: 0 4px; word-break: break-all; }
.mk-dash .mk-chip { display: inline-block; border-radius: 8px; padding: 0 6px;
  margin-right: 4px; font-size: 11px; border: 1px solid var(--mk-c);
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)); }
.mk-dash .mk-tile { white-space: pre !important; text-align: left !important;
  line-height: 1.35 !important; padding: 4px 6px !important; border-radius: 6px !important;
  border: 2px solid var(--mk-c) !important; overflow: hidden; text-overflow: clip;
  font-size: 11px; font-family: var(--jp-code-font-family, monospace);
  box-shadow: none !important; color: var(--jp-ui-font-color1, #111827) !important;
  background: var(--jp-layout-color2, #f3f4f6) !important;
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)) !important; }
.mk-dash .mk-tile.mk-s-starting { border-style: dashed !important; }
.mk-dash .mk-tile.mk-s-stopped { opacity: 0.75; }
.mk-dash .mk-tile.mk-selected { outline: 2px solid var(--jp-ui-font-color1, #111827);
  outline-offset: -5px; }
.mk-dash .mk-detail pre, .mk-dash .mk-errors pre { background: var(--jp-layout-color2, #f9fafb);
  color: var(--jp-content-font-color1, #111827); border: 1px solid var(--jp-border-color2, #e5e7eb);
  padding: 4px 6px; margin: 2px 0 6px; max-height: 180px; overflow: auto; font-size: 11px;
  white-space: pre-wrap; overflow-wrap: anywhere; }
.mk-dash .mk-detail { overflow-wrap: anywhere; }
.mk-dash summary { cursor: pointer; }
.mk-dash .mk-sec { font-weight: bold; margin: 6px 0 2px; }
.mk-dash .mk-incident { border-left: 3px solid var(--jp-warn-color1, #ea580c);
  padding-left: 6px; margin: 4px 0; }
.mk-dash .mk-root { background: var(--jp-error-color1, #dc2626); color: #fff;
  border-radius: 4px; padding: 0 4px; margin-right: 4px; font-size: 10px; }
.mk-dash .mk-root.mk-interrupt { background: var(--jp-layout-color3, #6b7280);
  color: var(--jp-ui-font-color0, #fff); }
.mk-dash .mk-charts svg { margin: 2px 6px 2px 0; }
.mk-dash .mk-muted { color: var(--jp-ui-font-color2, #6b7280); }
.mk-dash .mk-phase { border-radius: 8px; padding: 0 6px; font-weight: bold;
  border: 1px solid var(--mk-c);
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)); }
.mk-dash .mk-phase-recovering { --mk-c: var(--jp-warn-color1, #d97706); }
.mk-dash .mk-phase-stopping { --mk-c: var(--jp-border-color1, #9ca3af); }
.mk-dash .mk-recovery { border-left: 3px solid var(--jp-brand-color1, #2563eb);
  padding-left: 6px; margin: 4px 0; }
.mk-dash .mk-jobs { margin: 2px 0; }
.mk-dash .mk-job { font-family: var(--jp-code-font-family, monospace); font-size: 11px;
  line-height: 28px; margin-right: 6px; }
"""
    + "".join(f".mk-dash .mk-s-{s} {{ --mk-c: {v}; }}\n" for s, v in STATE_VARS.items())
    + "</style>\n"
)

esc = html.escape

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
    lines.append(" · ".join(x for x in (v.device, v.mem) if x) or " ")
    lines.append(
        " · ".join(
            x for x in (f"step {v.step}" if v.step else "", f"seen {v.seen}" if v.seen else "") if x
        )
        or " "
    )
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
    if v.step:
        parts.append(f"step: {v.step}")
    if v.seen:
        parts.append(f"last heard from: {v.seen} ago")
    parts.append(
        f"controller in (from rank): {rate_text(v.rate_in)}; out (to rank): {rate_text(v.rate_out)}"
    )
    if v.restarts:
        parts.append(f"restarts: {v.restarts}")
    parts.append("click: show recent output and last error")
    return "\n".join(parts)


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
        r_in, r_out = st.total_rate
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


def jobs_title_html(st: MeshState, shown: list[JobView]) -> str:
    """The line above the running-jobs rows (empty when nothing runs)."""
    if not shown:
        return ""
    more = st.jobs_more
    extra = f' <span class="mk-muted">(+{more} more not listed)</span>' if more > 0 else ""
    return f'<div class="mk-sec mk-jobs">Running jobs{extra}</div>'


def job_html(job: JobView) -> str:
    """One running job: what, on which ranks, for how long."""
    state = ' <span class="mk-muted">cancelling…</span>' if job.cancelling else ""
    return (
        f'<span class="mk-job" data-request="{esc(job.request)}"><b>{esc(job.what)}</b> · '
        f"running on {esc(job.ranks)} · {esc(job.elapsed)}{state}</span>"
    )


def detail_html(st: MeshState, rank: int | None, view: TileView | None) -> str:
    if rank is None or view is None:
        return (
            '<div class="mk-detail mk-muted">Click a tile to see that rank\'s recent output '
            "and last error.</div>"
        )
    lines = st.output_lines(rank)
    out = esc("\n".join(lines)) if lines else '<span class="mk-muted">(no output yet)</span>'
    found = st.last_error.get(rank)
    if found is not None:
        incident, entry = found
        when = time.strftime("%H:%M:%S", time.localtime(entry.first))
        err = (
            f"<div>{esc(entry.title)} <span class='mk-muted'>({when}"
            f"{', ' + esc(incident.what) if incident.what else ''})</span></div>"
            f"<pre>{esc(entry.detail)}</pre>"
        )
    else:
        err = '<div class="mk-muted">none</div>'
    what = f": {esc(view.what)}" if view.what else ""
    return (
        f'<div class="mk-detail"><div><b>rank {rank}</b> ({esc(view.coords)}) · '
        f"{esc(view.state)}{what} · {esc(view.host)} pid {esc(view.pid or '?')} · "
        f"{esc(view.device or '?')} · restarts {view.restarts}</div>"
        f'<div class="mk-sec">Recent output</div><pre>{out}</pre>'
        f'<div class="mk-sec">Last error</div>{err}</div>'
    )


def errors_html(st: MeshState, limit: int = 8) -> str:
    """The incident area: error incidents and restarts in place, newest first."""
    recoveries = list(st.recoveries)
    if not st.incidents and not recoveries:
        return (
            '<div class="mk-errors"><div class="mk-sec">Errors</div>'
            '<div class="mk-muted">none</div></div>'
        )
    title = "Errors and recoveries" if recoveries else "Errors"
    parts = [f'<div class="mk-errors"><div class="mk-sec">{title} (newest first)</div>']
    items: list[tuple[float, Incident | Recovery]] = [(inc.last, inc) for inc in st.incidents]
    items += [(rec.time, rec) for rec in recoveries]
    items.sort(key=lambda item: item[0], reverse=True)
    first_incident = True
    for _, item in items[:limit]:
        if isinstance(item, Recovery):
            parts.append(_recovery_html(st, item))
        else:
            parts.append(_incident_html(st, item, open_first=first_incident))
            first_incident = False
    if len(items) > limit:
        parts.append(f'<div class="mk-muted">{len(items) - limit} older not shown</div>')
    parts.append("</div>")
    return "".join(parts)


def _recovery_html(st: MeshState, rec: Recovery) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(rec.time))
    restarted = list(rec.report.restarted)
    who = ""
    if restarted:
        many = "ranks" if len(restarted) > 1 else "rank"
        who = f" · {many} {format_ranks(restarted)} of {st.rt.world}"
    return (
        f'<div class="mk-recovery"><div><b>{when}</b> · recovered{who}</div>'
        f"<pre>{esc(rec.text)}</pre></div>"
    )


def _incident_html(st: MeshState, inc: Incident, open_first: bool) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(inc.first))
    what = f" · {esc(inc.what)}" if inc.what else ""
    ranks = inc.ranks
    head = (
        f"<div><b>{when}</b>{what} · {'ranks' if len(ranks) > 1 else 'rank'} "
        f"{format_ranks(ranks)} of {st.rt.world}</div>"
    )
    body = []
    for i, e in enumerate(inc.entries):
        root = ""
        if i == 0:
            badge = "interrupted" if e.kind == "interrupt" else "root cause"
            root = f'<span class="mk-root mk-{e.kind}">{badge}</span>'

        who = f"{'ranks' if len(e.ranks) > 1 else 'rank'} {format_ranks(e.ranks)}"
        hosts = f" on {', '.join(e.hosts)}" if e.hosts else ""
        body.append(
            f"<details{' open' if open_first and i == 0 else ''}><summary>{root}"
            f"{esc(e.title)} — {who}{esc(hosts)}</summary><pre>{esc(e.detail)}</pre></details>"
        )
    return f'<div class="mk-incident">{head}{"".join(body)}</div>'


def metric_charts(st: MeshState) -> list[str]:
    out = []
    for name, per_rank in list(st.metrics.items()):
        lines = [(f"r{r}", *s.arrays()) for r, s in sorted(per_rank.items())]
        out.append(charts.line_chart(name, lines, chart_id=f"metric:{name}", x_label="step"))
    return out


def _rate_unit(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0.0)
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if top >= scale:
            return scale, unit
    return 1.0, "B/s"


def throughput_chart(st: MeshState) -> str:
    """Transfer rates over time: per rank in (solid) and out (dashed), or the mesh total
    when the controller keeps no per-rank counters."""
    hist = list(st.rate_history)
    if not hist:
        return charts.line_chart("transfer", [], chart_id="throughput")
    t0 = hist[0][0]
    raw: list[tuple[str, list[tuple[float, float]]]] = []
    dashed: list[bool] = []
    if st.per_rank_bytes:
        ranks = sorted({r for _, rates, _ in hist for r in rates})
        if len(ranks) <= charts.MAX_LINES // 2:
            for idx, direction in ((0, "in"), (1, "out")):
                for r in ranks:
                    pts = [(t - t0, rates[r][idx]) for t, rates, _ in hist if r in rates]
                    raw.append((f"r{r} {direction}", pts))
                    dashed.append(idx == 1)
        else:  # too many lines: the mean per direction
            for idx, direction in ((0, "in"), (1, "out")):
                pts = [
                    (t - t0, sum(v[idx] for v in rates.values()) / max(1, len(rates)))
                    for t, rates, _ in hist
                ]
                raw.append((f"mean {direction}", pts))
                dashed.append(idx == 1)
    else:
        raw = [
            ("in", [(t - t0, tot[0]) for t, _, tot in hist]),
            ("out", [(t - t0, tot[1]) for t, _, tot in hist]),
        ]
        dashed = [False, True]
    scale, unit = _rate_unit([y for _, pts in raw for _, y in pts])
    lines = [(label, [x for x, _ in pts], [y / scale for _, y in pts]) for label, pts in raw]
    title = f"transfer {unit}" + ("" if st.per_rank_bytes else " (mesh total)")
    return charts.line_chart(title, lines, chart_id="throughput", dashed=dashed, x_label="s")


def metrics_hint() -> str:
    """What to do to see metric charts (shown until a rank reports one)."""
    return (
        '<div class="mk-muted">Call <code>monarch_kernel.report(step=i, loss=...)</code> '
        "inside a rank to chart metrics here.</div>"
    )


def charts_html(st: MeshState) -> str:
    parts = [throughput_chart(st), *metric_charts(st)]
    hint = "" if st.metrics else metrics_hint()
    return (
        f'<div class="mk-charts" style="display:flex;flex-wrap:wrap">{"".join(parts)}</div>{hint}'
    )


def snapshot_html(st: MeshState, views: list[TileView], columns: int) -> str:
    """A static, self-contained HTML view (inline styles only) for non-widget frontends."""
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
    return (
        # light colours of its own: legible whatever the theme of the page showing it
        '<div class="mk-dash-static" style="font-family:sans-serif;font-size:12px;'
        'background:#fff;color:#111827;padding:4px">'
        + header_html(st, views)
        + jobs_snapshot_html(st)
        + f'<table style="border-collapse:separate;border-spacing:3px">{"".join(rows)}</table>'
        + charts_html(st)
        + errors_html(st)
        + "</div>"
    )


def jobs_snapshot_html(st: MeshState) -> str:
    """The running jobs, for the static snapshot (no buttons there)."""
    shown = st.jobs_view()
    if not shown:
        return ""
    rows = "".join(f"<div>{job_html(job)}</div>" for job in shown)
    return jobs_title_html(st, shown) + rows


def snapshot_text(st: MeshState, views: list[TileView]) -> str:
    """The plain-text view: one line per rank."""
    rt = st.rt
    alive = alive_count(views)
    lines = [
        f"Mesh {rt.name!r} {rt.shape.describe()} ({rt.backend}, "
        f"{phase_text(st, views)}): {alive}/{rt.world} alive, "
        f"up {duration(time.time() - rt.started_at)}"
    ]
    for v in views:
        extra = " ".join(x for x in (v.what, f"step {v.step}" if v.step else "", v.mem) if x)
        lines.append(f"  rank {v.rank:<3} {v.state:<8} {extra}".rstrip())
    for job in st.jobs_view():
        lines.append(f"  running: {job.text}")
    if st.recoveries:
        lines.append(f"  {st.recoveries[0].summary}")
    for inc in st.incidents[:3]:
        e = inc.entries[0]
        lines.append(f"  error: {e.title} on ranks {format_ranks(inc.ranks)}")
    return "\n".join(lines)


def grid_columns(st: MeshState) -> int:
    """Tiles per row: the mesh's last dim (gpus), wrapped at 8 for wide meshes."""
    sizes = list(st.rt.shape.sizes) or [1]
    last = sizes[-1]
    return last if last <= 8 else 8


def summary(st: MeshState, views: list[TileView]) -> dict[str, Any]:
    """Counts by state (used by tests and the text view)."""
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    return counts
