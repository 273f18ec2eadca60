"""Rank output under the right cell: labelled by rank, identical lines collapsed.

A :class:`CellOutput` belongs to one ``%%remote`` execution. The controller's I/O thread
feeds it text per rank; complete lines are grouped across ranks (``[0-3] epoch 1 done``)
for a short window and then emitted through ``emit(stream_name, text)``, which the
kernel binds to the cell that ran the code (see :mod:`monarch_kernel.kernel.remote`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import format_ranks

Emit = Callable[[str, str], None]

#: How long a line waits for the same line from the other ranks before it is shown.
COLLAPSE_WINDOW = 0.05
#: Stream messages a cell's output may send at once, one as it comes (a burst of
#: :data:`EMIT_BURST`, then :data:`EMIT_RATE` a second); past that, output waits for the
#: flusher's next turn (every :data:`EMIT_INTERVAL`) and goes as one message. So a print
#: goes out at once, and a flood of lines is a few messages a second, not one per line.
EMIT_BURST = 20
EMIT_RATE = 200.0
EMIT_INTERVAL = 0.005
#: What the notebook is sent of one cell's output at most, in bytes a second (a burst of
#: :data:`BURST_BYTES` first). Past it lines are elided, counted and pointed at the
#: per-rank logs, which always have everything. ``$MONARCH_KERNEL_OUTPUT_RATE`` sets it.
RATE_BYTES = int(os.environ.get("MONARCH_KERNEL_OUTPUT_RATE", 4 * 1024 * 1024))
BURST_BYTES = 2 * RATE_BYTES
MODES = ("collapse", "order", "rank")


@dataclass
class _Line:
    name: str
    text: str
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class _Bucket:
    """A token bucket: ``level`` up to ``burst``, refilled at ``rate`` a second."""

    __slots__ = ("burst", "rate", "level", "at")

    def __init__(self, burst: float, rate: float):
        self.burst, self.rate = float(burst), float(rate)
        self.level = self.burst
        self.at = time.monotonic()

    def refill(self, now: float) -> float:
        """Add what accrued since the last refill; returns the level."""
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level


class CellOutput:
    """Groups and labels the output of one cell's ranks.

    ``mode``: ``collapse`` (default) merges identical lines from several ranks;
    ``order`` shows each line as it arrives; ``rank`` holds everything and shows one
    block per rank when :meth:`close` is called. ``logs``: where the full output is
    (named when lines are elided).
    """

    def __init__(
        self,
        emit: Emit,
        ranks: list[int],
        mode: str = "collapse",
        label: bool = True,
        logs: str = "",
    ):
        if mode not in MODES:
            raise ValueError(f"unknown output grouping {mode!r}; use one of {', '.join(MODES)}")
        self._emit = emit
        self._ranks = set(ranks)
        self._mode = mode
        self._label = label
        self._logs = logs
        self._lock = threading.Lock()
        # Held from taking a batch until it is emitted: batches leave in the order they
        # were taken, and close() returns only after every batch taken before it left (a
        # flusher thread descheduled between the two would otherwise emit after the cell
        # went idle, and the notebook would miss those lines).
        self._send_lock = threading.Lock()
        self._partial: dict[tuple[int, str], str] = {}
        self._pending: deque[_Line] = deque()
        # (stream, text) -> pending lines with that text, oldest first (collapse mode)
        self._index: dict[tuple[str, str], list[_Line]] = {}
        self._by_rank: dict[int, list[tuple[str, str]]] = {}
        self._messages = _Bucket(EMIT_BURST, EMIT_RATE)  # stream messages sent at once
        self._bytes = _Bucket(BURST_BYTES, RATE_BYTES)  # bytes the notebook is sent
        #: Lines shown, and lines elided (not sent to the notebook; they are in the logs).
        self.shown = 0
        self.elided = 0
        self._elided_since_note = 0
        _active.add(self)

    def feed(self, rank: int, name: str, text: str) -> None:
        """Text from ``rank`` on stream ``name`` (any thread)."""
        with self._lock:
            buf = self._partial.get((rank, name), "") + text
            *lines, rest = buf.split("\n")
            self._partial[(rank, name)] = rest
            now = time.monotonic()
            for line in lines:
                self._add(rank, name, line, now)
            due = self._messages.refill(now) >= 1.0
        if due:
            self.flush()
        if self._pending:  # lines held back (no message left now, or the collapse window)
            _due.set()  # the flusher's next turn sends them

    def _add(self, rank: int, name: str, line: str, now: float) -> None:
        if self._mode == "rank":
            self._by_rank.setdefault(rank, []).append((name, line))
            return
        if self._mode == "collapse":
            same = self._index.get((name, line))
            if same is None:
                same = self._index[(name, line)] = []
            for entry in same:
                if rank not in entry.ranks:
                    entry.ranks.add(rank)
                    return
            entry = _Line(name, line, now, {rank})
            same.append(entry)
            self._pending.append(entry)
            return
        self._pending.append(_Line(name, line, now, {rank}))

    def flush(self, force: bool = False) -> None:
        """Emit lines that are complete (all ranks) or waited long enough."""
        with self._send_lock:
            self._flush_sending(force)

    def _flush_sending(self, force: bool) -> None:
        out: list[tuple[str, str]] = []
        with self._lock:
            now = time.monotonic()
            pending = self._pending
            while pending:
                entry = pending[0]
                ready = (
                    force
                    or self._mode == "order"
                    or entry.ranks >= self._ranks
                    or now - entry.first_seen >= COLLAPSE_WINDOW
                )
                if not ready:
                    break
                pending.popleft()
                if self._mode == "collapse":
                    key = (entry.name, entry.text)
                    same = self._index[key]
                    same.remove(entry)  # the oldest: index 0
                    if not same:
                        del self._index[key]
                out.append((entry.name, self._labelled(entry.ranks, entry.text)))
            if out or force:
                out = self._within_budget(out, now, force)
                if out:
                    self._messages.level = max(0.0, self._messages.level - 1.0)
        self._send(out)

    def _within_budget(
        self, lines: list[tuple[str, str]], now: float, closing: bool
    ) -> list[tuple[str, str]]:
        """The lines the notebook can be sent now; count the rest as elided (lock held)."""
        budget = self._bytes
        budget.refill(now)
        kept: list[tuple[str, str]] = []
        for name, text in lines:
            size = len(text)
            if size <= budget.level:
                budget.level -= size
                kept.append((name, text))
            else:
                self._elided_since_note += 1
        self.shown += len(kept)
        self.elided += len(lines) - len(kept)
        if self._elided_since_note and (kept or closing):
            where = f"; every line is in {self._logs}" if self._logs else ""
            kept.append(
                (
                    "stderr",
                    f"[... {self._elided_since_note:,} lines elided: more output than the "
                    f"notebook is sent ({RATE_BYTES / 2**20:.0f} MiB/s){where}]\n",
                )
            )
            self._elided_since_note = 0
        return kept

    def _labelled(self, ranks: set[int], text: str) -> str:
        if not self._label:
            return text + "\n"
        if len(ranks) == 1:  # the common case in a flood
            for r in ranks:
                return f"[{r}] {text}\n"
        return f"[{format_ranks(sorted(ranks))}] {text}\n"

    def _send(self, lines: list[tuple[str, str]]) -> None:
        # Consecutive lines of one stream go out as one message.
        i = 0
        while i < len(lines):
            name = lines[i][0]
            j = i
            while j < len(lines) and lines[j][0] == name:
                j += 1
            self._emit(name, "".join(text for _, text in lines[i:j]))
            i = j

    def close(self) -> None:
        """Flush everything, partial lines included; no more output after this."""
        with self._lock:
            now = time.monotonic()
            for (rank, name), rest in sorted(self._partial.items()):
                if rest:
                    self._add(rank, name, rest, now)
            self._partial.clear()
            blocks = []
            for rank in sorted(self._by_rank):
                for name, line in self._by_rank[rank]:
                    blocks.append((name, self._labelled({rank}, line)))
            self._by_rank.clear()
        with self._send_lock:
            self._flush_sending(force=True)
            if blocks:
                with self._lock:
                    blocks = self._within_budget(blocks, time.monotonic(), True)
                self._send(blocks)
        _active.discard(self)


_active: weakref.WeakSet[CellOutput] = weakref.WeakSet()
#: Set when some output waits for the flusher (asleep while nothing waits).
_due = threading.Event()


def _flusher() -> None:
    while True:
        _due.wait()
        time.sleep(EMIT_INTERVAL)
        _due.clear()
        waiting = False
        for out in list(_active):
            try:
                out.flush()
                waiting = waiting or bool(out._pending)
            except Exception:  # pragma: no cover - never kill the flusher
                pass
        if waiting:  # lines still wait for other ranks' copies (the collapse window)
            _due.set()


threading.Thread(target=_flusher, name="mk-output-flusher", daemon=True).start()
