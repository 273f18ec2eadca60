"""What the dashboard shows of the ranks' GPUs: the fields the host agents sample through
NVML (``wire.reports.GpuStats``, in each rank's stats), as a tile line, a tooltip line,
and a history for the GPU charts (utilisation and memory in use over time).

A rank without GPU fields (a CPU-only host, no ``nvidia-ml-py`` there) shows nothing of
this, and no GPU chart appears until some rank has them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from monarch_kernel.controller.state.records import RankInfo
from monarch_kernel.widgets import charts
from monarch_kernel.widgets.fmt import human_bytes, rate_text
from monarch_kernel.wire.reports import RankStats

GPU_SAMPLES = 120  # history, one sample a second
GB = 1e9


def _gb(n: float) -> str:
    """``1.2`` / ``80``: GB, short enough for a tile."""
    v = n / GB
    return f"{v:.1f}" if v < 10 else f"{v:.0f}"


def tile_line(stats: RankStats) -> str:
    """``87% 1.2/80G 312W`` (what is known of it), or ``""`` without GPU fields."""
    if "gpu" not in stats:
        return ""
    parts = []
    util = stats.get("gpu_util")
    if util is not None:
        parts.append(f"{util:.0f}%")
    used, total = stats.get("gpu_used"), stats.get("gpu_total")
    if used is not None and total:
        parts.append(f"{_gb(used)}/{_gb(total)}G")
    power = stats.get("gpu_power")
    if power is not None:
        parts.append(f"{power:.0f}W")
    return " ".join(parts)


def tooltip_line(stats: RankStats) -> str:
    """``GPU 0: 87% busy, memory 1.2 GB / 80.0 GB (this rank 1.0 GB), 312 W, PCIe ...``."""
    if "gpu" not in stats:
        return ""
    facts = []
    util = stats.get("gpu_util")
    if util is not None:
        facts.append(f"{util:.0f}% busy")
    used, total = stats.get("gpu_used"), stats.get("gpu_total")
    if used is not None:
        mem = f"memory {human_bytes(used)}" + (f" / {human_bytes(total)}" if total else "")
        own = stats.get("gpu_proc")
        facts.append(mem + (f" (this rank {human_bytes(own)})" if own is not None else ""))
    power = stats.get("gpu_power")
    if power is not None:
        facts.append(f"{power:.0f} W")
    for name, tx, rx in (
        ("PCIe", stats.get("pcie_tx"), stats.get("pcie_rx")),
        ("NVLink", stats.get("nvlink_tx"), stats.get("nvlink_rx")),
    ):
        if tx is not None or rx is not None:
            facts.append(f"{name} tx {rate_text(tx)} / rx {rate_text(rx)}")
    return f"GPU {stats['gpu']}: " + ", ".join(facts)


class GpuSample(NamedTuple):
    """One second of the ranks' GPUs."""

    time: float  #: ``time.time()`` when it was taken
    #: rank -> (utilisation %, memory used GB), None where the GPU does not give it
    per_rank: dict[int, tuple[float | None, float | None]]


class GpuHistory:
    """The ranks' GPU utilisation and memory in use, about once a second."""

    def __init__(self) -> None:
        self.history: deque[GpuSample] = deque(maxlen=GPU_SAMPLES)
        self.samples = 0  #: samples taken (the history keeps the newest)

    def sample(self, ranks: Sequence[RankInfo], stats_of: Callable[[int], RankStats]) -> None:
        """Record the live ranks that have GPU fields (nothing when none has)."""
        per_rank: dict[int, tuple[float | None, float | None]] = {}
        for info in ranks:
            if not info.alive:
                continue
            stats = stats_of(info.rank)
            util, used = stats.get("gpu_util"), stats.get("gpu_used")
            if "gpu" in stats and (util is not None or used is not None):
                per_rank[info.rank] = (
                    None if util is None else float(util),
                    None if used is None else used / GB,
                )
        if per_rank:
            self.history.append(GpuSample(time.time(), per_rank))
            self.samples += 1

    def rekey(self, moved: dict[int, int], gone: set[int]) -> None:
        """A shrink renumbered the ranks: the history follows the processes."""
        self.history = deque(
            (
                GpuSample(
                    s.time, {moved.get(r, r): v for r, v in s.per_rank.items() if r not in gone}
                )
                for s in self.history
            ),
            maxlen=GPU_SAMPLES,
        )


#: The GPU charts: chart id, title, index in a rank's sample, unit.
CHARTS = (("gpu:util", "GPU util", 0, "%"), ("gpu:mem", "GPU memory", 1, "GB"))


def lines(
    rows: Sequence[GpuSample], t0: float, idx: int, aggregate: bool, gaps: bool = False
) -> list[tuple[str, list[float], list[float | None]]]:
    """``(label, xs, ys)`` of one GPU chart (``idx``: 0 utilisation, 1 memory): per
    rank, or (``aggregate``) the mean and the max over the ranks; x: seconds since
    ``t0``. Unknown values are left out, or with ``gaps`` are None (a point per row:
    the live charts count points by sample)."""
    if aggregate:
        xs: list[float] = []
        mean: list[float | None] = []
        top: list[float | None] = []
        for s in rows:
            vals = [y for v in s.per_rank.values() if (y := v[idx]) is not None]
            if vals or gaps:
                xs.append(s.time - t0)
                mean.append(sum(vals) / len(vals) if vals else None)
                top.append(max(vals) if vals else None)
        return [("mean", xs, mean), ("max", xs, top)] if xs else []
    out: list[tuple[str, list[float], list[float | None]]] = []
    for r in sorted({r for s in rows for r in s.per_rank}):
        pts = [
            (s.time - t0, s.per_rank[r][idx] if r in s.per_rank else None)
            for s in rows
            if gaps or (r in s.per_rank and s.per_rank[r][idx] is not None)
        ]
        if pts:
            out.append((f"r{r}", [x for x, _ in pts], [y for _, y in pts]))
    return out


def svg_charts(hist: GpuHistory) -> list[str]:
    """The static SVG GPU charts (none while no rank has GPU fields)."""
    rows = list(hist.history)
    if not rows:
        return []
    t0 = rows[0].time
    return [  # more ranks than charts.MAX_LINES: drawn as their mean and min-max band
        charts.line_chart(
            title,
            [
                (label, xs, [y for y in ys if y is not None])
                for label, xs, ys in lines(rows, t0, idx, False)
            ],
            unit=unit,
            chart_id=chart_id,
            x_label="s",
        )
        for chart_id, title, idx, unit in CHARTS
    ]
