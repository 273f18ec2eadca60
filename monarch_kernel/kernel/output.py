"""Rank output under the right cell: labelled by rank, identical lines collapsed, bars
redrawn in place, rich displays shown.

A :class:`CellOutput` belongs to one ``%%remote`` execution. The controller's I/O thread
feeds it text per rank; each stream of each rank goes through a
:class:`~monarch_kernel.wire.terminal.Terminal`, which applies ``\r``, cursor moves and
line erases. Committed lines are grouped across ranks (``[0-3] epoch 1 done``) for a
short window and then emitted through ``emit(stream_name, text)``, which the kernel
binds to the cell that ran the code (see :mod:`monarch_kernel.kernel.remote`).

Rows still live (a progress bar being redrawn, a line without its newline) are shown in
a *bar block*: one display (``display_id``) under the cell, one line per rank and bar,
labelled on every frame, identical frames of several ranks collapsed, updated in place at
most every :data:`BAR_INTERVAL`. A bar's last frame stays in its block when it ends; the
block closes once none of its rows is live, and the next bar opens a new one below what
was printed meanwhile.

Rich displays from ranks (``display(...)``, matplotlib figures) arrive through
:meth:`CellOutput.show`, in order with the lines, collapsed like lines when several ranks
show the same bundle, and labelled by a line ``[r]:`` above them.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.state.events import DisplayOutput
from monarch_kernel.kernel.output_items import BarBlock, Bucket, Display, Line
from monarch_kernel.wire.jsontypes import JsonObject, MimeBundle
from monarch_kernel.wire.terminal import Terminal

Emit = Callable[[str, str], None]
#: ``display(data, metadata, display_id, update)``: a display_data (or, ``update``, an
#: update_display_data) under the cell.
DisplayEmit = Callable[[MimeBundle, JsonObject, "str | None", bool], None]

#: How long a line waits for the same line from the other ranks before it is shown.
COLLAPSE_WINDOW = 0.05
#: The ranks of a cell start it a little apart (tenths of a second on a loaded machine),
#: so for the cell's first :data:`START_SPAN` seconds a line waits up to
#: :data:`START_WINDOW` for a rank that has shown nothing at all yet: ``[0-3] hello``, not
#: ``[0-2] hello`` then ``[3] hello``. A rank already heard from gets the usual window.
START_SPAN = 2.0
START_WINDOW = 0.3
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
#: A bar block is redrawn at most this often (at once after a quiet spell).
BAR_INTERVAL = 0.01
#: How long a line without its newline waits for it before it is shown as live.
PARTIAL_WAIT = 0.05
#: Rows a bar block holds before the next bar opens a new block.
BLOCK_ROWS = 256
#: The pseudo stream name of a display in the queue of lines.
DISPLAY = "\0display"


class CellOutput:
    """Groups and labels the output of one cell's ranks.

    ``mode``: ``collapse`` (default) merges identical lines from several ranks;
    ``order`` shows each line as it arrives; ``rank`` holds everything and shows one
    block per rank when :meth:`close` is called. ``logs``: where the full output is
    (named when lines are elided). ``display``: where rich displays and bar blocks go
    (without it, live rows wait for their newline and displays show their text).
    """

    def __init__(
        self,
        emit: Emit,
        ranks: list[int],
        mode: str = "collapse",
        label: bool = True,
        logs: str = "",
        display: DisplayEmit | None = None,
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
        self._display = display
        self._terms: dict[tuple[int, str], Terminal] = {}
        #: terminals whose live rows changed since the bar block was last drawn
        self._live: set[tuple[int, str]] = set()
        self._block: BarBlock | None = None
        self._bars_at = -1.0  # when the bar block was last drawn
        #: id of a live row without its newline -> when it was first seen so
        self._partial_since: dict[int, float] = {}
        #: per rank: the id of its last display, and whether it cleared its output since
        self._last_display: dict[int, str] = {}
        self._cleared: set[int] = set()
        self._pending: deque[Line] = deque()
        self._started = time.monotonic()
        #: ranks that sent any text or display (a rank not among them may start late)
        self._heard: set[int] = set()
        # (stream, text) -> pending lines with that text, oldest first (collapse mode)
        self._index: dict[tuple[str, str], list[Line]] = {}
        self._by_rank: dict[int, list[tuple[str, str | Display]]] = {}
        start = time.monotonic()
        self._messages = Bucket(EMIT_BURST, EMIT_RATE, start)  # stream messages sent at once
        self._bytes = Bucket(BURST_BYTES, RATE_BYTES, start)  # bytes the notebook is sent
        #: Lines shown, and lines elided (not sent to the notebook; they are in the logs).
        self.shown = 0
        self.elided = 0
        self._elided_since_note = 0
        _active.add(self)

    def feed(self, rank: int, name: str, text: str) -> None:
        """Text from ``rank`` on stream ``name`` (any thread)."""
        with self._lock:
            self._heard.add(rank)
            key = (rank, name)
            term = self._terms.get(key)
            if term is None:
                term = self._terms[key] = Terminal()
            lines = term.feed(text)
            now = time.monotonic()
            for line in lines:
                self._add(rank, name, line, now)
            if term.settled or term.pending:
                term.settled.clear()
                self._live.add(key)
            due = self._messages.refill(now) >= 1.0
        if due:
            self.flush()
        if self._pending or self._live:  # held back (no message left now, the collapse
            _due.set()  # window, a bar drawn less than BAR_INTERVAL ago): next turn

    def show_event(self, event: DisplayOutput) -> None:
        """:meth:`show` for a mesh's :class:`DisplayOutput` (the stream router's sink)."""
        self.show(event.rank, event.op, event.data, event.metadata, event.display_id, event.key)

    def show(
        self,
        rank: int,
        op: str,
        data: MimeBundle,
        metadata: JsonObject,
        display_id: str | None,
        key: bytes,
    ) -> None:
        """A rich display from ``rank`` (any thread). ``op``: ``display``, ``update``
        (of ``display_id``), ``clear`` or ``clear_wait`` (``clear_output(wait=...)``:
        clears what this rank displayed, not the other ranks' output); ``key``: equal
        for equal bundles (identical displays of several ranks collapse)."""
        if self._display is None:  # nowhere to show it: its text, as a line
            text = str(data.get("text/plain", "")) if op in ("display", "update") else ""
            if text:
                self.feed(rank, "stdout", text + "\n")
            return
        size = sum(len(v) if isinstance(v, (str, bytes)) else 64 for v in data.values())
        with self._lock:
            self._heard.add(rank)
            now = time.monotonic()
            if op in ("clear", "clear_wait"):
                self._cleared.add(rank)
                last = self._last_display.get(rank)
                if op == "clear" and last is not None:
                    blank = Display(DISPLAY, "", now, {rank}, {"text/plain": ""}, {}, last, True)
                    self._pending.append(blank)
                return
            update = op == "update"
            if display_id:  # the rank's own id: per rank (ranks reuse names)
                did = f"{display_id}-r{rank}"
            elif rank in self._cleared and rank in self._last_display:
                did, update = self._last_display[rank], True  # clear_output + display
            else:
                did = ""
            self._cleared.discard(rank)
            entry: Display | None
            if not update and display_id is None and self._mode == "collapse":
                entry = self._collapsed(rank, key, data, metadata, size, now)
                did = entry.display_id if entry is not None else did
            else:
                did = did or f"mk-d-{uuid.uuid4().hex[:12]}"
                entry = Display(DISPLAY, "", now, {rank}, data, metadata, did, update, size)
            if entry is not None:
                if not update:
                    self._last_display[rank] = did
                if self._mode == "rank" and not update:
                    self._by_rank.setdefault(rank, []).append((DISPLAY, entry))
                else:
                    self._pending.append(entry)
        self.flush()
        if self._pending:
            _due.set()

    def _collapsed(
        self,
        rank: int,
        key: bytes,
        data: MimeBundle,
        metadata: JsonObject,
        size: int,
        now: float,
    ) -> Display | None:
        """A display of ``rank`` that may join an identical one of another rank (lock
        held): None when it joined one (nothing new to send), else the new entry."""
        text = key.hex() if len(key) <= 64 else str(hash(key))
        same = self._index.get((DISPLAY, text))
        if same is None:
            same = self._index[(DISPLAY, text)] = []
        for other in same:
            if rank not in other.ranks and isinstance(other, Display):
                other.ranks.add(rank)
                self._last_display[rank] = other.display_id
                return None
        did = f"mk-d-{uuid.uuid4().hex[:12]}"
        entry = Display(DISPLAY, text, now, {rank}, data, metadata, did, False, size)
        same.append(entry)
        return entry

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
            entry = Line(name, line, now, {rank})
            same.append(entry)
            self._pending.append(entry)
            return
        self._pending.append(Line(name, line, now, {rank}))

    def flush(self, force: bool = False) -> None:
        """Emit lines that are complete (all ranks) or waited long enough, and redraw
        the bar block if it changed."""
        with self._send_lock:
            self._flush_sending(force)

    def _flush_sending(self, force: bool) -> None:
        out: list[tuple[str, str | Display]] = []
        with self._lock:
            now = time.monotonic()
            pending = self._pending
            while pending:
                entry = pending[0]
                ready = (
                    force
                    or self._mode == "order"
                    or entry.ranks >= self._ranks
                    or now - entry.first_seen >= self._window(entry)
                )
                if not ready:
                    break
                pending.popleft()
                if self._mode == "collapse" and (entry.name, entry.text) in self._index:
                    key = (entry.name, entry.text)
                    same = self._index[key]
                    if entry in same:
                        same.remove(entry)  # the oldest: index 0
                    if not same:
                        del self._index[key]
                if isinstance(entry, Display):
                    if self._label and not entry.update:
                        out.append(("stdout", f"[{format_ranks(sorted(entry.ranks))}]:\n"))
                    out.append((DISPLAY, entry))
                else:
                    out.append((entry.name, self._labelled(entry.ranks, entry.text)))
            if out or force:
                out = self._within_budget(out, now, force)
                if out:
                    self._messages.level = max(0.0, self._messages.level - 1.0)
            bars = self._bars(now, force)
        self._send(out)
        if bars is not None:
            block, text = bars
            assert self._display is not None
            data: MimeBundle = {"text/plain": text}
            self._display(data, {"monarch_kernel": {"bars": True}}, block.display_id, block.opened)
            block.opened = True

    def _window(self, entry: Line) -> float:
        """How long ``entry`` waits for the ranks it lacks (lock held)."""
        early = entry.first_seen - self._started < START_SPAN
        if early and not (self._ranks - entry.ranks) <= self._heard:
            return START_WINDOW  # a rank it lacks has shown nothing yet: maybe a late start
        return COLLAPSE_WINDOW

    def _bars(self, now: float, force: bool) -> tuple[BarBlock, str] | None:
        """The bar block to draw now and its text, if it changed (lock held)."""
        if self._display is None or self._mode == "rank" or not self._live:
            return None
        if not force and now - self._bars_at < BAR_INTERVAL:
            return None  # the flusher's next turn
        block = self._block
        if block is None or len(block.rows) >= BLOCK_ROWS:
            block = self._block = BarBlock()
        waiting: set[tuple[int, str]] = set()
        for key in sorted(self._live):
            for row in self._terms[key].live():
                if row.shown:
                    continue
                if not (row.framed or row.returned) and not force:
                    # a line without its newline yet: shown once it stayed so for a
                    # while (a flood's batches end mid-line for a moment)
                    since = self._partial_since.setdefault(id(row), now)
                    if now - since < PARTIAL_WAIT:
                        waiting.add(key)
                        continue
                self._partial_since.pop(id(row), None)
                row.shown = True
                block.rows.append((key[0], row))
        self._live = waiting
        if len(self._partial_since) > 1024:  # rows completed before they were shown
            self._partial_since.clear()
        if not block.rows:
            if self._block is block and not block.opened:
                self._block = None
            return None
        text = block.render(self._mode == "collapse", self._label)
        if all(row.done for _, row in block.rows):
            self._block = None  # every row in it is final: the next bar opens a new one
        if text == block.sent:
            return None
        block.sent = text
        self._bars_at = now
        return block, text

    def _within_budget(
        self, lines: list[tuple[str, str | Display]], now: float, closing: bool
    ) -> list[tuple[str, str | Display]]:
        """The lines the notebook can be sent now; count the rest as elided (lock held)."""
        budget = self._bytes
        budget.refill(now)
        kept: list[tuple[str, str | Display]] = []
        for name, text in lines:
            size = text.size if isinstance(text, Display) else len(text)
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

    def _send(self, lines: list[tuple[str, str | Display]]) -> None:
        # Consecutive lines of one stream go out as one message.
        i = 0
        while i < len(lines):
            name, item = lines[i]
            if isinstance(item, Display):
                assert self._display is not None
                meta = dict(item.metadata)
                meta["monarch_kernel"] = {"ranks": sorted(item.ranks)}
                self._display(item.data, meta, item.display_id, item.update)
                i += 1
                continue
            j = i
            while j < len(lines) and lines[j][0] == name and not isinstance(lines[j][1], Display):
                j += 1
            self._emit(name, "".join(str(text) for _, text in lines[i:j]))
            i = j

    def close(self) -> None:
        """Flush everything, bars and lines without their newline included; no more
        output after this."""
        with self._lock:
            now = time.monotonic()
            for (rank, name), term in sorted(self._terms.items()):
                for line in term.close():
                    self._add(rank, name, line, now)
                if term.settled:
                    term.settled.clear()
                    self._live.add((rank, name))
            blocks: list[tuple[str, str | Display]] = []
            for rank in sorted(self._by_rank):
                for name, item in self._by_rank[rank]:
                    if isinstance(item, Display):
                        if self._label:
                            blocks.append(("stdout", f"[{rank}]:\n"))
                        blocks.append((DISPLAY, item))
                    else:
                        blocks.append((name, self._labelled({rank}, item)))
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
                waiting = waiting or bool(out._pending) or bool(out._live)
            except Exception:  # pragma: no cover - never kill the flusher
                pass
        if waiting:  # lines still wait for other ranks' copies (the collapse window)
            _due.set()


threading.Thread(target=_flusher, name="mk-output-flusher", daemon=True).start()
