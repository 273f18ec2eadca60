"""The dashboard's charts: live uPlot charts (appends only) when anywidget is there, else
the static SVG charts in one HTML widget.

The live charts are sent only the points that arrived since the last update; a chart view
that opens later asks for the whole history (a snapshot, taken under the dashboard's lock
on whichever thread the request came in on).

A big mesh (``aggregate``: drawn as a heat-map grid) sends no chart per-rank points:
a metric is its mean, min and max over the ranks per step
(:mod:`~monarch_kernel.widgets.bands`), transfer the mesh's totals, so what the charts
send does not grow with ranks."""

from __future__ import annotations

import threading
import time

import ipywidgets as W

from monarch_kernel.widgets import chart_pane, gpu_view, live_chart
from monarch_kernel.widgets.bands import StepBands
from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.series import Series
from monarch_kernel.widgets.state import MeshState


class ChartArea:
    """The live charts' box, then ``charts``: the hint (no metrics yet) with live charts,
    the SVG charts without."""

    def __init__(self, state: MeshState, lock: threading.RLock, aggregate: bool = False) -> None:
        self.state = state
        #: Charts of the whole mesh (mean/min/max, totals), not of each rank.
        self.aggregate = aggregate
        self.bands: dict[str, StepBands] = {}  # metric -> its mean/min/max (aggregate)
        self._lock = lock  # the dashboard's: snapshots read the state it updates
        self.charts = W.HTML()
        #: chart id (``throughput``, ``metric:NAME``) -> its live chart
        self.live_charts: dict[str, live_chart.LiveChart] = {}
        self.box = W.Box(layout=W.Layout(display="flex", flex_flow="row wrap"))
        #: seconds between two chart updates (charts of many ranks cost more to draw)
        self.interval = 0.5 if state.rt.world <= 8 else 1.0
        #: (metric version, rate samples, GPU samples) last sent
        self._key: tuple[int, int, int] = (-1, -1, -1)
        self._last = 0.0
        self._rate_sent = 0  # transfer samples sent to the live chart
        self._rate_t0: float | None = None
        self._gpu_sent = 0  # GPU samples sent to the live GPU charts
        self._gpu_t0: float | None = None
        if live_chart.AVAILABLE:
            self.box.children = (self._new_chart("throughput"),)

    def put(self, now: float) -> int:
        """Bring the charts up to date if there is anything new and they were not
        updated in the last :attr:`interval` seconds; returns the messages sent."""
        st = self.state
        key = (st.history.version, st.throughput.samples, st.gpu.samples)
        if key == self._key or now - self._last < self.interval:
            return 0
        self._key = key
        self._last = now
        if live_chart.AVAILABLE:
            return self._append_charts()
        return put(self.charts, value=chart_pane.charts_html(st))

    def _new_chart(self, chart_id: str) -> live_chart.LiveChart:
        """A live chart: ``throughput`` (transfer rates), ``gpu:util`` or ``gpu:mem``
        (the ranks' GPUs), or ``metric:NAME``."""
        gpu = {c[0]: c for c in gpu_view.CHARTS}.get(chart_id)
        if gpu is not None:
            _, title, idx, unit = gpu
            chart = live_chart.LiveChart(
                lambda: self._gpu_snapshot(idx),
                chart_id=chart_id,
                title=f"{title} (mean, max over ranks)" if self.aggregate else title,
                x_label="s",
                unit=unit,
            )
        elif chart_id == "throughput":
            per_rank = self.state.throughput.per_rank_bytes and not self.aggregate
            chart = live_chart.LiveChart(
                self._rate_snapshot,
                chart_id=chart_id,
                title="transfer" + ("" if per_rank else " (mesh total)"),
                x_label="s",
                unit="B/s",
            )
        else:
            name = chart_id.split(":", 1)[1]
            chart = live_chart.LiveChart(
                lambda: self._metric_snapshot(name),
                chart_id=chart_id,
                title=f"{name} (mean, min, max over ranks)" if self.aggregate else name,
                x_label="step",
            )
        self.live_charts[chart_id] = chart
        return chart

    def _append_charts(self) -> int:
        """Send each live chart the points that arrived since the last update (one
        message per chart that has new points); new metrics get a chart."""
        st = self.state
        sent = 0
        new = [n for n in st.metrics if f"metric:{n}" not in self.live_charts]
        if new:
            added = tuple(self._new_chart(f"metric:{n}") for n in new)
            self.box.children = (*self.box.children, *added)
            sent += 1
        for name, per_rank in list(st.metrics.items()):
            if self.aggregate:
                sent += self._append_bands(name, per_rank)
                continue
            batch: list[live_chart.Points] = []
            for rank, series in sorted(per_rank.items()):
                start, xs, ys = series.take_fresh()
                if xs:
                    key = f"r{rank}"
                    batch.append({"key": key, "label": key, "start": start, "x": xs, "y": ys})
            if batch:
                self.live_charts[f"metric:{name}"].append(batch)
                sent += 1
        rates = self._rate_points(self._rate_sent)
        self._rate_sent = st.throughput.samples
        if rates:
            self.live_charts["throughput"].append(rates)
            sent += 1
        sent += self._append_gpu()
        hint = "" if st.metrics else chart_pane.metrics_hint()
        return sent + put(self.charts, value=hint)

    def _append_bands(self, name: str, per_rank: dict[int, Series]) -> int:
        """Fold the ranks' new points of metric ``name`` into its bands; send the steps
        that are complete (one message, three series), if any."""
        bands = self.bands.get(name)
        if bands is None:
            bands = self.bands[name] = StepBands()
        now = time.monotonic()
        for series in per_rank.values():
            _start, xs, ys = series.take_fresh()
            if xs:
                bands.add(xs, ys, now)
        if not bands.settle(len(per_rank), now):
            return 0
        batch: list[live_chart.Points] = []
        for key, line in _band_lines(bands):
            start, xs, ys = line.take_fresh()
            batch.append(_band_points(key, start, xs, ys))
        self.live_charts[f"metric:{name}"].append(batch)
        return 1

    def _metric_snapshot(self, name: str) -> list[live_chart.Points]:
        """Every kept point of metric ``name`` (a chart view that just opened)."""
        with self._lock:
            out: list[live_chart.Points] = []
            if self.aggregate:
                bands = self.bands.get(name)
                for key, line in _band_lines(bands) if bands is not None else []:
                    xs, ys = line.arrays()
                    points = _band_points(key, 0, xs, ys)
                    points["count"] = line.count
                    out.append(points)
                return out
            for rank, series in sorted(self.state.metrics.get(name, {}).items()):
                xs, ys = series.arrays()
                key = f"r{rank}"
                out.append(
                    {"key": key, "label": key, "start": 0, "count": series.count, "x": xs, "y": ys}
                )
            return out

    def _append_gpu(self) -> int:
        """Send the GPU charts the samples since the last update; they appear with the
        first sample (never on hosts without GPU fields)."""
        gpu = self.state.gpu
        if gpu.samples == self._gpu_sent:
            return 0
        sent = 0
        if "gpu:util" not in self.live_charts:
            added = tuple(self._new_chart(c[0]) for c in gpu_view.CHARTS)
            # after the transfer chart, before the metrics'
            self.box.children = (self.box.children[0], *added, *self.box.children[1:])
            sent += 1
        since, self._gpu_sent = self._gpu_sent, gpu.samples
        for chart_id, _, idx, _ in gpu_view.CHARTS:
            points = self._gpu_points(idx, since)
            if points:
                self.live_charts[chart_id].append(points)
                sent += 1
        return sent

    def _gpu_snapshot(self, idx: int) -> list[live_chart.Points]:
        """Every kept GPU sample of one GPU chart (a chart view that just opened)."""
        with self._lock:
            return self._gpu_points(idx, 0, reset=True)

    def _gpu_points(self, idx: int, since: int, reset: bool = False) -> list[live_chart.Points]:
        """One GPU chart's points of samples ``since`` on (numbers count from the first;
        a point per sample and series, None where unknown), per rank (a big mesh: the
        mean and max over the ranks)."""
        gpu = self.state.gpu
        hist = list(gpu.history)
        first = gpu.samples - len(hist)  # sample number of hist[0]
        start = max(since, first)
        rows = hist[start - first :]
        if not rows:
            return []
        if self._gpu_t0 is None:
            self._gpu_t0 = rows[0].time
        out: list[live_chart.Points] = []
        for label, xs, ys in gpu_view.lines(rows, self._gpu_t0, idx, self.aggregate, gaps=True):
            points: live_chart.Points = {"key": label, "label": label, "start": start, "x": xs}
            points["y"] = ys  # type: ignore[typeddict-item]  # None: a gap
            if reset:
                points["count"] = gpu.samples
            out.append(points)
        return out

    def _rate_snapshot(self) -> list[live_chart.Points]:
        """Every kept transfer sample (a chart view that just opened)."""
        with self._lock:
            return self._rate_points(0, reset=True)

    def _rate_points(self, since: int, reset: bool = False) -> list[live_chart.Points]:
        """Transfer rates (bytes/s) of samples ``since`` on (sample numbers count from
        the first): per rank in and out, or the mesh totals."""
        tp = self.state.throughput
        hist = list(tp.history)
        first = tp.samples - len(hist)  # sample number of hist[0]
        start = max(since, first)
        rows = hist[start - first :]
        if not rows:
            return []
        if self._rate_t0 is None:
            self._rate_t0 = rows[0].time
        xs = [row.time - self._rate_t0 for row in rows]
        out: list[live_chart.Points] = []

        def add(key: str, group: str, ys: list[float]) -> None:
            points: live_chart.Points = {
                "key": key,
                "label": key,
                "group": group,
                "dash": group == "out",
                "start": start,
                "x": xs,
                "y": ys,
            }
            if reset:
                points["count"] = tp.samples
            out.append(points)

        for idx, direction in ((0, "in"), (1, "out")):
            if tp.per_rank_bytes and not self.aggregate:  # a big mesh: its totals
                for r in range(self.state.rt.world):
                    ys = [row.per_rank[r][idx] if r in row.per_rank else 0.0 for row in rows]
                    add(f"r{r} {direction}", direction, ys)
            else:
                add(direction, direction, [row.total[idx] for row in rows])
        return out


def _band_lines(bands: StepBands) -> list[tuple[str, Series]]:
    """A metric's three lines over the ranks, by the key the chart knows them by."""
    return [("mean", bands.mean), ("min", bands.lo), ("max", bands.hi)]


def _band_points(key: str, start: int, xs: list[float], ys: list[float]) -> live_chart.Points:
    """Points of one of a metric's lines over the ranks (min and max dashed)."""
    return {"key": key, "label": key, "dash": key != "mean", "start": start, "x": xs, "y": ys}
