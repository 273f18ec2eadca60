"""What a host agent asks of this machine's network: the interface that owns an
address, and the local address of the route to the controller."""

from __future__ import annotations

from monarch_kernel.wire.netaddr import route_source


def interface_of(addr: str) -> str | None:
    """The name of the network interface that owns IPv4/IPv6 address ``addr``."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return str(name)
    return None


def source_address(url: str) -> str:
    """The local address this machine uses to reach ``tcp://HOST:PORT`` (no packet is
    sent: a UDP socket is only routed)."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return route_source(host, int(port))


__all__ = ["interface_of", "source_address"]
