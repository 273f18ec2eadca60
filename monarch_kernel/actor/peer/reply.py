"""The reply socket of a process's :class:`~monarch_kernel.actor.peer.client.PeerClient`:
where it listens (a unix socket in a 0700 directory and, where ranks of other machines
may answer, a CURVE TCP socket) and how the controller admits any client key on it."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys

from monarch_kernel.rank import context
from monarch_kernel.wire import peer_address
from monarch_kernel.wire.netaddr import route_source
from monarch_kernel.wire.tempdirs import PEER_PREFIX, make_private_dir, mark_owners


def reply_path() -> str:
    """A unix socket path for replies, in a 0700 directory (only we can connect): in a
    rank the host agent's private one (removed with the agent), else a private one of
    this process's, removed at exit (and swept if it is killed). Either leaves room for
    a socket's name under a long ``$TMPDIR`` (``wire.tempdirs.make_private_dir``)."""
    rt = context.services()
    if rt is not None:
        from monarch_kernel.rank.dataplane.common import socket_path

        path = socket_path(rt.config, f"c{rt.rank}-{os.getpid()}")
        atexit.register(_unlink, path)
        return path
    d = make_private_dir(PEER_PREFIX, len("/r"))
    mark_owners(d, [os.getpid()])
    atexit.register(shutil.rmtree, d, True)
    return os.path.join(d, "r")


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def reply_tcp_host() -> str:
    """The address this process takes replies from other machines on ("" if none).

    In a rank of a mesh that spans machines: the address its own peer socket listens
    on. In the controller: the local address of the route to the machine of a rank that
    listens on TCP (a mesh of another machine), if there is one when the client is made
    (see ``peer.client.client``)."""
    rt = context.services()
    if rt is not None:
        return rt.peer.tcp_host
    # In the controller (a rank never loads it): its meshes, if it has started any.
    registry_module = sys.modules.get("monarch_kernel.controller.mesh")
    if registry_module is None:
        return ""
    for mesh in registry_module.registry.live():
        for info in mesh.ranks:
            if info.peer.tcp and info.peer.machine != peer_address.this_machine():
                try:
                    return route_source(info.peer.tcp_host)
                except OSError:
                    continue
    return ""


#: The ZAP domain of the controller's reply socket (see :func:`admit_any_key`).
REPLY_ZAP_DOMAIN = "mk-peer-replies"


class _AnyKey:
    """ZAP provider admitting every CURVE client key on the controller's own reply and
    peer sockets (admission there is the signed message; the key only encrypts)."""

    def callback(self, domain: str, key: bytes) -> bool:
        return True


def admit_any_key() -> str:
    """The controller runs a ZAP handler for its meshes' sockets, which refuses keys of
    domains it does not know: register the reply socket's domain with it (loaded with the
    meshes of other machines this is for; never in a rank)."""
    launchers = sys.modules.get("monarch_kernel.launchers.base")
    if launchers is None:
        return ""
    launchers.zap(REPLY_ZAP_DOMAIN, _AnyKey())
    return REPLY_ZAP_DOMAIN


__all__ = ["REPLY_ZAP_DOMAIN", "admit_any_key", "reply_path", "reply_tcp_host"]
