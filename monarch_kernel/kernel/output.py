"""Rank output under the right cell: labelled by rank, identical lines collapsed.

A :class:`CellOutput` belongs to one ``%%remote`` execution. The controller's I/O thread
feeds it text per rank; complete lines are grouped across ranks (``[0-3] epoch 1 done``)
for a short window and then emitted through ``emit(stream_name, text)``, which the
kernel binds to the cell that ran the code (see :mod:`monarch_kernel.kernel.remote`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from monarch_kernel.controller.errors import format_ranks

Emit = Callable[[str, str], None]

#: How long a line waits for the same line from the other ranks before it is shown.
COLLAPSE_WINDOW = 0.05
MODES = ("collapse", "order", "rank")


@dataclass
class _Line:
    name: str
    text: str
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class CellOutput:
    """Groups and labels the output of one cell's ranks.

    ``mode``: ``collapse`` (default) merges identical lines from several ranks;
    ``order`` shows each line as it arrives; ``rank`` holds everything and shows one
    block per rank when :meth:`close` is called.
    """

    def __init__(self, emit: Emit, ranks: list[int], mode: str = "collapse", label: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown output grouping {mode!r}; use one of {', '.join(MODES)}")
        self._emit = emit
        self._ranks = set(ranks)
        self._mode = mode
        self._label = label
        self._lock = threading.Lock()
        self._partial: dict[tuple[int, str], str] = {}
        self._pending: list[_Line] = []
        self._by_rank: dict[int, list[tuple[str, str]]] = {}
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
        self.flush()

    def _add(self, rank: int, name: str, line: str, now: float) -> None:
        if self._mode == "rank":
            self._by_rank.setdefault(rank, []).append((name, line))
            return
        if self._mode == "collapse":
            for entry in self._pending:
                if entry.name == name and entry.text == line and rank not in entry.ranks:
                    entry.ranks.add(rank)
                    return
        self._pending.append(_Line(name, line, now, {rank}))

    def flush(self, force: bool = False) -> None:
        """Emit lines that are complete (all ranks) or waited long enough."""
        out: list[tuple[str, str]] = []
        with self._lock:
            now = time.monotonic()
            while self._pending:
                entry = self._pending[0]
                ready = (
                    force
                    or self._mode == "order"
                    or entry.ranks >= self._ranks
                    or now - entry.first_seen >= COLLAPSE_WINDOW
                )
                if not ready:
                    break
                self._pending.pop(0)
                out.append((entry.name, self._labelled(entry.ranks, entry.text)))
        self._send(out)

    def _labelled(self, ranks: set[int], text: str) -> str:
        return f"[{format_ranks(sorted(ranks))}] {text}\n" if self._label else text + "\n"

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
        self.flush(force=True)
        self._send(blocks)
        _active.discard(self)


_active: weakref.WeakSet[CellOutput] = weakref.WeakSet()


def _flusher() -> None:
    while True:
        time.sleep(COLLAPSE_WINDOW / 2)
        for out in list(_active):
            try:
                out.flush()
            except Exception:  # pragma: no cover - never kill the flusher
                pass


threading.Thread(target=_flusher, name="mk-output-flusher", daemon=True).start()
