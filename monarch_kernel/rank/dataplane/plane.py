"""The data plane: tensors move rank to rank directly, never through the controller.

Inside a rank, :func:`share` keeps a tensor and returns a small picklable
:class:`TensorRef` (in the spirit of Monarch's RDMA buffers). The ref travels through
the controller like any value (an endpoint argument, ``%push``/``%pull``); the receiver
calls :meth:`TensorRef.get` and pulls the bytes straight from the owner.

A rank's host is its host agent (not its machine: two host agents on one box are two
hosts). Between ranks of one host:

* a contiguous CPU tensor of :data:`SHM_MIN_BYTES` or more that owns its whole storage,
  shared on a host with other ranks, has its storage moved into shared memory in place at
  :func:`share` time (torch's ``share_memory_``: one copy; the owner's tensor, and every
  view of it, then lives there), and ``get()`` maps that memory copy-on-write (through
  ``/proc/<owner pid>/fd/N``, mode 0600) without copying it and without asking the owner;
* everything else goes over the owner's data socket, a unix socket (``ipc://``) in the
  host agent's private 0700 directory: no TCP listener for other local users to reach.

Whatever the path, ``get()`` returns the owner's tensor as it is when ``get()`` runs:
the owner's in-place changes made after ``share()`` are seen (never a snapshot taken at
share time), and the receiver's copy is private (its writes never reach the owner).

Between hosts, over TCP, bound to the host's own address (never ``0.0.0.0``); a mesh of
the local backend (one machine, no CURVE) has no TCP listener at all, the ranks of a mesh
started by a multi-machine backend have one (ranks of other meshes on other machines may
fetch from them). Requests are signed with the mesh key like every
control message, and carry a random nonce and a timestamp: a replayed (or stale) request
is refused and counted (``replays_refused`` in :func:`counters`). Bytes moved are counted
per rank for the dashboard.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from monarch_kernel.rank.dataplane.client import Client, client, rank_config
from monarch_kernel.rank.dataplane.common import (
    ENCRYPT_ENV,
    NONCE_MAX,
    NONCE_WINDOW,
    SHM_DIR,
    SHM_MIN_BYTES,
    counters,
    host_addr,
    private_dir,
    socket_path,
)
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.dataplane.server import Nonces, Server

__all__ = [
    "ENCRYPT_ENV",
    "NONCE_MAX",
    "NONCE_WINDOW",
    "SHM_DIR",
    "SHM_MIN_BYTES",
    "TensorRef",
    "cleanup_shm",
    "counters",
    "host_addr",
    "private_dir",
    "share",
    "socket_path",
]

# Older names, still imported by tests.
_Nonces = Nonces
_Client = Client
_client = client

_server: Server | None = None
_init_lock = threading.Lock()


def share(tensor: Any) -> TensorRef:
    """Keep ``tensor`` in this rank and return a handle other ranks can ``get()``.

    The tensor itself is kept, not a copy: ``get()`` returns the owner's tensor as it is
    when ``get()`` runs (in-place changes made here after this call are seen, on every
    path), as a private copy. On a host with other ranks, a contiguous CPU tensor of
    :data:`SHM_MIN_BYTES` or more that owns its whole storage has that storage moved into
    shared memory now, in place (one copy; this tensor and its views then live there, and
    the storage can no longer be resized), so that ranks of this host map it without a
    copy. Other tensors are sent when asked for."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"share() takes a torch.Tensor, got {type(tensor).__name__}")
    return server().share(tensor)


def server() -> Server:
    """This process's data-plane server (made on first use)."""
    global _server
    with _init_lock:
        if _server is None:
            _server = Server(rank_config())
        return _server


def cleanup_shm(run_id: str) -> None:
    """Remove shared-memory files a mesh's ranks left behind (called by the host agent)."""
    if SHM_DIR is None:
        return
    prefix = f"mk-{run_id}-"
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
