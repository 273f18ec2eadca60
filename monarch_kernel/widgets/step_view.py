"""The dashboard's "where the time goes" view: per-rank step time by category (a
stacked bar each: compute / comm / data / optimizer / other, over the last steps), the
straggler named, a heat map of step time by rank over the last steps, and collective
bus bandwidth per rank. Fed by the mesh's step telemetry
(:class:`~monarch_kernel.controller.telemetry.steps.MeshTelemetry`), redrawn at most
once a second and only when something changed.

The widget's state carries the numbers too (:attr:`StepsHTML.steps`: per rank, ms per
step by category, step time, bandwidth), so a notebook or a test reads the breakdown
from the model, not from the HTML.

Large meshes: the bars show the slowest :data:`MAX_BARS` ranks (and say so); the heat
map is an image (one pixel per rank and step, scaled), so 1,000 ranks cost a few KB.
"""

from __future__ import annotations

import base64
import html
import struct
import zlib
from typing import TYPE_CHECKING, Any

import ipywidgets as W
import numpy as np
import traitlets

from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.fmt import rate_text
from monarch_kernel.wire.steps import CATEGORIES

if TYPE_CHECKING:
    from monarch_kernel.controller.telemetry.steps import MeshTelemetry

#: Steps the bars average over, and the heat map's columns.
LAST_STEPS = 20
HEAT_STEPS = 60
#: Ranks drawn as bars at most (the slowest ones).
MAX_BARS = 32
#: Seconds between two redraws.
PERIOD = 1.0
#: category -> its colour in the bars and the legend.
COLOURS = {
    "compute": "#2563eb",
    "comm": "#dc2626",
    "data": "#ca8a04",
    "optim": "#7c3aed",
    "other": "#9ca3af",
}
LABELS = {
    "compute": "compute",
    "comm": "waiting in collectives",
    "data": "data loading",
    "optim": "optimizer",
    "other": "other",
}


class StepsHTML(W.HTML):
    """The view's HTML, with the numbers it shows in its model (``steps``)."""

    steps = traitlets.Dict().tag(sync=True)


class StepView:
    """Renders a mesh's step telemetry into :attr:`html` (call :meth:`put` each tick)."""

    def __init__(self, telemetry: MeshTelemetry | None):
        self.telemetry = telemetry
        self.html = StepsHTML()
        self.html.add_class("mk-steps")
        self._last = 0.0
        self._seen = -1

    def put(self, now: float, force: bool = False) -> int:
        """Redraw if due and changed; returns the widget messages sent (0 or 1)."""
        tel = self.telemetry
        if tel is None or (not force and now - self._last < PERIOD):
            return 0
        self._last = now
        if tel.received == self._seen and not force:
            return 0
        self._seen = tel.received
        state = model_state(tel)
        if not state:
            return 0
        return put(self.html, value=render(state, tel), steps=state)


def model_state(tel: MeshTelemetry) -> dict[str, Any]:
    """Per-rank ms per step by category, step time, bandwidth (the widget's ``steps``)."""
    rows = tel.breakdown(LAST_STEPS)
    if not rows:
        return {}
    ranks = sorted(rows)
    state: dict[str, Any] = {"ranks": ranks, "last_steps": LAST_STEPS}
    for c in CATEGORIES:
        state[c] = [round(rows[r].seconds[c] * 1000, 3) for r in ranks]
    state["step_ms"] = [round(rows[r].wall * 1000, 3) for r in ranks]
    state["bus_bytes_per_s"] = [round(rows[r].bus_bandwidth, 1) for r in ranks]
    state["step"] = [rows[r].last_step for r in ranks]
    current = tel.detector.current
    state["straggler"] = current.line() if current is not None else ""
    return state


def render(state: dict[str, Any], tel: MeshTelemetry) -> str:
    """The view's HTML."""
    ranks: list[int] = state["ranks"]
    walls: list[float] = state["step_ms"]
    order = sorted(range(len(ranks)), key=lambda i: -walls[i])[:MAX_BARS]
    order.sort(key=lambda i: ranks[i])
    longest = max(walls) or 1.0
    parts = [
        "<div class='mk-steps-view' style='font-size:12px;margin:6px 0'>",
        f"<b>Where the time goes</b> <span style='opacity:.7'>(mean of the last "
        f"{LAST_STEPS} steps per rank)</span>",
    ]
    if state.get("straggler"):
        parts.append(
            "<div class='mk-straggler' style='color:var(--jp-error-color1,#dc2626);"
            f"margin:3px 0'>{html.escape(state['straggler'])}</div>"
        )
    parts.append("<div style='margin:3px 0'>")
    for c in CATEGORIES:
        parts.append(
            f"<span style='margin-right:10px'><span style='display:inline-block;width:10px;"
            f"height:10px;background:{COLOURS[c]};margin-right:3px'></span>{LABELS[c]}</span>"
        )
    parts.append("</div>")
    if len(ranks) > MAX_BARS:
        parts.append(f"<div style='opacity:.7'>the {MAX_BARS} slowest of {len(ranks)} ranks</div>")
    for i in order:
        r = ranks[i]
        segs = []
        for c in CATEGORIES:
            ms = state[c][i]
            width = 100.0 * ms / longest
            if width > 0.05:
                segs.append(
                    f"<span class='mk-seg mk-seg-{c}' title='{LABELS[c]} {ms:.1f} ms' "
                    f"style='display:inline-block;height:12px;width:{width:.2f}%;"
                    f"background:{COLOURS[c]}'></span>"
                )
        bw = state["bus_bytes_per_s"][i]
        bw_text = f" · {rate_text(bw)} bus" if bw > 0 else ""
        parts.append(
            f"<div class='mk-step-row' data-rank='{r}' style='display:flex;align-items:center;"
            "gap:6px;margin:1px 0'>"
            f"<span style='width:56px;text-align:right'>rank {r}</span>"
            f"<span style='flex:1 1 auto;display:flex;min-width:120px'>{''.join(segs)}</span>"
            f"<span style='width:170px'>{walls[i]:.1f} ms/step{bw_text}</span></div>"
        )
    heat = tel.heat(HEAT_STEPS)
    if heat:
        parts.append(heat_html(heat))
    parts.append("</div>")
    return "".join(parts)


def heat_html(heat: dict[int, list[float]]) -> str:
    """Step time by rank (rows) over the last steps (columns) as a scaled image: dark is
    the fastest step in view, bright red the slowest."""
    ranks = sorted(heat)
    width = max(len(v) for v in heat.values())
    grid = np.full((len(ranks), width), np.nan)
    for row, r in enumerate(ranks):
        values = heat[r]
        grid[row, width - len(values) :] = values
    finite = grid[np.isfinite(grid)]
    if finite.size == 0:
        return ""
    # a percentile range: one warm-up step of a second must not wash the rest out
    lo, hi = (float(v) for v in np.percentile(finite, [2, 95]))
    scale = np.clip((grid - lo) / (hi - lo), 0, 1) if hi > lo else np.zeros_like(grid)
    rgb = np.zeros((len(ranks), width, 3), dtype=np.uint8)
    level = np.nan_to_num(scale, nan=0.0)
    rgb[..., 0] = (40 + 215 * level).astype(np.uint8)
    rgb[..., 1] = (40 + 60 * (1 - level)).astype(np.uint8)
    rgb[..., 2] = (90 * (1 - level)).astype(np.uint8)
    rgb[~np.isfinite(grid)] = (230, 230, 230)
    png = _png(rgb)
    height = min(240, max(48, 12 * len(ranks)))
    return (
        "<div style='margin-top:6px'><span style='opacity:.7'>step time by rank "
        f"(rows, {len(ranks)} ranks) over the last {width} steps: {lo * 1000:.1f} ms "
        f"(dark) to {hi * 1000:.1f} ms or more (red)</span><br>"
        f"<img class='mk-step-heat' alt='step time by rank' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode()}' "
        f"style='width:100%;max-width:720px;height:{height}px;image-rendering:pixelated'>"
        "</div>"
    )


def _png(rgb: np.ndarray) -> bytes:
    """An RGB image (``rows x cols x 3`` bytes) as PNG."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


__all__ = ["StepView", "StepsHTML", "model_state", "render"]
