"""The controller's own process as ranks reach it: calls to its actors (``this_proc()``
there) from actors in ranks, and failures of actors that its actors own.

A handle on an actor of the controller's process that is passed to an actor in a rank
(a ``get_or_spawn_controller`` singleton, an argument) carries this server's address,
like a handle on a rank carries the rank's peer address: the rank sends the same signed
messages it sends to another rank (``call``, ``spawn_actor``, ``stop_actor``, and
``supervise`` to an owner), and the answers go back to the caller's reply socket.

One socket (a bound DEALER, like a rank's inbox) on a unix socket in a private
directory and, where meshes of other machines run when it opens, a CURVE TCP socket
(any client key; admission is the signed message: ranks' own listeners are the ones
that admit only their controller's listener key, see ``rank.listener_gate``).
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from monarch_kernel.actor.client_actor import Answer
from monarch_kernel.actor.peer.reply import admit_any_key, reply_tcp_host
from monarch_kernel.wire import Codec, WireError, peer_address
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.chunks import Assembler, encode_parts
from monarch_kernel.wire.codec import Buffer, Header, limit_size
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.peer_address import PeerAddress

log = logging.getLogger("monarch_kernel.actor")

#: How long an answer to a rank may wait for that rank's socket (it may be gone).
SEND_TIMEOUT_MS = 5000


class Served(Protocol):
    """What the server hands messages to (the controller's process)."""

    def deliver(
        self,
        header: Header,
        payload: bytes | memoryview,
        buffers: Sequence[Buffer],
        answer: Answer | None,
        context: contextvars.Context,
    ) -> None:
        """A ``call``, ``spawn_actor`` or ``stop_actor`` message for one of its actors."""
        ...

    def supervise_from(self, owner_name: str, body: dict[str, Any]) -> None:
        """An actor that actor ``owner_name`` owns failed (a ``supervise`` message)."""
        ...


class PeerServer:
    """Receives the messages ranks send to the controller's process (its own thread)."""

    def __init__(self, served: Served, key: bytes):
        self._served = served
        self.codec = Codec(key)
        self._assembler = Assembler()  # large arguments come in chunks
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        limit_size(self._sock)
        tcp_host = reply_tcp_host()
        domain = admit_any_key() if tcp_host else ""
        self._dir = tempfile.mkdtemp(prefix="mk-client-")  # 0700: only we connect
        atexit.register(shutil.rmtree, self._dir, True)
        path = os.path.join(self._dir, "p")
        self.address: PeerAddress = peer_address.bind(self._sock, path, tcp_host, zap_domain=domain)
        self._lock = threading.Lock()  # the outgoing sockets are used from any thread
        self._out: dict[tuple[int, PeerAddress], zmq.Socket[bytes]] = {}
        self._wake_addr = f"inproc://mk-client-wake-{id(self)}"
        self._wake_in = ctx.socket(zmq.PAIR)
        self._wake_in.bind(self._wake_addr)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mk-client-proc", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            while not self._closed:
                events = dict(poller.poll())
                if self._sock in events:
                    self._receive(wire_recv(self._sock))
        finally:
            self._sock.close(0)
            self._wake_in.close(0)

    def _receive(self, frames: list[Any]) -> None:
        try:
            msg = self._assembler.receive(self.codec, frames)
        except WireError as exc:  # forged or malformed: dropped before anything is unpickled
            log.warning("the controller's process dropped a message: %s", exc)
            return
        if msg is None:  # a part of a large value still arriving in chunks
            return
        hdr = H.decode_ordered(msg.header)
        try:
            if isinstance(hdr, H.Supervise):
                self._served.supervise_from(hdr.owner_name, pickle.loads(msg.payload))
                return
            answer: Answer | None = None
            if hdr.wants_reply and hdr.request is not None and hdr.reply_to is not None:
                answer = _RankAnswer(self, PeerAddress.decode(hdr.reply_to), hdr.request)
            # No caller context to copy: in a notebook, output goes to the running cell.
            self._served.deliver(
                msg.header, msg.payload, msg.buffers, answer, contextvars.Context()
            )
        except Exception:  # a bad message never stops the server
            log.exception("the controller's process could not serve a %s message", msg.kind)

    def send(
        self, kind: int, to: PeerAddress, codec: Codec, header: Header, payload: bytes,
        buffers: Sequence[Buffer] = (),
    ) -> None:  # fmt: skip
        """Send one message to another process's peer address (``kind``: PUSH for an
        answer, DEALER for a ``supervise`` message); raises what sending raises."""
        parts = encode_parts(codec, header, payload, buffers)  # a large value: in chunks
        with self._lock:
            sock = self._out.get((kind, to))
            if sock is None:
                ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
                sock = peer_address.open_socket(ctx, kind, to, 1000, SEND_TIMEOUT_MS)
                self._out[(kind, to)] = sock
            for frames in parts:
                wire_send(sock, frames)

    def close(self) -> None:
        """Stop taking messages and close the sockets."""
        self._closed = True
        with self._lock:
            wake: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
            wake.connect(self._wake_addr)
            wake.send(b"")
            wake.close(1000)
            for sock in self._out.values():
                sock.close(0)
            self._out.clear()
        self._thread.join(5.0)
        shutil.rmtree(self._dir, ignore_errors=True)


class _RankAnswer:
    """Sends the answer of a rank's call back to that rank's reply socket."""

    def __init__(self, server: PeerServer, route: PeerAddress, request: str):
        self._server = server
        self._route = route
        self._request = request

    def __call__(self, ok: bool, payload: bytes, buffers: Sequence[Buffer]) -> None:
        header = H.Result(request=self._request, ok=ok, rank=0).encode()
        try:
            self._server.send(zmq.PUSH, self._route, self._server.codec, header, payload, buffers)
        except (zmq.ZMQError, ConnectionError) as exc:
            log.warning("the caller at %s is gone (%s); answer dropped", self._route, exc)


__all__ = ["PeerServer", "Served"]
