"""A big mesh's metric as three lines over its ranks, per step: mean, min and max.

On a mesh drawn as a heat-map grid (:mod:`~monarch_kernel.widgets.compact`), a live chart
is not sent every rank's points (that grows with ranks) but, per step, the mean, minimum
and maximum over the ranks that reported it: three points a step, whatever the size.

A step is sent once every rank that reports the metric reported it, or after
:data:`SETTLE_S` (a slow or dead rank does not hold the chart back). How many ranks
report it is known only from what came: the ranks' first reports reach the dashboard
over more than one update, so a step is counted complete only once that number held
still from one update to the next (else a first step would be drawn from the ranks
heard so far, and the others' points of it dropped as late). A late point of a
step already sent is dropped, unless its step gathers at least half the ranks again: then
the run started over (at step 0, after a restart) and the chart starts a new line.

Pure Python, fed on the dashboard's updater thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monarch_kernel.widgets.series import Series

#: Seconds a step waits for ranks that have not reported it yet.
SETTLE_S = 2.0


@dataclass
class _Bucket:
    """The points of one step so far."""

    n: int
    total: float
    lo: float
    hi: float
    born: float  # monotonic time of its first point


class StepBands:
    """One metric of a big mesh: every rank's points folded into mean/min/max per step."""

    def __init__(self, settle: float = SETTLE_S) -> None:
        self.settle_s = settle
        self.pending: dict[float, _Bucket] = {}
        self.mean, self.lo, self.hi = Series(), Series(), Series()
        self.last_x: float | None = None  # the last step sent
        self.dropped = 0  # late points of steps already sent
        self._reporters = 0  # the ranks reporting the metric at the last settle

    def add(self, xs: list[float], ys: list[float], now: float) -> None:
        """One rank's new points."""
        pending = self.pending
        for x, y in zip(xs, ys):
            if not math.isfinite(y):
                continue
            b = pending.get(x)
            if b is None:
                pending[x] = _Bucket(1, y, y, y, now)
            else:
                b.n += 1
                b.total += y
                b.lo = min(b.lo, y)
                b.hi = max(b.hi, y)

    def settle(self, ranks: int, now: float) -> int:
        """Send the steps every one of ``ranks`` (the ranks that reported the metric so
        far) reported, or that waited long enough, into :attr:`mean`, :attr:`lo` and
        :attr:`hi` in step order; returns how many. While ``ranks`` still grows from one
        call to the next, only the wait sends a step."""
        known = ranks == self._reporters
        self._reporters = ranks
        ready = sorted(
            x
            for x, b in self.pending.items()
            if (known and b.n >= ranks) or now - b.born >= self.settle_s
        )
        sent = 0
        for x in ready:
            b = self.pending.pop(x)
            if self.last_x is not None and x <= self.last_x and b.n * 2 < ranks:
                self.dropped += b.n  # stragglers of a step already drawn
                continue
            self.mean.add(x, b.total / b.n)
            self.lo.add(x, b.lo)
            self.hi.add(x, b.hi)
            self.last_x = x
            sent += 1
        return sent
