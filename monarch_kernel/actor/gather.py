"""Turning replies into results: the one gather path of the actor API and ``%%remote``.

Each class here is a :class:`~monarch_kernel.controller.events.RequestObserver` that
completes a :class:`~monarch_kernel.controller.future.Future`:

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
from collections.abc import Callable, Iterator

from monarch_kernel.actor.value_mesh import ValueMesh
from monarch_kernel.controller.errors import ActorError, actor_error
from monarch_kernel.controller.events import Reply
from monarch_kernel.controller.future import Future, Waiter
from monarch_kernel.shape import Shape
from monarch_kernel.wire.reports import FailureReport


def reply_value(reply: Reply, total: int) -> object:
    """The value of one rank's reply, or its failure raised as an :class:`ActorError`."""
    if reply.ok:
        rank = reply.rank
        return reply.value(lambda: f"result from rank {rank}")
    assert reply.report is not None
    raise actor_error([reply.report], total)


class Gather:
    """Collects one reply per rank of ``ranks``; the future gives a ValueMesh."""

    def __init__(
        self,
        ranks: list[int],
        shape: Shape | None,
        waiter: Waiter | None,
        error_class: type[ActorError] = ActorError,
        value_name: str = "result",
    ):
        self.ranks = ranks
        self.shape = shape or Shape(("ranks",), (len(ranks),))
        self._index = {r: i for i, r in enumerate(ranks)}
        self._replies: list[Reply | None] = [None] * len(ranks)
        self._remaining = len(ranks)
        self._lock = threading.Lock()
        self._error_class = error_class
        self._value_name = value_name
        self.future: Future[ValueMesh[object]] = Future(self._finish, waiter)

    # -- observer (receiving thread) -----------------------------------------------------
    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            self._replies[self._index[reply.rank]] = reply
            self._remaining -= 1
            complete = self._remaining == 0
        if complete:
            self.future.set_result(None)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.future.set_exception(error)

    # -- results ---------------------------------------------------------------------------
    def answered(self, rank: int) -> bool:
        """Whether ``rank`` has replied."""
        return self._replies[self._index[rank]] is not None

    def _finish(self, _: object) -> ValueMesh[object]:
        values: list[object] = []
        failures: list[FailureReport] = []
        name = self._value_name
        for r, reply in zip(self.ranks, self._replies):
            assert reply is not None
            if reply.ok:
                values.append(reply.value(_naming(name, r)))
            else:
                assert reply.report is not None
                failures.append(reply.report)
                values.append(None)
        if failures:
            raise actor_error(failures, len(self.ranks), self._error_class)
        return ValueMesh(self.shape, values)


def _naming(name: str, rank: int) -> Callable[[], str]:
    """``result from rank 3``, formatted only if an error needs it."""
    return lambda: f"{name} from rank {rank}"


class One:
    """The reply of a single rank; the future gives its value."""

    __slots__ = ("future",)

    def __init__(self, waiter: Waiter | None):
        self.future: Future[object] = Future(_value_of_one, waiter)

    def on_reply(self, reply: Reply) -> None:
        self.future.set_result(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.future.set_exception(error)


def _value_of_one(reply: Reply) -> object:
    return reply_value(reply, 1)


class Each:
    """One future per rank, handed out in the order the ranks answer."""

    def __init__(self, ranks: list[int]):
        total = len(ranks)
        self._futures = {r: Future(lambda reply: reply_value(reply, total)) for r in ranks}
        self._done: queue.Queue[Future[object]] = queue.Queue()
        for fut in self._futures.values():
            fut.add_done_callback(self._done.put)

    def on_reply(self, reply: Reply) -> None:
        self._futures[reply.rank].set_result(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self._futures[rank].set_exception(error)

    def in_order_of_answers(self) -> Iterator[Future[object]]:
        for _ in self._futures:
            yield self._done.get()
