"""Error incidents: failures grouped by the request they happened in, root cause first.

One failure in eight ranks is one incident, not eight: an :class:`Incident` holds the
failures of one request (a cell, an endpoint call) or of one burst of deaths outside any
request, and groups identical ones (same type, message and line, or the same kind of
death) into one :class:`ErrorEntry` naming every rank it happened on. ``entries[0]`` is
the root cause: the first failure that arrived.

Pure Python, fed by :class:`~monarch_kernel.widgets.state.MeshState` on the dashboard's
updater thread (never on a controller thread).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import DeathInfo
from monarch_kernel.wire.reports import FailureReport

MAX_INCIDENTS = 30
#: Deaths (outside any request) and fire-and-forget faults this close in time are one
#: incident.
DEATH_MERGE_S = 3.0
#: Requests whose name (``cell 5``, ``counters.incr``) is remembered for their incident.
MAX_NAMED_REQUESTS = 4096
DEATH_TAIL = 12  # output lines of a dead rank shown in its entry

EntryKey = tuple[object, ...]


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
    index: dict[EntryKey, ErrorEntry] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for e in self.entries for r in e.ranks})


class IncidentLog:
    """The newest :data:`MAX_INCIDENTS` incidents of one mesh, newest first."""

    def __init__(self) -> None:
        self.incidents: list[Incident] = []
        #: rank -> its latest failure (the incident and the entry it is in)
        self.last_error: dict[int, tuple[Incident, ErrorEntry]] = {}
        self.version = 0  # bumped on every change (the widgets re-render on change only)
        self._by_key: dict[str, Incident] = {}
        self._request_what: dict[str, str] = {}
        self._death_seq = 0

    # -- requests ------------------------------------------------------------------------
    def name_request(self, request: str, what: str) -> None:
        """Remember what ``request`` is (``cell 5``): its incident, if any, is titled so."""
        names = self._request_what
        names[request] = what
        if len(names) > MAX_NAMED_REQUESTS:
            names.pop(next(iter(names)))
        incident = self._by_key.get(request)
        if incident is not None and not incident.what:
            incident.what = what

    def what(self, request: str) -> str:
        """What ``request`` was named (``cell 5``), if it is still remembered; else ""."""
        return self._request_what.get(request, "")

    def newest_named(self, requests: Sequence[str]) -> str | None:
        """The newest of ``requests`` that was named (work, not a control message)."""
        for rid in reversed(requests):
            if rid in self._request_what:
                return rid
        return None

    # -- failures ------------------------------------------------------------------------
    def add_report(
        self, key: str, rank: int, report: FailureReport, kind: str, what: str = ""
    ) -> None:
        """User code raised on ``rank`` (``kind``: exception, interrupt or fault)."""
        line = report.get("line") or {}
        kind_name = report.get("type") or "Error"
        message = report.get("message", "")
        title = f"{kind_name}: {message}" if message else kind_name
        detail = report.get("traceback") or title
        tensors = report.get("tensors")
        if tensors:
            detail += "\nTensors in the failing frame:\n  " + "\n  ".join(tensors)
        entry_key = (report.get("type"), message, line.get("line"), line.get("code"))
        host = report.get("host", "")
        self._add(key, entry_key, kind, title, detail, rank, time.time(), host, what)

    def add_fault(self, rank: int, report: FailureReport) -> str:
        """A fire-and-forget call raised on ``rank``; returns the incident's key.
        Faults of one endpoint in one burst are one incident."""
        where = report.get("where", "")
        key = f"fault:{where}"
        recent = self._by_key.get(key)
        if recent is not None and time.time() - recent.last > DEATH_MERGE_S:
            self._by_key.pop(key, None)  # a new burst: a new incident
        self.add_report(key, rank, report, "fault", what=f"{where} (fire-and-forget)")
        return key

    def add_death(self, death: DeathInfo, request: str | None) -> None:
        """``death.rank`` died, failing ``request`` (None: outside any request; deaths
        close together in time are then one incident)."""
        t = death.time or time.time()
        key = request
        if key is None:
            recent = self.incidents[0] if self.incidents else None
            if (
                recent is not None
                and recent.key.startswith("death:")
                and t - recent.last < DEATH_MERGE_S
            ):
                key = recent.key
            else:
                self._death_seq += 1
                key = f"death:{self._death_seq}"
        tail = death.tail[-DEATH_TAIL:]
        detail = "last output lines:\n" + "\n".join(tail) if tail else "(no output)"
        entry_key = ("death", death.code, death.signal, death.reason)
        title = f"died: {death.how}"
        self._add(key, entry_key, "death", title, detail, death.rank, t, death.host)

    def _add(
        self,
        key: str,
        entry_key: EntryKey,
        kind: str,
        title: str,
        detail: str,
        rank: int,
        t: float,
        host: str,
        what: str = "",
    ) -> None:
        incidents = self.incidents
        incident = self._by_key.get(key)
        if incident is None:
            incident = Incident(key, what or self._request_what.get(key, ""), t, t)
            self._by_key[key] = incident
            incidents.insert(0, incident)
            for old in incidents[MAX_INCIDENTS:]:
                if self._by_key.get(old.key) is old:
                    del self._by_key[old.key]
            del incidents[MAX_INCIDENTS:]
        elif incidents[0] is not incident:  # newest incident on top
            incidents.remove(incident)
            incidents.insert(0, incident)
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
        self.version += 1
