"""The dashboard's model of one mesh, fed by controller events and read by the widgets.

:meth:`MeshState.on_event` is a :class:`~monarch_kernel.controller.mesh.MeshRuntime`
listener. It runs on whichever controller thread receives a message and does one thing:
append the event to a deque (a metric's values to its rank's deque), O(1), never blocks,
never touches a widget. The dashboard's
updater thread calls :meth:`MeshState.drain` a few times a second; only there are events
turned into metric series, error incidents and per-rank extras. Everything else a tile
shows (state, pid, device, outstanding requests ...) is read from ``runtime.ranks`` at
that moment, so the dashboard never disagrees with the controller for long.

Pure Python (no ipywidgets): unit-testable and reusable by other frontends.
"""

from __future__ import annotations

import pickle
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

#: Events kept between two drains; far more than 64 ranks x 100 reports/s x 0.25 s.
MAX_QUEUED = 200_000
MAX_QUEUED_RANK = 20_000  # metric reports of one rank kept between two drains
#: Points kept per (metric, rank) series before it is thinned (whole run stays visible).
SERIES_CAP = 400
MAX_METRICS = 12
MAX_INCIDENTS = 30
#: Deaths (outside any request) this close in time are one incident.
DEATH_MERGE_S = 3.0
RATE_SAMPLES = 120  # throughput history, one sample a second
OUTPUT_LINES = 20


class Series:
    """``(x, y)`` points of one metric on one rank, in arrival order, bounded.

    When :data:`SERIES_CAP` points are held, every other one is dropped and from then on
    only every ``stride``-th new point is kept, so the chart always spans the whole run
    with bounded memory. ``count`` and ``last`` always reflect every point added.
    Points arrive in batches (one per dashboard update): the thinning is list slicing.
    """

    __slots__ = ("xs", "ys", "stride", "kept", "count", "last")

    def __init__(self) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.stride = 1
        self.kept = -1  # arrival index of the last kept point
        self.count = 0
        self.last: tuple[float, float] | None = None

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

    def points(self) -> list[tuple[float, float]]:
        return list(zip(*self.arrays()))


@dataclass
class ErrorEntry:
    """Identical failures (same type, message and line, or the same kind of death)."""

    kind: str  # exception | death | fault | interrupt
    title: str
    detail: str
    ranks: list[int]
    first: float
    hosts: list[str] = field(default_factory=list)


@dataclass
class Incident:
    """The failures of one request (a cell, a call) or of one burst of deaths.

    ``entries[0]`` is the root cause: the first failure that arrived.
    """

    key: str
    what: str
    first: float
    last: float
    entries: list[ErrorEntry] = field(default_factory=list)
    index: dict[tuple, ErrorEntry] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for e in self.entries for r in e.ranks})


@dataclass(frozen=True)
class TileView:
    """Everything one tile shows; compared between ticks to send deltas only."""

    rank: int
    state: str  # starting | idle | busy | error | dead | stopped
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


class MeshState:
    """Aggregated, throttle-friendly view of one mesh for the dashboard."""

    def __init__(self, runtime: Any):
        self.rt = runtime
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_QUEUED)
        self._metrics_in: dict[int, deque[dict[str, float]]] = {}
        self.dropped = 0
        self.metrics: dict[str, dict[int, Series]] = {}
        self.metric_version = 0
        self.step: dict[int, float] = {}
        self.report_count: dict[int, int] = {}
        self.last_event: dict[int, float] = {}  # monotonic time of the rank's last message
        self.stats: dict[int, dict[str, Any]] = {}
        self.what: dict[int, str] = {}  # last request started on the rank (taps)
        self.errored: dict[int, str] = {}  # rank -> request id whose failure it shows
        self.interrupted: dict[int, str] = {}  # rank -> request id it was interrupted in
        self.last_error: dict[int, tuple[Incident, ErrorEntry]] = {}
        self.incidents: list[Incident] = []
        self._by_key: dict[str, Incident] = {}
        self._request_what: dict[str, str] = {}
        self._death_request: dict[int, str] = {}
        self._death_seq = 0
        self.error_version = 0
        self.faults_seen = 0
        self.mesh_state = getattr(runtime, "state", "starting")
        # throughput
        self.rates: dict[int, tuple[float, float]] = {}
        self.total_rate: tuple[float, float] = (0.0, 0.0)
        self.rate_history: deque[tuple[float, dict[int, tuple[float, float]], tuple]] = deque(
            maxlen=RATE_SAMPLES
        )
        self.per_rank_bytes = False
        self.samples = 0
        self._last_sample: tuple[float, dict[int, tuple[int, int]], tuple[int, int]] | None = None
        self._local_host = socket.gethostname()
        self._psutil_procs: dict[int, Any] = {}
        self.local_stats: dict[int, dict[str, Any]] = {}  # psutil fallback for local ranks
        self._next_memory = 0.0
        self.attached = False

    # -- the controller side (any thread, O(1)) --------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        """MeshRuntime listener: queue the event for the next drain.

        Metrics (the bulk: 64 ranks x 100 reports/s) go straight into a per-rank queue,
        so that the drain handles them per rank, not per event.
        """
        if event["event"] == "metric":
            queue = self._metrics_in.get(event["rank"])
            if queue is None:
                queue = self._metrics_in.setdefault(event["rank"], deque(maxlen=MAX_QUEUED_RANK))
            if len(queue) == MAX_QUEUED_RANK:
                self.dropped += 1
            queue.append(event["values"])
            return
        events = self.events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(event)

    def attach(self) -> None:
        if not self.attached:
            self.rt.listeners.append(self.on_event)
            self.attached = True

    def detach(self) -> None:
        if self.attached:
            try:
                self.rt.listeners.remove(self.on_event)
            except ValueError:
                pass
            self.attached = False

    # -- the updater side ------------------------------------------------------------
    def drain(self) -> int:
        """Fold the queued events into the model; returns how many were handled."""
        now = time.monotonic()
        n = 0
        events = self.events
        if events:
            handlers = self._handlers
            popleft = events.popleft
            for _ in range(len(events)):
                ev = popleft()
                handler = handlers.get(ev["event"])
                if handler is not None:
                    handler(self, ev, now)
                n += 1
        for rank, queue in list(self._metrics_in.items()):
            k = len(queue)
            if k:
                popleft = queue.popleft
                self._fold_metrics(rank, [popleft() for _ in range(k)], now)
                n += k
        return n

    def _fold_metrics(self, rank: int, vals: list[dict[str, float]], now: float) -> None:
        self.last_event[rank] = now
        count = self.report_count.get(rank, 0)
        self.report_count[rank] = count + len(vals)
        steps = [v.get("step") for v in vals]
        if None in steps:
            xs = [float(count + i) if s is None else s for i, s in enumerate(steps)]
        else:
            xs = steps
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
                series.extend([p[0] for p in pairs], [p[1] for p in pairs])
            else:
                series.extend(xs, ys)
        self.metric_version += 1

    def _on_stream(self, ev: dict[str, Any], now: float) -> None:
        self.last_event[ev["rank"]] = now

    def _on_stats(self, ev: dict[str, Any], now: float) -> None:
        self.stats[ev["rank"]] = ev.get("stats") or {}
        self.last_event[ev["rank"]] = now

    def _on_rank(self, ev: dict[str, Any], now: float) -> None:
        rank, state = ev["rank"], ev.get("state")
        self.last_event[rank] = now
        if state == "busy":
            self.what[rank] = ev.get("what") or self.what.get(rank, "")
            self.errored.pop(rank, None)
            self.interrupted.pop(rank, None)
        elif state == "idle" and ev.get("error"):
            self.errored[rank] = ev.get("request") or "?"
        elif state == "dead":
            self._on_death(rank, ev.get("death") or {})
        elif state == "starting":
            self.errored.pop(rank, None)
            self.interrupted.pop(rank, None)

    def _on_death(self, rank: int, death: dict[str, Any]) -> None:
        self.errored.pop(rank, None)
        self.interrupted.pop(rank, None)
        rid = self._death_request.pop(rank, None) or death.get("request")
        if rid is None:
            recent = self.incidents[0] if self.incidents else None
            if (
                recent is not None
                and recent.key.startswith("death:")
                and death.get("time", time.time()) - recent.last < DEATH_MERGE_S
            ):
                rid = recent.key
            else:
                self._death_seq += 1
                rid = f"death:{self._death_seq}"
        code, sig, reason = death.get("code"), death.get("signal"), death.get("reason")
        how = reason or _describe_exit(code, sig)
        tail = list(death.get("tail") or [])[-12:]
        detail = "last output lines:\n" + "\n".join(tail) if tail else "(no output)"
        self._add_error(
            rid,
            ("death", code, sig, reason),
            "death",
            f"died: {how}",
            detail,
            rank,
            death.get("time", time.time()),
            death.get("host") or "",
        )

    def _on_fault(self, ev: dict[str, Any], now: float) -> None:
        report = ev.get("report") or {}
        self.faults_seen += 1
        where = report.get("where", "")
        key = f"fault:{where}"
        recent = self._by_key.get(key)
        t = time.time()
        if recent is not None and t - recent.last > DEATH_MERGE_S:
            self._by_key.pop(key, None)  # a new burst: a new incident
        self.errored[ev["rank"]] = key
        self._add_report(key, ev["rank"], report, "fault", what=f"{where} (fire-and-forget)")

    def _on_error(self, ev: dict[str, Any], now: float) -> None:
        report = ev.get("report")
        if report is None and ev.get("payload") is not None:
            try:
                report = pickle.loads(ev["payload"])
            except Exception:  # noqa: BLE001 - a report we cannot read is still an error
                report = {"type": "Error", "message": "(unreadable error report)"}
        report = report or {}
        rid = ev.get("request") or "?"
        rank = ev["rank"]
        if report.get("type") == "KeyboardInterrupt":
            self.interrupted[rank] = rid  # where it was interrupted is still worth a look
            self._add_report(rid, rank, report, "interrupt")
        else:
            self.errored[rank] = rid
            self._add_report(rid, rank, report, "exception")

    def _on_begin(self, ev: dict[str, Any], now: float) -> None:
        rid = ev.get("request")
        what = ev.get("what") or ""
        if not what and ev.get("cell_payload") is not None:
            try:
                what = f"cell {pickle.loads(ev['cell_payload']).get('cell', '')}".strip()
            except Exception:  # noqa: BLE001
                what = "cell"
        if rid:
            self._request_what[rid] = what
            if len(self._request_what) > 4096:
                self._request_what.pop(next(iter(self._request_what)))
            incident = self._by_key.get(rid)
            if incident is not None and not incident.what:
                incident.what = what
        for r in ev.get("ranks", ()):
            if what:
                self.what[r] = what
            if self.errored.get(r) != rid:
                self.errored.pop(r, None)
            if self.interrupted.get(r) != rid:
                self.interrupted.pop(r, None)

    def _on_request_death(self, ev: dict[str, Any], now: float) -> None:
        self._death_request[ev["rank"]] = ev.get("request")

    def _on_mesh(self, ev: dict[str, Any], now: float) -> None:
        self.mesh_state = ev.get("state", self.mesh_state)

    _handlers = {
        "stream": _on_stream,
        "stats": _on_stats,
        "rank": _on_rank,
        "fault": _on_fault,
        "error": _on_error,
        "begin": _on_begin,
        "request_death": _on_request_death,
        "mesh": _on_mesh,
    }

    # -- errors ----------------------------------------------------------------------
    def _add_report(
        self, key: str, rank: int, report: dict[str, Any], kind: str, what: str = ""
    ) -> None:
        line = report.get("line") or {}
        message = report.get("message", "")
        title = (
            f"{report.get('type', 'Error')}: {message}" if message else report.get("type", "Error")
        )
        where = line.get("line")
        detail = report.get("traceback") or title
        if report.get("tensors"):
            detail += "\nTensors in the failing frame:\n  " + "\n  ".join(report["tensors"])
        entry_key = (report.get("type"), report.get("message"), where, line.get("code"))
        self._add_error(
            key, entry_key, kind, title, detail, rank, time.time(), report.get("host", ""), what
        )

    def _add_error(
        self,
        key: str,
        entry_key: tuple,
        kind: str,
        title: str,
        detail: str,
        rank: int,
        t: float,
        host: str,
        what: str = "",
    ) -> None:
        incident = self._by_key.get(key)
        if incident is None:
            what = what or self._request_what.get(key, "")
            incident = Incident(key, what, t, t)
            self._by_key[key] = incident
            self.incidents.insert(0, incident)
            for old in self.incidents[MAX_INCIDENTS:]:
                self._by_key.pop(old.key, None)
            del self.incidents[MAX_INCIDENTS:]
        incident.last = max(incident.last, t)
        entry = incident.index.get(entry_key)
        if entry is None:
            entry = ErrorEntry(kind, title, detail, [], t)
            incident.index[entry_key] = entry
            incident.entries.append(entry)
        if rank not in entry.ranks:
            entry.ranks.append(rank)
        if host and host not in entry.hosts:
            entry.hosts.append(host)
        self.last_error[rank] = (incident, entry)
        # newest incident on top
        if self.incidents and self.incidents[0] is not incident:
            self.incidents.remove(incident)
            self.incidents.insert(0, incident)
        self.error_version += 1

    # -- sampling (about once a second) ------------------------------------------------
    def sample(self) -> None:
        """Record transfer rates (and local memory when ranks do not report it)."""
        now = time.monotonic()
        ranks = self.rt.ranks
        per = {}
        have = False
        for info in ranks:
            b_in = getattr(info, "bytes_in", None)
            b_out = getattr(info, "bytes_out", None)
            if b_in is not None and b_out is not None:
                per[info.rank] = (b_in, b_out)
                have = True
        codec = getattr(self.rt, "codec", None)
        totals = (getattr(codec, "bytes_in", 0), getattr(codec, "bytes_out", 0))
        self.per_rank_bytes = have
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
        """RSS of local ranks via psutil, for runtimes whose ranks send no stats yet
        (every second; every few seconds for big meshes, memory moves slowly)."""
        now = time.monotonic()
        if now < self._next_memory:
            return
        self._next_memory = now + max(1.0, len(self.rt.ranks) / 16) - 0.05
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        for info in self.rt.ranks:
            if getattr(info, "stats", None) or info.rank in self.stats:
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
    def rank_stats(self, rank: int) -> dict[str, Any]:
        info = self.rt.ranks[rank]
        return (
            getattr(info, "stats", None) or self.stats.get(rank) or self.local_stats.get(rank) or {}
        )

    def tile_state(self, rank: int) -> str:
        """Just the state of rank ``rank``'s tile (cheap: for the ticks that only recolour)."""
        info = self.rt.ranks[rank]
        state = info.state
        if state == "idle":
            if info.outstanding > 0:
                return "busy"
            if rank in self.errored:
                return "error"
        return state

    def tile(self, rank: int, now: float | None = None) -> TileView:
        """What rank ``rank``'s tile shows now."""
        now = time.monotonic() if now is None else now
        rt = self.rt
        info = rt.ranks[rank]
        state = info.state
        what = getattr(info, "what", None) or ""
        if state == "idle" and info.outstanding > 0:
            state = "busy"
        if state == "busy":
            what = what or self.what.get(rank, "")
        elif state == "idle":
            last = self.what.get(rank)
            what = f"last: {last}" if last else "ready"
            if rank in self.errored:
                state = "error"
                found = self.last_error.get(rank)
                what = found[1].title if found else "failed"
            elif rank in self.interrupted:
                what = f"interrupted: {last}" if last else "interrupted"
        elif state in ("dead", "stopped"):
            death = info.death or {}
            if state == "dead":
                what = death.get("reason") or _describe_exit(death.get("code"), death.get("signal"))
            else:
                what = "stopped"
        elif state == "starting":
            what = "restarting" if info.restarts else "starting"
        stats = self.rank_stats(rank) if info.alive else {}  # no stale memory of the dead
        gpu = stats.get("gpu_mem")
        if gpu is not None:
            mem = f"GPU {_bytes(gpu)}"
        elif stats.get("rss") is not None:
            mem = f"RSS {_bytes(stats['rss'])}"
        else:
            mem = ""
        step = self.step.get(rank)
        seen = ""
        if info.alive and state != "starting":
            hosts = getattr(rt, "hosts", None)
            host_seen = hosts[info.host].last_seen if hosts else 0.0
            last = max(host_seen, getattr(info, "last_seen", 0.0), self.last_event.get(rank, 0))
            if last:
                seen = _age(now - last)
        rate = self.rates.get(rank)
        labels = rt.shape.labels
        coords = ", ".join(f"{k}={v}" for k, v in zip(labels, info.coords))
        return TileView(
            rank=rank,
            state=state,
            what=what,
            coords=coords,
            host=info.hostname or f"host {info.host}",
            pid=str(info.pid) if info.pid else "",
            device=info.device or "",
            mem=mem,
            step=_num(step) if step is not None else "",
            seen=seen,
            rate_in=rate[0] if rate else None,
            rate_out=rate[1] if rate else None,
            restarts=info.restarts,
        )

    def output_lines(self, rank: int, n: int = OUTPUT_LINES) -> list[str]:
        """The rank's most recent output lines (the controller keeps them per rank)."""
        info = self.rt.ranks[rank]
        lines = list(info.tail)[-n:]
        for text in info.partial.values():
            if text:
                lines.append(text)
        return lines[-n:]


def _describe_exit(code: Any, sig: Any) -> str:
    if sig:
        import signal

        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    if code is None:
        return "exited"
    return f"exit code {code}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


def _age(seconds: float) -> str:
    if seconds < 1.5:
        return "<1s"
    if seconds < 90:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


def rate_text(bps: float | None) -> str:
    """``1.2 MB/s`` style text (``—`` when unknown)."""
    if bps is None:
        return "—"
    if bps >= 1e9:
        return f"{bps / 1e9:.1f} GB/s"
    if bps >= 1e6:
        return f"{bps / 1e6:.1f} MB/s"
    if bps >= 1e3:
        return f"{bps / 1e3:.0f} KB/s"
    return f"{bps:.0f} B/s"
