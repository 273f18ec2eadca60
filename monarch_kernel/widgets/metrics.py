"""The metrics ranks report (``monarch_kernel.report(step=i, loss=...)``), kept per name
and rank as :class:`~monarch_kernel.widgets.series.Series` for the charts."""

from __future__ import annotations

from itertools import chain
from typing import cast

from monarch_kernel.widgets.series import Series

#: Metric names charted at most (later names are ignored).
MAX_METRICS = 12


class MetricHistory:
    """Every rank's reported metrics: their series, the last step, the report count."""

    def __init__(self) -> None:
        #: metric name -> rank -> its series (names in first-reported order)
        self.series: dict[str, dict[int, Series]] = {}
        self.version = 0  #: changes whenever points are added
        self.step: dict[int, float] = {}  #: rank -> the last ``step`` it reported
        self.report_count: dict[int, int] = {}  #: rank -> reports received

    def fold(self, rank: int, vals: list[dict[str, float]]) -> None:
        """Add a batch of rank ``rank``'s reports (oldest first). A report's x is its
        ``step``, else its number among the rank's reports."""
        count = self.report_count.get(rank, 0)
        self.report_count[rank] = count + len(vals)
        steps = [v.get("step") for v in vals]
        if None in steps:
            xs = [float(count + i) if s is None else s for i, s in enumerate(steps)]
        else:
            xs = cast(list[float], steps)
        for s in reversed(steps):
            if s is not None:
                self.step[rank] = s
                break
        # every name reported in this batch, in first-seen order (charts keep that order)
        names = vals[0].keys() if len(vals) == 1 else dict.fromkeys(chain.from_iterable(vals))
        for name in names:
            if name == "step":
                continue
            series = self._series(name, rank)
            if series is None:
                continue
            ys = [v.get(name) for v in vals]
            if None in ys:
                pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
                series.extend([x for x, _ in pairs], [y for _, y in pairs])
            else:
                series.extend(xs, cast(list[float], ys))
        self.version += 1

    def _series(self, name: str, rank: int) -> Series | None:
        """Rank ``rank``'s series of ``name``, made if new (None: too many names)."""
        per_rank = self.series.get(name)
        if per_rank is None:
            if len(self.series) >= MAX_METRICS:
                return None
            per_rank = self.series[name] = {}
        series = per_rank.get(rank)
        if series is None:
            series = per_rank[rank] = Series()
        return series
