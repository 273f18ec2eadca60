"""A mesh's step telemetry in the controller (see the package docstring)."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from monarch_kernel.controller.state.records import RankInfo
from monarch_kernel.controller.telemetry.stragglers import (
    Margins,
    StragglerDetector,
    StragglerNotice,
)
from monarch_kernel.wire.codec import Header, Message
from monarch_kernel.wire.steps import CATEGORIES, StepBatch, StepRecord, decode_steps

log = logging.getLogger("monarch_kernel.controller")

#: Steps kept per rank (the dashboard's bars and heat map read the last of them).
KEEP = 240
#: A step is judged once every rank of its cell sent it, or once a rank is this many
#: steps past it (the others never will: died, or another slice).
LAG = 8
#: Seconds after a cell's first steps came before its steps are judged: every rank's
#: first batch arrives by then (they send every 0.1 s).
SETTLE = 0.3

NoticeHook = Callable[[str, StragglerNotice], None]
_notice_hook: NoticeHook | None = None


def set_notice_hook(hook: NoticeHook | None) -> None:
    """Call ``hook(mesh name, notice)`` for every straggler notice of every mesh (the
    kernel shows it under the running cell)."""
    global _notice_hook
    _notice_hook = hook


@dataclass(frozen=True)
class RankBreakdown:
    """A rank's mean step over its last steps: seconds by category, bandwidth."""

    rank: int
    steps: int
    last_step: int
    wall: float
    seconds: dict[str, float]
    #: Bus bandwidth (bytes/s) while its collectives were in flight, and bytes per step.
    bus_bandwidth: float
    nbytes: float


@dataclass
class _Cell:
    """The steps of one request (cell) not judged yet."""

    first_seen: float
    ranks: set[int]
    steps: dict[int, dict[int, StepRecord]]
    judged: int = 0  # the last step judged
    newest: int = 0


class MeshTelemetry:
    """Receives a mesh's ``steps`` messages (its :class:`Inbound` handler) and keeps
    what the dashboard and the straggler detector need."""

    def __init__(
        self,
        name: str,
        ranks: Sequence[RankInfo],
        margins: Margins | None = None,
        rank_of: Callable[[int], int | None] | None = None,
    ):
        """``rank_of(slot)``: the logical rank of a rank's wire id (a host's combined
        batches name their ranks by slot); default: the same number."""
        self.name = name
        self._ranks = ranks
        self._rank_of = rank_of or (lambda slot: slot)
        self._lock = threading.Lock()
        #: Notified whenever steps arrive (``wait_for_steps``).
        self._arrived = threading.Condition(self._lock)
        self._recent: dict[int, deque[StepRecord]] = {}
        self._cells: dict[str | None, _Cell] = {}
        self.detector = StragglerDetector(self._host_of, margins)
        self._judging: _Cell | None = None
        self._listeners: list[Callable[[StragglerNotice], None]] = []
        #: Every notice so far (newest last, bounded), for the dashboard and tests.
        self.notices: deque[StragglerNotice] = deque(maxlen=50)
        #: Steps received, and seconds spent handling them (the controller's cost).
        self.received = 0
        self.cpu_seconds = 0.0

    def _host_of(self, rank: int) -> str:
        try:
            return f"host-{self._ranks[rank].host}"
        except IndexError:
            return "host-?"

    # -- listeners ---------------------------------------------------------------------
    def subscribe(self, listener: Callable[[StragglerNotice], None]) -> None:
        """Call ``listener(notice)`` (on the receiving thread: append and return)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[StragglerNotice], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- receiving ---------------------------------------------------------------------
    def on_steps(self, h: Header, msg: Message) -> None:
        """``steps`` from rank ``h["r"]`` (already its logical rank; a rank without a
        host agent's fan-in, e.g. of a detachable mesh)."""
        rank = h.get("r")
        if isinstance(rank, int):
            self._take([(rank, msg.payload)])

    def on_host_steps(self, h: Header, msg: Message) -> None:
        """``host_steps``: a host agent's ranks' batches, combined (by slot)."""
        try:
            by_slot: dict[int, list[bytes]] = pickle.loads(msg.payload)
            items = [(self._rank_of(s), p) for s, ps in by_slot.items() for p in ps]
        except Exception as exc:  # signed by our agent: another version?
            log.warning("mesh %s dropped host %s's steps: %s", self.name, h.get("h"), exc)
            return
        self._take([(r, p) for r, p in items if r is not None])

    def _take(self, batches: list[tuple[int, bytes | memoryview]]) -> None:
        t0 = time.thread_time()
        notices: list[StragglerNotice] = []
        for rank, payload in batches:
            try:
                batch = decode_steps(payload)
            except ValueError as exc:
                log.warning("mesh %s: rank %s: %s", self.name, rank, exc)
                continue
            notices += self._add(rank, batch)
        self._tell(notices)
        self.cpu_seconds += time.thread_time() - t0

    def _add(self, rank: int, batch: StepBatch) -> list[StragglerNotice]:
        notices: list[StragglerNotice] = []
        with self._lock:
            recent = self._recent.get(rank)
            if recent is None:
                recent = self._recent[rank] = deque(maxlen=KEEP)
            recent.extend(batch.steps)
            self.received += len(batch.steps)
            self._arrived.notify_all()
            cell = self._cells.get(batch.request)
            now = time.monotonic()
            if cell is None:
                cell = self._cells[batch.request] = _Cell(now, set(), {})
                if len(self._cells) > 8:  # old cells: forget
                    del self._cells[next(iter(self._cells))]
            cell.ranks.add(rank)
            for record in batch.steps:
                if record.step > cell.judged:
                    cell.steps.setdefault(record.step, {})[rank] = record
                cell.newest = max(cell.newest, record.step)
            if now - cell.first_seen >= SETTLE:
                notices = self._judge(cell)
        return notices

    def _tell(self, notices: list[StragglerNotice]) -> None:
        for notice in notices:
            self.notices.append(notice)
            for listener in list(self._listeners):
                try:
                    listener(notice)
                except Exception:
                    log.exception("straggler listener failed")
            hook = _notice_hook
            if hook is not None:
                try:
                    hook(self.name, notice)
                except Exception:
                    log.exception("straggler notice hook failed")

    def _judge(self, cell: _Cell) -> list[StragglerNotice]:
        notices = []
        if cell is not self._judging:  # another loop: judged afresh
            self._judging = cell
            self.detector = StragglerDetector(self._host_of, self.detector.margins)
        for step in sorted(cell.steps):
            records = cell.steps[step]
            if len(records) < len(cell.ranks) and cell.newest - step < LAG:
                break
            del cell.steps[step]
            cell.judged = step
            notice = self.detector.judge(step, records)
            if notice is not None:
                notices.append(notice)
        return notices

    # -- what the dashboard reads ------------------------------------------------------
    def breakdown(self, last: int = 20) -> dict[int, RankBreakdown]:
        """Each rank's mean over its ``last`` steps."""
        with self._lock:
            recents = {r: list(d)[-last:] for r, d in self._recent.items() if d}
        out = {}
        for rank, steps in recents.items():
            n = len(steps)
            seconds = {c: sum(s.category(c) for s in steps) / n for c in CATEGORIES}
            in_flight = sum(s.in_flight for s in steps)
            bus = sum(s.bus_bytes for s in steps)
            out[rank] = RankBreakdown(
                rank,
                n,
                steps[-1].step,
                sum(s.wall for s in steps) / n,
                seconds,
                bus / in_flight if in_flight > 0 else 0.0,
                sum(s.nbytes for s in steps) / n,
            )
        return out

    def heat(self, columns: int = 60) -> dict[int, list[float]]:
        """Each rank's step times (s) of its last ``columns`` steps, oldest first."""
        with self._lock:
            return {r: [s.wall for s in list(d)[-columns:]] for r, d in self._recent.items()}

    def recent(self, rank: int) -> list[StepRecord]:
        """Rank ``rank``'s steps kept (oldest first)."""
        with self._lock:
            return list(self._recent.get(rank, ()))

    def wait_for_steps(self, timeout: float) -> None:
        """Return when the next steps arrive from any rank, or after ``timeout`` s."""
        with self._arrived:
            self._arrived.wait(timeout)

    def forget(self) -> None:
        """Drop what was kept (a new cell of another loop, a test)."""
        with self._lock:
            self._recent.clear()
            self._cells.clear()
