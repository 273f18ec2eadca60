"""The client side of rank-to-rank actor calls: one :class:`PeerClient` per process.

It sends actor calls (signed with the *target* mesh's key) straight to the target
ranks' inboxes and matches their replies, which come back to this process's reply
socket, to the futures waiting for them; a thread of its own reads the replies and
watches the connections, so a target that dies, or whose machine vanishes, fails its
calls as it would from the controller (:class:`RankDiedError`).

Each target rank is reached where it listens (:mod:`monarch_kernel.wire.peer_address`):
its unix socket from the same machine, its CURVE TCP socket from another (ranks of meshes
that span machines take those). Replies come back the same way to this process's reply
socket. A target on another machine that dies, or whose machine vanishes, fails its calls
as one on this machine does (the connection drops, or its heartbeats stop); one that
cannot be reached at all fails them after :data:`CONNECT_TIMEOUT` seconds.

Mesh handles in a rank reach it through :class:`~.requester.PeerRequester`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.utils.monitor

from monarch_kernel.actor.peer.inline import on_main_thread, serve_inline
from monarch_kernel.actor.peer.reply import admit_any_key, reply_path, reply_tcp_host
from monarch_kernel.actor.peer.resolve import gone, locate
from monarch_kernel.calls import reply as calls_reply
from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.calls.reply import Reply, RequestObserver, reply_of
from monarch_kernel.calls.requester import MeshRef
from monarch_kernel.rank import context, listener_gate
from monarch_kernel.wire import Codec, WireError, handoff, peer_address
from monarch_kernel.wire.chunks import Assembler, encode_parts
from monarch_kernel.wire.codec import Buffer, Header, limit_size
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.peer_address import PeerAddress

#: Seconds a first connection to a rank may take before its calls fail (it is not
#: running, or its machine cannot be reached from here).
CONNECT_TIMEOUT = 5.0
#: Monitor events that mean a connection to a target rank is gone or refused.
_LOST = {
    zmq.EVENT_DISCONNECTED: "its connection closed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the encrypted handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the encrypted handshake failed (protocol)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its listener refused our key",
}


# -- the client: one per process -------------------------------------------------------


class _Pending:
    __slots__ = ("observer", "ranks", "addrs", "left", "rid", "ref", "parts", "of_slot")

    def __init__(
        self,
        observer: RequestObserver,
        ranks: list[int],
        addrs: list[str],
        rid: str = "",
        ref: MeshRef | None = None,
        parts: Sequence[list[Any]] = (),
    ):
        """``addrs``: the route each of ``ranks`` was sent on (see ``_on_lost``);
        ``ref`` and ``parts``: the mesh and the messages, sent again where a rank is
        now if its connection never came up (it moved: :mod:`.resolve`). A reply
        names its rank by its slot (wire id): ``of_slot`` maps it back to the rank of
        ``ref`` it answers for (the same number unless a shrink renumbered the ranks)."""
        self.observer = observer
        self.ranks = ranks
        self.addrs = addrs
        self.left = set(ranks)
        self.rid, self.ref, self.parts = rid, ref, parts
        self.of_slot = {ref.slot(r) if ref is not None else r: r for r in ranks}


class PeerClient:
    """Sends actor calls to other ranks and routes their replies to futures."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.lock = threading.Lock()
        self.codecs: dict[str, Codec] = {}
        self.socks: dict[str, zmq.Socket] = {}  # peer address -> DEALER (sent under lock)
        self.pending: dict[str, _Pending] = {}
        self.ports: dict[str, RequestObserver] = {}  # open channels: every message
        self.ids = itertools.count()
        #: Reassembles large replies and channel messages, which come in chunks.
        self.assembler = Assembler()
        #: Where ranks are that moved since the references to them were made, as their
        #: controller said: (mesh key, slot) -> address (see :mod:`.resolve`).
        self.moved: dict[tuple[str, int], PeerAddress] = {}
        #: Targets whose connection was lost: where they are is asked before the next call.
        self.stale: set[tuple[str, int]] = set()
        #: route -> the targets (mesh key, slot) called through it
        self.route_targets: dict[str, set[tuple[str, int]]] = {}
        self._reply_ident = 0  # the reply thread's (it never waits for an answer itself)
        #: Messages on the reply socket that no known mesh key verified (dropped).
        self.rejected = 0
        self.prefix = f"p{os.getpid()}-{os.urandom(3).hex()}-"
        rt = context.services()
        self.machine = peer_address.this_machine()  # a rank's too: its agent's hostname
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        limit_size(self.replies)
        #: Where replies to this process go: its unix socket and, where ranks of other
        #: machines may answer, a CURVE TCP socket (see :func:`.reply.reply_tcp_host`).
        tcp_host = reply_tcp_host()
        domain = admit_any_key() if tcp_host and rt is None else ""
        # In a rank of a CURVE mesh: only the mesh's listener key may answer over TCP.
        gate = listener_gate.gate() if rt is not None else None
        self.reply = peer_address.bind(
            self.replies, reply_path(), tcp_host, self.machine, domain, gate=gate
        )
        #: route -> when its first connection must be up (see CONNECT_TIMEOUT)
        self.connecting: dict[str, float] = {}
        # New monitor sockets are handed to the reply thread through ``wake``.
        self.wake_addr = f"inproc://mk-peer-wake-{id(self)}"
        wake_in = self.ctx.socket(zmq.PAIR)
        wake_in.bind(self.wake_addr)
        self.wake = self.ctx.socket(zmq.PAIR)
        self.wake.connect(self.wake_addr)
        self.new_monitors: list[tuple[str, zmq.Socket]] = []
        threading.Thread(
            target=self._serve, args=(wake_in,), name="mk-peer-replies", daemon=True
        ).start()

    def codec(self, key: str) -> Codec:
        codec = self.codecs.get(key)
        if codec is None:
            codec = self.codecs[key] = Codec(bytes.fromhex(key))
        return codec

    def _socket(self, addr: PeerAddress, route: str, rank: int) -> zmq.Socket:
        """The DEALER connected to ``route`` (``addr``'s route from here); call under
        ``lock``."""
        sock = self.socks.get(route)
        if sock is not None:
            return sock
        if route.startswith("ipc://") and not os.path.exists(route.removeprefix("ipc://")):
            raise RankDiedError(f"rank {rank} is not running (no peer socket at {route})")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Never block a send under the client's lock (the reply thread takes it): a
        # large value's many chunks queue as references to the caller's buffers.
        sock.setsockopt(zmq.SNDHWM, 0)
        limit_size(sock)
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
        for event in _LOST:
            events |= event
        monitor = sock.get_monitor_socket(events)
        peer_address.connect(sock, addr, self.machine)
        self.socks[route] = sock
        self.connecting[route] = time.monotonic() + CONNECT_TIMEOUT
        self.new_monitors.append((route, monitor))
        self.wake.send(b"")
        return sock

    def request(
        self,
        ref: MeshRef,
        ranks: Sequence[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver | None,
    ) -> str:
        """Send ``header`` + payload to each of ``ranks`` of ``ref``'s mesh; the replies
        go to ``observer`` (None: fire and forget). Returns the request id ('' for fire
        and forget, or when the only target was served inline)."""
        codec = self.codec(ref.key)
        ranks = list(ranks)
        addrs = [self._where(ref, r) for r in ranks]
        rt = context.services()
        if (
            rt is not None
            and rt.peer in addrs
            and on_main_thread()
            and rt.claim(str(header.get("a", "")))
        ):
            # A call to this very rank from its main thread, to an actor that is free
            # (or whose endpoint waits on this thread): it runs here, inline, at once
            # (``claim`` counts it in; ``serve_inline`` counts it out).
            i = addrs.index(rt.peer)
            others = ranks[:i] + ranks[i + 1 :]
            rid = self.request(ref, others, header, payload, buffers, observer)
            serve_inline(rt, ranks[i], header, payload, buffers, observer)
            return rid
        if not ranks:
            return ""
        routes = [_route(ref, r, a, self.machine) for r, a in zip(ranks, addrs)]
        # value semantics (wire.handoff): sent as it is now, whatever the caller does
        # with its tensors after the call returns (the wait comes after the lock)
        with handoff.values(), self.lock:
            rid = ""
            if observer is not None:
                rid = self.prefix + str(next(self.ids))
                header = dict(header, i=rid, w=1, rt=self.reply.encode())
            parts = encode_parts(codec, header, payload, buffers)  # large: in chunks
            if observer is not None:
                self.pending[rid] = _Pending(observer, ranks, routes, rid, ref, parts)
            try:
                for r, addr, route in zip(ranks, addrs, routes):
                    self.route_targets.setdefault(route, set()).add((ref.key, ref.slot(r)))
                    sock = self._socket(addr, route, r)
                    for frames in parts:
                        wire_send(sock, frames)
            except BaseException:
                if rid:
                    self.pending.pop(rid, None)
                raise
        return rid

    def expect(self, observer: RequestObserver, rank: int) -> str:
        """A request id whose one reply (from ``rank``) goes to ``observer``."""
        with self.lock:
            rid = self.prefix + str(next(self.ids))
            self.pending[rid] = _Pending(observer, [rank], [""])
        return rid

    def open_port(self, port_id: str, observer: RequestObserver) -> None:
        """Deliver every message sent to ``port_id`` to ``observer`` (a channel)."""
        with self.lock:
            self.ports[port_id] = observer

    # -- where targets are ------------------------------------------------------------
    def _where(self, ref: MeshRef, rank: int) -> PeerAddress:
        """Where to call ``rank`` of ``ref``'s mesh: where its controller last said it
        is, else where the reference says; asked again (:func:`.resolve.locate`)
        when its connection was lost or cannot be made, as it may have moved.
        RankDiedError when it is gone."""
        target = (ref.key, ref.slot(rank))  # the process: a renumbering does not move it
        addr = self.moved.get(target) or (ref.addrs[rank] if rank < len(ref.addrs) else None)
        addr = addr or PeerAddress("")
        if target not in self.stale and self._reachable(addr):
            return addr
        # The reply thread reads the answer itself: it never waits for one.
        where = None if threading.get_ident() == self._reply_ident else locate(self, ref, rank)
        if where is None:  # nobody to ask: the reference's address, as it is
            if addr:
                return addr
            raise RankDiedError(f"rank {rank} of mesh {ref.mesh!r} is not running")
        error = gone(ref, rank, where)
        if error is not None:
            raise error
        with self.lock:
            self.moved[target] = where.address
            self.stale.discard(target)
        return where.address

    def _reachable(self, addr: PeerAddress) -> bool:
        """Whether ``addr`` may be connected to from here (an existing connection, or a
        unix socket whose file exists, or TCP)."""
        if not addr:
            return False
        try:
            route = addr.route(self.machine)
        except ConnectionError:
            return False
        if route.startswith("ipc://") and route not in self.socks:
            return os.path.exists(route.removeprefix("ipc://"))
        return True

    # -- the reply thread -----------------------------------------------------------
    def _serve(self, wake_in: zmq.Socket) -> None:
        self._reply_ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self.replies, zmq.POLLIN)
        poller.register(wake_in, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        while True:
            timeout = 500 if self.connecting else None  # first connections under way
            for sock, _ in poller.poll(timeout):
                if sock is self.replies:
                    self._on_reply(wire_recv(sock))
                elif sock is wake_in:
                    wake_in.recv()
                    with self.lock:
                        fresh, self.new_monitors = self.new_monitors, []
                    for route, mon in fresh:
                        monitors[mon] = route
                        poller.register(mon, zmq.POLLIN)
                else:
                    event = zmq.utils.monitor.recv_monitor_message(sock)["event"]
                    route = monitors[sock]
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        with self.lock:
                            self.connecting.pop(route, None)
                    elif event in _LOST:
                        self._on_lost(route, _LOST[event])
                    elif event == zmq.EVENT_MONITOR_STOPPED:  # its socket was closed
                        poller.unregister(sock)
                        del monitors[sock]
                        sock.close(0)
            now = time.monotonic()
            with self.lock:
                late = [r for r, deadline in self.connecting.items() if deadline < now]
            for route in late:
                self._on_lost(route, f"no connection within {CONNECT_TIMEOUT:g}s")

    def _on_reply(self, frames: list[Any]) -> None:
        msg = None
        forged = True
        for codec in list(self.codecs.values()):  # a handful of keys: try each
            try:
                msg = codec.decode(frames)
            except WireError:
                continue
            forged = False
            try:
                msg = self.assembler.feed(codec, msg)  # a large value comes in chunks
            except WireError:
                msg = None
            break
        if msg is None:  # forged, malformed or a part of a value still arriving
            self.rejected += forged
            return
        h = msg.header
        rank = h.get("r")
        port = self.ports.get(h.get("i"))  # type: ignore[arg-type]
        if port is not None:
            port.on_reply(Reply(rank, msg))  # type: ignore[arg-type]
            return
        with self.lock:
            p = self.pending.get(h.get("i"))  # type: ignore[arg-type]
            rank = p.of_slot.get(rank) if p is not None else None  # type: ignore[arg-type]
            if p is None or rank not in p.left:
                p = None
            else:
                p.left.discard(rank)
                if not p.left:
                    del self.pending[h["i"]]
        if p is not None:
            p.observer.on_reply(reply_of(rank, msg))  # type: ignore[arg-type]
        elif h.get("x") and calls_reply.handle_reader is not None:
            # by handle, and nobody waits for it any more: its copies are let go of
            calls_reply.handle_reader.discard(bytes(msg.payload))

    def _on_lost(self, route: str, why: str) -> None:
        """The connection to a target rank at ``route`` is gone (``why``): it died, its
        mesh stopped or its machine cannot be reached. Its calls fail, unless the
        connection never came up (nothing reached the rank): those are sent again where
        the rank is now, if it moved. The next call asks where its targets are."""
        lost: list[tuple[_Pending, int]] = []
        with self.lock:
            sock = self.socks.pop(route, None)
            never_connected = self.connecting.pop(route, None) is not None
            self.stale |= self.route_targets.pop(route, set())
            for rid, p in list(self.pending.items()):
                for r, a in zip(p.ranks, p.addrs):
                    if a == route and r in p.left:
                        p.left.discard(r)
                        lost.append((p, r))
                if not p.left:
                    del self.pending[rid]
        if sock is not None:
            sock.close(0)
        if never_connected and lost:  # asking where they are waits: not on this thread
            args = (lost, route, why)
            threading.Thread(
                target=self._send_elsewhere, args=args, name="mk-peer-relocate", daemon=True
            ).start()
            return
        for p, r in lost:
            p.observer.on_lost(r, _lost(r, route, why))

    def _send_elsewhere(self, lost: list[tuple[_Pending, int]], route: str, why: str) -> None:
        """Send calls that never reached their rank (at ``route``) to where it is now;
        fail those whose rank is gone or did not move."""
        for p, r in lost:
            try:
                error = self._resend(p, r, route)
            except (RankDiedError, ConnectionError) as exc:
                error = exc if isinstance(exc, RankDiedError) else RankDiedError(str(exc))
            if error is not None:
                p.observer.on_lost(r, error)

    def _resend(self, p: _Pending, rank: int, old_route: str) -> RankDiedError | None:
        if p.ref is None or not p.parts:
            return _lost(rank, old_route, "no connection")
        addr = self._where(p.ref, rank)
        route = _route(p.ref, rank, addr, self.machine)
        if route == old_route:
            return _lost(rank, old_route, f"no connection within {CONNECT_TIMEOUT:g}s")
        with self.lock:
            p.addrs = [route if r == rank else a for r, a in zip(p.ranks, p.addrs)]
            p.left.add(rank)
            self.pending[p.rid] = p
            self.route_targets.setdefault(route, set()).add((p.ref.key, p.ref.slot(rank)))
            sock = self._socket(addr, route, rank)
            for frames in p.parts:
                sock.send_multipart(frames, copy=False)
        return None


def _lost(rank: int, route: str, why: str) -> RankDiedError:
    return RankDiedError(
        f"rank {rank} died, its mesh stopped or its machine cannot be reached "
        f"during an actor call ({why}; at {route})"
    )


_client: PeerClient | None = None
_client_lock = threading.Lock()


def client() -> PeerClient:
    """This process's client (made on first use, again after a fork). In the controller
    a client made before any mesh of another machine existed takes replies on this
    machine only; once one exists the next caller gets a new client that takes them
    over TCP too (the old one keeps serving the channels it opened)."""
    global _client
    with _client_lock:
        stale = _client is None or _client_pid != os.getpid()
        # A controller's client without TCP replies, now that a mesh of another machine is up.
        local_only = (
            _client is not None
            and not _client.reply.tcp
            and not context.in_rank()
            and bool(reply_tcp_host())
        )
        if stale or local_only:
            _set_client(PeerClient())
        assert _client is not None
        return _client


_client_pid = 0


def _set_client(c: PeerClient) -> None:
    global _client, _client_pid
    _client, _client_pid = c, os.getpid()


def _route(ref: MeshRef, rank: int, addr: PeerAddress, here: str) -> str:
    try:
        return addr.route(here)
    except ConnectionError as exc:
        raise ConnectionError(
            f"rank {rank} of mesh {ref.mesh!r} cannot be reached from this rank: {exc}"
        ) from None


__all__ = ["CONNECT_TIMEOUT", "MeshRef", "PeerClient", "client"]
