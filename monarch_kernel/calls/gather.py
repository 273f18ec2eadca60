"""Turning replies into results: the one gather path of the actor API and ``%%remote``.

Each class here is a :class:`~monarch_kernel.calls.reply.RequestObserver` that
completes a :class:`~.future.Future`:

* :class:`Gather`: every rank of a request -> a :class:`ValueMesh`, or one grouped
  :class:`ActorError` (identical failures grouped, root cause first);
* :class:`One`: the single rank of ``call_one``/``choose`` -> its value;
* :class:`Each`: one future per rank, completed as each answers (``stream``).

The replies are stored as received (on the receiving thread); values are unpickled,
and errors built, in the thread that asks for the result.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator

from monarch_kernel.calls.errors import (
    ActorError,
    CallSite,
    RankDiedError,
    actor_error,
    call_failed,
    format_ranks,
)
from monarch_kernel.calls.future import Future, Waiter
from monarch_kernel.calls.reply import IncidentView, Reply
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.shape import Shape
from monarch_kernel.wire.reports import FailureReport
from monarch_kernel.wire.serialize import is_immutable

#: Seconds a failed request's error waits for its incident to be settled: the release
#: of the other ranks and, when nothing died, the mesh put right in place (process
#: group re-formed, replicas made the same), which the error then reports.
SETTLE_WAIT = 65.0

_UNSHARED = object()


def reply_value(reply: Reply, total: int, call: CallSite | None = None) -> object:
    """The value of one rank's reply, or its failure raised as an :class:`ActorError`
    (of endpoint call ``call``, when it is one)."""
    if reply.ok:
        rank = reply.rank
        return reply.value(lambda: f"result from rank {rank}")
    assert reply.report is not None
    raise actor_error([reply.report], total, call=call)


class Gather:
    """Collects one reply per rank of ``ranks``; the future gives a ValueMesh.

    The request fails only once every rank answered or was lost: when one rank fails,
    the mesh's failure policy releases the others (see
    :mod:`monarch_kernel.controller.lifecycle.failures`), and the error names the root cause
    (the first failure) and what was done to the others.
    """

    def __init__(
        self,
        ranks: list[int],
        shape: Shape | None,
        waiter: Waiter | None,
        error_class: type[ActorError] = ActorError,
        value_name: str = "result",
        call: CallSite | None = None,
    ):
        self.ranks = ranks
        self.shape = shape or Shape(("ranks",), (len(ranks),))
        self._index = {r: i for i, r in enumerate(ranks)}
        self._replies: list[Reply | None] = [None] * len(ranks)
        self._lost: dict[int, BaseException] = {}
        self._failed_order: list[int] = []  #: failing ranks, in the order they failed
        self._incident: IncidentView | None = None
        self._remaining = len(ranks)
        self._lock = threading.Lock()
        self._error_class = error_class
        self._value_name = value_name
        self._call = call  # the endpoint call, for Monarch's text of a SupervisionError
        future: Future[ValueMesh[object]] = Future(self._finish, waiter)
        #: Held here while the request runs; once it is answered and the future was
        #: handed out, weakly only (see :meth:`hand_out`)
        self._future: Future[ValueMesh[object]] | None = future
        self._future_ref = weakref.ref(future)
        self._handed_out = False

    @property
    def future(self) -> Future[ValueMesh[object]]:
        """The request's future."""
        future = self._future_ref()
        if future is None:
            raise RuntimeError("the future of this request was handed out and dropped")
        return future

    def hand_out(self) -> Future[ValueMesh[object]]:
        """The future, for a caller that will not ask :attr:`future` again: once the
        request is answered only the caller holds it, so that a future dropped unread
        goes at once with this gather and its replies, with no reference cycle left for
        the collector (a reply may hold copies another rank keeps for it:
        ``HandleReply``). While the request runs it is held here (callbacks on it, as
        ``then`` adds, must run)."""
        future = self.future
        self._handed_out = True  # (first: see _completed)
        if future.done():
            self._future = None
        return future

    def _completed(self) -> None:
        future = self._future_ref()
        if future is not None:
            future.set_result(None)
        if self._handed_out:  # (set before hand_out looks at done(): one of us drops it)
            self._future = None

    # -- observer (receiving thread) -----------------------------------------------------
    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            self._replies[self._index[reply.rank]] = reply
            if not reply.ok:
                self._failed_order.append(reply.rank)
            self._remaining -= 1
            complete = self._remaining == 0
        if complete:
            self._completed()

    def on_replies(self, replies: list[Reply]) -> None:
        """:meth:`on_reply` for each of ``replies`` (a ``fan_in`` part), one lock hold."""
        index, stored = self._index, self._replies
        with self._lock:
            for reply in replies:
                stored[index[reply.rank]] = reply
                if not reply.ok:
                    self._failed_order.append(reply.rank)
            self._remaining -= len(replies)
            complete = self._remaining == 0
        if complete:
            self._completed()

    def on_lost(self, rank: int, error: BaseException) -> None:
        with self._lock:
            if rank in self._lost or self._replies[self._index[rank]] is not None:
                return
            self._lost[rank] = error
            self._failed_order.append(rank)
            self._remaining -= 1
            complete = self._remaining == 0
        if complete:
            self._completed()

    # -- the mesh grew or shrank while the request ran (``controller.elastic.resize``) -----------
    def add_rank(self, rank: int, shape: Shape | None = None) -> None:
        """``rank`` joined the request (a new rank of a grown mesh runs it too); the
        result's shape becomes ``shape`` (default: the ranks, flat)."""
        with self._lock:
            if rank in self._index:
                return
            self._index[rank] = len(self.ranks)
            self.ranks.append(rank)
            self._replies.append(None)
            self._remaining += 1
            self.shape = shape or Shape(("ranks",), (len(self.ranks),))

    def drop_rank(self, rank: int, shape: Shape | None = None) -> None:
        """``rank`` left the request (removed from a shrunk mesh): its answer is not
        part of the result (``shape``: the result's new shape, default flat)."""
        with self._lock:
            i = self._index.pop(rank, None)
            if i is None:
                return
            reply = self._replies.pop(i)
            self.ranks.pop(i)
            self._index = {r: j for j, r in enumerate(self.ranks)}
            if reply is None and rank not in self._lost:
                self._remaining -= 1
            self._lost.pop(rank, None)
            self._failed_order = [r for r in self._failed_order if r != rank]
            self.shape = shape or Shape(("ranks",), (len(self.ranks),))
            complete = self._remaining == 0 and bool(self.ranks)
        if complete:
            self._completed()

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (old -> new; a shrink dropped ranks other
        than the last ones): the request's ranks take their new numbers (a rank not in
        ``mapping``, gone, keeps a negative one)."""
        with self._lock:
            new = {r: mapping.get(r, -1 - r) for r in self.ranks}
            self.ranks = [new[r] for r in self.ranks]  # a new list: callers share the old
            self._index = {r: i for i, r in enumerate(self.ranks)}
            self._lost = {new.get(r, r): e for r, e in self._lost.items()}
            self._failed_order = [new.get(r, r) for r in self._failed_order]
            for reply in self._replies:
                if reply is not None:
                    reply.rank = new.get(reply.rank, reply.rank)

    def on_incident(self, incident: IncidentView) -> None:
        """The failure policy opened an incident for this request (see module doc)."""
        self._incident = incident

    # -- results ---------------------------------------------------------------------------
    @property
    def failed(self) -> list[int]:
        """The ranks that failed (an error reply, or lost) so far, in that order."""
        with self._lock:
            return list(self._failed_order)

    @property
    def incident(self) -> IncidentView | None:
        """The failure policy's incident for this request, if it opened one."""
        return self._incident

    def lost(self, rank: int) -> BaseException | None:
        """Why ``rank``'s part was lost (its death, the mesh stopped), if it was."""
        with self._lock:
            return self._lost.get(rank)

    def failure(self, rank: int) -> FailureReport | None:
        """``rank``'s failure report, if it answered with an error."""
        with self._lock:
            reply = self._replies[self._index[rank]] if rank in self._index else None
        return reply.report if reply is not None else None

    def answered(self, rank: int) -> bool:
        """Whether ``rank`` has replied (or was lost)."""
        return self._replies[self._index[rank]] is not None or rank in self._lost

    def _finish(self, _: object) -> ValueMesh[object]:
        if self._failed_order:
            for reply in self._replies:  # values that will never be read
                if reply is not None and reply.ok:
                    reply.discard("another rank failed the request")
            raise self._error()
        name = self._value_name
        values: list[object] = []
        # Ranks of one ``fan_in`` part share their Message (the same bytes): an
        # immutable value is unpickled once for all of them; a mutable one once per
        # rank, so that each rank's value is its own object (as if sent apart).
        shared: dict[int, object] = {}  # id(message) -> its immutable value
        try:
            for r, reply in zip(self.ranks, self._replies):
                assert reply is not None
                key = id(reply.message)  # the replies keep their messages alive meanwhile
                value = shared.get(key, _UNSHARED)
                if value is _UNSHARED:
                    value = reply.value(_naming(name, r))
                    if is_immutable(value):
                        shared[key] = value
                values.append(value)
        except BaseException as exc:  # the ranks' values not read yet never will be
            for reply in self._replies:
                if reply is not None:
                    reply.discard(f"reading the results stopped at {type(exc).__name__}")
            values.clear()  # (the error's traceback keeps this frame: not what was read)
            shared.clear()
            raise
        return ValueMesh(self.shape, values)

    def _error(self) -> BaseException:
        """One error for the whole request: the root cause (first failure) first."""
        incident = self._incident
        if incident is not None:
            # Its thread notes how the last ranks were released just after they answer.
            incident.settled.wait(SETTLE_WAIT)
        released = set(incident.released) if incident is not None else set()
        deaths = [r for r in self._failed_order if isinstance(self._lost.get(r), RankDiedError)]
        if incident is not None and incident.released and incident.root_rank in self._index:
            root = incident.root_rank  # the others were stuck waiting for it
        elif deaths:  # peers fail at once when a rank dies; its death is the cause
            root = deaths[0]
        else:  # failures at about the same time: the lowest rank, for a stable message
            root = min(self._failed_order, key=self._index.__getitem__)
        order = [root] + [r for r in self._failed_order if r != root]
        note = incident.summary() if incident is not None else ""
        root_loss = self._lost.get(root)
        if root_loss is not None:  # a death (or a stop) is the root cause
            others = [r for r in order[1:] if r not in released]
            text = str(root_loss)
            if others:
                text += f"\nalso failed: rank(s) {format_ranks(others)}"
            if note:
                text += "\n" + note
            if isinstance(root_loss, RankDiedError):
                error: BaseException = type(root_loss)(text, root_loss.death, root_loss.mesh)
            else:
                error = type(root_loss)(text) if note or others else root_loss
            return call_failed(error, self._call, root)
        reports: list[FailureReport] = []
        for r in order:
            reply = self._replies[self._index[r]]
            if reply is not None and reply.report is not None:
                if r == root or r not in released:
                    reports.append(reply.report)
            elif r in self._lost and r not in released:
                reports.append(_lost_report(r, self._lost[r]))
        failed = actor_error(reports, len(self.ranks), self._error_class, note, self._call)
        failed.failures.extend(  # every rank's report stays available to code
            reply.report
            for r in order
            if r in released
            and r != root
            and (reply := self._replies[self._index[r]]) is not None
            and reply.report is not None
        )
        return failed


def _lost_report(rank: int, error: BaseException) -> FailureReport:
    """A lost rank as a failure report (it died, or the mesh stopped)."""
    text = str(error)
    return {
        "type": type(error).__name__,
        "message": text.split("\n", 1)[0],
        "traceback": text + "\n",
        "where": "",
        "rank": rank,
    }


def _naming(name: str, rank: int) -> Callable[[], str]:
    """``result from rank 3``, formatted only if an error needs it."""
    return lambda: f"{name} from rank {rank}"


class One:
    """The reply of a single rank; the future gives its value (``call``: the endpoint
    call it answers, for Monarch's text of a ``SupervisionError``)."""

    __slots__ = ("future", "_call")

    def __init__(self, waiter: Waiter | None, call: CallSite | None = None):
        self._call = call
        finish = _value_of_one if call is None else lambda reply: reply_value(reply, 1, call)
        self.future: Future[object] = Future(finish, waiter)

    def on_reply(self, reply: Reply) -> None:
        self.future.set_result(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.future.set_exception(call_failed(error, self._call, rank))

    def renumber(self, mapping: dict[int, int]) -> None:
        """Nothing is kept by rank here (see :meth:`Gather.renumber`)."""


def _value_of_one(reply: Reply) -> object:
    return reply_value(reply, 1)


class Each:
    """One future per rank, handed out in the order the ranks answer."""

    def __init__(
        self, ranks: list[int], waiter: Waiter | None = None, call: CallSite | None = None
    ):
        total = len(ranks)
        self._call = call
        self._futures = {
            r: Future(lambda reply: reply_value(reply, total, call), waiter) for r in ranks
        }
        self._done: queue.Queue[Future[object]] = queue.Queue()
        for fut in self._futures.values():
            fut.add_done_callback(self._done.put)

    def on_reply(self, reply: Reply) -> None:
        self._futures[reply.rank].set_result(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self._futures[rank].set_exception(call_failed(error, self._call, rank))

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (see :meth:`Gather.renumber`)."""
        self._futures = {mapping.get(r, -1 - r): f for r, f in self._futures.items()}

    def futures(self) -> list[Future[object]]:
        """Every rank's future (in the order of the ranks)."""
        return list(self._futures.values())

    def in_order_of_answers(self) -> Iterator[Future[object]]:
        for _ in self._futures:
            yield self._done.get()
