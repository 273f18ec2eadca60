"""The CUDA IPC protocol (``monarch_kernel.rank.dataplane.cuda_ipc``) with host shared
memory under it, for machines without a GPU: :class:`HostMemory` is a
``cuda_ipc.Device`` whose "device memory" is a CPU tensor's storage moved into shared
memory (torch's file-descriptor strategy) and whose "handle" is that memory's
``/proc/<pid>/fd`` path, which another process maps ``MAP_SHARED``: a receiver's mapping
really is the owner's memory, as a CUDA IPC mapping is. Everything else (the requests, the
leases and their renewal, the kept mappings, the board, the sweeper, deaths) is the data
plane's own code in real rank processes. ``IpcPeer`` is the actor both sides run."""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from monarch_kernel.actor import Actor, endpoint


class HostMemory:
    """A ``cuda_ipc.Device`` over host shared memory (see the module's docstring)."""

    def __init__(self) -> None:
        self.released: list[tuple[bytes, int]] = []

    def shareable(self, t: Any) -> bool:
        return t.device.type == "cpu"

    def in_use(self) -> bool:
        return True

    def describe(self, t: Any, settled: bool = False) -> dict[str, Any]:
        fd, size = t.untyped_storage()._share_fd_cpu_()  # moved there in place, once
        return {
            "size": list(t.shape),
            "stride": list(t.stride()),
            "toff": t.storage_offset(),
            "path": f"/proc/{os.getpid()}/fd/{fd}",
            "ss": int(size),
            "rch": b"host",
            "rco": fd,
        }

    def synchronize(self, t: Any) -> None:
        pass  # a CPU tensor's producers finished when they returned

    def settle(self, t: Any) -> None:
        pass  # (the same)

    def open(self, h: dict[str, Any], dtype: Any) -> Any:
        fd = os.open(h["path"], os.O_RDWR)
        try:
            pages = mmap.mmap(fd, h["ss"], flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        flat = torch.frombuffer(pages, dtype=torch.uint8).view(dtype)
        return flat.as_strided(h["size"], h["stride"], h["toff"])

    def wait(self, mapped: Any) -> None:
        pass

    def release(self, ref_counter: tuple[bytes, int]) -> None:
        self.released.append(ref_counter)

    def collect(self) -> None:
        pass


class IpcPeer(Actor):
    """Owner and receiver of the protocol's tests (``tests/test_ipc_protocol.py``)."""

    def __init__(self) -> None:
        from monarch_kernel.rank.dataplane import cuda_ipc

        cuda_ipc.device = HostMemory()
        self.kept: dict[str, Any] = {}

    # -- the owner --------------------------------------------------------------------
    @endpoint
    def share(self, n: int):
        import monarch_kernel

        self.kept["t"] = t = torch.arange(n, dtype=torch.float32)
        return monarch_kernel.share(t)

    @endpoint
    def buffer(self, n: int, one_sided: bool):
        from monarch_kernel.rdma import RDMABuffer

        self.kept["b"] = t = torch.arange(n, dtype=torch.float32)
        self.kept["buffer"] = buffer = RDMABuffer(t, one_sided=one_sided)
        return buffer

    @endpoint
    def bump(self, key: str) -> None:
        self.kept[key].add_(1)

    @endpoint
    def owned_sum(self, key: str) -> float:
        return float(self.kept[key].double().sum())

    @endpoint
    def give_new_memory(self, ident: int, value: float) -> None:
        """The shared tensor moves to new memory (as ``resize_`` can move it)."""
        from monarch_kernel.rank.dataplane.plane import server

        t = server().tensors[ident]
        t.set_(torch.full(t.shape, value, dtype=t.dtype))

    @endpoint
    def drop_buffer(self) -> None:
        self.kept["buffer"].drop().get()

    @endpoint
    def release(self, ident: int) -> None:
        from monarch_kernel.rank.dataplane.plane import server

        server().release(ident)

    @endpoint
    def leases(self) -> int:
        from monarch_kernel.rank.dataplane.plane import server

        return len(server().leases.held)

    @endpoint
    def released_counters(self) -> int:
        from monarch_kernel.rank.dataplane import cuda_ipc

        assert isinstance(cuda_ipc.device, HostMemory)
        return len(cuda_ipc.device.released)

    # -- the receiver -----------------------------------------------------------------
    @endpoint
    def read(self, ref, one_sided: bool = False) -> float:
        """The owner's tensor (a ``TensorRef`` or an ``RDMABuffer``, whose bytes are read
        as float32) copied by the IPC protocol; its sum."""
        return _read(ref, one_sided)

    @endpoint
    def write(self, buf, value: float) -> None:
        """Fill an RDMA buffer with ``value`` (float32) through the mapping, one-sided."""
        from monarch_kernel.rank.dataplane.client import client

        ref = buf._ref
        src = torch.full((ref.nbytes // 4,), value, dtype=torch.float32).view(torch.uint8)
        client().ipc_copy(ref, torch.uint8, lambda mapped: mapped.copy_(src), one_sided=True)

    @endpoint
    def read_error(self, ref, one_sided: bool = False) -> str:
        try:
            _read(ref, one_sided)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    @endpoint
    def mappings(self) -> int:
        from monarch_kernel.rank.dataplane import cuda_ipc

        return len(cuda_ipc.mappings.held)

    @endpoint
    def set_idle(self, seconds: float) -> None:
        from monarch_kernel.rank.dataplane import cuda_ipc

        cuda_ipc.mappings.idle = seconds

    # -- both -------------------------------------------------------------------------
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def phases(self) -> dict:
        from monarch_kernel.rank.dataplane import cuda_ipc

        return dict(cuda_ipc.phase_counts)

    @endpoint
    def counters(self) -> dict:
        from monarch_kernel.rank.dataplane.plane import counters

        return counters()


def _read(ref: Any, one_sided: bool) -> float:
    from monarch_kernel.rank.dataplane.client import client

    ref = getattr(ref, "_ref", ref)  # an RDMABuffer's TensorRef
    dtype = getattr(torch, ref.dtype)
    dst = torch.empty(ref.nbytes, dtype=torch.uint8)

    def copy(mapped: Any) -> None:
        dst.view(dtype).view(mapped.shape).copy_(mapped)

    client().ipc_copy(ref, dtype, copy, one_sided=one_sided)
    return float(dst.view(torch.float32).double().sum())
