"""The dashboard's model of one mesh, fed by the controller's lifecycle events.

:class:`MeshState` subscribes to its mesh's event bus (``runtime.events``) with an
:class:`~monarch_kernel.widgets.inbox.EventInbox`: controller threads only append events
to a deque there (O(1), never blocking, never touching a widget). The dashboard's updater
thread calls :meth:`MeshState.drain` a few times a second; only there are events turned
into metric series, error incidents and per-rank extras, dispatched by event type through
one handler table. Everything else a tile shows (state, pid, device, output ...) is read
from the controller's records (``runtime.ranks``) at that moment, so the dashboard never
disagrees with the controller for long.

Its parts, each in a module of its own: the running jobs (:mod:`.jobs`), the reported
metrics (:mod:`.metrics`), the sampled transfer rates and memory (:mod:`.sampling`) and the
error incidents (:mod:`.incidents`); what each part shows is a record in :mod:`.views`.

Pure Python (no ipywidgets): unit-testable and reusable by other frontends.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch_kernel.controller.state.events import (
    DebuggerPaused,
    DebuggerResumed,
    FaultReported,
    MeshEvent,
    MeshPhaseChanged,
    MeshRecovered,
    MeshResized,
    MetricReported,
    RankDied,
    RanksRenumbered,
    RankStateChanged,
    ReplyReceived,
    RequestFailed,
    RequestKind,
    RequestStarted,
    StatsReported,
    StreamOutput,
)
from monarch_kernel.controller.state.records import MeshPhase, RankInfo, RankState
from monarch_kernel.widgets import gpu_view
from monarch_kernel.widgets.fmt import age, human_bytes, num
from monarch_kernel.widgets.inbox import EventInbox
from monarch_kernel.widgets.incidents import ErrorEntry, Incident, IncidentLog
from monarch_kernel.widgets.jobs import Job, RunningJobs
from monarch_kernel.widgets.metrics import MetricHistory
from monarch_kernel.widgets.sampling import LocalMemory, Throughput
from monarch_kernel.widgets.series import SERIES_CAP, Series
from monarch_kernel.widgets.views import Recovery, TileView
from monarch_kernel.wire.reports import RankStats

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

__all__ = [
    # SERIES_CAP and Series are imported from here by the tests (they live in .series)
    "SERIES_CAP",
    "SUBSCRIBED",
    "MeshState",
    "Series",
    "TileView",
]

OUTPUT_LINES = 20
#: The tensor engine's client module: looked up, never imported (it loads torch).
_TENSOR_CLIENT = "monarch_kernel.tensor_engine.client"
#: Recoveries (restarts in place) remembered for the incident area.
MAX_RECOVERIES = 10

#: The events the dashboard listens to. Replies are among them only to tell when a
#: running job is over on a rank (one dict look-up each when folded); a rank's IDLE/BUSY
#: state is the controller's.
SUBSCRIBED: tuple[type[MeshEvent], ...] = (
    MeshPhaseChanged,
    RequestStarted,
    StreamOutput,
    MetricReported,
    ReplyReceived,
    RequestFailed,
    FaultReported,
    RankStateChanged,
    RankDied,
    StatsReported,
    MeshRecovered,
    DebuggerPaused,
    DebuggerResumed,
    RanksRenumbered,
    MeshResized,
)


class MeshState:
    """Aggregated, throttle-friendly view of one mesh for the dashboard."""

    def __init__(self, runtime: MeshRuntime):
        self.rt = runtime
        self.inbox = EventInbox()
        #: The mesh event listener (see :mod:`~monarch_kernel.widgets.inbox`).
        self.on_event: Callable[[MeshEvent], None] = self.inbox.put
        self.history = MetricHistory()
        self.last_event: dict[int, float] = {}  # monotonic time of the rank's last message
        self.what: dict[int, str] = {}  # what was last started on the rank (cell 5 ...)
        self.errored: dict[int, str] = {}  # rank -> request id whose failure it shows
        self.interrupted: dict[int, str] = {}  # rank -> request id it was interrupted in
        #: rank -> where its debugger holds it (``cell line 7``), while paused
        self.paused: dict[int, str] = {}
        self.errors = IncidentLog()
        self.mesh_state: MeshPhase = runtime.state
        self.running = RunningJobs()
        #: Restarts in place, newest first; ``recovery_count`` counts them all.
        self.recoveries: deque[Recovery] = deque(maxlen=MAX_RECOVERIES)
        self.recovery_count = 0
        #: The last grow or shrink, in words (``MeshResized``), and how many there were.
        self.resize_text = ""
        self.resize_count = 0
        self.throughput = Throughput()
        self.local_memory = LocalMemory()  # psutil's view of local ranks without stats
        #: The ranks' GPU utilisation and memory over time (host agents' NVML samples).
        self.gpu = gpu_view.GpuHistory()
        #: rank -> (its restarts, the ops issued to it then): the count it reports
        #: starts again at each restart
        self._ops_base: dict[int, tuple[int, int]] = {}
        self.attached = False

    # -- the controller side ---------------------------------------------------------
    def attach(self) -> None:
        """Start listening to the mesh's events."""
        if not self.attached:
            self.rt.events.subscribe(self.on_event, *SUBSCRIBED)
            self.mesh_state = self.rt.state  # any later change comes as an event
            self.attached = True

    def detach(self) -> None:
        """Stop listening (events still queued are folded in by the next drain)."""
        if self.attached:
            self.rt.events.unsubscribe(self.on_event)
            self.attached = False

    @property
    def dropped(self) -> int:
        """Events lost because the updater fell far behind (should stay 0)."""
        return self.inbox.dropped

    @property
    def metrics(self) -> dict[str, dict[int, Series]]:
        """The reported metrics' series: by name (first reported first), then rank."""
        return self.history.series

    @property
    def jobs(self) -> dict[str, Job]:
        """Running jobs by request id, oldest first (see :attr:`running`)."""
        return self.running.jobs

    @property
    def incidents(self) -> list[Incident]:
        """Error incidents, newest first."""
        return self.errors.incidents

    @property
    def last_error(self) -> dict[int, tuple[Incident, ErrorEntry]]:
        """rank -> its latest error: the incident and the entry it is in."""
        return self.errors.last_error

    @property
    def error_version(self) -> int:
        """Changes whenever the incident area changes (errors, or a recovery)."""
        return self.errors.version + self.recovery_count

    # -- the updater side ------------------------------------------------------------
    def drain(self) -> int:
        """Fold the queued events into the model; returns how many were handled."""
        now = time.monotonic()
        n = 0
        events = self.inbox.events
        if events:
            handlers = _HANDLERS
            popleft = events.popleft
            for _ in range(len(events)):
                ev = popleft()
                handler = handlers.get(type(ev))
                if handler is not None:
                    handler(self, ev, now)
                n += 1
        for rank, queue in list(self.inbox.metrics.items()):
            k = len(queue)
            if k:
                popleft_values = queue.popleft
                self.last_event[rank] = now
                self.history.fold(rank, [popleft_values() for _ in range(k)])
                n += k
        if self.running.jobs:
            self.running.prune(self.rt.ranks)
        return n

    # -- event handlers (one per event type: see _HANDLERS) ------------------------------
    def _on_paused(self, ev: DebuggerPaused, now: float) -> None:
        self.paused[ev.rank] = ev.where

    def _on_resumed(self, ev: DebuggerResumed, now: float) -> None:
        self.paused.pop(ev.rank, None)

    def _on_phase(self, ev: MeshPhaseChanged, now: float) -> None:
        self.mesh_state = ev.phase

    def _on_recovered(self, ev: MeshRecovered, now: float) -> None:
        self.recoveries.appendleft(Recovery(time.time(), ev.report, ev.report.describe(ev.mesh)))
        self.recovery_count += 1

    def _on_reply(self, ev: ReplyReceived, now: float) -> None:
        if self.paused:
            self.paused.pop(ev.rank, None)  # its work is over: no debugger holds it
        if self.running.jobs:
            self.running.done_on(ev.request, ev.rank)

    def _on_started(self, ev: RequestStarted, now: float) -> None:
        if ev.kind is RequestKind.CONTROL:  # push/pull/ping: not work a rank is busy with
            return
        rid, what = ev.request, ev.what
        self.running.start(ev, now)
        self.errors.name_request(rid, what)
        for r in ev.ranks:
            if what:
                self.what[r] = what
            if self.errored.get(r) != rid:
                self.errored.pop(r, None)
            if self.interrupted.get(r) != rid:
                self.interrupted.pop(r, None)

    def _on_stream(self, ev: StreamOutput, now: float) -> None:
        self.last_event[ev.rank] = now

    def _on_stats(self, ev: StatsReported, now: float) -> None:
        self.last_event[ev.rank] = now

    def _on_failed(self, ev: RequestFailed, now: float) -> None:
        if ev.kind is RequestKind.CONTROL:  # e.g. pull() of a name a rank lacks
            return
        rank, rid, report = ev.rank, ev.request, ev.report
        self.running.done_on(rid, rank)
        self.last_event[rank] = now
        if report.get("type") == "KeyboardInterrupt":
            self.interrupted[rank] = rid  # where it was interrupted is still worth a look
            self.errors.add_report(rid, rank, report, "interrupt")
        else:
            self.errored[rank] = rid
            self.errors.add_report(rid, rank, report, "exception")

    def _on_fault(self, ev: FaultReported, now: float) -> None:
        self.last_event[ev.rank] = now
        self.errored[ev.rank] = self.errors.add_fault(ev.rank, ev.report)

    def _on_rank_state(self, ev: RankStateChanged, now: float) -> None:
        self.last_event[ev.rank] = now
        if ev.state is RankState.BUSY or ev.state is RankState.STARTING:
            self.errored.pop(ev.rank, None)  # new work (or a new process): a clean slate
            self.interrupted.pop(ev.rank, None)

    def _on_resized(self, ev: MeshResized, now: float) -> None:
        self.resize_text = ev.text
        self.resize_count += 1

    def _on_renumbered(self, ev: RanksRenumbered, now: float) -> None:
        """A shrink renumbered the ranks (events before this named the old numbers,
        those after the new ones): what is kept per rank follows its process."""
        moved, gone = dict(ev.renumbered), set(ev.removed)

        def rekey(per_rank: dict[int, Any]) -> dict[int, Any]:
            return {moved.get(r, r): v for r, v in per_rank.items() if r not in gone}

        self.last_event = rekey(self.last_event)
        self.what = rekey(self.what)
        self.errored = rekey(self.errored)
        self.interrupted = rekey(self.interrupted)
        self.paused = rekey(self.paused)
        history = self.history
        history.step = rekey(history.step)
        history.report_count = rekey(history.report_count)
        history.series = {name: rekey(per) for name, per in history.series.items()}
        history.version += 1
        self.throughput.rates = rekey(self.throughput.rates)
        self.throughput._last = None  # byte counters per rank: start sampling again
        self.local_memory.stats = rekey(self.local_memory.stats)
        self.gpu.rekey(moved, gone)
        for job in self.running.jobs.values():
            job.ranks = tuple(moved.get(r, r) for r in job.ranks if r not in gone)
            job.running = {moved.get(r, r) for r in job.running if r not in gone}

    def _on_died(self, ev: RankDied, now: float) -> None:
        # A process that ended runs nothing: every job is over on it (not only those
        # ``ev.requests`` names: requests given up on earlier are not among them).
        self.running.rank_ended(ev.rank)
        self.errored.pop(ev.rank, None)
        self.interrupted.pop(ev.rank, None)
        if ev.state is RankState.DEAD:  # not stopped on purpose: an incident
            self.errors.add_death(ev.death, self.errors.newest_named(ev.requests))

    # -- sampling (about once a second) ------------------------------------------------
    def sample(self) -> None:
        """Record transfer rates (and local memory when ranks do not report it), and
        the ranks' GPUs when their host agents sample them."""
        now = time.monotonic()
        self.throughput.sample(self.rt, now)
        self.local_memory.sample(self.rt.ranks)
        self.gpu.sample(self.rt.ranks, self.rank_stats)

    # -- views -----------------------------------------------------------------------
    def rank_stats(self, rank: int) -> RankStats:
        """Rank ``rank``'s latest stats: its own report, else psutil's (local ranks)."""
        return self.rt.ranks[rank].stats or self.local_memory.stats.get(rank) or {}

    def tile_state(self, rank: int) -> str:
        """Just the state of rank ``rank``'s tile (cheap: for the ticks that only recolour)."""
        state = self.rt.ranks[rank].state
        if state is RankState.IDLE and rank in self.errored:
            return "error"
        if state is RankState.BUSY and rank in self.paused:
            return "paused"
        return state.value

    def tile(self, rank: int, now: float | None = None) -> TileView:
        """What rank ``rank``'s tile shows now."""
        now = time.monotonic() if now is None else now
        rt = self.rt
        info = rt.ranks[rank]
        shown, what = self._tile_state_what(info)
        step = self.history.step.get(rank)
        rate = self.throughput.rates.get(rank)
        coords = ", ".join(f"{k}={v}" for k, v in zip(rt.shape.labels, info.coords))
        stats = self.rank_stats(rank) if info.alive else {}  # never stale GPU of the dead
        issued, pending = self._tensor_ops(info, stats)
        return TileView(
            rank=rank,
            state=shown,
            what=what,
            coords=coords,
            host=info.hostname or f"host {info.host}",
            pid=str(info.pid) if info.pid else "",
            device=info.device or "",
            mem=self._tile_memory(info),
            step=num(step) if step is not None else "",
            seen=self._tile_seen(info, now),
            rate_in=rate[0] if rate else None,
            rate_out=rate[1] if rate else None,
            restarts=info.restarts,
            gpu=gpu_view.tile_line(stats),
            gpu_tip=gpu_view.tooltip_line(stats),
            ops_issued=issued,
            ops_pending=pending,
        )

    def _tensor_ops(self, info: RankInfo, stats: RankStats) -> tuple[int | None, int | None]:
        """Tensor-engine ops issued to the rank (by this notebook's client of the mesh),
        and how many it has not run yet by its last report; ``(None, None)`` when the
        tensor engine was never used on the mesh. A restarted rank counts from its
        restart (the ops issued before were lost with it)."""
        # loaded only once the engine is used; while another thread imports it, it has
        # no ``existing_client`` yet (and no client exists)
        existing = getattr(sys.modules.get(_TENSOR_CLIENT), "existing_client", None)
        client = existing(self.rt) if existing is not None else None
        if client is None:
            return None, None
        rank = info.rank
        issued = client.issued_to(rank)
        restarts, base = self._ops_base.get(rank, (0, 0))
        if info.restarts != restarts:  # the ops before the restart were lost with it
            restarts, base = info.restarts, issued
            self._ops_base[rank] = (restarts, base)
        done = stats.get("te_ops", 0)
        return issued, max(0, issued - base - done) if info.alive else None

    def _tile_state_what(self, info: RankInfo) -> tuple[str, str]:
        """The tile's state and its line saying what the rank does (or did last)."""
        rank, state = info.rank, info.state
        if state is RankState.BUSY and rank in self.paused:
            return "paused", f"rank {rank} stopped at {self.paused[rank]}"
        if state is RankState.BUSY:
            return state.value, self.what.get(rank, "")
        if state is RankState.IDLE:
            last = self.what.get(rank)
            if rank in self.errored:
                found = self.last_error.get(rank)
                return "error", found[1].title if found else "failed"
            if rank in self.interrupted:
                return state.value, f"interrupted: {last}" if last else "interrupted"
            return state.value, f"last: {last}" if last else "ready"
        if state is RankState.DEAD:
            return state.value, info.death.how if info.death is not None else "dead"
        if state is RankState.STOPPED:
            return state.value, "stopped"
        return state.value, "restarting" if info.restarts else "starting"

    def _tile_memory(self, info: RankInfo) -> str:
        """``GPU 1.2 GB``, else ``RSS 300 MB``, else nothing (never stale memory of the dead)."""
        stats = self.rank_stats(info.rank) if info.alive else {}
        gpu, rss = stats.get("gpu_mem"), stats.get("rss")
        if gpu is not None:
            return f"GPU {human_bytes(gpu)}"
        return f"RSS {human_bytes(rss)}" if rss is not None else ""

    def _tile_seen(self, info: RankInfo, now: float) -> str:
        """How long ago the rank (or its host) was last heard from; empty while it starts."""
        if not info.alive or info.state is RankState.STARTING:
            return ""
        host_seen = self.rt.hosts[info.host].last_seen
        last_seen = max(host_seen, info.last_seen, self.last_event.get(info.rank, 0.0))
        return age(now - last_seen) if last_seen else ""

    def output_lines(self, rank: int, n: int = OUTPUT_LINES) -> list[str]:
        """The rank's most recent output lines (the controller keeps them per rank)."""
        info = self.rt.ranks[rank]
        lines = list(info.tail)[-n:]
        for text in list(info.partial.values()):
            if text:
                lines.append(text)
        return lines[-n:]


#: event type -> its handler (drain dispatches on ``type(event)``; each handler takes
#: the event type it is registered for).
_HANDLERS: dict[type[MeshEvent], Callable[[MeshState, Any, float], None]] = {
    MeshPhaseChanged: MeshState._on_phase,
    RequestStarted: MeshState._on_started,
    ReplyReceived: MeshState._on_reply,
    StreamOutput: MeshState._on_stream,
    StatsReported: MeshState._on_stats,
    RequestFailed: MeshState._on_failed,
    FaultReported: MeshState._on_fault,
    RankStateChanged: MeshState._on_rank_state,
    RankDied: MeshState._on_died,
    MeshRecovered: MeshState._on_recovered,
    DebuggerPaused: MeshState._on_paused,
    DebuggerResumed: MeshState._on_resumed,
    RanksRenumbered: MeshState._on_renumbered,
    MeshResized: MeshState._on_resized,
}
