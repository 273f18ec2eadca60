"""The items :class:`~monarch_kernel.kernel.output.CellOutput` queues and draws: lines,
rich displays, the block of live bars, and the token bucket that bounds a cell's output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from monarch_kernel.wire.jsontypes import JsonObject, MimeBundle
from monarch_kernel.wire.terminal import Row


@dataclass
class Line:
    name: str
    text: str
    first_seen: float
    ranks: set[int] = field(default_factory=set)


@dataclass
class Display(Line):
    """A rich display waiting in line (``text``: its bundle's key for collapsing)."""

    data: MimeBundle = field(default_factory=dict)
    metadata: JsonObject = field(default_factory=dict)
    display_id: str = ""
    update: bool = False
    size: int = 0


class BarBlock:
    """The display of the bars live at one time (see the module's doc)."""

    __slots__ = ("display_id", "rows", "sent", "opened")

    def __init__(self) -> None:
        self.display_id = f"mk-bars-{uuid.uuid4().hex[:12]}"
        self.rows: list[tuple[int, Row]] = []  # (rank, row), in order of appearance
        self.sent = ""  # the text last sent
        self.opened = False  # its display_data went out


class Bucket:
    """A token bucket: ``level`` up to ``burst``, refilled at ``rate`` a second."""

    __slots__ = ("burst", "rate", "level", "at")

    def __init__(self, burst: float, rate: float, now: float):
        """Full at ``now`` (the caller's clock: ``time.monotonic()``)."""
        self.burst, self.rate = float(burst), float(rate)
        self.level = self.burst
        self.at = now

    def refill(self, now: float) -> float:
        """Add what accrued since the last refill; returns the level."""
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level


__all__ = ["BarBlock", "Bucket", "Display", "Line"]
