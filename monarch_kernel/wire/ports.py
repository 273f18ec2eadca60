"""The TCP ports this project's processes may listen on.

``$MONARCH_KERNEL_PORTS`` (``LOW-HIGH``, inclusive) limits every TCP listener (the
controller's sockets, the join endpoint, ranks' peer and data sockets) to a range, for
clusters whose firewalls open only those; unset, any free port is taken.

A port one process picks for another to listen on later (the rendezvous port,
``MASTER_PORT``, that a host agent picks when it starts and rank 0's ``TCPStore`` binds
at the mesh's first collective, maybe minutes later) is held meanwhile by a
:class:`PortReservation`.
"""

from __future__ import annotations

import os
import socket

import zmq

#: Environment variable with the ports processes may bind on tcp (``30000-30100``).
PORTS_ENV = "MONARCH_KERNEL_PORTS"


def port_range() -> tuple[int, int] | None:
    """The ports ``$MONARCH_KERNEL_PORTS`` (``LOW-HIGH``, inclusive) allows, if set."""
    raw = os.environ.get(PORTS_ENV, "").strip()
    if not raw:
        return None
    low, _, high = raw.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"{PORTS_ENV}={raw!r} is not a port range like 30000-30100") from None
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"{PORTS_ENV}={raw!r} is not a port range like 30000-30100")
    return lo, hi


def bind_port(sock: zmq.Socket[bytes], host: str) -> int:
    """Bind ``sock`` on ``host`` at a free port (within ``$MONARCH_KERNEL_PORTS``)."""
    ports = port_range()
    if ports is None:
        return sock.bind_to_random_port(f"tcp://{host}")
    lo, hi = ports
    for port in range(lo, hi + 1):
        try:
            sock.bind(f"tcp://{host}:{port}")
            return port
        except zmq.ZMQError:
            continue
    raise zmq.ZMQError(zmq.EADDRINUSE, f"no free port in {PORTS_ENV}={lo}-{hi}")


class PortReservation:
    """A free TCP port, kept from other programs until (and while) its user listens on it.

    A port found by binding port 0 and closing the socket is free only at that moment:
    on a busy machine the next outgoing connection, or another program's bind to port 0,
    may get it. Rank 0's store then fails with "address already in use" while the other
    ranks wait in their connect to it: the mesh's first collective never ends
    (reproduced by listening on the port; the likely cause of a hang seen once in CI).

    Held, the socket stays bound with ``SO_REUSEADDR`` and never listens. Linux then
    hands the port to no bind to port 0 and no outgoing connection (both pass over a
    port a socket was bound to) and refuses it to a bind without ``SO_REUSEADDR``, while
    a ``TCPStore`` (its server sets ``SO_REUSEADDR``, with libuv or without) binds and
    listens on it: a socket that does not listen is no conflict. The socket is not
    inherited by programs this process starts.
    """

    __slots__ = ("_sock", "port")

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", 0))
        except OSError:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        #: The port held.
        self.port: int = sock.getsockname()[1]

    def release(self) -> None:
        """Let other programs have the port again (its listener, if any, keeps it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<PortReservation {self.port}{'' if self._sock else ' released'}>"
