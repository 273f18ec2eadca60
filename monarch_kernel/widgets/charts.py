"""Small inline-SVG line charts (no JavaScript, no second server: plain HTML in a widget).

Few ranks: one line per rank. Many ranks: the mean with a min/max band, so one slow or
diverging rank still shows as a widening band.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np

#: Ranks up to this many get a line each; more get mean + min/max band.
MAX_LINES = 8
MAX_POINTS = 160  # points drawn per line
PALETTE = (
    "#2563eb", "#dc2626", "#16a34a", "#9333ea",
    "#ea580c", "#0891b2", "#ca8a04", "#db2777",
)  # fmt: skip

Line = tuple[str, Sequence[float], Sequence[float]]  # (label, xs, ys)


def color(i: int) -> str:
    """The line colour of series ``i`` (cycles through the palette)."""
    return PALETTE[i % len(PALETTE)]


def _thin(
    xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS
) -> tuple[list[float], list[float]]:
    """At most about ``limit`` evenly spaced points, always keeping the last one."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    step = -(-n // limit)
    tx, ty = list(xs[::step]), list(ys[::step])
    if (n - 1) % step:
        tx.append(xs[-1])
        ty.append(ys[-1])
    return tx, ty


def band(
    lines: Sequence[tuple[Sequence[float], Sequence[float]]], bins: int = 80
) -> list[tuple[float, float, float, float]]:
    """``(x, mean, min, max)`` per x-bin over all ``lines`` (numpy: cheap for 64 ranks)."""
    thinned = [_thin(x, y, 100) for x, y in lines if len(x)]  # before numpy: it is the cost
    xs = [np.asarray(x, dtype=float) for x, _ in thinned]
    ys = [np.asarray(y, dtype=float) for _, y in thinned]
    if not xs:
        return []
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    ok = np.isfinite(y) & np.isfinite(x)
    x, y = x[ok], y[ok]
    if not len(x):
        return []
    x0, x1 = float(x.min()), float(x.max())
    span = (x1 - x0) or 1.0
    idx = np.minimum(bins - 1, ((x - x0) / span * bins).astype(int))
    count = np.bincount(idx, minlength=bins)
    sx = np.bincount(idx, weights=x, minlength=bins)
    sy = np.bincount(idx, weights=y, minlength=bins)
    lo = np.full(bins, np.inf)
    hi = np.full(bins, -np.inf)
    np.minimum.at(lo, idx, y)
    np.maximum.at(hi, idx, y)
    used = count > 0
    return list(
        zip(
            (sx[used] / count[used]).tolist(),
            (sy[used] / count[used]).tolist(),
            lo[used].tolist(),
            hi[used].tolist(),
        )
    )


def runs(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[list[float], list[float]]]:
    """Split a series where x goes back (a training run that started again at step 0):
    each run is drawn on its own, never joined to the previous one."""
    out: list[tuple[list[float], list[float]]] = []
    start = 0
    for i in range(1, len(xs)):
        if xs[i] < xs[i - 1]:
            out.append((list(xs[start:i]), list(ys[start:i])))
            start = i
    out.append((list(xs[start:]), list(ys[start:])))
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.2e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def line_chart(
    title: str,
    lines: Sequence[Line],
    *,
    width: int = 320,
    height: int = 130,
    unit: str = "",
    chart_id: str = "",
    dashed: Sequence[bool] = (),
    x_label: str = "",
) -> str:
    """An SVG chart of ``lines`` (``(label, xs, ys)``); more than :data:`MAX_LINES`
    lines become their mean with a min/max band."""
    pad_l, pad_r, pad_t, pad_b = 44, 8, 20, 16
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    lines = [line for line in lines if len(line[1])]
    aggregated = len(lines) > MAX_LINES
    drawn: list[tuple[str, list[float], list[float], str, bool]] = []
    rows: list[tuple[float, float, float, float]] = []
    if aggregated:
        rows = band([(xs, ys) for _, xs, ys in lines])
        drawn.append(
            (f"mean of {len(lines)}", [r[0] for r in rows], [r[1] for r in rows], color(0), False)
        )
    else:
        for i, (label, xs, ys) in enumerate(lines):
            dash = bool(dashed[i]) if i < len(dashed) else False
            tx, ty = _thin(xs, ys)
            drawn.append((label, tx, ty, color(i), dash))
    all_x = [x for _, xs, _, _, _ in drawn for x in xs]
    all_y = [y for _, _, ys, _, _ in drawn for y in ys if math.isfinite(y)]
    all_y += [v for _, _, lo, hi in rows for v in (lo, hi)]
    esc = html.escape
    out = [
        f'<svg class="mk-chart" data-chart="{esc(chart_id or title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" '
        'font-family="sans-serif" font-size="10">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff" stroke="#e5e7eb"/>',
        f'<text x="{pad_l}" y="13" font-weight="bold" fill="#111827">{esc(title)}</text>',
    ]
    if not all_x or not all_y:
        out.append(
            f'<text x="{pad_l + 4}" y="{pad_t + h / 2:.0f}" fill="#9ca3af">waiting for data</text>'
        )
        out.append("</svg>")
        return "".join(out)
    x0, x1 = min(all_x), max(all_x)
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return pad_t + h - (y - y0) / (y1 - y0) * h

    out.append(
        f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#9ca3af"/>'
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="#9ca3af"/>'
        f'<text x="{pad_l - 3}" y="{pad_t + 4}" text-anchor="end" fill="#4b5563">'
        f"{_fmt(y1)}{esc(unit)}</text>"
        f'<text x="{pad_l - 3}" y="{pad_t + h}" text-anchor="end" fill="#4b5563">'
        f"{_fmt(y0)}{esc(unit)}</text>"
        f'<text x="{pad_l}" y="{height - 3}" fill="#4b5563">{_fmt(x0)}</text>'
        f'<text x="{pad_l + w / 2:.0f}" y="{height - 3}" text-anchor="middle" fill="#9ca3af">'
        f"{esc(x_label)}</text>"
        f'<text x="{pad_l + w}" y="{height - 3}" text-anchor="end" fill="#4b5563">{_fmt(x1)}</text>'
    )
    if rows:
        upper = " ".join(f"{sx(x):.1f},{sy(hi):.1f}" for x, _, _, hi in rows)
        lower = " ".join(f"{sx(x):.1f},{sy(lo):.1f}" for x, _, lo, _ in reversed(rows))
        out.append(
            f'<polygon class="mk-band" points="{upper} {lower}" fill="{color(0)}" '
            'fill-opacity="0.18" stroke="none"/>'
        )
    legend_x = pad_l + 4 + len(title) * 6.5 + 8
    for label, all_xs, all_ys, col, dash in drawn:
        *old, (xs, ys) = runs(all_xs, all_ys)
        style = ' stroke-dasharray="4 2"' if dash else ""
        for oxs, oys in old:  # earlier runs: faded, behind the current one
            pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(oxs, oys) if math.isfinite(y))
            out.append(
                f'<polyline class="mk-old-run" points="{pts}" fill="none" stroke="{col}" '
                f'stroke-opacity="0.35" stroke-width="1"{style}/>'
            )
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys) if math.isfinite(y))
        out.append(
            f'<polyline class="mk-line" data-label="{esc(label)}" data-last-x="{xs[-1]:g}" '
            f'data-last-y="{ys[-1]:g}" data-points="{len(xs)}" points="{coords}" fill="none" '
            f'stroke="{col}" stroke-width="1.5"{style}/>'
        )
        if legend_x < width - 30:
            out.append(f'<text x="{legend_x:.0f}" y="13" fill="{col}">{esc(label)}</text>')
            legend_x += len(label) * 6 + 10
    if aggregated:
        out.append(f'<text x="{legend_x:.0f}" y="13" fill="#6b7280">band: min–max</text>')
    out.append("</svg>")
    return "".join(out)
