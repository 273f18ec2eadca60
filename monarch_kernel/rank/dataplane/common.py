"""What both sides of the data plane share: limits, byte counters, where its sockets
live (the host agent's private directory) and the address other hosts reach."""

from __future__ import annotations

import atexit
import os
import shutil
from typing import Protocol

from monarch_kernel.rank import listener_gate
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.wire.netaddr import is_loopback, route_source
from monarch_kernel.wire.tempdirs import (
    DATAPLANE_PREFIX,
    SOCKET_NAME_ROOM,
    SOCKET_PATH_MAX,
    make_private_dir,
    mark_owners,
)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: CPU tensors this size or larger are placed in shared memory at ``share()`` time (when
#: the host has other ranks) and ``auto`` gets them through it; smaller ones go over the
#: data socket (a shared-memory file costs more than it saves there).
SHM_MIN_BYTES = 1024 * 1024
#: Set to 1 in the ranks' environment (``%mesh ... --env MONARCH_KERNEL_ENCRYPT_DATA=1``)
#: to encrypt rank-to-rank tensors between hosts with CurveZMQ (2-3x slower for big
#: tensors on this kind of machine). Requests are signed and carry a nonce either way.
ENCRYPT_ENV = "MONARCH_KERNEL_ENCRYPT_DATA"
#: A request older than this (by the sender's clock) is refused; its nonce is remembered
#: this long, and at most :data:`NONCE_MAX` nonces are.
NONCE_WINDOW = 120.0
NONCE_MAX = 65536
#: ``requests_rejected``: requests dropped unsigned or forged (not replays).
#: ``bytes_ipc``: bytes of CUDA tensors this rank read or wrote by CUDA IPC (device to
#: device); ``bytes_staged``: bytes of CUDA tensors that went through its host memory
#: (either side; 0 while every CUDA transfer is by IPC); ``ipc_fallbacks``: transfers
#: that tried IPC and were staged instead; ``ipc_one_sided``: reads and writes of RDMA
#: buffers by CUDA IPC that needed no message to the owner (a kept mapping);
#: ``ipc_arguments``: CUDA tensors this rank sent in calls to ranks of its machine as
#: data-plane handles instead of pickled bytes (``dataplane.cuda_args``);
#: ``ipc_results``: the same for the results it sent back to ranks of its machine
#: (``dataplane.cuda_results``).
counters_ = {
    "bytes_out": 0,
    "bytes_in": 0,
    "replays_refused": 0,
    "requests_rejected": 0,
    "bytes_ipc": 0,
    "bytes_staged": 0,
    "ipc_fallbacks": 0,
    "ipc_one_sided": 0,
    "ipc_arguments": 0,
    "ipc_results": 0,
}


class SharedTensor(Protocol):
    """What the data-plane client reads of a ``TensorRef`` (``dataplane.ref``), which
    uses the client: named here so that neither module imports the other's."""

    @property
    def owner(self) -> int: ...

    @property
    def address(self) -> str: ...

    @property
    def ipc(self) -> str: ...

    @property
    def shm(self) -> str: ...

    @property
    def shm_ino(self) -> int: ...

    @property
    def key_id(self) -> str: ...

    @property
    def id(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def curve_key(self) -> str: ...

    @property
    def machine(self) -> str: ...

    @property
    def mesh_key(self) -> str: ...

    @property
    def pid(self) -> int: ...

    def same_host(self) -> bool: ...


def counters() -> dict[str, int]:
    """Bytes this rank served to and pulled from other ranks over the data plane, how
    many replayed or stale requests and how many forged ones it refused, and how many
    connections its TCP listeners refused in the handshake (``keys_refused``: a client
    key other than the mesh's listener key, see ``rank.listener_gate``)."""
    return {**counters_, "keys_refused": listener_gate.refused()}


def private_dir(cfg: RankConfig) -> str:
    """The host agent's private 0700 directory (where rank logs live), else our own
    (:func:`own_dir`)."""
    log = cfg.log
    if log:
        d = os.path.dirname(log)
        st = os.stat(d)
        if st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
            return d
    return own_dir()


def socket_path(cfg: RankConfig, name: str) -> str:
    """Where this rank's unix socket ``name`` goes: in :func:`private_dir`, or in our
    own directory when that path would be too long for a unix socket (a host agent's
    directory deep in a long ``$TMPDIR``)."""
    path = os.path.join(private_dir(cfg), name)
    if len(path) <= SOCKET_PATH_MAX:
        return path
    return os.path.join(own_dir(), name)


def own_dir() -> str:
    """This rank's own private 0700 directory ``mk-dp-*``, made once: in the temporary
    directory, or in ``/tmp`` where that leaves no room for a socket's name
    (:func:`~monarch_kernel.wire.tempdirs.make_private_dir`). Removed at exit, and
    swept by the next kernel or host agent if this process is killed."""
    global _own_dir
    if _own_dir is None:
        _own_dir = make_private_dir(DATAPLANE_PREFIX, SOCKET_NAME_ROOM)
        mark_owners(_own_dir, [os.getpid()])
        atexit.register(shutil.rmtree, _own_dir, True)
    return _own_dir


_own_dir: str | None = None


def host_addr(cfg: RankConfig) -> str:
    """The address this host is reached at by the others: the local address of the
    route to the controller (loopback if it is on this box)."""
    peer = ""
    recv = cfg.recv
    if recv.startswith("tcp://"):
        peer = recv[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    elif cfg.master_addr:
        peer = cfg.master_addr
    if not peer or is_loopback(peer):
        return "127.0.0.1"
    return route_source(peer)


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd``."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def read_all(fd: int, out: memoryview) -> None:
    """Fill ``out`` from ``fd``; EOFError if it ends first."""
    done = 0
    while done < len(out):
        n = os.readv(fd, [out[done:]])
        if n == 0:
            raise EOFError("shared-memory copy is shorter than the tensor")
        done += n
