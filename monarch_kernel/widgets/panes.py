"""HTML of the dashboard's text panes: the running jobs, the selected rank's detail and
the incident area (errors and recoveries). Shared by the live widgets and the snapshot."""

from __future__ import annotations

import time
from html import escape as esc

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.widgets.incidents import Incident
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.views import JobView, Recovery, TileView


def jobs_title_html(st: MeshState, shown: list[JobView]) -> str:
    """The line above the running-jobs rows (empty when nothing runs)."""
    if not shown:
        return ""
    more = st.running.more
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


#: Different errors shown per incident (on a big mesh every rank may fail its own way);
#: the rest are counted, with their ranks.
MAX_ENTRIES = 6
#: Hosts named per error; the rest are counted.
MAX_HOSTS = 4


def hosts_text(hosts: list[str]) -> str:
    """`` on a, b`` or `` on a, b, c, d +12 more hosts`` (empty for none)."""
    if not hosts:
        return ""
    more = len(hosts) - MAX_HOSTS
    extra = f" +{more} more hosts" if more > 0 else ""
    return f" on {', '.join(hosts[:MAX_HOSTS])}{extra}"


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
    for i, e in enumerate(inc.entries[:MAX_ENTRIES]):
        root = ""
        if i == 0:
            badge = "interrupted" if e.kind == "interrupt" else "root cause"
            root = f'<span class="mk-root mk-{e.kind}">{badge}</span>'

        who = f"{'ranks' if len(e.ranks) > 1 else 'rank'} {format_ranks(e.ranks)}"
        body.append(
            f"<details{' open' if open_first and i == 0 else ''}><summary>{root}"
            f"{esc(e.title)} — {who}{esc(hosts_text(e.hosts))}</summary>"
            f"<pre>{esc(e.detail)}</pre></details>"
        )
    rest = inc.entries[MAX_ENTRIES:]
    if rest:
        ranks_left = sorted({r for e in rest for r in e.ranks})
        body.append(
            f'<div class="mk-muted">+{len(rest)} more different errors on '
            f"{'ranks' if len(ranks_left) > 1 else 'rank'} {format_ranks(ranks_left)}</div>"
        )
    return f'<div class="mk-incident">{head}{"".join(body)}</div>'
