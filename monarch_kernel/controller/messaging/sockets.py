"""The controller's socket plumbing of one mesh: where it listens (and where an earlier
controller of a detachable mesh listened), its private unix-socket directory, binding
and re-binding, and the inproc sockets that wake the receiving thread. Used by
:mod:`.transport`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import zmq

from monarch_kernel.wire.ports import bind_port
from monarch_kernel.wire.tempdirs import make_private_dir, mark_owners

#: Seconds a controller that attaches to a tcp mesh retries binding its addresses (the
#: kernel it took the mesh from with ``--force`` closes them a moment later).
REBIND_TIMEOUT = 10.0


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE mesh's keys, as a controller that attaches takes them over: the server
    keypair, and per host the client key it admits and the routing-id tag (z85/str)."""

    public: str
    secret: str
    hosts: dict[int, tuple[str, str]]  #: host -> (its client public key, its ident tag)


@dataclass(frozen=True)
class Endpoints:
    """Where an earlier controller of a detachable mesh listened: a controller that
    attaches binds the same sockets (unix sockets, or tcp addresses with the same CURVE
    keys), and its ranks and agents reconnect by themselves."""

    send: str
    recv: str
    ipc_dir: str | None  #: the private directory holding them (removed on a stop)
    curve: CurveKeys | None = None  #: a tcp mesh's keys


def wake_socket(ctx: zmq.Context[zmq.Socket[bytes]], ident: bytes, addr: str) -> zmq.Socket[bytes]:
    """An inproc DEALER to the recv socket at ``addr``: a message on it only wakes the
    thread receiving there."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(addr)
    return sock


#: The names of the controller's unix sockets in its directory (``/send``, ``/recv``).
CONTROLLER_SOCKET_ROOM = len("/send")


def private_ipc_dir() -> str | None:
    """A fresh 0700 directory for the controller's unix sockets (None: this libzmq has
    no ipc, use tcp). Under a temporary directory too long for a socket's path it is
    made in ``/tmp`` (:func:`~monarch_kernel.wire.tempdirs.make_private_dir`): the mesh
    keeps unix sockets, unencrypted and private, instead of falling back to tcp."""
    if not zmq.has("ipc"):
        return None
    path = make_private_dir("mk-mesh-", CONTROLLER_SOCKET_ROOM)
    mark_owners(path, [os.getpid()])  # swept once its owners are gone (wire.tempdirs)
    return path


def rebind(sock: zmq.Socket[bytes], addr: str) -> None:
    """Bind ``addr``, an earlier controller's; a tcp port it still holds (it is being
    told it was taken over) is retried for :data:`REBIND_TIMEOUT` seconds."""
    deadline = time.monotonic() + REBIND_TIMEOUT
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def bind(sock: zmq.Socket[bytes], host: str) -> str:
    """Bind ``host`` (a full ``tcp://``/``ipc://`` endpoint, or an address to get a
    port on); the endpoint bound."""
    if host.startswith(("ipc://", "tcp://")):
        sock.bind(host)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return f"tcp://{host}:{bind_port(sock, host)}"
