"""Where a process is reached by its peers: a unix socket on its own machine and, for
other machines, a CURVE-encrypted TCP socket.

Ranks take actor calls from other ranks, and callers take the replies, on sockets they
bind themselves (not through the controller). A :class:`PeerAddress` names such a socket
for every machine: :func:`bind` makes one and :func:`connect` reaches one, choosing the
unix socket from the same machine (no encryption: the socket lives in a 0700 directory)
and TCP with CURVE from another (the address carries the listener's public key).

Invariants (relied on by :func:`bind`):

* libzmq copies a socket's options into each endpoint when it is bound or connected, so
  one socket can be a plain unix listener, a CURVE server on TCP and a CURVE client of
  the controller at once, provided each is set up in that order with its own options.
* A rank's TCP peer listener admits only the CURVE client keys of its :class:`KeyGate`
  (ZAP; see ``rank.listener_gate``): a connection with any other key is refused in the
  handshake, before a frame of it is read. Every client connects with this process's
  client keypair (:func:`set_client_key`: a rank's mesh gives it one). Admission to
  what a message may do is still the signed, nonce'd message (``Codec``).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from monarch_kernel.wire.key_gate import KeyGate, guard
from monarch_kernel.wire.ports import bind_port

#: Heartbeats on TCP peer connections: a machine that vanishes (no RST) is noticed in
#: about ``PEER_HEARTBEAT_TIMEOUT_MS`` and the connection's calls fail.
PEER_HEARTBEAT_IVL_MS = 1000
PEER_HEARTBEAT_TIMEOUT_MS = 4000


@dataclass(frozen=True)
class PeerAddress:
    """How to reach one process's peer socket."""

    machine: str  #: the hostname of the machine it runs on
    ipc: str = ""  #: ``ipc://`` address, usable on ``machine`` only ("" if none)
    tcp: str = ""  #: ``tcp://host:port`` for other machines ("" if it takes none)
    curve: str = ""  #: the TCP listener's CURVE public key (z85)

    def encode(self) -> list[str]:
        """As a header value (see ``wire.kinds``: ``pa``, ``rt``, ``oa``)."""
        return [self.machine, self.ipc, self.tcp, self.curve]

    @classmethod
    def decode(cls, value: object) -> PeerAddress:
        """The inverse of :meth:`encode` (ValueError for anything else)."""
        if (
            isinstance(value, (list, tuple))
            and len(value) == 4
            and all(isinstance(v, str) for v in value)
        ):
            return cls(*value)
        raise ValueError(f"not a peer address: {value!r}")

    def __bool__(self) -> bool:
        return bool(self.ipc or self.tcp)

    @property
    def tcp_host(self) -> str:
        """The host of :attr:`tcp` ("" if it takes no TCP)."""
        return self.tcp.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")

    @property
    def tcp_port(self) -> int:
        """The port of :attr:`tcp` (0 if it takes no TCP)."""
        return int(self.tcp.rsplit(":", 1)[1]) if self.tcp else 0

    def route(self, here: str | None = None) -> str:
        """The address to connect to from machine ``here`` (default: this one).

        Raises :class:`ConnectionError` saying why when there is none: a process that
        listens on its own machine only, called from another."""
        here = here or this_machine()
        if self.machine == here and self.ipc:
            return self.ipc
        if self.tcp:
            return self.tcp
        raise ConnectionError(
            f"it runs on machine {self.machine!r} and listens there only (a mesh started "
            f"by the local backend); this is {here!r}. Start it with a multi-machine "
            "backend (join, ray, slurm, lightning) to reach it from other machines"
        )


@dataclass(frozen=True)
class RankLocation:
    """Where a rank of a mesh is now, as the mesh's controller knows it: the answer a
    process holding an old reference gets when it asks (the rank may have restarted on
    a host agent relaunched elsewhere since the reference was made)."""

    address: PeerAddress  #: its peer address now (false when it is not running)
    incarnation: int  #: how many times it was restarted
    alive: bool
    why: str = ""  #: when not alive: why (its death, or its mesh stopped), a sentence


def this_machine() -> str:
    """This machine's name as peer addresses carry it: its hostname (what ranks report
    in ``ready`` and the controller records)."""
    return socket.gethostname()


def bind(
    sock: zmq.Socket[bytes],
    ipc_path: str,
    tcp_host: str = "",
    machine: str = "",
    zap_domain: str = "",
    secret: str = "",
    port: int = 0,
    gate: KeyGate | None = None,
) -> PeerAddress:
    """Bind ``sock`` for peers: plain on the unix socket ``ipc_path``, and a CURVE server
    on a TCP port of ``tcp_host`` when it is given: with the keypair of ``secret`` (z85;
    a fresh one if empty), on ``port`` if it is free, else on a free port (within
    ``$MONARCH_KERNEL_PORTS``). A rank restarted with its previous ``secret`` and
    ``port`` is reached again by references to it made before the restart.
    ``zap_domain``: where the process runs a ZAP handler (the controller), the domain
    under which it admits any client key. ``gate``: admit only its client keys (a
    rank; ``zap_domain`` then names the gate's domain, default :data:`GATE_DOMAIN`).

    Must run before any other CURVE option is set on ``sock`` (see the module's
    invariants); leaves the socket with no security mechanism set, so the caller then
    configures its own connections as it likes."""
    ipc = f"ipc://{ipc_path}"
    sock.bind(ipc)
    tcp = public = ""
    if tcp_host:
        if secret:
            keys = zmq.curve_public(secret.encode()), secret.encode()
        else:
            keys = zmq.curve_keypair()
        pub = keys[0]
        if gate is not None:
            guard(sock, keys[1].decode(), gate, zap_domain or GATE_DOMAIN)
        else:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
            if zap_domain:
                sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())
        host = f"[{tcp_host}]" if ":" in tcp_host else tcp_host
        try:
            if not port:
                raise zmq.ZMQError(zmq.EADDRINUSE)
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:  # taken meanwhile (or none asked for): any free one
            port = bind_port(sock, host)
        sock.setsockopt(zmq.CURVE_SERVER, 0)  # back to NULL for what comes next
        tcp, public = f"tcp://{host}:{port}", pub.decode()
    return PeerAddress(machine or this_machine(), ipc, tcp, public)


#: The ZAP domain of a rank's gated TCP listeners (peer socket, reply socket, data plane).
GATE_DOMAIN = "mk-rank-peers"

_keys: tuple[bytes, bytes] | None = None
_keys_lock = threading.Lock()


def set_client_key(secret: str) -> None:
    """From now on connect to peers with the CURVE keypair of ``secret`` (z85): the one
    the listeners admit (a rank: its mesh's listener key; the controller: the key it hands
    its meshes). Connections already made keep the key they were made with."""
    global _keys
    raw = secret.encode()
    public = zmq.curve_public(raw)  # ValueError for a key that is not one
    with _keys_lock:
        _keys = (public, raw)


def client_keys() -> tuple[bytes, bytes]:
    """This process's CURVE client keypair (public, secret; z85) for peer connections:
    the one set by :func:`set_client_key`, else a throw-away one made on first use
    (admitted only by listeners that admit any key)."""
    global _keys
    with _keys_lock:
        if _keys is None:
            _keys = zmq.curve_keypair()
        return _keys


def connect(sock: zmq.Socket[bytes], addr: PeerAddress, here: str | None = None) -> str:
    """Connect ``sock`` to ``addr`` (see :meth:`PeerAddress.route`); over TCP as a CURVE
    client of its listener, with heartbeats. Returns the address connected to."""
    route = addr.route(here)
    if route.startswith("tcp://"):
        if not addr.curve:
            raise ConnectionError(f"peer address {route} has no CURVE key: refusing plain TCP")
        public, secret = client_keys()
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, addr.curve.encode())
        sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_HEARTBEAT_TIMEOUT_MS)
    sock.connect(route)
    return route


def open_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    addr: PeerAddress,
    linger_ms: int,
    send_timeout_ms: int = -1,
    here: str | None = None,
) -> zmq.Socket[bytes]:
    """A new socket of ``kind`` connected to ``addr`` (see :func:`connect`); closed
    again, and the error raised, when ``addr`` cannot be reached from here."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    try:
        connect(sock, addr, here)
    except BaseException:
        sock.close(0)
        raise
    opened: zmq.Socket[Any] = sock
    return opened


__all__ = [
    "GATE_DOMAIN",
    "PeerAddress",
    "RankLocation",
    "bind",
    "client_keys",
    "connect",
    "open_socket",
    "set_client_key",
    "this_machine",
]
