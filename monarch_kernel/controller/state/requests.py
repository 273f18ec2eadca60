"""The table of outstanding requests: who still owes a reply, and who is told.

Written only by the thread holding the receive token (replies, deaths) and by callers
registering a request before they send it; a request is in the table from before its
first byte leaves until its last rank answered or was lost.

It also keeps each rank's ``outstanding`` count and its IDLE/BUSY state: a rank is BUSY
while requests (not control messages) sent to it are unanswered.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Sequence

from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.controller.state.events import (
    EventBus,
    RankStateChanged,
    ReplyReceived,
    RequestFailed,
    RequestKind,
)
from monarch_kernel.controller.state.records import RankInfo, RankState
from monarch_kernel.wire import Message

_ids = itertools.count()
_id_prefix = uuid.uuid4().hex[:6]


def new_request_id() -> str:
    """A request id unique in this process (and across kernels, with high probability)."""
    return f"{_id_prefix}{next(_ids)}"


class Pending:
    """An outstanding request: which ranks still owe a reply, and whom to tell."""

    __slots__ = ("id", "ranks", "waiting", "observer", "kind", "what", "internal", "cancelled")

    def __init__(
        self,
        request_id: str,
        ranks: list[int],
        observer: RequestObserver,
        kind: RequestKind,
        what: str = "",
        internal: bool = False,
    ):
        self.id = request_id
        self.ranks = ranks
        self.waiting = set(ranks)
        self.observer = observer
        self.kind = kind
        self.what = what
        #: Sent by the controller itself (re-forming a mesh): no failure policy applies.
        self.internal = internal
        #: A person interrupted it (cancel, the stop button): its failures are not faults.
        self.cancelled = False


class RequestTable:
    """Outstanding requests of one mesh."""

    def __init__(self, mesh: str, ranks: list[RankInfo], events: EventBus):
        self._mesh = mesh
        self._ranks = ranks
        self._events = events
        self._pending: dict[str, Pending] = {}
        #: Ranks given up on (still running a request whose caller was told they failed):
        #: their late answer only makes them IDLE again.
        self._abandoned: dict[str, set[int]] = {}
        # Callers add requests while the token holder takes answers off: the per-rank
        # counts and the IDLE/BUSY flips they imply change under this lock.
        self._count_lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(
        self,
        rid: str,
        ranks: list[int],
        observer: RequestObserver,
        kind: RequestKind,
        what: str = "",
        internal: bool = False,
    ) -> None:
        """Register request ``rid`` before it is sent."""
        self._pending[rid] = Pending(rid, ranks, observer, kind, what, internal)
        if kind is RequestKind.CONTROL:
            return
        flipped = []
        with self._count_lock:
            for r in ranks:
                info = self._ranks[r]
                info.outstanding += 1
                if info.state is RankState.IDLE:
                    info.state = RankState.BUSY
                    flipped.append(info)
        if flipped and self._events.wants(RankStateChanged):
            for info in flipped:
                self._announce(info, RankState.BUSY, RankState.IDLE)

    def on_result(self, rank: int, rid: str, msg: Message) -> None:
        """``rank`` answered ``rid`` (token holder only)."""
        pending = self._pending.get(rid)
        if pending is None or rank not in pending.waiting:
            if rank in self._abandoned.get(rid, ()):
                self._abandoned[rid].discard(rank)
                if not self._abandoned[rid]:
                    del self._abandoned[rid]
                self._answered(self._ranks[rank])
            return  # a late answer to a request that already failed
        waiting = pending.waiting
        waiting.discard(rank)
        if not waiting:
            del self._pending[rid]
        if pending.kind is not RequestKind.CONTROL:
            self._answered(self._ranks[rank])
        reply = Reply(rank, msg)
        # Listeners hear of it before the caller does: whoever looks when the caller's
        # future completes (a test, the dashboard) finds the event already delivered.
        events = self._events
        if reply.ok:
            if events.wants(ReplyReceived):
                events.emit(ReplyReceived(self._mesh, rank, rid))
        elif reply.report is not None and events.wants(RequestFailed):
            events.emit(RequestFailed(self._mesh, rank, rid, pending.kind, reply.report))
        pending.observer.on_reply(reply)

    def on_results(self, ranks: Sequence[int], rid: str, msg: Message) -> None:
        """Each of ``ranks`` answered ``rid`` with the same ``msg`` (a host agent's
        ``fan_in`` part; token holder only): what :meth:`on_result` does for each rank
        in turn, with one table look-up, one pass under the count lock and one
        observer call (when it is a :class:`~monarch_kernel.calls.reply.BatchObserver`) for all of
        them. The ranks share ``msg``: its header names no rank (each :class:`Reply`
        does), and a value is unpickled per rank unless it is immutable (see
        ``Gather``)."""
        pending = self._pending.get(rid)
        if pending is None:  # late answers (a failed request): rare, rank by rank
            for r in ranks:
                self.on_result(r, rid, msg)
            return
        waiting = pending.waiting
        mine: list[int] = []
        late: list[int] = []
        for r in ranks:  # in turn, as on_result would: a rank named twice answers once
            if r in waiting:
                waiting.discard(r)
                mine.append(r)
            else:
                late.append(r)
        if not waiting:
            del self._pending[rid]
        for r in late:  # abandoned (or already answered): on_result's own path
            self.on_result(r, rid, msg)
        if not mine:
            return
        if pending.kind is not RequestKind.CONTROL:
            self._answered_all(mine)
        replies = [Reply(r, msg) for r in mine]
        events = self._events
        if replies[0].ok:  # one message: all ok or all failed
            if events.wants(ReplyReceived):
                for r in mine:
                    events.emit(ReplyReceived(self._mesh, r, rid))
        elif events.wants(RequestFailed):
            for reply in replies:
                if reply.report is not None:
                    events.emit(
                        RequestFailed(self._mesh, reply.rank, rid, pending.kind, reply.report)
                    )
        # A BatchObserver's method, looked up (isinstance with a runtime Protocol costs
        # tens of microseconds: more than it saves on a host's ranks).
        on_replies = getattr(pending.observer, "on_replies", None)
        if on_replies is not None:
            on_replies(replies)
        else:
            for reply in replies:
                pending.observer.on_reply(reply)

    def _answered_all(self, ranks: list[int]) -> None:
        """:meth:`_answered` for each of ``ranks``, under one hold of the count lock."""
        infos = self._ranks
        flipped = []
        with self._count_lock:
            for r in ranks:
                info = infos[r]
                left = info.outstanding = max(0, info.outstanding - 1)
                if not left and info.state is RankState.BUSY:
                    info.state = RankState.IDLE
                    flipped.append(info)
        if flipped and self._events.wants(RankStateChanged):
            for info in flipped:
                self._announce(info, RankState.IDLE, RankState.BUSY)

    def _answered(self, info: RankInfo) -> None:
        with self._count_lock:
            left = info.outstanding = max(0, info.outstanding - 1)
            flip = not left and info.state is RankState.BUSY
            if flip:
                info.state = RankState.IDLE
        if flip:
            self._announce(info, RankState.IDLE, RankState.BUSY)

    def get(self, rid: str) -> Pending | None:
        """Request ``rid`` if it is still outstanding."""
        return self._pending.get(rid)

    def waiting(self, rid: str) -> frozenset[int]:
        """The ranks ``rid`` still waits on (empty once it is complete)."""
        pending = self._pending.get(rid)
        return frozenset(pending.waiting) if pending is not None else frozenset()

    def abandon(self, rid: str, ranks: set[int], error: BaseException) -> None:
        """Give up on ``ranks``' answers to ``rid`` (they still run it): their part of
        the request fails with ``error``; they stay BUSY until they do answer."""
        pending = self._pending.get(rid)
        if pending is None:
            return
        gone = pending.waiting & ranks
        pending.waiting -= gone
        if not pending.waiting:
            del self._pending[rid]
        if pending.kind is not RequestKind.CONTROL:
            self._abandoned.setdefault(rid, set()).update(gone)
        for r in sorted(gone):
            pending.observer.on_lost(r, error)

    def take_rank(self, rank: int, keep: frozenset[str] = frozenset()) -> list[Pending]:
        """``rank`` will never answer: take it out of every request that waits on it and
        return those requests (the caller tells their observers, with :meth:`lose`).
        Requests in ``keep`` go on waiting for it (a restarted rank answers them)."""
        taken = []
        for rid, pending in list(self._pending.items()):
            if rank in pending.waiting and rid not in keep:
                pending.waiting.discard(rank)
                if not pending.waiting:
                    self._pending.pop(rid, None)
                taken.append(pending)
        for rid, ranks in list(self._abandoned.items()):
            ranks.discard(rank)
            if not ranks:
                del self._abandoned[rid]
        with self._count_lock:
            self._ranks[rank].outstanding = 0
        return taken

    def rejoin(self, rid: str, rank: int) -> None:
        """A restarted ``rank`` runs request ``rid`` again (it kept waiting for it)."""
        pending = self._pending.get(rid)
        if pending is None:
            return
        pending.waiting.add(rank)
        info = self._ranks[rank]
        with self._count_lock:
            info.outstanding += 1
            flip = info.state is RankState.IDLE
            if flip:
                info.state = RankState.BUSY
        if flip:
            self._announce(info, RankState.BUSY, RankState.IDLE)

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (old -> new for every rank kept; the others
        left every request before): every request and its observer follow (token
        holder only, with the records rewritten at the same moment)."""
        if all(old == new for old, new in mapping.items()):
            return
        for pending in list(self._pending.values()):
            pending.ranks = [mapping[r] for r in pending.ranks if r in mapping]
            pending.waiting = {mapping[r] for r in pending.waiting if r in mapping}
            renumber = getattr(pending.observer, "renumber", None)
            if renumber is not None:
                renumber(mapping)
        self._abandoned = {
            rid: {mapping[r] for r in ranks if r in mapping}
            for rid, ranks in self._abandoned.items()
        }

    def unmovable(self, mapping: dict[int, int]) -> list[str]:
        """What of the outstanding requests could not follow ``mapping`` (their observer
        names ranks and cannot be told new numbers): their ``what``."""
        moved = {old for old, new in mapping.items() if old != new}
        out = []
        for pending in list(self._pending.values()):
            if moved & set(pending.waiting) and not hasattr(pending.observer, "renumber"):
                out.append(pending.what or pending.id)
        return out

    @staticmethod
    def lose(rank: int, taken: list[Pending], error: BaseException) -> None:
        """Tell the observers of ``taken`` that ``rank`` will never answer."""
        for pending in taken:
            pending.observer.on_lost(rank, error)

    def fail_part(self, rid: str, rank: int, error: BaseException) -> None:
        """``rank`` will never answer ``rid`` (it was gone when ``rid`` was sent): fail
        that part of ``rid`` alone. Other requests keep their own terms with the rank:
        one a recovery from peers kept waiting for it (``take_rank``'s ``keep``) must
        not fail because a later request found the rank dead (token holder only)."""
        pending = self._pending.get(rid)
        if pending is None or rank not in pending.waiting:
            return  # answered, or taken when the death was handled
        pending.waiting.discard(rank)
        if not pending.waiting:
            del self._pending[rid]
        if pending.kind is not RequestKind.CONTROL:
            self._answered(self._ranks[rank])
        pending.observer.on_lost(rank, error)

    def fail_rank(self, rank: int, error: BaseException) -> tuple[str, ...]:
        """``rank`` will never answer: fail its part of every request; the ids failed."""
        taken = self.take_rank(rank)
        self.lose(rank, taken, error)
        return tuple(p.id for p in taken)

    def fail_request(self, rid: str, error: BaseException) -> None:
        """Fail every rank ``rid`` still waits on (it was registered as the mesh stopped)."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            for r in list(pending.waiting):
                pending.observer.on_lost(r, error)

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Fail every rank of every request (the mesh stopped)."""
        for rid, pending in list(self._pending.items()):
            self._pending.pop(rid, None)
            exc = error()
            for r in list(pending.waiting):
                pending.observer.on_lost(r, exc)
        with self._count_lock:
            for info in self._ranks:
                info.outstanding = 0

    def _announce(self, info: RankInfo, state: RankState, previous: RankState) -> None:
        if self._events.wants(RankStateChanged):
            self._events.emit(RankStateChanged(self._mesh, info.rank, state, previous))

    def set_state(self, info: RankInfo, state: RankState, announce: bool = True) -> RankState:
        """Move ``info`` to ``state`` (atomic with the IDLE/BUSY flips); returns the
        previous state. ``announce``: emit :class:`RankStateChanged` (deaths are told
        by :class:`~.events.RankDied` instead)."""
        with self._count_lock:
            previous, info.state = info.state, state
        if announce and previous is not state:
            self._announce(info, state, previous)
        return previous
