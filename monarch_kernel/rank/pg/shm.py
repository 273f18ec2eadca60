"""Shared-memory slots: how an op's tensors reach the process-group worker.

A slot is a ``memfd`` mapped in the rank and (once its descriptor was sent along with
an op) in the worker. An op packs all its tensors into one slot: the rank copies the
inputs in, the worker runs the collective in place, the rank copies the outputs back:
one copy each way, never a pickle of tensor data. Slots come in power-of-two sizes and
are reused; at most ``cache_bytes`` of free slots are kept.

A slot that an aborted op used is *discarded*, never reused: the killed worker may still
be writing into it for a moment.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.rank.pg.protocol import TensorRef

#: Smallest slot (bytes); every op's slot is a power of two at least this big.
MIN_SLOT = 1 << 16
#: Free slots kept for reuse, in bytes, by default.
DEFAULT_CACHE = 512 << 20


def torch_dtype(name: str) -> Any:
    """``torch.float32`` for ``"float32"``."""
    import torch

    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).rsplit(".", 1)[-1]


class Slot:
    """One shared-memory region (``fd`` stays open: new workers map it too)."""

    __slots__ = ("id", "size", "fd", "_map", "data")

    def __init__(self, slot_id: int, size: int, fd: int):
        import torch

        self.id = slot_id
        self.size = size
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        #: The whole slot as a uint8 tensor (views of it are the op's tensors).
        self.data: Any = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, ref: TensorRef) -> Any:
        """The tensor ``ref`` names inside this region."""
        dtype = torch_dtype(ref.dtype)
        count = 1
        for d in ref.shape:
            count *= d
        nbytes = count * dtype.itemsize
        return self.data[ref.offset : ref.offset + nbytes].view(dtype).view(ref.shape)

    def close(self) -> None:
        """Unmap (once no tensor views remain) and close the descriptor."""
        self.data = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive: the GC unmaps it later
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def map_slot(slot_id: int, size: int, fd: int) -> Slot:
    """Map a region (a slot, or an adopted storage) whose descriptor came from the rank
    (in the worker)."""
    return Slot(slot_id, size, fd)


class SlotPool:
    """The rank's slots: acquire one per op, release it when the op completed."""

    def __init__(self, next_id: Callable[[], int], cache_bytes: int = DEFAULT_CACHE):
        """``next_id()``: a region id never used before (slots share ids with adopted
        storages)."""
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[Slot]] = {}  # size -> free slots of that size
        self._free_bytes = 0
        self._next_id = next_id
        self._closed = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The slot size an op of ``nbytes`` gets."""
        size = MIN_SLOT
        while size < nbytes:
            size *= 2
        return size

    def acquire(self, nbytes: int) -> Slot:
        """A slot of at least ``nbytes`` (a cached one, else a new memfd)."""
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        slot_id = self._next_id()
        fd = os.memfd_create(f"mk-pg-slot-{slot_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return Slot(slot_id, size, fd)
        except BaseException:
            os.close(fd)
            raise

    def release(self, slot: Slot) -> list[int]:
        """Give ``slot`` back; returns the ids of slots dropped to keep the cache bound
        (the worker should unmap them)."""
        dropped: list[Slot] = []
        with self._lock:
            if self._closed:
                dropped.append(slot)
            else:
                self._free.setdefault(slot.size, []).append(slot)
                self._free_bytes += slot.size
                while self._free_bytes > self._cache_bytes:
                    biggest = max(s for s, slots in self._free.items() if slots)
                    victim = self._free[biggest].pop(0)
                    self._free_bytes -= victim.size
                    dropped.append(victim)
        for victim in dropped:
            victim.close()
        return [v.id for v in dropped]

    def discard(self, slot: Slot) -> None:
        """Drop ``slot`` for good (an aborted op used it)."""
        slot.close()

    def close(self) -> None:
        """Drop every free slot; slots released later are dropped too."""
        with self._lock:
            self._closed = True
            slots = [s for free in self._free.values() for s in free]
            self._free.clear()
            self._free_bytes = 0
        for slot in slots:
            slot.close()
