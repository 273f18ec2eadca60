"""Bounded metric series: the points of one metric on one rank, thinned as they grow."""

from __future__ import annotations

#: Points kept per (metric, rank) series before it is thinned (whole run stays visible).
SERIES_CAP = 400
#: Points held for the live chart between two of its updates; past this the oldest go
#: (only when no chart takes them: a chart takes them a few times a second).
FRESH_CAP = 4096


class Series:
    """``(x, y)`` points of one metric on one rank, in arrival order, bounded.

    When :data:`SERIES_CAP` points are held, every other one is dropped and from then on
    only every ``stride``-th new point is kept, so the chart always spans the whole run
    with bounded memory. ``count`` and ``last`` always reflect every point added.
    Points arrive in batches (one per dashboard update): the thinning is list slicing.

    ``fresh_x``/``fresh_y`` hold every point added since the live chart last took them
    (:meth:`take_fresh`): the chart is sent only what is new (appends), unthinned.
    """

    __slots__ = ("xs", "ys", "stride", "kept", "count", "last", "fresh_x", "fresh_y", "fresh_at")

    def __init__(self) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.stride = 1
        self.kept = -1  # arrival index of the last kept point
        self.count = 0
        self.last: tuple[float, float] | None = None
        self.fresh_x: list[float] = []
        self.fresh_y: list[float] = []
        self.fresh_at = 0  # arrival index of fresh_x[0]

    def extend(self, xs: list[float], ys: list[float]) -> None:
        """Add points (in arrival order)."""
        n = len(xs)
        if not n:
            return
        start = self.kept + self.stride - self.count  # first index of this batch to keep
        if start < n:
            picked = xs[start :: self.stride]
            self.xs += picked
            self.ys += ys[start :: self.stride]
            self.kept = self.count + start + self.stride * (len(picked) - 1)
        self.count += n
        self.last = (xs[-1], ys[-1])
        self.fresh_x += xs
        self.fresh_y += ys
        over = len(self.fresh_x) - FRESH_CAP
        if over > 0:
            del self.fresh_x[:over], self.fresh_y[:over]
            self.fresh_at += over
        while len(self.xs) >= SERIES_CAP:
            if len(self.xs) % 2 == 0:  # the last kept point is about to go
                self.kept -= self.stride
            del self.xs[1::2]
            del self.ys[1::2]
            self.stride *= 2

    def add(self, x: float, y: float) -> None:
        self.extend([x], [y])

    def arrays(self) -> tuple[list[float], list[float]]:
        """The kept points as ``(xs, ys)``, ending with the latest one."""
        xs, ys = list(self.xs), list(self.ys)
        if self.last is not None and (not xs or (xs[-1], ys[-1]) != self.last):
            xs.append(self.last[0])
            ys.append(self.last[1])
        return xs, ys

    def take_fresh(self) -> tuple[int, list[float], list[float]]:
        """``(index of the first, xs, ys)`` of the points added since the last call."""
        out = (self.fresh_at, self.fresh_x, self.fresh_y)
        self.fresh_x, self.fresh_y = [], []
        self.fresh_at = self.count
        return out

    def points(self) -> list[tuple[float, float]]:
        return list(zip(*self.arrays()))
