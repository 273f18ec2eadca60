"""This machine's addresses as other machines see them."""

from __future__ import annotations

import socket


def is_loopback(bind: str) -> bool:
    """Whether ``bind`` (a host address or a ``tcp://`` endpoint) is a loopback address."""
    host = bind.removeprefix("tcp://")
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.startswith("127.") or host in ("localhost", "::1")


def route_source(host: str, port: int = 9) -> str:
    """The local address of this machine's route to ``host`` (a name or an IPv4/IPv6
    address, brackets allowed). No packet is sent: a UDP socket is only routed. Raises
    OSError when there is no route (or the name does not resolve)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])
