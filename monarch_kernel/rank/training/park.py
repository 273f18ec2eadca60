"""A rank parked at a step boundary, and what the controller tells it to do there.

When a peer dies during a training step, the collective this rank was in fails; the
step's context manager (``TrainingState.stepping``) tells the controller it is *parked*
(at which step, whether it holds state) and waits here, on its main thread, for the
controller's orders. They come as ``train`` control messages (payload: a pickled
:class:`Order`), which the control thread queues for the parked main thread:

* ``reform``: form the process group again at a new rendezvous (every rank of the
  world joins, the restarted one included); with ``defer``, its ``new_group``
  subgroups wait for ``subgroups`` (the reply: how many wait);
* ``subgroups``: form those subgroups, once the restarted rank made its own again;
* ``offer``: share this rank's state (a :class:`~.parts.StateOffer`, the reply);
* ``load``: take the state of the offer given (a rank behind the others, or a restarted
  one whose first source died);
* ``resume``: leave the boundary and go on (the failed step is redone);
* ``raise``: leave it and raise the step's error (no recovery: the cell fails);
* ``world``: the mesh grew or shrank: take on its new shape (before ``reform``).

A resize (``%mesh grow``/``shrink``) first tells every rank ``hold`` on its control
thread: its main thread parks at the next step boundary by itself (and the abort of
its process group releases peers already in that step's collectives, which park too).

A restarted rank is told ``expect`` (an offer to load when its first step starts) on
its control thread before the cell is sent to it again. Notices go back to the
controller as ``train_notice`` messages (payload: a pickled :class:`Notice`).
"""

from __future__ import annotations

import pickle
import queue
import threading
from typing import Any, Protocol

from monarch_kernel.rank import context
from monarch_kernel.rank.training.parts import StateOffer
from monarch_kernel.wire import Message, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.train_msgs import Notice, Offered, Order

#: How often the parked main thread looks up from its queue (for Ctrl-C, a dead host).
POLL = 0.2


class Replier(Protocol):
    """The rank's outbox, as far as parking uses it."""

    def reply(self, request: str, value: Any, what: str, where: str | None = None) -> None: ...
    def reply_error(self, request: str | None, exc: BaseException, where: str) -> None: ...


class ParkedState(Protocol):
    """The TrainingState of a parked rank, as far as the orders use it."""

    step: int

    def offer(self) -> StateOffer: ...
    def load(self, offer: StateOffer) -> Notice: ...
    def released(self) -> None: ...


_orders: queue.Queue[tuple[str, Order, Replier]] = queue.Queue()
_expected: dict[str, StateOffer] = {}
#: Requests whose ranks were told to park at their next step boundary (a resize).
_holds: set[str] = set()
_lock = threading.Lock()


def on_control(msg: Message, outbox: Replier) -> None:
    """A ``train`` control message (control thread): queue it for the parked main
    thread, or keep an ``expect`` offer for the cell that comes next."""
    request = msg.header.get("i")
    order: Order = loads(msg.payload, msg.buffers, "training order")
    if not isinstance(request, str):
        raise ValueError("a train control message needs a request id")
    if order.op == "expect":
        offer = pickle.loads(order.offer)
        with _lock:
            _expected.clear()  # one recovery at a time: older offers are stale
            _expected[order.request] = offer
        outbox.reply(request, True, "expect")
        return
    if order.op == "hold":
        with _lock:
            _holds.clear()  # one resize at a time
            _holds.add(order.request)
        outbox.reply(request, True, "hold")
        return
    _orders.put((request, order, outbox))


def take_expected(request: str | None) -> StateOffer | None:
    """The offer this (restarted) rank was told to expect for ``request``, once."""
    if request is None:
        return None
    with _lock:
        return _expected.pop(request, None)


def take_hold(request: str | None) -> bool:
    """Whether this rank was told to park at the step boundary of ``request`` (once)."""
    if request is None or not _holds:
        return False
    with _lock:
        if request in _holds:
            _holds.discard(request)
            return True
    return False


def tell(notice: Notice) -> None:
    """Send ``notice`` to the controller (no-op outside a rank)."""
    services = context.services()
    if services is None:
        return
    header = H.RankNotice(kind=K.TRAIN_NOTICE, rank=services.rank).encode()
    services.send(header, pickle.dumps(notice))


def park(
    state: ParkedState,
    request: str,
    error: str,
    has_state: bool = True,
    replicas: tuple[int, ...] = (),
) -> Order:
    """Wait at the step boundary for the controller's orders; returns the last one
    (``resume`` or ``raise``); ``replicas``: the ranks that hold the same state (see
    :class:`Notice`). Interruptible: Ctrl-C raises KeyboardInterrupt here."""
    from monarch_kernel.rank.training.reform import release_peers

    _drain_stale()
    with _lock:  # parked now: a hold for this boundary is answered
        _holds.discard(request)
    release_peers()
    tell(Notice("parked", request, state.step, has_state, error, replicas=replicas))
    offered = False
    while True:
        try:
            rid, order, outbox = _orders.get(timeout=POLL)
        except queue.Empty:
            continue
        if order.request != request:
            outbox.reply_error(rid, RuntimeError("not parked for that request"), "train")
            continue
        try:
            value = _obey(state, order)
        except Exception as exc:
            outbox.reply_error(rid, exc, f"train {order.op}")
            continue
        offered = offered or order.op == "offer"
        outbox.reply(rid, value, f"train {order.op}")
        if order.op in ("resume", "raise"):
            if offered:
                state.released()
            with _lock:  # a hold that came while it was parked is answered by this park
                _holds.discard(request)
            return order


def _obey(state: ParkedState, order: Order) -> Any:
    """Carry out one order on the main thread; its reply value."""
    if order.op == "reform":
        from monarch_kernel.rank.training.reform import reform

        return reform(order.addr, order.port, defer=order.defer)
    if order.op == "subgroups":
        from monarch_kernel.rank.training.reform import reform_subgroups

        return reform_subgroups(order.addr, order.port)
    if order.op == "world":
        from monarch_kernel.rank.world import set_world

        return set_world(order.labels, order.sizes, dict(order.ranks))
    if order.op == "offer":
        offer = state.offer()
        return Offered(offer.source, offer.step, offer.nbytes, pickle.dumps(offer))
    if order.op == "load":
        return state.load(pickle.loads(order.offer))
    if order.op in ("resume", "raise"):
        return state.step
    raise ValueError(f"unknown training order {order.op!r}")


def _drain_stale() -> None:
    """Orders left from an earlier park (their controller gave up on them)."""
    while True:
        try:
            rid, order, outbox = _orders.get_nowait()
        except queue.Empty:
            return
        outbox.reply_error(rid, RuntimeError("no longer parked"), "train")
