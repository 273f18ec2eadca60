"""The static SVG charts pane (inline SVG in one HTML widget): the transfer rates, the
ranks' GPU utilisation and memory (when their host agents sample GPUs) and one chart per
reported metric. The live dashboard shows it when live charts are off (no
anywidget, or ``MONARCH_KERNEL_CHARTS=svg``); the snapshot always does."""

from __future__ import annotations

from monarch_kernel.widgets import charts, gpu_view
from monarch_kernel.widgets.state import MeshState


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
    hist = list(st.throughput.history)
    if not hist:
        return charts.line_chart("transfer", [], chart_id="throughput")
    t0 = hist[0][0]
    raw: list[tuple[str, list[tuple[float, float]]]] = []
    dashed: list[bool] = []
    if st.throughput.per_rank_bytes:
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
    title = f"transfer {unit}" + ("" if st.throughput.per_rank_bytes else " (mesh total)")
    return charts.line_chart(title, lines, chart_id="throughput", dashed=dashed, x_label="s")


def metrics_hint() -> str:
    """What to do to see metric charts (shown until a rank reports one)."""
    return (
        '<div class="mk-muted">Call <code>monarch_kernel.report(step=i, loss=...)</code> '
        "inside a rank to chart metrics here.</div>"
    )


def charts_html(st: MeshState) -> str:
    parts = [throughput_chart(st), *gpu_view.svg_charts(st.gpu), *metric_charts(st)]
    hint = "" if st.metrics else metrics_hint()
    return (
        f'<div class="mk-charts" style="display:flex;flex-wrap:wrap">{"".join(parts)}</div>{hint}'
    )
