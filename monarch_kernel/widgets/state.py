"""The dashboard's model of one mesh, fed by the controller's lifecycle events.

:class:`MeshState` subscribes to its mesh's event bus (``runtime.events``) with an
:class:`~monarch_kernel.widgets.inbox.EventInbox`: controller threads only append events
to a deque there (O(1), never blocking, never touching a widget). The dashboard's updater
thread calls :meth:`MeshState.drain` a few times a second; only there are events turned
into metric series, error incidents and per-rank extras, dispatched by event type through
one handler table. Everything else a tile shows (state, pid, device, output ...) is read
from the controller's records (``runtime.ranks``) at that moment, so the dashboard never
disagrees with the controller for long.

Pure Python (no ipywidgets): unit-testable and reusable by other frontends.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.events import (
    DebuggerPaused,
    DebuggerResumed,
    FaultReported,
    MeshEvent,
    MeshPhaseChanged,
    MeshRecovered,
    MetricReported,
    RankDied,
    RankStateChanged,
    ReplyReceived,
    RequestFailed,
    RequestKind,
    RequestStarted,
    StatsReported,
    StreamOutput,
)
from monarch_kernel.controller.records import MeshPhase, RankState, RecoveryReport
from monarch_kernel.widgets.fmt import age, human_bytes, num, rate_text
from monarch_kernel.widgets.inbox import EventInbox
from monarch_kernel.widgets.incidents import (
    ErrorEntry,
    Incident,
    IncidentLog,
)
from monarch_kernel.widgets.series import SERIES_CAP, Series
from monarch_kernel.wire.reports import RankStats

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

__all__ = [
    "SERIES_CAP",
    "SUBSCRIBED",
    "ErrorEntry",
    "Incident",
    "Job",
    "JobView",
    "MeshState",
    "Recovery",
    "Series",
    "TileView",
    "rate_text",
]

MAX_METRICS = 12
RATE_SAMPLES = 120  # throughput history, one sample a second
OUTPUT_LINES = 20

#: Requests listed as running jobs: ``%%remote`` cells and actor calls (not spawns,
#: actor stops or control messages, which are over in moments or not work at all).
JOB_KINDS = frozenset({RequestKind.CELL, RequestKind.CALL})
#: Running jobs shown (the newest); older ones are counted, not listed.
MAX_JOBS = 5
#: Running requests tracked at most (a flood of outstanding calls drops the oldest).
MAX_TRACKED_JOBS = 4096
#: Actor calls are listed once they have run this long (cells at once): a training loop
#: of short calls would otherwise make the list flicker at every update.
CALL_MIN_AGE = 0.5
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
)


@dataclass(frozen=True)
class TileView:
    """Everything one tile shows; compared between ticks to send deltas only."""

    rank: int
    state: str  # starting | idle | busy | paused | error | dead | stopped
    what: str
    coords: str
    host: str
    pid: str
    device: str
    mem: str
    step: str
    seen: str
    rate_in: float | None
    rate_out: float | None
    restarts: int


@dataclass
class Job:
    """A request running on the mesh that a person would call a job: a ``%%remote``
    cell or an actor call. ``running``: the ranks that have not answered it yet and
    were not lost (it leaves the list when that is empty)."""

    request: str
    kind: RequestKind
    what: str
    ranks: tuple[int, ...]
    running: set[int]
    started: float  #: ``time.monotonic()`` when it was sent


@dataclass(frozen=True)
class JobView:
    """One row of the running-jobs list; compared between ticks to send deltas only."""

    request: str
    what: str
    kind: str  # cell | call
    ranks: str  # "ranks 0-3", "rank 1 (3 of 4 done)"
    elapsed: str  # "12s", "3m 05s"
    cancelling: bool

    @property
    def text(self) -> str:
        state = " · cancelling…" if self.cancelling else ""
        return f"{self.what} · running on {self.ranks} · {self.elapsed}{state}"


@dataclass(frozen=True)
class Recovery:
    """A restart in place (:class:`MeshRecovered`), as the dashboard shows it."""

    time: float  #: ``time.time()`` when the dashboard learnt of it
    report: RecoveryReport
    text: str  #: ``report.describe(mesh)``: ranks restarted, what was re-run, what was lost

    @property
    def summary(self) -> str:
        """One line for the status: ``recovered: restarted ranks 1 in 1.2s``."""
        rep = self.report
        if rep.restarted:
            what = f"restarted ranks {format_ranks(list(rep.restarted))}"
        elif rep.process_group is not None:
            what = "re-formed the process group"
        else:
            what = "nothing to restart"
        text = f"recovered: {what} in {rep.seconds:.2f}s"
        if rep.reason:
            text += f", {rep.reason}"
        if rep.problems:
            text += f"; {len(rep.problems)} problem(s), see below"
        return text


def duration(seconds: float) -> str:
    """``42s``, ``3m 05s``, ``2h 01m``."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


class MeshState:
    """Aggregated, throttle-friendly view of one mesh for the dashboard."""

    def __init__(self, runtime: MeshRuntime):
        self.rt = runtime
        self.inbox = EventInbox()
        #: The mesh event listener (see :mod:`~monarch_kernel.widgets.inbox`).
        self.on_event: Callable[[MeshEvent], None] = self.inbox.put
        self.metrics: dict[str, dict[int, Series]] = {}
        self.metric_version = 0
        self.step: dict[int, float] = {}
        self.report_count: dict[int, int] = {}
        self.last_event: dict[int, float] = {}  # monotonic time of the rank's last message
        self.what: dict[int, str] = {}  # what was last started on the rank (cell 5 ...)
        self.errored: dict[int, str] = {}  # rank -> request id whose failure it shows
        self.interrupted: dict[int, str] = {}  # rank -> request id it was interrupted in
        self.errors = IncidentLog()
        self.mesh_state: MeshPhase = runtime.state
        #: Running jobs by request id, oldest first (see :meth:`jobs_view`).
        self.jobs: dict[str, Job] = {}
        #: Request ids a Cancel was sent for (written by the dashboard's action thread).
        self.cancelling: set[str] = set()
        self.jobs_more = 0  #: running jobs the last :meth:`jobs_view` left out
        #: Restarts in place, newest first; ``recovery_count`` counts them all.
        self.recoveries: deque[Recovery] = deque(maxlen=MAX_RECOVERIES)
        self.recovery_count = 0
        # throughput
        self.rates: dict[int, tuple[float, float]] = {}
        self.total_rate: tuple[float, float] = (0.0, 0.0)
        self.rate_history: deque[
            tuple[float, dict[int, tuple[float, float]], tuple[float, float]]
        ] = deque(maxlen=RATE_SAMPLES)
        self.per_rank_bytes = True  # the controller counts bytes per rank
        self.samples = 0
        self._last_sample: tuple[float, dict[int, tuple[int, int]], tuple[int, int]] | None = None
        self._local_host = socket.gethostname()
        self._psutil_procs: dict[int, Any] = {}  # rank -> psutil.Process
        self.local_stats: dict[int, RankStats] = {}  # psutil fallback for local ranks
        self._next_memory = 0.0
        self.attached = False
        #: rank -> where its debugger holds it (``cell line 7``), while paused
        self.paused: dict[int, str] = {}

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
    def incidents(self) -> list[Incident]:
        """Error incidents, newest first."""
        return self.errors.incidents

    @property
    def last_error(self) -> dict[int, tuple[Incident, ErrorEntry]]:
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
                self._fold_metrics(rank, [popleft_values() for _ in range(k)], now)
                n += k
        if self.jobs:
            self._prune_jobs()
        return n

    def _prune_jobs(self) -> None:
        """Take out of the jobs the ranks the controller says run nothing now (idle,
        dead or stopped). The events say when a rank is done with a job; this catches
        what they cannot: a rank given up on (its late answer is no event), a stop.
        Sound because a rank is BUSY before its :class:`RequestStarted` is emitted, and
        stays BUSY until every request sent to it was answered or lost."""
        ranks = self.rt.ranks
        busy = (RankState.BUSY, RankState.STARTING)
        for rid, job in list(self.jobs.items()):
            job.running = {r for r in job.running if ranks[r].state in busy}
            if not job.running:
                self._end_job(rid)

    def _fold_metrics(self, rank: int, vals: list[dict[str, float]], now: float) -> None:
        self.last_event[rank] = now
        count = self.report_count.get(rank, 0)
        self.report_count[rank] = count + len(vals)
        steps = [v.get("step") for v in vals]
        if None in steps:
            xs = [float(count + i) if s is None else s for i, s in enumerate(steps)]
        else:
            xs = cast(list[float], steps)
        for s in reversed(steps):
            if s is not None:
                self.step[rank] = s
                break
        # every name reported in this batch, in first-seen order (charts keep that order)
        names = vals[0].keys() if len(vals) == 1 else dict.fromkeys(chain.from_iterable(vals))
        metrics = self.metrics
        for name in names:
            if name == "step":
                continue
            per_rank = metrics.get(name)
            if per_rank is None:
                if len(metrics) >= MAX_METRICS:
                    continue
                per_rank = metrics[name] = {}
            series = per_rank.get(rank)
            if series is None:
                series = per_rank[rank] = Series()
            ys = [v.get(name) for v in vals]
            if None in ys:
                pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
                series.extend([x for x, _ in pairs], [y for _, y in pairs])
            else:
                series.extend(xs, cast(list[float], ys))
        self.metric_version += 1

    def _on_paused(self, ev: DebuggerPaused, now: float) -> None:
        self.paused[ev.rank] = ev.where

    def _on_resumed(self, ev: DebuggerResumed, now: float) -> None:
        self.paused.pop(ev.rank, None)

    def _on_phase(self, ev: MeshPhaseChanged, now: float) -> None:
        self.mesh_state = ev.phase

    def _on_recovered(self, ev: MeshRecovered, now: float) -> None:
        self.recoveries.appendleft(Recovery(time.time(), ev.report, ev.report.describe(ev.mesh)))
        self.recovery_count += 1

    # -- running jobs ------------------------------------------------------------------
    def _end_job(self, rid: str) -> None:
        self.jobs.pop(rid, None)
        self.cancelling.discard(rid)

    def _job_done_on(self, rid: str, rank: int) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            job.running.discard(rank)
            if not job.running:
                self._end_job(rid)

    def _on_reply(self, ev: ReplyReceived, now: float) -> None:
        if self.paused:
            self.paused.pop(ev.rank, None)  # its work is over: no debugger holds it
        if self.jobs:
            self._job_done_on(ev.request, ev.rank)

    def jobs_view(self, now: float | None = None, limit: int = MAX_JOBS) -> list[JobView]:
        """The newest ``limit`` running jobs, oldest first (cells at once, actor calls
        once they ran :data:`CALL_MIN_AGE` seconds); :attr:`jobs_more` counts the
        others that would be listed."""
        now = time.monotonic() if now is None else now
        listed: list[Job] = []
        more = 0
        for job in reversed(list(self.jobs.values())):
            if job.kind is RequestKind.CALL and now - job.started < CALL_MIN_AGE:
                continue
            if len(listed) < limit:
                listed.append(job)
            else:
                more += 1
        self.jobs_more = more
        shown = []
        for job in reversed(listed):
            running = sorted(job.running)
            ranks = f"{'ranks' if len(running) > 1 else 'rank'} {format_ranks(running)}"
            done = len(job.ranks) - len(running)
            if done:
                ranks += f" ({done} of {len(job.ranks)} done)"
            shown.append(
                JobView(
                    request=job.request,
                    what=job.what or job.kind.value,
                    kind=job.kind.value,
                    ranks=ranks,
                    elapsed=duration(now - job.started),
                    cancelling=job.request in self.cancelling,
                )
            )
        return shown

    def _on_started(self, ev: RequestStarted, now: float) -> None:
        if ev.kind is RequestKind.CONTROL:  # push/pull/ping: not work a rank is busy with
            return
        rid, what = ev.request, ev.what
        if ev.kind in JOB_KINDS and ev.ranks:
            jobs = self.jobs
            jobs[rid] = Job(rid, ev.kind, what, ev.ranks, set(ev.ranks), now)
            if len(jobs) > MAX_TRACKED_JOBS:
                self._end_job(next(iter(jobs)))
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
        self._job_done_on(rid, rank)
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

    def _on_died(self, ev: RankDied, now: float) -> None:
        # A process that ended runs nothing: every job is over on it (not only those
        # ``ev.requests`` names: requests given up on earlier are not among them).
        for rid, job in list(self.jobs.items()):
            if ev.rank in job.running:
                self._job_done_on(rid, ev.rank)
        self.errored.pop(ev.rank, None)
        self.interrupted.pop(ev.rank, None)
        if ev.state is RankState.DEAD:  # not stopped on purpose: an incident
            self.errors.add_death(ev.death, self.errors.newest_named(ev.requests))

    # -- sampling (about once a second) ------------------------------------------------
    def sample(self) -> None:
        """Record transfer rates (and local memory when ranks do not report it)."""
        now = time.monotonic()
        rt = self.rt
        per = {info.rank: (info.bytes_in, info.bytes_out) for info in rt.ranks}
        totals = (rt.codec.bytes_in, rt.codec.bytes_out)
        last = self._last_sample
        self._last_sample = (now, per, totals)
        self._sample_memory()
        if last is None:
            return
        dt = max(1e-3, now - last[0])
        rates = {}
        for r, (b_in, b_out) in per.items():
            prev = last[1].get(r)
            if prev is not None:
                rates[r] = (max(0, b_in - prev[0]) / dt, max(0, b_out - prev[1]) / dt)
        self.rates = rates
        self.total_rate = (
            max(0, totals[0] - last[2][0]) / dt,
            max(0, totals[1] - last[2][1]) / dt,
        )
        self.rate_history.append((time.time(), rates, self.total_rate))
        self.samples += 1

    def _sample_memory(self) -> None:
        """RSS of local ranks via psutil, for ranks that sent no stats yet (every
        second; every few seconds for big meshes, memory moves slowly)."""
        now = time.monotonic()
        if now < self._next_memory:
            return
        self._next_memory = now + max(1.0, len(self.rt.ranks) / 16) - 0.05
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        for info in self.rt.ranks:
            if info.stats:
                continue
            if not info.alive or not info.pid or info.hostname != self._local_host:
                self._psutil_procs.pop(info.rank, None)
                self.local_stats.pop(info.rank, None)
                continue
            proc = self._psutil_procs.get(info.rank)
            try:
                if proc is None or proc.pid != info.pid:
                    proc = self._psutil_procs[info.rank] = psutil.Process(info.pid)
                rss = proc.memory_info().rss
            except (psutil.Error, OSError):
                self._psutil_procs.pop(info.rank, None)
                self.local_stats.pop(info.rank, None)
                continue
            self.local_stats[info.rank] = {"rss": rss, "gpu_mem": None, "time": time.time()}

    # -- views -----------------------------------------------------------------------
    def rank_stats(self, rank: int) -> RankStats:
        return self.rt.ranks[rank].stats or self.local_stats.get(rank) or {}

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
        state = info.state
        shown = state.value
        if state is RankState.BUSY and rank in self.paused:
            shown = "paused"
            what = f"rank {rank} stopped at {self.paused[rank]}"
        elif state is RankState.BUSY:
            what = self.what.get(rank, "")
        elif state is RankState.IDLE:
            last = self.what.get(rank)
            what = f"last: {last}" if last else "ready"
            if rank in self.errored:
                shown = "error"
                found = self.last_error.get(rank)
                what = found[1].title if found else "failed"
            elif rank in self.interrupted:
                what = f"interrupted: {last}" if last else "interrupted"
        elif state is RankState.DEAD:
            what = info.death.how if info.death is not None else "dead"
        elif state is RankState.STOPPED:
            what = "stopped"
        else:  # starting
            what = "restarting" if info.restarts else "starting"
        stats = self.rank_stats(rank) if info.alive else {}  # no stale memory of the dead
        gpu, rss = stats.get("gpu_mem"), stats.get("rss")
        if gpu is not None:
            mem = f"GPU {human_bytes(gpu)}"
        else:
            mem = f"RSS {human_bytes(rss)}" if rss is not None else ""
        step = self.step.get(rank)
        seen = ""
        if info.alive and state is not RankState.STARTING:
            host_seen = rt.hosts[info.host].last_seen
            last_seen = max(host_seen, info.last_seen, self.last_event.get(rank, 0.0))
            if last_seen:
                seen = age(now - last_seen)
        rate = self.rates.get(rank)
        coords = ", ".join(f"{k}={v}" for k, v in zip(rt.shape.labels, info.coords))
        return TileView(
            rank=rank,
            state=shown,
            what=what,
            coords=coords,
            host=info.hostname or f"host {info.host}",
            pid=str(info.pid) if info.pid else "",
            device=info.device or "",
            mem=mem,
            step=num(step) if step is not None else "",
            seen=seen,
            rate_in=rate[0] if rate else None,
            rate_out=rate[1] if rate else None,
            restarts=info.restarts,
        )

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
}
