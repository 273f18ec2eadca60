"""The TCP ports this project's processes may listen on.

``$MONARCH_KERNEL_PORTS`` (``LOW-HIGH``, inclusive) limits every TCP listener (the
controller's sockets, the join endpoint, ranks' peer and data sockets) to a range, for
clusters whose firewalls open only those; unset, any free port is taken.
"""

from __future__ import annotations

import os

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
