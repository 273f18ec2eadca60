"""The controller's listener keypair: the one CURVE client key the TCP listeners of its
meshes' ranks admit (see ``rank.listener_gate`` for why one per controller).

Made when the first mesh whose sockets use CURVE starts, or taken over from the first
detachable mesh this kernel attaches (its ranks admit the key of the kernel that started
it, kept in the attach file with the ranks' common configuration): meshes this kernel
starts afterwards get the same key, so their ranks and the attached ones call each other.
The controller's process connects to ranks with it too (its actors, ``this_proc()``).
"""

from __future__ import annotations

import logging
import threading

import zmq

from monarch_kernel.wire import peer_address

log = logging.getLogger("monarch_kernel.controller")

_lock = threading.Lock()
_secret = ""


def mesh_key() -> str:
    """The secret (z85) to hand a mesh whose sockets use CURVE (made on first use)."""
    global _secret
    with _lock:
        if not _secret:
            _secret = zmq.curve_keypair()[1].decode()
            peer_address.set_client_key(_secret)
        return _secret


def adopt(secret: str, mesh: str) -> bool:
    """Take over ``secret``, the listener key of attached mesh ``mesh``, unless this kernel
    already has one (its own meshes admit that one). False, logged, when the keys
    differ: the attached mesh's ranks then refuse direct calls from this kernel's other
    meshes and its own actors, and those refuse the attached ranks' calls (cells, pushes
    and calls from the notebook go through the controller's sockets and still work)."""
    global _secret
    if not secret:
        return True
    with _lock:
        if not _secret:
            peer_address.set_client_key(secret)
            _secret = secret
            return True
        if _secret == secret:
            return True
    log.warning(
        "mesh %r was started by another kernel while this one had meshes of its own: "
        "its actors and this kernel's cannot call each other directly (each side's "
        "listeners admit their own kernel's listener key only)",
        mesh,
    )
    return False


__all__ = ["adopt", "mesh_key"]
