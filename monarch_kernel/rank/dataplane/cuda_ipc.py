"""CUDA tensors between processes of one host by CUDA IPC, and staged through pinned host
memory where IPC is not used (``dataplane.transport`` decides which).

The owner answers an ``ipc`` request with :func:`describe`: what torch's
``reduce_tensor`` gives for the tensor (the ``cudaIpcMemHandle`` of its caching-allocator
block, the offsets, shape, stride, dtype, torch's ref-counter slot and interprocess
event), as plain header values (no pickle, no file descriptor), plus the GPU's UUID. It
keeps a :class:`Lease` on the tensor until the receiver says ``ipc_done``, its process is
gone, or :data:`LEASE_SECONDS` pass. The receiver maps it (:func:`open_mapping`:
``rebuild_cuda_tensor`` on the same GPU, found by UUID), copies device to device into its
own memory (peer to peer if the ranks use different GPUs), waits for that copy and drops
the mapping at once: its copy outlives the owner.

Stream ordering: the owner synchronizes its whole device before it describes the tensor
(every stream of its process, not only the one the serving thread sees), so the kernels
that produced the tensor have finished; torch's interprocess event, recorded by
``_share_cuda_`` and waited for by ``rebuild_cuda_tensor``, orders the serving thread's
own stream too. The receiver synchronizes its device after the copy, before it drops the
mapping and acknowledges.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.rank.dataplane.common import counters_
from monarch_kernel.wire.osutil import proc_state

#: How long the owner keeps a tensor for a receiver that neither acknowledged nor died.
LEASE_SECONDS = 120.0


#: Seconds this process spent in each phase of its CUDA IPC transfers, and how many:
#: "describe" (the owner: device synchronize, torch's reduce_tensor), "map" (the receiver:
#: opening the handle and event), "copy" (the receiver's device copy and the wait for
#: it), "unmap" (dropping the mapping); read by bench/gpu_ipc.py to say where a
#: transfer's time goes (the rest is the request and the acknowledgement).
phase_seconds: dict[str, float] = {"describe": 0.0, "map": 0.0, "copy": 0.0, "unmap": 0.0}
phase_counts: dict[str, int] = {"describe": 0, "map": 0, "copy": 0, "unmap": 0}


_phase_lock = threading.Lock()  # (the owner's serving thread and readers' threads)


def _timed(phase: str, since: float) -> float:
    now = time.perf_counter()
    with _phase_lock:
        phase_seconds[phase] += now - since
        phase_counts[phase] += 1
    return now


#: This process's own shared tensors by id (set by its data-plane server): a reader in
#: the owner's own process copies from the tensor itself (CUDA IPC does not open a handle
#: of its own process).
local_tensor: Callable[[int], Any] | None = None


class IpcUnavailable(RuntimeError):
    """CUDA IPC could not be used for this transfer (the handle did not open here, the
    GPU is not visible here ...); staging through host memory is safe instead."""


@dataclass
class Lease:
    """The owner's hold on a tensor a receiver maps."""

    tensor: Any
    pid: int  #: the receiver's process (on this machine)
    deadline: float  #: ``time.monotonic()`` after which the tensor is let go
    ref_counter: tuple[bytes, int]  #: torch's counter slot the receiver decrements


class Leases:
    """The owner's leases, by id; expired by the serving thread (:meth:`expire`)."""

    def __init__(self) -> None:
        self.held: dict[int, Lease] = {}
        self.next = 1
        self.lock = threading.Lock()

    def add(self, lease: Lease) -> int:
        with self.lock:
            ident = self.next
            self.next += 1
            self.held[ident] = lease
        return ident

    def done(self, ident: int) -> None:
        with self.lock:
            self.held.pop(ident, None)

    def expire(self, now: float | None = None) -> int:
        """Let go of the leases whose receiver died or whose deadline passed; how many.
        A receiver killed while it mapped the tensor never decremented torch's counter:
        the owner does it for it, so that the block is freed once the owner frees the
        tensor (``torch.cuda.ipc_collect`` then frees any block torch kept)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            gone = {
                i: lease
                for i, lease in self.held.items()
                if lease.deadline <= now or not _alive(lease.pid)
            }
            for i in gone:
                del self.held[i]
        if not gone:
            return 0
        import torch

        count = len(gone)
        for lease in gone.values():
            if not _alive(lease.pid):
                handle, offset = lease.ref_counter
                try:
                    torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)
                except (RuntimeError, AttributeError):
                    pass  # best effort, as torch's own release
        gone.clear()
        try:
            torch.cuda.ipc_collect()
        except RuntimeError:
            pass
        return count


def _alive(pid: int) -> bool:
    return proc_state(f"/proc/{pid}/stat") not in ("", "Z", "X")


@functools.cache
def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; IpcUnavailable if it sees none."""
    import torch

    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    raise IpcUnavailable(f"GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES)")


def describe(t: Any) -> dict[str, Any]:
    """Header values a process of this host maps ``t`` from (see the module's docstring);
    ``rc``: torch's ref-counter slot (for the owner's :class:`Lease`)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    t0 = time.perf_counter()
    with torch.cuda.device(t.device):
        torch.cuda.synchronize()  # every stream of this process: the producer finished
        _rebuild, args = reduce_tensor(t)
    _timed("describe", t0)
    (_, size, stride, offset, _, _, device, handle, nbytes, soff, _, rch, rco, evh, evs) = args
    counters_["bytes_out"] += t.numel() * t.element_size()
    return {
        "size": list(size),
        "stride": list(stride),
        "toff": int(offset),
        "dev": int(device),
        "uuid": _uuid(int(device)),
        "h": bytes(handle),
        "ss": int(nbytes),
        "so": int(soff),
        "rch": bytes(rch),
        "rco": int(rco),
        "evh": None if evh is None else bytes(evh),
        "evs": bool(evs),
    }


def open_mapping(h: dict[str, Any], dtype: Any) -> Any:
    """The owner's tensor mapped into this process (torch's ``rebuild_cuda_tensor``), on
    this process's index of the owner's GPU; IpcUnavailable if it cannot be opened."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_device(str(h["uuid"]))
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(h["size"]),
            tuple(h["stride"]),
            h["toff"],
            torch.UntypedStorage,
            dtype,
            device,
            h["h"],
            h["ss"],
            h["so"],
            False,
            h["rch"],
            h["rco"],
            h["evh"],
            h["evs"],
        )
    except (RuntimeError, TypeError, OSError) as exc:
        raise IpcUnavailable(f"the CUDA IPC handle did not open here: {exc}") from exc


def copy_from_mapping(h: dict[str, Any], dtype: Any, use: Callable[[Any], None]) -> None:
    """Map the owner's tensor, run ``use(mapped)`` (a device copy into or out of it),
    wait for it and drop the mapping."""
    import torch

    t0 = time.perf_counter()
    mapped = open_mapping(h, dtype)
    t0 = _timed("map", t0)
    try:
        use(mapped)
        torch.cuda.synchronize(mapped.device)  # the copy is done before the mapping goes
        t0 = _timed("copy", t0)
    finally:
        del mapped  # closes the handle (torch's cache holds it weakly)
        _timed("unmap", t0)


def pinned_like(shape: tuple[int, ...], dtype: Any) -> Any:
    """A pinned CPU tensor (plain where pinning fails: no CUDA driver here)."""
    import torch

    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:
        return torch.empty(shape, dtype=dtype)


def stage_to_host(t: Any) -> Any:
    """``t`` (on CUDA) copied once into pinned host memory, as uint8; counted."""
    import torch

    torch.cuda.synchronize(t.device)  # every stream of this process: the producer finished
    src = t.contiguous().view(-1).view(torch.uint8)
    out = pinned_like((src.numel(),), torch.uint8)
    out.copy_(src)  # synchronous into pinned memory
    counters_["bytes_staged"] += src.numel()
    return out
