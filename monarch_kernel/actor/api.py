"""Monarch's runtime helpers: ``context()``, ``current_actor_name()``, ``this_proc()``,
``Accumulator``, ``Channel``/``Port``/``PortReceiver``/``RankedPortReceiver`` and
``get_or_spawn_controller``."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import zmq

from monarch_kernel.actor.peer import RemoteProcMesh, _waiter, then
from monarch_kernel.actor.peer_client import MeshRef, client
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import One
from monarch_kernel.calls.reply import Reply
from monarch_kernel.controller.inbound import ASK_HANDLERS
from monarch_kernel.rank import context as rank_context
from monarch_kernel.rank.runtime import ResponsePort
from monarch_kernel.rank.supervise import MeshFailure
from monarch_kernel.shape import Point, Shape
from monarch_kernel.wire import Codec, dumps, loads, peer_address
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import new_key
from monarch_kernel.wire.peer_address import PeerAddress

log = logging.getLogger("monarch_kernel.actor")
R = TypeVar("R")
A = TypeVar("A")


# -- context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """The running actor (Monarch's ``context().actor_instance``).

    ``rank`` is its point in its process mesh, ``actor_id`` a readable id
    (``mesh/actor[rank]``; ``client`` in the controller), ``proc`` its own process as
    a one-point process mesh (what :func:`this_proc` returns)."""

    rank: Point
    actor_id: str
    proc_id: str
    name: str

    @property
    def proc(self) -> Any:
        return this_proc()


@dataclass(frozen=True)
class Context:
    """Monarch's ``context()``: the running actor and the current message's rank."""

    actor_instance: Instance

    @property
    def message_rank(self) -> Point:
        """This rank's point within the slice the current message was sent to (its
        ``.rank`` the index in that slice); ``actor_instance.rank`` is its point in
        the whole process mesh."""
        return rank_context.message_rank()


def context() -> Context:
    """Information about the actor running this code (the client in the controller)."""
    rt = rank_context._runtime
    if rt is None:
        point = Point({}, 0)
        return Context(Instance(point, "client", "client", "client"))
    point = rank_context.current_rank()
    mesh = rt.cfg.get("mesh", rt.cfg.get("run_id", "mesh"))
    proc = f"{mesh}[{point.rank}]"
    name = rank_context.current_actor or ""
    return Context(Instance(point, f"{mesh}/{name}[{point.rank}]", proc, name))


def current_actor_name() -> str:
    """The id of the actor running this code, e.g. ``trainers/trainer[3]``."""
    return context().actor_instance.actor_id


_this_proc: Any = None
_this_proc_lock = threading.Lock()


def this_proc() -> Any:
    """This process as a one-point process mesh: spawn actors on it.

    In a rank: its own process (an actor spawned here lives in this rank). In the
    controller, which runs no actors itself, a one-rank process mesh on this machine,
    started on first use and kept (Monarch spawns such actors in the client process)."""
    global _this_proc
    rt = rank_context._runtime
    if rt is not None:
        cfg = rt.cfg
        world = int(cfg.get("world_size", rt.rank + 1))
        none = PeerAddress("")
        addrs = tuple(rt.peer if r == rt.rank else none for r in range(world))
        shape = Shape((), (), (), rt.rank)
        mesh = str(cfg.get("mesh", cfg.get("run_id", "mesh")))
        return RemoteProcMesh(MeshRef(mesh, cfg["key"], addrs, shape))
    with _this_proc_lock:
        if _this_proc is None or _this_proc.stopped:
            from monarch_kernel.actor.meshes import this_host

            _this_proc = this_host().spawn_procs(per_host={"procs": 1}, name="this_proc")
        return _this_proc.slice(procs=0)


# -- supervision at the root ------------------------------------------------------------


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Called in the controller for a failure nobody handled: an exception under
    ``broadcast`` (or in an actor spawned by an actor, that no ``__supervise__`` on the
    way up handled) or a rank that died. Replace it to act on failures::

        import monarch_kernel.actor as actor
        actor.unhandled_fault_hook = my_hook

    The default does nothing more than what is shown already (the failure under the
    running cell, the dead rank in the mesh's errors); unlike Monarch's, it never ends
    the controller (a notebook kernel)."""


def tell_owner(
    owner: dict[str, str], mesh: str, actor: str, rank: int, report: dict[str, Any]
) -> None:
    """Send the owner actor of ``actor`` a ``supervise`` message (see rank.supervise);
    never blocks (it runs on the controller's receiving thread)."""
    import pickle

    body = {"mesh": mesh, "actor": actor, "rank": rank, "report": report, "path": ()}
    frames = _codec(owner["ox"]).encode({"k": K.SUPERVISE, "on": owner["on"]}, pickle.dumps(body))
    with _push_lock:
        try:
            addr = PeerAddress.decode(owner["oa"])
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


def _watch(runtime: Any) -> None:
    """Hand a controller mesh's unanswered failures and deaths to the fault hook."""
    from monarch_kernel.controller.events import FaultReported, RankDied
    from monarch_kernel.controller.records import RankState

    name = runtime.name

    def on_event(event: Any) -> None:
        if isinstance(event, FaultReported):
            actor = str(event.report.get("actor", ""))
            failure = MeshFailure(name, actor, event.rank, dict(event.report))
        elif isinstance(event, RankDied) and event.state is RankState.DEAD:
            d = event.death
            report = {"type": "RankDied", "message": f"rank {d.rank} on {d.host}: {d.how}"}
            info = runtime.ranks[event.rank]
            owned, info.owners = info.owners, {}
            for actor, owner in owned.items():  # their owners supervise them
                tell_owner(owner, name, actor, event.rank, report)
            if owned:
                return
            failure = MeshFailure(name, "", event.rank, report)
        else:
            return
        hook = getattr(sys.modules.get("monarch_kernel.actor"), "unhandled_fault_hook", None)
        try:
            (hook or unhandled_fault_hook)(failure)
        except Exception:  # a user's hook never takes the controller down
            log.exception("unhandled_fault_hook raised")

    runtime.events.subscribe(on_event, FaultReported, RankDied)


# -- controllers ------------------------------------------------------------------------

_controllers: dict[str, Any] = {}
_controllers_lock = threading.Lock()


def get_or_spawn_controller(name: str, cls: type, *args: Any, **kwargs: Any) -> Future[Any]:
    """The singleton actor ``name`` of this controller, spawned (with ``cls(*args,
    **kwargs)``) on :func:`this_proc` the first time; a future of its one-point mesh."""
    if rank_context.in_rank():  # asked of the controller, which owns the singletons
        rt = rank_context._runtime
        call, buffers = dumps((name, cls, args, kwargs), f"get_or_spawn_controller({name!r})")
        if buffers:
            raise TypeError("get_or_spawn_controller() arguments must pickle in-band")
        c = client()
        c.codec(rt.cfg["key"])  # the controller answers with this mesh's key
        one = One(_waiter())
        rid = c.expect(one, 0)
        req = {"op": "get_or_spawn_controller", "id": rid, "rt": c.reply.encode(), "call": call}
        rt.send({"k": K.ASK, "r": rt.rank}, pickle.dumps(req))
        return one.future
    with _controllers_lock:
        mesh = _controllers.get(name)
        if mesh is None or mesh._runtime.state == "stopped":
            mesh = _controllers[name] = this_proc().spawn(name, cls, *args, **kwargs)
    fut: Future[Any] = Future()
    fut.set_result(mesh)
    return fut


def _ask_get_or_spawn(requester: Any, req: dict[str, Any]) -> Any:
    """A rank's ``get_or_spawn_controller``, run in the controller: the actor mesh
    (pickled back to the rank as a live reference)."""
    name, cls, args, kwargs = loads(req["call"], (), "get_or_spawn_controller arguments")
    return get_or_spawn_controller(name, cls, *args, **kwargs).get()


ASK_HANDLERS["get_or_spawn_controller"] = _ask_get_or_spawn


# -- accumulator ------------------------------------------------------------------------


class Accumulator(Generic[R, A]):
    """Fold the answers of every rank of an endpoint's call (Monarch's ``Accumulator``):
    ``Accumulator(counters.value, 0, lambda acc, v: acc + v).accumulate().get()``."""

    def __init__(self, endpoint: Any, identity: A, combine: Callable[[A, R], A]):
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call every rank now; the future folds their answers in arrival order."""
        futures = list(self._endpoint.stream(*args, **kwargs))
        identity, combine = self._identity, self._combine

        def fold(_: object) -> A:
            acc = identity
            for f in futures:
                acc = combine(acc, f.get())
            return acc

        done: Future[None] = Future()
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done.set_result(None)

        if not futures:
            done.set_result(None)
        for f in futures:
            f.add_done_callback(one_done)
        return then(done, fold)


# -- channels ---------------------------------------------------------------------------


class Port(Generic[R]):
    """The sending end of a channel (Monarch's ``Port``): ``send(value)`` delivers to
    the :class:`PortReceiver` it was opened with, in order; ``exception(exc)`` makes
    that receiver's ``recv()`` raise. Picklable: pass it to actors, on this machine or
    (where the receiving process takes TCP, see ``actor.peer_client.client``) on others.

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
        self._deliver({"ok": 1}, payload, buffers)

    def exception(self, exc: BaseException) -> None:
        """Make the receiver's next ``recv()`` raise ``exc`` (as an ``ActorError``)."""
        import pickle

        from monarch_kernel.rank.errors import exception_report

        self._deliver({"ok": 0}, pickle.dumps(exception_report(exc, "port")), ())

    def _sender_rank(self) -> int | None:
        """The rank this message is from: the one the port was made for, else the
        sending rank's message rank; None in the controller (no rank)."""
        if self._rank is not None:
            return self._rank
        if rank_context.in_rank():
            return rank_context.message_rank().rank
        return None

    def _deliver(self, extra: dict[str, Any], payload: bytes, buffers: Any) -> None:
        header: dict[str, Any] = {"k": K.RESULT, "i": self._id, **extra}
        rank = self._sender_rank()
        if rank is not None:
            header["r"] = rank
        frames = _codec(self._key).encode(header, payload, buffers)
        sock = _push(self._addr)
        with _push_lock:
            sock.send_multipart(frames, copy=False)

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
    from monarch_kernel.calls.gather import reply_value

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
    rt = rank_context._runtime
    if rt is not None:
        return str(rt.cfg["key"])
    if _key is None:
        _key = new_key().hex()
    return _key


__all__ = [
    "Accumulator",
    "Channel",
    "Context",
    "Instance",
    "MeshFailure",
    "Port",
    "PortReceiver",
    "RankedPortReceiver",
    "ResponsePort",
    "context",
    "current_actor_name",
    "get_or_spawn_controller",
    "this_proc",
    "unhandled_fault_hook",
]
