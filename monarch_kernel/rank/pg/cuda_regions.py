"""CUDA tensors the NCCL worker uses in place, in the rank's own GPU memory (CUDA IPC).

The rank keeps its tensors; the worker (another process, with its own CUDA context on
the same GPU) maps each storage once by its IPC handle and runs NCCL on that very
memory: no copy and no host memory on the way in or out. A storage is described by
torch's own reduction of a ``uint8`` tensor covering it (``reduce_tensor``: the
``cudaIpcMemHandle`` of the caching allocator's block, the storage's offset in it, and
torch's reference counter, which keeps the block allocated in the rank while the
worker maps it, even if the user drops the tensor meanwhile).

Storages are held weakly, as in :mod:`.adopt`: one the user dropped is forgotten at
the next op and the worker unmaps it. A worker killed while it maps storages (an abort)
never gives its references back: torch then keeps those blocks until the rank ends,
which is the safe direction (the rank, the owner, outlives the worker; nothing the rank
still uses is freed under it).

Ordering: the rank synchronizes the issuing stream before it sends an op (the inputs
are written), and the worker answers only once the op's kernels finished on the GPU
(the outputs are written), so neither side ever reads memory the other is still
writing.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.rank.pg.protocol import TensorRef


@dataclass(eq=False)
class CudaEntry:
    """One CUDA storage the worker maps: ``id`` (a region id), ``nbytes``, weakly held."""

    id: int
    nbytes: int
    ref: Any  #: a StorageWeakRef
    payload: bytes  #: the pickled IPC description (sent once per worker)


class CudaStorages:
    """The rank's CUDA storages known to the worker (used under the group's lock)."""

    def __init__(self, next_id: Callable[[], int]):
        self._next_id = next_id
        self._by_ptr: dict[int, CudaEntry] = {}

    def place(self, t: Any) -> tuple[CudaEntry, int]:
        """``(region, byte offset)`` of CUDA tensor ``t`` (contiguous) in place."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        entry = self._by_ptr.get(ptr)
        if entry is not None and (entry.ref.expired() or entry.nbytes != storage.nbytes()):
            del self._by_ptr[ptr]  # freed, and the address reused: a new storage
            entry = None
        if entry is None:
            entry = CudaEntry(self._next_id(), storage.nbytes(), *_describe(storage))
            self._by_ptr[ptr] = entry
        return entry, t.storage_offset() * t.element_size()

    def forget_dropped(self) -> list[int]:
        """Forget storages the user dropped; their region ids (the worker unmaps them)."""
        gone = [p for p, e in self._by_ptr.items() if e.ref.expired()]
        return [self._by_ptr.pop(p).id for p in gone]

    def clear(self) -> None:
        self._by_ptr.clear()


def _describe(storage: Any) -> tuple[Any, bytes]:
    """``(weak reference, pickled IPC description)`` of a CUDA storage."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

    whole = torch.empty((0,), dtype=torch.uint8, device=storage.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    rebuild, args = reduce_tensor(whole)
    return StorageWeakRef(storage), pickle.dumps((rebuild, args), protocol=5)


class CudaRegion:
    """The worker's mapping of one rank storage (a ``uint8`` CUDA tensor over it)."""

    __slots__ = ("data",)

    def __init__(self, payload: bytes):
        rebuild, args = pickle.loads(payload)
        self.data: Any = rebuild(*args)

    def view(self, ref: TensorRef) -> Any:
        """The tensor ``ref`` names inside this storage."""
        import torch

        dtype = getattr(torch, ref.dtype)
        count = 1
        for d in ref.shape:
            count *= d
        nbytes = count * dtype.itemsize
        return self.data[ref.offset : ref.offset + nbytes].view(dtype).view(ref.shape)

    def close(self) -> None:
        """Drop the mapping (torch's reference counter tells the rank)."""
        self.data = None
