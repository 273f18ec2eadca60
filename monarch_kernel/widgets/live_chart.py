"""The dashboard's live charts: an anywidget front end drawing with uPlot.

The kernel sends a chart only what is new (appends), at the dashboard's pace (at most four
updates a second); a view that opens later asks for the whole history once. The front end
(``static/chart.js``) has a log/linear toggle, tick labels, a hover readout per rank,
drag to zoom, optional smoothing, starts a new line when a series' x goes back (a run
started again at step 0) and draws many ranks as their mean with a min/max band.

uPlot's built JS and CSS are vendored in ``static/uplot`` (MIT licence file included):
nothing is fetched at runtime. Without anywidget, or with ``MONARCH_KERNEL_CHARTS=svg``
(:data:`AVAILABLE` false), the dashboard keeps its static SVG charts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any, TypedDict

try:
    import anywidget
    import traitlets

    # MONARCH_KERNEL_CHARTS=svg keeps the static SVG charts: for a frontend that shows
    # core ipywidgets but cannot load anywidget's front end
    AVAILABLE = os.environ.get("MONARCH_KERNEL_CHARTS", "").lower() != "svg"
except ImportError:  # pragma: no cover - anywidget is a dependency; be safe anyway
    AVAILABLE = False


class Points(TypedDict, total=False):
    """One series' points in a message to the front end."""

    key: str  # stable identity (``r3``, ``r3 in``)
    label: str  # what the readout calls it
    group: str  # series averaged together when there are many (``in``, ``out``)
    dash: bool
    start: int  # arrival index of the first point (overlaps are dropped by the front end)
    count: int  # points of the series so far (a reset)
    x: list[float]
    y: list[float]


@cache
def _asset(name: str) -> str:
    return resources.files("monarch_kernel.widgets").joinpath("static", name).read_text("utf-8")


def esm() -> str:
    """The front end: uPlot's build, then our module (it uses the ``uPlot`` it defines)."""
    return _asset("uplot/uPlot.iife.min.js") + "\n" + _asset("chart.js")


def css() -> str:
    return _asset("uplot/uPlot.min.css") + "\n" + _asset("chart.css")


if AVAILABLE:

    class LiveChart(anywidget.AnyWidget):
        """One live line chart (a metric, or transfer rates).

        ``snapshot`` returns the whole history (sent when a view opens); :meth:`append`
        sends new points. Both may be called from any thread.
        """

        _esm = traitlets.Unicode(esm()).tag(sync=True)
        _css = traitlets.Unicode(css()).tag(sync=True)
        chart_id = traitlets.Unicode("").tag(sync=True)
        title = traitlets.Unicode("").tag(sync=True)
        x_label = traitlets.Unicode("step").tag(sync=True)
        unit = traitlets.Unicode("").tag(sync=True)
        log = traitlets.Bool(False).tag(sync=True)
        #: More series than this are drawn as their mean with a min/max band.
        max_lines = traitlets.Int(8).tag(sync=True)

        def __init__(
            self, snapshot: Callable[[], list[Points]], *, log: bool = False, **kwargs: Any
        ) -> None:
            super().__init__(log=log, **kwargs)
            self._snapshot = snapshot
            self.sent = 0  # messages sent (for tests and the overhead bench)
            self.on_msg(self._on_front_end)

        def _on_front_end(self, _widget: Any, content: Any, _buffers: Any) -> None:
            if isinstance(content, dict) and content.get("type") == "sync":
                self.send({"type": "reset", "series": self._snapshot()})

        def append(self, series: list[Points]) -> None:
            """Send new points (nothing when there are none)."""
            if any(s.get("x") for s in series):
                self.sent += 1
                self.send({"type": "append", "series": series})
