"""Small inline-SVG line charts (no JavaScript, no second server: plain HTML in a widget).

Few ranks: one line per rank. Many ranks: the mean with a min/max band, so one slow or
diverging rank still shows as a widening band.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

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


#: Space around the plot area of a chart: left (y labels), right, top (title), bottom.
PAD_L, PAD_R, PAD_T, PAD_B = 44, 8, 20, 16


@dataclass(frozen=True)
class Drawn:
    """One line as drawn: thinned points (or the band's mean), its colour and dash."""

    label: str
    xs: list[float]
    ys: list[float]
    color: str
    dashed: bool


@dataclass(frozen=True)
class Frame:
    """A chart's plot area and value ranges: maps values to SVG coordinates."""

    width: int
    height: int
    x0: float
    x1: float
    y0: float
    y1: float

    @property
    def w(self) -> int:
        return self.width - PAD_L - PAD_R

    @property
    def h(self) -> int:
        return self.height - PAD_T - PAD_B

    def sx(self, x: float) -> float:
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * self.w

    def sy(self, y: float) -> float:
        return PAD_T + self.h - (y - self.y0) / (self.y1 - self.y0) * self.h

    def points(self, xs: Sequence[float], ys: Sequence[float]) -> str:
        """SVG ``points`` of the finite values."""
        return " ".join(
            f"{self.sx(x):.1f},{self.sy(y):.1f}" for x, y in zip(xs, ys) if math.isfinite(y)
        )


def _drawn_lines(
    lines: Sequence[Line], dashed: Sequence[bool]
) -> tuple[list[Drawn], list[tuple[float, float, float, float]]]:
    """The lines to draw and, past :data:`MAX_LINES`, the band rows they are the mean of."""
    if len(lines) > MAX_LINES:
        rows = band([(xs, ys) for _, xs, ys in lines])
        mean = Drawn(
            f"mean of {len(lines)}", [r[0] for r in rows], [r[1] for r in rows], color(0), False
        )
        return [mean], rows
    drawn = []
    for i, (label, xs, ys) in enumerate(lines):
        dash = bool(dashed[i]) if i < len(dashed) else False
        tx, ty = _thin(xs, ys)
        drawn.append(Drawn(label, tx, ty, color(i), dash))
    return drawn, []


def _frame(
    drawn: list[Drawn], rows: list[tuple[float, float, float, float]], width: int, height: int
) -> Frame | None:
    """The ranges that hold every point (and the band); None when there is nothing."""
    all_x = [x for d in drawn for x in d.xs]
    all_y = [y for d in drawn for y in d.ys if math.isfinite(y)]
    all_y += [v for _, _, lo, hi in rows for v in (lo, hi)]
    if not all_x or not all_y:
        return None
    x0, x1 = min(all_x), max(all_x)
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:  # a flat line: a range around it, so it is drawn mid-height
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    return Frame(width, height, x0, x1, y0, y1)


def _axes(f: Frame, unit: str, x_label: str) -> str:
    """The two axes and their end labels (y: min and max; x: first, name, last)."""
    esc = html.escape
    w, h, height = f.w, f.h, f.height
    return (
        f'<line x1="{PAD_L}" y1="{PAD_T + h}" x2="{PAD_L + w}" y2="{PAD_T + h}" stroke="#9ca3af"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{PAD_T + h}" stroke="#9ca3af"/>'
        f'<text x="{PAD_L - 3}" y="{PAD_T + 4}" text-anchor="end" fill="#4b5563">'
        f"{_fmt(f.y1)}{esc(unit)}</text>"
        f'<text x="{PAD_L - 3}" y="{PAD_T + h}" text-anchor="end" fill="#4b5563">'
        f"{_fmt(f.y0)}{esc(unit)}</text>"
        f'<text x="{PAD_L}" y="{height - 3}" fill="#4b5563">{_fmt(f.x0)}</text>'
        f'<text x="{PAD_L + w / 2:.0f}" y="{height - 3}" text-anchor="middle" fill="#9ca3af">'
        f"{esc(x_label)}</text>"
        f'<text x="{PAD_L + w}" y="{height - 3}" text-anchor="end" fill="#4b5563">'
        f"{_fmt(f.x1)}</text>"
    )


def _band_svg(f: Frame, rows: list[tuple[float, float, float, float]]) -> str:
    """The min/max band: along the maxima, back along the minima."""
    upper = " ".join(f"{f.sx(x):.1f},{f.sy(hi):.1f}" for x, _, _, hi in rows)
    lower = " ".join(f"{f.sx(x):.1f},{f.sy(lo):.1f}" for x, _, lo, _ in reversed(rows))
    return (
        f'<polygon class="mk-band" points="{upper} {lower}" fill="{color(0)}" '
        'fill-opacity="0.18" stroke="none"/>'
    )


def _line_svg(f: Frame, d: Drawn) -> list[str]:
    """One line: its earlier runs faded, behind the current one."""
    esc = html.escape
    *old, (xs, ys) = runs(d.xs, d.ys)
    style = ' stroke-dasharray="4 2"' if d.dashed else ""
    out = [
        f'<polyline class="mk-old-run" points="{f.points(oxs, oys)}" fill="none" '
        f'stroke="{d.color}" stroke-opacity="0.35" stroke-width="1"{style}/>'
        for oxs, oys in old
    ]
    out.append(
        f'<polyline class="mk-line" data-label="{esc(d.label)}" data-last-x="{xs[-1]:g}" '
        f'data-last-y="{ys[-1]:g}" data-points="{len(xs)}" points="{f.points(xs, ys)}" '
        f'fill="none" stroke="{d.color}" stroke-width="1.5"{style}/>'
    )
    return out


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
    lines = [line for line in lines if len(line[1])]
    drawn, rows = _drawn_lines(lines, dashed)
    esc = html.escape
    out = [
        f'<svg class="mk-chart" data-chart="{esc(chart_id or title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" '
        'font-family="sans-serif" font-size="10">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff" stroke="#e5e7eb"/>',
        f'<text x="{PAD_L}" y="13" font-weight="bold" fill="#111827">{esc(title)}</text>',
    ]
    f = _frame(drawn, rows, width, height)
    if f is None:
        h = height - PAD_T - PAD_B
        out.append(
            f'<text x="{PAD_L + 4}" y="{PAD_T + h / 2:.0f}" fill="#9ca3af">waiting for data</text>'
        )
        out.append("</svg>")
        return "".join(out)
    out.append(_axes(f, unit, x_label))
    if rows:
        out.append(_band_svg(f, rows))
    legend_x = PAD_L + 4 + len(title) * 6.5 + 8
    for d in drawn:
        out += _line_svg(f, d)
        if legend_x < width - 30:
            out.append(f'<text x="{legend_x:.0f}" y="13" fill="{d.color}">{esc(d.label)}</text>')
            legend_x += len(d.label) * 6 + 10
    if len(lines) > MAX_LINES:
        out.append(f'<text x="{legend_x:.0f}" y="13" fill="#6b7280">band: min–max</text>')
    out.append("</svg>")
    return "".join(out)
