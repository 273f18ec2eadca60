"""The request lifecycle: typed events the controller emits, and how to subscribe.

Everything that happens to a request or a rank is one small frozen dataclass below.
Layers above the controller (futures and gathering in the actor API, the kernel's
output routing, the dashboard) learn what happens only from these events and from the
read-only records in :mod:`.records`; none of them wraps the
controller's methods or reads its private state.

Two ways to listen:

* **the mesh's event bus** (``runtime.events``, an :class:`EventBus`): ``subscribe(fn,
  EventType, ...)`` for every event of those types on that mesh, ``unsubscribe(fn)`` to
  stop. Listeners run on the thread that caused the event: for what arrives in a
  message (output, replies, deaths ...) the thread holding the receive token (the I/O
  thread, or a caller receiving its own reply); for :class:`RequestStarted` and the
  IDLE -> BUSY change, the caller's thread; for phase changes and a stop, the thread
  that started or stopped the mesh. So they must be quick, thread-safe and must never
  block: append to a queue and return.
* **a request's observer** (a :class:`~monarch_kernel.calls.reply.RequestObserver` given
  to ``runtime.request``): told of that request's replies and of ranks it lost, and
  nothing else. This is how futures complete without a dictionary look-up per event on the hot path.

For one request, the order is: :class:`RequestStarted` (just before it is sent), then
per rank either :class:`ReplyReceived`/:class:`RequestFailed` or that rank's
:class:`RankDied` (whose ``requests`` name it; a stop ends the live ranks with a
``RankDied`` in state STOPPED). Listeners hear of a reply or a death before the
request's caller does. :class:`StreamOutput` and
:class:`MetricReported` tagged with the request id arrive before the rank's reply
(ranks flush their output before they answer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from monarch_kernel.calls.errors import DeathInfo
from monarch_kernel.controller.state.records import MeshPhase, RankState, RecoveryReport
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.jsontypes import JsonObject, MimeBundle
from monarch_kernel.wire.reports import FailureReport, RankStats

log = logging.getLogger("monarch_kernel.controller")


class RequestKind(str, Enum):
    """What a request asks of its ranks."""

    CELL = "cell"  #: run a ``%%remote`` cell
    CALL = "call"  #: call an actor endpoint
    SPAWN = "spawn"  #: construct an actor
    STOP_ACTOR = "stop_actor"  #: remove an actor
    CONTROL = "control"  #: push / pull / ping, served while the rank is busy

    @classmethod
    def of(cls, header_kind: str, control: bool) -> RequestKind:
        if control:
            return cls.CONTROL
        return _KINDS.get(header_kind, cls.CALL)


_KINDS = {
    K.EXEC: RequestKind.CELL,
    K.CALL: RequestKind.CALL,
    K.SPAWN_ACTOR: RequestKind.SPAWN,
    K.STOP_ACTOR: RequestKind.STOP_ACTOR,
}


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MeshPhaseChanged:
    """The whole mesh started running, began stopping, or stopped."""

    mesh: str
    phase: MeshPhase


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """A request is being sent to ``ranks``. ``what`` is what a person calls it:
    ``cell 5``, ``counters.incr``, ``spawn counters`` (empty for control requests)."""

    mesh: str
    request: str
    ranks: tuple[int, ...]
    kind: RequestKind
    what: str


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """Text a rank wrote to ``stream`` (``stdout`` or ``stderr``) while running
    ``request`` (None: outside any request, e.g. a thread it left running)."""

    mesh: str
    rank: int
    request: str | None
    stream: str
    text: str


@dataclass(frozen=True, slots=True)
class DisplayOutput:
    """A rich display a rank made while running ``request``: ``op`` is ``display``,
    ``update`` (of the rank's ``display_id``), ``clear`` or ``clear_wait``; ``data`` is
    the MIME bundle (image bytes raw), ``key`` equal for equal bundles."""

    mesh: str
    rank: int
    request: str | None
    op: str
    data: MimeBundle
    metadata: JsonObject
    display_id: str | None
    key: bytes


@dataclass(frozen=True, slots=True)
class MetricReported:
    """``monarch_kernel.report(step=..., loss=...)`` on a rank."""

    mesh: str
    rank: int
    request: str | None
    values: dict[str, float]
    time: float


@dataclass(frozen=True, slots=True)
class ReplyReceived:
    """A rank answered ``request`` successfully."""

    mesh: str
    rank: int
    request: str


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """User code raised on ``rank`` while serving ``request`` (its reply is the report)."""

    mesh: str
    rank: int
    request: str
    kind: RequestKind
    report: FailureReport


@dataclass(frozen=True, slots=True)
class FaultReported:
    """User code raised on ``rank`` where nobody waits for an answer (a broadcast)."""

    mesh: str
    rank: int
    report: FailureReport


@dataclass(frozen=True, slots=True)
class RankStateChanged:
    """A rank moved from ``previous`` to ``state`` (deaths are :class:`RankDied`)."""

    mesh: str
    rank: int
    state: RankState
    previous: RankState


@dataclass(frozen=True, slots=True)
class RankDied:
    """A rank ended: ``state`` is DEAD (unasked) or STOPPED (on purpose). ``requests``
    are the requests that waited on it and failed because of it."""

    mesh: str
    rank: int
    state: RankState
    death: DeathInfo
    requests: tuple[str, ...]
    #: Its training state is recovered from peers: requests it ran wait for a restarted
    #: rank (see ``controller.training.recovery``), the failure policy leaves it alone.
    claimed: bool = False
    #: It failed a ``%%remote`` cell, whose error says what happened (the failure is not
    #: one nobody handled).
    in_cell: bool = False


@dataclass(frozen=True, slots=True)
class HostLost:
    """A host agent exited or went silent; its ranks are dead with ``reason``."""

    mesh: str
    host: int
    reason: str


@dataclass(frozen=True, slots=True)
class StatsReported:
    """A rank's once-a-second report (memory, data-plane bytes)."""

    mesh: str
    rank: int
    stats: RankStats
    time: float


@dataclass(frozen=True, slots=True)
class MeshRecovered:
    """Ranks were restarted in place and the mesh re-formed (see ``report``)."""

    mesh: str
    report: RecoveryReport


@dataclass(frozen=True, slots=True)
class MeshResized:
    """The mesh grew or shrank from ``before`` to ``after`` ranks (``%mesh grow``);
    ``text`` says what happened. A shrink that dropped ranks other than the last ones
    renumbered the survivors: ``removed`` (old numbers) and ``renumbered`` ((old, new)
    of each survivor whose rank changed) say how, for listeners that keep something
    per rank (the dashboard)."""

    mesh: str
    before: int
    after: int
    text: str
    removed: tuple[int, ...] = ()
    renumbered: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RanksRenumbered:
    """A shrink dropped ranks other than the last ones: at this moment the survivors
    took new numbers (``renumbered``: (old, new) of each whose rank changed; ``removed``:
    the old numbers of the ranks that left). Emitted on the thread that holds the
    receive token, so every event before it names ranks by their old numbers, every one
    after by their new ones (the dashboard re-keys what it keeps per rank)."""

    mesh: str
    renumbered: tuple[tuple[int, int], ...]
    removed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InputRequested:
    """User code on ``rank`` called ``input()`` (or ``getpass``) while serving
    ``request``: answer with ``MeshRuntime.answer_input(rank, serial, ...)``."""

    mesh: str
    rank: int
    request: str | None
    serial: int
    prompt: str
    password: bool
    #: A debugger prompt (pdb on the rank waits for a command), not an ``input()``.
    debug: bool = False
    #: What the debugger printed since its last prompt (where it stopped, a variable ...).
    output: str = ""
    #: Where the rank is stopped, e.g. ``cell line 7`` (debugger prompts only).
    where: str = ""
    #: The debugger is a post-mortem one (``%debug_remote``), not a breakpoint.
    post_mortem: bool = False


@dataclass(frozen=True, slots=True)
class DebuggerPaused:
    """A rank's debugger waits for a command (a breakpoint or a post-mortem): its
    main thread is paused at ``where`` until it is continued, detached or times out."""

    mesh: str
    rank: int
    request: str | None
    where: str


@dataclass(frozen=True, slots=True)
class DebuggerResumed:
    """A rank's debugger let it run on: ``why`` is ``continue``, ``detach``, ``quit``,
    ``timeout``, ``interrupted`` or ``done``; its prompt number ``serial`` (if asked)
    needs no answer any more."""

    mesh: str
    rank: int
    request: str | None
    serial: int
    why: str


MeshEvent = (
    MeshPhaseChanged
    | RequestStarted
    | StreamOutput
    | DisplayOutput
    | MetricReported
    | ReplyReceived
    | RequestFailed
    | FaultReported
    | RankStateChanged
    | RankDied
    | HostLost
    | StatsReported
    | MeshRecovered
    | MeshResized
    | RanksRenumbered
    | InputRequested
    | DebuggerPaused
    | DebuggerResumed
)

EVENT_TYPES: tuple[type[MeshEvent], ...] = (
    MeshPhaseChanged,
    RequestStarted,
    StreamOutput,
    DisplayOutput,
    MetricReported,
    ReplyReceived,
    RequestFailed,
    FaultReported,
    RankStateChanged,
    RankDied,
    HostLost,
    StatsReported,
    MeshRecovered,
    MeshResized,
    RanksRenumbered,
    InputRequested,
    DebuggerPaused,
    DebuggerResumed,
)

Listener = Callable[[MeshEvent], None]


class EventBus:
    """Per-mesh publish/subscribe of :data:`MeshEvent` s, by event type.

    ``emit`` costs one dict look-up when nobody listens to that type; hot paths ask
    :meth:`wants` first so that they do not even build the event.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribed: dict[Listener, frozenset[type[MeshEvent]]] = {}
        #: event type -> listeners, rebuilt (copy on write) by subscribe/unsubscribe,
        #: so emitting needs no lock.
        self._by_type: dict[type[MeshEvent], tuple[Listener, ...]] = dict.fromkeys(EVENT_TYPES, ())

    def subscribe(self, listener: Listener, *types: type[MeshEvent]) -> Listener:
        """Call ``listener(event)`` for every event of ``types`` (all types if none).

        Subscribing the same listener again replaces its types. Returns ``listener``.
        """
        wanted = frozenset(types or EVENT_TYPES)
        unknown = [t for t in wanted if t not in self._by_type]
        if unknown:
            raise TypeError(f"not mesh event types: {unknown}")
        with self._lock:
            self._subscribed[listener] = wanted
            self._rebuild()
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener``; no error if it was not subscribed."""
        with self._lock:
            if self._subscribed.pop(listener, None) is not None:
                self._rebuild()

    def _rebuild(self) -> None:
        by_type: dict[type[MeshEvent], tuple[Listener, ...]] = dict.fromkeys(EVENT_TYPES, ())
        for listener, types in self._subscribed.items():
            for t in types:
                by_type[t] += (listener,)
        self._by_type = by_type

    def wants(self, event_type: type[MeshEvent]) -> bool:
        """Whether anybody listens to ``event_type`` now."""
        return bool(self._by_type[event_type])

    def emit(self, event: MeshEvent) -> None:
        """Call the listeners of ``event``'s type; a failing listener is logged, and
        never stops the others or the controller."""
        for listener in self._by_type[type(event)]:
            try:
                listener(event)
            except Exception:
                log.exception("mesh event listener %r failed on %r", listener, event)
