"""The items :class:`~monarch_kernel.kernel.output.CellOutput` queues and draws: lines,
rich displays, the block of live bars, and the token bucket that bounds a cell's output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import format_ranks
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

    __slots__ = ("display_id", "rows", "sent", "opened", "split")

    def __init__(self) -> None:
        self.display_id = f"mk-bars-{uuid.uuid4().hex[:12]}"
        self.rows: list[tuple[int, Row]] = []  # (rank, row), in order of appearance
        self.sent = ""  # the text last sent
        self.opened = False  # its display_data went out
        self.split: set[int] = set()  # bar slots whose ranks' frames differed

    def render(self, collapse: bool, label: bool) -> str:
        """One line per rank and bar, the k-th bar of each rank side by side (rows
        without text hold no place); ``collapse``: identical frames of several ranks on
        one line; ``label``: each line starts with its ranks (``[0-3] ``), the labels
        of the block padded to one width so that the bars line up.

        Once the ranks' frames of a bar differed, that bar stays one line per rank
        while it runs (lines merging and splitting with every frame would make the
        block jump); its final frames collapse again if they are the same."""
        by_slot: dict[int, list[tuple[int, str, bool]]] = {}
        seen: dict[int, int] = {}
        for rank, row in self.rows:
            text = row.text.rstrip()
            if text:
                slot = seen.get(rank, 0)
                seen[rank] = slot + 1
                by_slot.setdefault(slot, []).append((rank, text, row.done))
        lines: list[tuple[str, str]] = []  # (label, text)
        for slot in sorted(by_slot):
            entries = sorted(by_slot[slot])  # by rank: a stable order
            if len({text for _, text, _ in entries}) > 1:
                self.split.add(slot)
            running = not all(done for _, _, done in entries)
            merge = collapse and not (running and slot in self.split)
            groups: dict[str, list[int]] = {}
            for rank, text, _ in entries:
                groups.setdefault(text if merge else f"{rank}\0{text}", []).append(rank)
            for key, ranks in sorted(groups.items(), key=lambda group: group[1][0]):
                text = key.split("\0", 1)[-1]
                lines.append((f"[{format_ranks(ranks)}]" if label else "", text))
        if not label:
            return "\n".join(text for _, text in lines)
        # Labels of one width, so that the bars line up (``[0, 2]`` above ``[1]``).
        width = max((len(tag) for tag, _ in lines), default=0)
        return "\n".join(f"{tag:<{width}} {text}" for tag, text in lines)


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
