"""A handle on a tensor another rank shared (:func:`monarch_kernel.rank.dataplane.plane.share`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.client import client, rank_config
from monarch_kernel.rank.dataplane.common import SHM_DIR, counters_
from monarch_kernel.rank.dataplane.transport import Facts, Transport, choose, ipc_enabled

_TRANSPORTS = ("auto", "shm", "tcp", "ipc")


@dataclass(frozen=True)
class TensorRef:
    """A handle on a tensor held by another rank. ``get()`` pulls a copy of it.

    ``address`` is the owner's TCP data socket (empty in a mesh of one host), ``ipc``
    its unix socket for ranks of its own host, ``shm`` the path of the shared memory the
    owner's tensor lives in (empty unless it was moved there at share time) and
    ``shm_ino`` its inode (the path is a file descriptor of the owner's, which is closed
    at release: a reused descriptor is told apart by its inode)."""

    owner: int
    host: int
    address: str
    ipc: str
    shm: str
    key_id: str
    id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cuda: bool
    shm_ino: int = 0
    #: The owner's CURVE public key (z85) when its TCP data socket is encrypted.
    curve_key: str = ""
    #: The owner's machine (hostname) and its mesh's key (hex), so that a rank of
    #: another mesh of that machine can ask it (over its unix socket) too. The key
    #: travels like a mesh reference's (inside signed control messages); not shown.
    machine: str = ""
    mesh_key: str = field(default="", repr=False)
    #: The owner's process id: a reader on its machine notices at once that it died.
    pid: int = 0
    #: The owner's CUDA allocator settings (a CUDA tensor's): whether IPC may be tried.
    alloc_conf: str = ""

    def get(self, transport: str = "auto") -> Any:
        """A new tensor with the owner's data as it is now (on this rank's CUDA device if
        it has one and the source was on CUDA); a private copy. ``transport``: ``auto``,
        ``shm`` (ranks of one host only), ``tcp`` (the owner's data socket: unix socket
        on the same host, TCP from another) or ``ipc`` (a CUDA tensor of a rank of this
        host, copied device to device; an error where that cannot be). A CUDA tensor
        read by a rank with CUDA comes by CUDA IPC within a host (``auto``), else through
        pinned host memory (``dataplane.transport``)."""
        import torch

        dtype = getattr(torch, self.dtype)
        if self.cuda and self.cuda_transport(transport) is not Transport.HOST_BYTES:
            out = torch.empty(self.shape, dtype=dtype, device=_this_device())
            return self.read_into(out, transport)
        raw = None
        if self.nbytes and self._use_shm(transport):
            # Same host: map the owner's shared memory privately (copy-on-write), no
            # copy. The mapping outlives the owner's release of it.
            try:
                raw = client().map_shm(self)
            except PermissionError:
                if transport == "shm":
                    raise
                # /proc/<pid>/fd of the owner not openable here: its socket, same data
        if raw is not None:
            dst = raw.view(dtype).reshape(self.shape)
            counters_["bytes_in"] += self.nbytes
        else:
            dst = torch.empty(self.shape, dtype=dtype)
            self.read_into(dst, transport)
        return dst  # on the CPU: a CUDA tensor read where there is no CUDA stays here

    def read_into(self, dst: Any, transport: str = "auto") -> Any:
        """Copy the owner's data into ``dst`` (a contiguous tensor of the same size)."""
        import torch

        if dst.numel() * dst.element_size() != self.nbytes or not dst.is_contiguous():
            raise ValueError(
                f"read_into needs a contiguous tensor of {self.nbytes} bytes "
                f"(shape {self.shape}, {self.dtype}); got {tuple(dst.shape)} {dst.dtype}"
            )
        if self.cuda and dst.is_cuda:
            how = self.cuda_transport(transport)
            if how is Transport.IPC:
                try:
                    self._read_ipc(dst)
                    return dst
                except cuda_ipc.IpcUnavailable as exc:
                    if transport == "ipc":
                        raise
                    counters_["ipc_fallbacks"] += 1
                    warnings.warn(
                        f"CUDA IPC from rank {self.owner} failed ({exc}); staged through "
                        "pinned host memory instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                transport = "auto"
        use_shm = self._use_shm(transport)
        if dst.device.type == "cpu":
            target = dst
        else:  # into pinned host memory, then onto the device in one copy
            target = cuda_ipc.pinned_like(tuple(dst.shape), dst.dtype)
            if self.cuda:
                counters_["bytes_staged"] += self.nbytes
        raw = target.view(-1).view(torch.uint8) if self.nbytes else None
        if raw is not None:
            if use_shm:
                try:
                    client().read_shm(self, raw)
                except PermissionError:
                    if transport == "shm":
                        raise
                    use_shm = False  # the owner's socket then: the same data
            if not use_shm:
                client().read_socket(self, raw)
            counters_["bytes_in"] += self.nbytes
        if target is not dst:
            dst.copy_(target)
        return dst

    def cuda_transport(self, transport: str = "auto") -> Transport:
        """How this CUDA tensor reaches this process (``dataplane.transport.choose``):
        an explicit ``shm``/``tcp`` stages it, ``ipc`` is an error where IPC is not
        possible."""
        import torch

        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be auto, shm, tcp or ipc, not {transport!r}")
        facts = self.facts(torch.cuda.is_available())
        how = choose(facts)
        if transport == "ipc" and how is not Transport.IPC:
            raise ValueError(
                f"CUDA IPC is not possible for tensor {self.id} of rank {self.owner}: {facts}"
            )
        if transport in ("shm", "tcp") and how is Transport.IPC:
            return Transport.STAGED_PINNED
        return how

    def facts(self, receiver_cuda: bool) -> Facts:
        """What ``dataplane.transport.choose`` needs to know of a read of this tensor
        here."""
        return Facts(
            same_host=self.same_host(),
            owner_device="cuda" if self.cuda else "cpu",
            receiver_cuda=receiver_cuda,
            alloc_conf=self.alloc_conf,
            ipc_enabled=ipc_enabled(),
        )

    def _read_ipc(self, dst: Any) -> None:
        """Copy the owner's CUDA tensor into ``dst`` (CUDA) by CUDA IPC."""
        import torch

        if not self.nbytes:
            return
        dtype = getattr(torch, self.dtype)

        def copy(mapped: Any) -> None:
            if dst.dtype == mapped.dtype and dst.numel() == mapped.numel():
                dst.view(mapped.shape).copy_(mapped)  # strided source: no temporary
            else:
                src = mapped.contiguous().view(-1).view(torch.uint8)
                dst.view(-1).view(torch.uint8).copy_(src)

        client().ipc_copy(self, dtype, copy)
        counters_["bytes_in"] += self.nbytes

    def same_host(self) -> bool:
        """Whether the owner is a rank of this rank's host (host agent), or a rank of
        another mesh on this machine (reached over its unix socket as well)."""
        cfg = rank_config()
        if self.key_id == cfg.run_id:
            return self.host == cfg.host
        return bool(self.machine) and self.machine == cfg.hostname

    def _use_shm(self, transport: str) -> bool:
        """Whether to go through shared memory; an error if it was asked for and cannot."""
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be auto, shm, tcp or ipc, not {transport!r}")
        if transport == "ipc":
            raise ValueError(
                f"transport='ipc' is for CUDA tensors read into CUDA memory; tensor "
                f"{self.id} of rank {self.owner} is {'on CUDA' if self.cuda else 'on the CPU'}"
            )
        if transport == "tcp":
            return False
        local = SHM_DIR is not None and self.same_host()
        if transport == "shm" and not local:
            raise ValueError(
                f"rank {self.owner} is on another host (host {self.host}); shared memory "
                "is only used between ranks of one host, use transport='tcp'"
            )
        # auto: only where the owner's tensor lives in shared memory (else its socket)
        return local and (transport == "shm" or bool(self.shm))

    def release(self) -> None:
        """Tell the owner it may drop the tensor (its shared memory is no longer offered;
        the owner's tensor itself stays where it is)."""
        cuda_ipc.mappings.drop_tensor(self.key_id, self.pid, self.id)  # ours, if kept
        client().request(self, {"op": "release", "id": self.id})


def _this_device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device())
