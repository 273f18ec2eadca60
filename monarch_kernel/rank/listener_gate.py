"""Who may connect to a rank's TCP listeners: the mesh's listener key, and nobody else.

A rank of a mesh that may span machines listens on TCP three times: its peer socket
(actor calls from other ranks and from the controller's actors), its reply socket (the
answers to its own calls) and, with ``MONARCH_KERNEL_ENCRYPT_DATA``, its data-plane
socket. Each is a CURVE server; without a ZAP handler any client key would complete the
handshake and get as far as the signature check. Here each runs behind one
:class:`~monarch_kernel.wire.key_gate.KeyGate` that admits the public half of
``RankConfig.listener_key`` only; a refused handshake is counted (``keys_refused`` in the
data plane's ``counters()``, so in the rank's stats) and never reaches a socket's reader.

Why one key per controller (not each host's own keypair): ranks call ranks of *other*
meshes of the same controller (a trainer mesh calling a generator mesh, callbacks the
other way), and the controller's own actors call ranks. With per-host keys every rank of
every mesh would have to learn each new host's key before that host's ranks call it
(elastic grow, a host relaunched elsewhere, a new mesh), a race on every change. The
controller instead makes one listener keypair and hands its secret to every mesh it starts
(in the ``spawn_ranks`` common part, so also to ranks that join later and to the attach
file of a detachable mesh); ranks and the controller connect with it. The trust is the
same as the mesh signing keys': a rank is told the key of every mesh it may call.
"""

from __future__ import annotations

import zmq

from monarch_kernel.rank.config import RankConfig
from monarch_kernel.wire import peer_address
from monarch_kernel.wire.key_gate import KeyGate

_gate: KeyGate | None = None


def setup(cfg: RankConfig) -> KeyGate | None:
    """At the rank's start: connect to peers with the mesh's listener key and admit only
    it on this rank's listeners. None (nothing changes) for a mesh without one (the
    local backend: unix sockets only)."""
    global _gate
    if not cfg.listener_key:
        return None
    peer_address.set_client_key(cfg.listener_key)
    _gate = KeyGate([zmq.curve_public(cfg.listener_key.encode())])
    return _gate


def gate() -> KeyGate | None:
    """The gate of this rank's TCP listeners (None outside a CURVE mesh's rank)."""
    return _gate


def refused() -> int:
    """Handshakes this rank's listeners refused (a client key other than the mesh's)."""
    return _gate.refused if _gate is not None else 0


__all__ = ["gate", "refused", "setup"]
