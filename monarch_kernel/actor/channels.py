"""Monarch's channels: ``Channel.open()`` / ``open_ranked()``, :class:`Port` (picklable,
sends to the receiving process directly) and :class:`PortReceiver`; and
:func:`tell_owner`, which sends an owner actor the failure of an actor it spawned."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

import zmq

from monarch_kernel.actor.peer.client import client
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import reply_value
from monarch_kernel.calls.reply import Reply
from monarch_kernel.rank import context as rank_context
from monarch_kernel.rank.errors import exception_report
from monarch_kernel.wire import Codec, dumps, handoff, peer_address
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.chunks import encode_parts
from monarch_kernel.wire.codec import Buffer, new_key
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import FailureReport

log = logging.getLogger("monarch_kernel.actor")
R = TypeVar("R")


# -- channels ---------------------------------------------------------------------------


class Port(Generic[R]):
    """The sending end of a channel (Monarch's ``Port``): ``send(value)`` delivers to
    the :class:`PortReceiver` it was opened with, in order; ``exception(exc)`` makes
    that receiver's ``recv()`` raise. Picklable: pass it to actors, on this machine or
    (where the receiving process takes TCP, see ``actor.peer.client.client``) on others.

    Each message carries the rank that sent it, which a :class:`RankedPortReceiver`
    (``Channel.open_ranked()``) hands out with the value: sent from a rank, its point
    in the slice of the call it is serving (Monarch's ``context().message_rank``; its
    global rank outside of a call); sent from the controller, none.

    An endpoint declared ``@endpoint(explicit_response_port=True)`` is given a port of
    the same interface, which answers the call."""

    def __init__(self, addr: PeerAddress, key: str, port_id: str, rank: int | None = None):
        self._addr = addr
        self._key = key
        self._id = port_id
        self._rank = rank

    def send(self, obj: R) -> None:
        """Send ``obj`` to the receiver (in order with this sender's other messages)."""
        payload, buffers = dumps(obj, "value sent to a port")
        self._deliver(True, payload, buffers)

    def exception(self, exc: BaseException) -> None:
        """Make the receiver's next ``recv()`` raise ``exc`` (as an ``ActorError``)."""
        self._deliver(False, pickle.dumps(exception_report(exc, "port")), ())

    def _sender_rank(self) -> int | None:
        """The rank this message is from: the one the port was made for, else the
        sending rank's message rank; None in the controller (no rank)."""
        if self._rank is not None:
            return self._rank
        if rank_context.in_rank():
            return rank_context.message_rank().rank
        return None

    def _deliver(self, ok: bool, payload: bytes, buffers: Sequence[Buffer]) -> None:
        header = H.Result(request=self._id, ok=ok, rank=self._sender_rank()).encode()
        parts = encode_parts(_codec(self._key), header, payload, buffers)  # large: chunks
        sock = _push(self._addr)
        with handoff.values(), _push_lock:  # sent as the value is now (wire.handoff)
            for frames in parts:
                wire_send(sock, frames)

    def __reduce__(self) -> tuple[Any, ...]:
        return Port, (self._addr, self._key, self._id, self._rank)


_codecs: dict[str, Codec] = {}
_pushes: dict[tuple[int, PeerAddress], zmq.Socket] = {}
_push_lock = threading.Lock()


def _codec(key: str) -> Codec:
    codec = _codecs.get(key)
    if codec is None:
        codec = _codecs[key] = Codec(bytes.fromhex(key))
    return codec


def _push(addr: PeerAddress) -> zmq.Socket:
    with _push_lock:
        sock = _pushes.get((os.getpid(), addr))
        if sock is None:
            sock = peer_address.open_socket(zmq.Context.instance(), zmq.PUSH, addr, 1000)
            _pushes[(os.getpid(), addr)] = sock
        return sock


class _PortQueue:
    """Observer of a channel's messages: queued for :meth:`PortReceiver.recv`."""

    def __init__(self) -> None:
        self.items: queue.Queue[Reply | BaseException] = queue.Queue()

    def on_reply(self, reply: Reply) -> None:
        self.items.put(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.items.put(error)


class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``recv()`` is a future of the next value."""

    def __init__(self, q: _PortQueue):
        self._q = q

    def _process(self, reply: Reply) -> R:
        """What ``recv()`` gives for one message (raises what the sender sent with
        ``Port.exception``)."""
        return cast(R, _value(reply))

    def recv(self) -> Future[R]:
        """A future of the next message's value, in the order they arrive."""
        fut: Future[R] = Future()
        q = self._q

        def wait() -> None:
            item = q.items.get()
            if isinstance(item, BaseException):
                fut.set_exception(item)
                return
            try:
                fut.set_result(self._process(item))
            except BaseException as exc:
                fut.set_exception(exc)

        if not q.items.empty():
            wait()
        else:
            threading.Thread(target=wait, name="mk-port-recv", daemon=True).start()
        return fut

    def ranked(self) -> RankedPortReceiver[R]:
        """A receiver of the same channel whose ``recv()`` gives ``(rank, value)``
        (both take from the same messages)."""
        return RankedPortReceiver(self._q)

    def __iter__(self) -> Iterator[R]:
        while True:
            yield self.recv().get()


class RankedPortReceiver(PortReceiver[tuple[int, R]]):
    """The receiving end of a channel opened with ``Channel.open_ranked()`` (Monarch's
    ``RankedPortReceiver``): ``recv()`` is a future of ``(rank, value)``, ``rank`` the
    sender's (see :class:`Port`). A message sent from the controller has no rank: its
    ``recv()`` raises ValueError, as in Monarch."""

    def __init__(self, q: _PortQueue):
        super().__init__(q)

    def _process(self, reply: Reply) -> tuple[int, R]:
        rank: int | None = reply.rank
        if rank is None:
            raise ValueError(
                "a ranked port receiver got a message without a rank (sent from the "
                "controller, not from an actor on a rank)"
            )
        return rank, cast(R, _value(reply))


def _value(reply: Reply) -> object:
    return reply_value(reply, 1)


_port_ids = itertools.count()


class Channel(Generic[R]):
    """Monarch's ``Channel``: ``port, receiver = Channel.open()``; pass ``port`` to
    actors, read what they send with ``receiver.recv()``."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        """A new channel: its port (picklable) and its receiver (stays here).
        ``once`` is accepted for Monarch's signature; the port is not limited to one
        message."""
        c = client()
        key = _channel_key()
        c.codec(key)  # replies signed with it are accepted by the reply thread
        port_id = f"{c.prefix}port{next(_port_ids)}"
        q = _PortQueue()
        c.open_port(port_id, q)
        return Port(c.reply, key, port_id), PortReceiver(q)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], RankedPortReceiver[R]]:
        """Like :meth:`open`, but the receiver's ``recv()`` gives ``(rank, value)``
        (Monarch's ``Channel.open_ranked``): which rank sent each value."""
        port: Port[R]
        receiver: PortReceiver[R]
        port, receiver = Channel.open(once)
        return port, receiver.ranked()


_key: str | None = None


def _channel_key() -> str:
    """The key channel messages to this process are signed with: its mesh's key in a
    rank; a random one made once in the controller."""
    global _key
    svc = rank_context.services()
    if svc is not None:
        return svc.key
    if _key is None:
        _key = new_key().hex()
    return _key


# -- supervision messages to owners ------------------------------------------------------


def tell_owner(owner: H.Owner, mesh: str, actor: str, rank: int, report: FailureReport) -> None:
    """Send the owner actor of ``actor`` a ``supervise`` message (see rank.supervise);
    never blocks (it runs on the controller's receiving thread)."""
    body = {"mesh": mesh, "actor": actor, "rank": rank, "report": report, "path": ()}
    header = H.Supervise(owner_name=owner.name).encode()
    frames = _codec(owner.key).encode(header, pickle.dumps(body))
    with _push_lock:
        try:
            addr = PeerAddress.decode(owner.address)
            sock = _owners.get(addr)
            if sock is None:
                sock = peer_address.open_socket(zmq.Context.instance(), zmq.DEALER, addr, 0)
                _owners[addr] = sock
            sock.send_multipart(frames, zmq.NOBLOCK)
        except (zmq.Again, ConnectionError, ValueError) as exc:
            log.warning(
                "the owner of %s/%s is unreachable (%s); its death is not reported",
                mesh,
                actor,
                exc,
            )


_owners: dict[PeerAddress, zmq.Socket] = {}


def report_unhandled(failure: Exception) -> None:
    """Hand a failure nobody handled to the controller's fault hook: the package's
    ``unhandled_fault_hook`` attribute, read now (a user may have replaced it). What the
    hook raises is logged: a user's hook never takes the controller down."""
    hook = getattr(sys.modules.get("monarch_kernel.actor"), "unhandled_fault_hook", None)
    if hook is None:
        return
    try:
        hook(failure)  # once per failure, also when it raises (Monarch's contract)
    except BaseException:  # SystemExit too (Monarch's default hook exits): logged only
        log.exception("unhandled_fault_hook raised")


__all__ = [
    "Channel",
    "Port",
    "PortReceiver",
    "RankedPortReceiver",
    "report_unhandled",
    "tell_owner",
]
