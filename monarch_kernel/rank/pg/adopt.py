"""Tensors the process-group worker uses in place: no copy for the buffers ops repeat.

A large contiguous tensor whose storage comes back in a later op (DDP's gradient
buckets every step, a tensor all-reduced in a loop) has its storage moved into shared
memory once, in place (``share_memory_()``, as torch's DataLoader does: every view of
it follows), and its descriptor sent to the worker, which then runs the collective on
that very memory. The first time a storage is seen it is copied (a tensor seen once is
not worth moving). Storages are held weakly: one the user dropped is forgotten at the
next op and the worker unmaps it.

Invariants: "seen again" means the *same storage object*, alive in between, seen in an
earlier op (:meth:`AdoptedStorages.begin_op`): not a new storage the allocator placed
at a freed one's address, nor the second tensor of one op on the same storage (FSDP2
all-gathers from a view of its output, into buffers it allocates afresh every step:
adopting those moved each into a new shared region every step). Every region id given
out is returned once by :meth:`AdoptedStorages.forget_dropped` when its storage is gone,
however it was found gone, so the worker unmaps it (one lost id leaked that region in
the worker for good).
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
        #: data_ptr -> (nbytes, a StorageWeakRef, the op it was seen in): storages seen
        #: once
        self._seen: OrderedDict[int, tuple[int, Any, int]] = OrderedDict()
        self._op = 0  #: the op being laid out (:meth:`begin_op`)
        #: Region ids of adopted storages found gone in :meth:`place` (for the worker).
        self._gone: list[int] = []

    def begin_op(self) -> None:
        """The tensors :meth:`place` gets from now on belong to the next op."""
        self._op += 1

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
            self._gone.append(entry.id)
            entry = None
        if entry is None:
            if not self._seen_before(ptr, storage):
                self._remember(ptr, storage)
                return None
            entry = self._adopt(storage)
            if entry is None:
                return None
        return entry, t.storage_offset() * t.element_size()

    def _seen_before(self, ptr: int, storage: Any) -> bool:
        """Whether this very storage (not one at a freed storage's address) was seen."""
        seen = self._seen.get(ptr)
        return (
            seen is not None
            and seen[0] == storage.nbytes()
            and not seen[1].expired()
            and seen[1].cdata == storage._cdata
            and seen[2] != self._op
        )

    def _remember(self, ptr: int, storage: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        if ptr in self._seen and self._seen[ptr][2] == self._op:
            return  # another tensor of this op on the same storage
        self._seen[ptr] = (storage.nbytes(), StorageWeakRef(storage), self._op)
        self._seen.move_to_end(ptr)
        while len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _adopt(self, storage: Any) -> Adopted | None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._seen.pop(storage.data_ptr(), None)  # (share_memory_ moves the data)
        try:
            if not storage.is_shared():
                storage.share_memory_()  # in place: the data moves, every view follows
            fd, size = storage._share_fd_cpu_()
        except (RuntimeError, TypeError):  # not resizable (numpy memory), other strategy
            return None
        entry = Adopted(self._next_id(), fd, int(size), StorageWeakRef(storage))
        old = self._by_ptr.get(storage.data_ptr())
        if old is not None:  # a dropped storage's address, reused by the shared copy
            self._gone.append(old.id)
        self._by_ptr[storage.data_ptr()] = entry
        return entry

    def forget_dropped(self) -> list[int]:
        """Forget storages the user dropped; their region ids (the worker unmaps them)."""
        gone = [p for p, e in self._by_ptr.items() if e.ref.expired()]
        ids = self._gone + [self._by_ptr.pop(p).id for p in gone]
        self._gone = []
        return ids

    def clear(self) -> None:
        """Forget everything (the group is destroyed)."""
        self._by_ptr.clear()
        self._seen.clear()
        self._gone = []
