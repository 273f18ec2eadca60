"""Tensors the process-group worker uses in place: no copy for the buffers ops repeat.

A large contiguous tensor whose storage comes back in a later op (DDP's gradient
buckets every step, a tensor all-reduced in a loop) has its storage moved into shared
memory once, in place (``share_memory_()``, as torch's DataLoader does: every view of
it follows), and its descriptor sent to the worker, which then runs the collective on
that very memory. The first time a storage is seen it is copied (a tensor seen once is
not worth moving). Storages are held weakly: one the user dropped is forgotten at the
next op and the worker unmaps it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Smaller tensors are copied (a copy costs less than a region of their own).
ADOPT_MIN_BYTES = 1 << 20
#: Storages remembered as seen once (a second sighting adopts them).
SEEN_LIMIT = 256


@dataclass(eq=False)
class Adopted:
    """One storage the worker maps: ``id`` (a region id), its descriptor and size."""

    id: int
    fd: int
    size: int
    ref: Any  #: a StorageWeakRef: the storage itself stays the user's


class AdoptedStorages:
    """The rank's adopted storages (used under the group's lock)."""

    def __init__(self, next_id: Callable[[], int]):
        self._next_id = next_id
        self._by_ptr: dict[int, Adopted] = {}
        self._seen: OrderedDict[int, int] = OrderedDict()  # data_ptr -> nbytes

    def place(self, t: Any) -> tuple[Adopted, int] | None:
        """``(region, byte offset)`` where the worker finds ``t`` in place, or None: copy
        it (small, strided, or seen for the first time)."""
        nbytes = t.numel() * t.element_size()
        if nbytes < ADOPT_MIN_BYTES or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        entry = self._by_ptr.get(ptr)
        if entry is not None and (entry.ref.expired() or entry.size != storage.nbytes()):
            del self._by_ptr[ptr]  # freed, and the address reused: a new storage
            entry = None
        if entry is None:
            if self._seen.get(ptr) != storage.nbytes():
                self._remember(ptr, storage.nbytes())
                return None
            entry = self._adopt(storage)
            if entry is None:
                return None
        return entry, t.storage_offset() * t.element_size()

    def _remember(self, ptr: int, nbytes: int) -> None:
        self._seen[ptr] = nbytes
        self._seen.move_to_end(ptr)
        while len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _adopt(self, storage: Any) -> Adopted | None:
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            if not storage.is_shared():
                storage.share_memory_()  # in place: the data moves, every view follows
            fd, size = storage._share_fd_cpu_()
        except (RuntimeError, TypeError):  # not resizable (numpy memory), other strategy
            return None
        entry = Adopted(self._next_id(), fd, int(size), StorageWeakRef(storage))
        self._seen.pop(storage.data_ptr(), None)
        self._by_ptr[storage.data_ptr()] = entry
        return entry

    def forget_dropped(self) -> list[int]:
        """Forget storages the user dropped; their region ids (the worker unmaps them)."""
        gone = [p for p, e in self._by_ptr.items() if e.ref.expired()]
        return [self._by_ptr.pop(p).id for p in gone]

    def clear(self) -> None:
        """Forget everything (the group is destroyed)."""
        self._by_ptr.clear()
        self._seen.clear()
