"""``%mesh profile`` in the controller: ask ranks for a profile of their next steps,
gather their traces, and merge them into one Chrome trace on one time axis.

Each rank's trace keeps torch's own timestamps (its monotonic clock, µs); the rank
recorded an anchor event at a known ``time.time()``, so ``epoch = ts - anchor_ts +
anchor_epoch``. Ranks on another machine than the controller are moved by the offset
between their clock and the controller's measured when their trace arrived (its
``sent_at`` against the arrival: exact to the transfer's latency). The merged trace has
one process per rank (``pid`` = rank, named ``rank N (host)``), times from the earliest
event of all.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import PLAIN, CallOptions
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.steps import ProfileOrder, RankTrace

#: A profile waits for the loop: no restart wait, a control message (served while busy).
_PROFILE = CallOptions(what="profile", control=True)


class ProfiledMesh(Protocol):
    """What a profile uses of a mesh (a ``MeshRuntime``)."""

    @property
    def name(self) -> str: ...
    def request(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver,
        options: CallOptions = PLAIN,
        request_id: str | None = None,
    ) -> str: ...


@dataclass
class ProfileGather:
    """The ranks' answers to one profile request (observer: the receiving thread)."""

    ranks: list[int]
    traces: dict[int, Any] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def on_reply(self, reply: Reply) -> None:
        try:
            value: Any = reply.value(f"profile of rank {reply.rank}") if reply.ok else None
            error = str(getattr(value, "error", "") or "")
            if value is None or error:
                why = error or str((reply.report or {}).get("message", ""))
                self.errors[reply.rank] = why or "failed"
            else:
                self.traces[reply.rank] = value
                self.arrived[reply.rank] = time.time()
        except Exception as exc:
            self.errors[reply.rank] = repr(exc)
        self._check()

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.errors[rank] = str(error)
        self._check()

    def _check(self) -> None:
        if len(self.traces) + len(self.errors) >= len(self.ranks):
            self.done.set()


#: Seconds from the order to the step boundary that starts a running loop's profile
#: when the controller has seen none of its steps (no ``start_step``): every rank has
#: the order by then; a rank whose step ends within the ranks' jitter of that moment
#: starts a step after the others (hence ``start_step`` wherever steps were seen).
START_DELAY = 0.2


#: How far ahead (s) of the latest step the controller has seen a running loop's
#: profile starts: the ranks' step batches lag up to 0.2 s (0.1 s in the rank, 0.1 s in
#: the host agent), and the order must reach every rank before that step begins.
START_AHEAD = 0.5


def first_profiled_step(latest: Sequence[tuple[int, float]]) -> int:
    """The step a running loop's profile starts with, from each profiled rank's latest
    step seen (its number and wall time, s): far enough ahead that every rank gets the
    order before it; 0 when some rank has shown no step yet (then by time)."""
    if not latest:
        return 0
    step = max(n for n, _ in latest)
    wall = max(1e-3, sorted(w for _, w in latest)[len(latest) // 2])
    return step + 1 + int(START_AHEAD / wall) + 1


def request_profile(
    mesh: ProfiledMesh,
    ranks: list[int],
    name: str,
    steps: int,
    running: bool = True,
    start_step: int = 0,
) -> ProfileGather:
    """Arm the profiler on ``ranks`` for their next ``steps`` steps (of a ``running``
    loop: from step ``start_step``, or without one from the first step boundary
    :data:`START_DELAY` from now on; else from the next loop's first); the gather fills
    as they answer (each once its steps ran)."""
    gather = ProfileGather(list(ranks))
    start = time.time() + START_DELAY if running else 0.0
    payload = pickle.dumps(ProfileOrder(name, steps, start, start_step if running else 0))
    mesh.request(list(ranks), {"k": K.PROFILE}, payload, (), gather, _PROFILE)
    return gather


def disarm(mesh: ProfiledMesh, ranks: list[int]) -> None:
    """Take back an armed profile (``%mesh profile`` interrupted)."""
    mesh.request(list(ranks), {"k": K.PROFILE}, pickle.dumps(ProfileOrder("", 0)), (),
                 ProfileGather(list(ranks)), _PROFILE)  # fmt: skip


@dataclass(frozen=True)
class OpRow:
    """One op of one rank in the summary."""

    rank: int
    name: str
    self_ms: float
    calls: int


@dataclass
class MergedTrace:
    """The merged trace and what the summary shows."""

    trace: dict[str, Any]
    ranks: list[int]
    top_ops: dict[int, list[OpRow]]
    #: rank -> ms per step spent in collective ops (the waiting, on CPU)
    waited: dict[int, float]
    span_ms: float


#: Op names that are collectives (a rank's time in them is time it waited for others).
COLLECTIVE_MARKS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                    "broadcast", "barrier", "all_to_all", "c10d::", "nccl:", "gloo:")  # fmt: skip


def _is_collective(name: str) -> bool:
    lowered = name.lower()
    return any(mark in lowered for mark in COLLECTIVE_MARKS)


def merge(gather: ProfileGather, here: str | None = None) -> MergedTrace:
    """One Chrome trace of every rank's trace in ``gather``."""
    here = here or socket.gethostname()
    events: list[dict[str, Any]] = []
    starts: list[float] = []
    per_rank: list[tuple[int, RankTrace, list[dict[str, Any]], float]] = []
    for rank in sorted(gather.traces):
        t = gather.traces[rank]
        raw = json.loads(zlib.decompress(t.trace))
        offset = t.anchor_epoch_us - t.anchor_ts
        if t.hostname != here and t.sent_at:
            offset += (gather.arrived.get(rank, t.sent_at) - t.sent_at) * 1e6
        evs = [e for e in raw.get("traceEvents", ()) if isinstance(e, dict) and "ts" in e]
        timed = [float(e["ts"]) + offset for e in evs if e.get("ph") != "M"]
        if timed:
            starts.append(min(timed))
        per_rank.append((rank, t, evs, offset))
    zero = min(starts) if starts else 0.0
    end = zero
    for rank, t, evs, offset in per_rank:
        events.append(_meta("process_name", rank, {"name": f"rank {rank} ({t.hostname})"}))
        events.append(_meta("process_sort_index", rank, {"sort_index": rank}))
        if t.first_step:
            events.append(_meta("process_labels", rank, {"labels": steps_label(t)}))
        for e in evs:
            if e.get("ph") == "M" and e.get("name") != "thread_name":
                continue
            e = dict(e)
            e["pid"] = rank
            e["ts"] = round(float(e["ts"]) + offset - zero, 3) if e.get("ph") != "M" else 0
            end = max(end, zero + e["ts"] + float(e.get("dur", 0) or 0))
            events.append(e)
    top: dict[int, list[OpRow]] = {}
    waited: dict[int, float] = {}
    for rank, t in gather.traces.items():
        rows = [OpRow(rank, n, us / 1000, c) for n, us, c in t.top_ops]
        top[rank] = rows
        steps = max(1, t.steps)
        ops = sum(r.self_ms for r in rows if _is_collective(r.name)) / steps
        waited[rank] = max(ops, t.comm_per_step * 1000)
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"producer": "monarch_kernel %mesh profile"}}  # fmt: skip
    return MergedTrace(trace, sorted(gather.traces), top, waited, (end - zero) / 1000)


def steps_label(t: RankTrace) -> str:
    """Which of its loop's steps a rank's trace holds ("steps 12-14")."""
    last = t.first_step + t.steps - 1
    return f"step {t.first_step}" if last == t.first_step else f"steps {t.first_step}-{last}"


def _meta(name: str, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": 0, "ts": 0, "args": args}
