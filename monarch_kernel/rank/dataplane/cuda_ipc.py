"""CUDA tensors between processes of one host by CUDA IPC, and staged through pinned host
memory where IPC is not used (``dataplane.transport`` decides which).

The owner answers an ``ipc`` request with :func:`describe`: what torch's
``reduce_tensor`` gives for the tensor (the ``cudaIpcMemHandle`` of its caching-allocator
block, the offsets, shape, stride, dtype, torch's ref-counter slot and interprocess
event), as plain header values (no pickle, no file descriptor), plus the GPU's UUID. It
keeps a :class:`Lease` on the tensor until the receiver says ``ipc_done``, its process is
gone, or :data:`LEASE_SECONDS` pass without a renewal. The receiver maps it
(:func:`open_mapping`, on the same GPU, found by UUID) and copies device to device into
its own memory (peer to peer if the ranks use different GPUs).

Mappings are kept (:class:`Mappings`): opening and closing a handle costs more than
copying a few hundred MiB, so the receiver keeps the owner's tensor mapped while it reads
it again and again, and drops it (telling the owner, ``ipc_done``) after
:data:`MAPPING_IDLE_SECONDS` without use, when more than :data:`MAX_MAPPINGS` are held,
or at once when the owner's process is gone. A later read of a tensor still mapped asks
the owner with the lease it holds (``have``): the owner renews the lease and synchronizes
its device, without describing the tensor again, and the receiver copies from the
mapping it has.

Stream ordering: the owner synchronizes its whole device before it answers (every stream
of its process, not only the one the serving thread sees), so the kernels that produced
the tensor have finished; torch's interprocess event, recorded by ``_share_cuda_`` and
waited for by ``rebuild_cuda_tensor``, orders the serving thread's own stream too. The
receiver synchronizes its device after the copy, before it answers its caller.

One-sided reads and writes (RDMA buffers made with ``one_sided=True``,
``monarch_kernel.rdma``): as with Monarch's RDMA, a read or write of such a buffer the
receiver has mapped goes straight to the owner's memory, with no message to the owner and
so no synchronize of the owner's device: the owner finishes its GPU work on the buffer
before it tells anyone to read it, and does not resize it. The owner publishes which of
those buffers it still offers on a :class:`Board` (a page of shared memory the receiver
maps read-only): a dropped buffer is refused from then on. A one-sided mapping asks the
owner again (renewing the lease) every :data:`RENEW_SECONDS`.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from monarch_kernel.rank.dataplane.common import counters_
from monarch_kernel.wire.osutil import pid_gone

#: How long the owner keeps a tensor for a receiver that neither acknowledged nor died
#: (each renewal starts it again).
LEASE_SECONDS = 120.0
#: A receiver drops a mapping it has not used for this long (``ipc_done`` to the owner);
#: set with ``MONARCH_KERNEL_IPC_MAPPING_IDLE_S`` in the ranks' environment.
MAPPING_IDLE_SECONDS = 10.0
IDLE_ENV = "MONARCH_KERNEL_IPC_MAPPING_IDLE_S"
#: At most this many mappings per receiving process (the least recently used goes).
MAX_MAPPINGS = 64
#: A one-sided mapping goes back to the owner (renewing its lease) after this long.
RENEW_SECONDS = LEASE_SECONDS / 4
#: How many RDMA buffers one owner's :class:`Board` offers for one-sided use at once
#: (the others are read and written with a message each).
BOARD_SLOTS = 1024


#: Seconds this process spent in each phase of its CUDA IPC transfers, and how many:
#: "describe" (the owner: device synchronize, torch's reduce_tensor), "map" (the receiver:
#: opening the handle and event), "copy" (the receiver's device copy and the wait for
#: it), "unmap" (dropping the mapping); read by bench/gpu_ipc.py to say where a
#: transfer's time goes (the rest is the request and its answer).
#: "renew" is the owner's answer to a receiver that still maps the tensor (its device
#: synchronize only).
PHASES = ("describe", "renew", "map", "copy", "unmap")
phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
phase_counts: dict[str, int] = dict.fromkeys(PHASES, 0)


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
#: ... and whether one is settled (a call's argument: a finished copy, see
#: :func:`describe`), which such a reader need not wait for the whole device for.
local_settled: Callable[[int], bool] | None = None


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
    ident: int = 0  #: the shared tensor's id (the owner's data-plane registry)
    #: where the tensor's bytes were when described (:func:`layout`): a renewal needs
    #: the same, else the receiver would copy from memory the tensor no longer uses
    layout: tuple[Any, ...] = ()


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

    def renew(
        self,
        ident: int,
        tensor: int,
        pid: int,
        layout: tuple[Any, ...] = (),
        now: float | None = None,
    ) -> bool:
        """Start lease ``ident`` of process ``pid`` again if it is held for tensor
        ``tensor`` and its bytes are where they were (``layout``); False if not. A lease of
        ``pid`` that cannot be renewed (the tensor moved) is ended: that receiver drops
        its mapping when it is not renewed."""
        now = time.monotonic() if now is None else now
        with self.lock:
            lease = self.held.get(ident)
            if lease is None or lease.pid != pid:
                return False
            if lease.ident != tensor or lease.layout != layout:
                del self.held[ident]
                return False
            lease.deadline = now + LEASE_SECONDS
            return True

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
        count = len(gone)
        for lease in gone.values():
            if not _alive(lease.pid):
                device.release(lease.ref_counter)
        gone.clear()
        device.collect()
        return count


def _alive(pid: int) -> bool:
    return not pid_gone(pid)


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


def describe(t: Any, settled: bool = False) -> dict[str, Any]:
    """Header values a process of this host maps ``t`` from (see the module's docstring);
    ``rc``: torch's ref-counter slot (for the owner's :class:`Lease`). ``settled``: ``t``
    is a copy whose making was waited for and that nothing writes (a call's argument,
    ``dataplane.cuda_args``): no device synchronize, and the receiver is told not to wait
    on the handle's event (``evs`` false; torch records it on this thread's current
    stream, where GPU work the owner queued since may be: a collective that needs the
    receiver would never finish)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    with torch.cuda.device(t.device):
        if not settled:
            torch.cuda.synchronize()  # every stream of this process: the producer finished
        _rebuild, args = reduce_tensor(t)
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
        "evs": bool(evs) and not settled,
    }


def layout(t: Any) -> tuple[Any, ...]:
    """Where ``t``'s bytes are: its storage's address, offset, shape, stride and dtype (a
    tensor given new memory, ``t.data = ...`` or a resize, changes it)."""
    return (
        t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
        str(t.dtype),
    )  # fmt: skip


class Device(Protocol):
    """The device under the IPC protocol: CUDA (:class:`CudaDevice`, the only one the
    data plane uses). A seam, so that the protocol around it (leases, renewals, kept
    mappings, the board, deaths) runs end to end on machines without a GPU with host
    shared memory behind it (``tests/ipc_host_memory.py``)."""

    def shareable(self, t: Any) -> bool:
        """Whether ``t`` can be described for another process."""
        ...

    def in_use(self) -> bool:
        """Whether this process may hold device memory to share (CUDA initialised here):
        asked before a call of the notebook's is looked through for its tensors."""
        ...

    def describe(self, t: Any, settled: bool = False) -> dict[str, Any]:
        """Header values another process opens ``t`` from (with ``rch``/``rco``, the
        counter slot :meth:`release` takes), after ``t``'s producers finished
        (``settled``: they were waited for already, see :func:`describe`)."""
        ...

    def synchronize(self, t: Any) -> None:
        """The owner's side of a renewal: ``t``'s producers finished."""
        ...

    def settle(self, t: Any) -> None:
        """``t`` was just made (a copy on the current stream): wait for that alone."""
        ...

    def open(self, h: dict[str, Any], dtype: Any) -> Any:
        """The tensor ``h`` describes, mapped here; IpcUnavailable if it cannot be."""
        ...

    def wait(self, mapped: Any) -> None:
        """The receiver's side: its copies into or out of ``mapped`` finished."""
        ...

    def release(self, ref_counter: tuple[bytes, int]) -> None:
        """Release the counter slot of a receiver that died holding it (best effort)."""
        ...

    def collect(self) -> None:
        """Free what released slots let go (best effort)."""
        ...


class CudaDevice:
    """CUDA IPC through torch (:func:`describe`, :func:`open_mapping`)."""

    def shareable(self, t: Any) -> bool:
        return bool(t.is_cuda)

    def in_use(self) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and bool(torch.cuda.is_initialized())

    def describe(self, t: Any, settled: bool = False) -> dict[str, Any]:
        return describe(t, settled)

    def settle(self, t: Any) -> None:
        """Wait until the work queued on ``t``'s current stream (its making) is done."""
        import torch

        torch.cuda.current_stream(t.device).synchronize()

    def synchronize(self, t: Any) -> None:
        import torch

        with torch.cuda.device(t.device):
            torch.cuda.synchronize()  # every stream of this process, as describe()

    def open(self, h: dict[str, Any], dtype: Any) -> Any:
        return open_mapping(h, dtype)

    def wait(self, mapped: Any) -> None:
        import torch

        torch.cuda.synchronize(mapped.device)

    def release(self, ref_counter: tuple[bytes, int]) -> None:
        import torch

        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*ref_counter)
        except (RuntimeError, AttributeError, TypeError):
            pass  # best effort, as torch's own release

    def collect(self) -> None:
        import torch

        try:
            torch.cuda.ipc_collect()
        except RuntimeError:
            pass


#: The device the protocol runs on (see :class:`Device`).
device: Device = CudaDevice()


def open_mapping(h: dict[str, Any], dtype: Any) -> Any:
    """The owner's tensor mapped into this process, on this process's index of the owner's
    GPU; IpcUnavailable if it cannot be opened (torch's counter slot for it is released
    then, as no storage holds it).

    Not ``rebuild_cuda_tensor``: that one returns a storage already open for the same
    block (its ``shared_cache``) and releases the new counter slot at once, so the
    owner's lease would name a slot nobody holds any more. Each mapping here holds its
    own slot, released when its storage goes (torch's allocator still opens a block's
    handle once per process)."""
    import torch

    try:
        device = local_device(str(h["uuid"]))
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device, h["h"], h["ss"], h["so"], h["rch"], h["rco"], h["evh"], h["evs"]
        )
    except (RuntimeError, TypeError, OSError) as exc:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(h["rch"], h["rco"])
        except (RuntimeError, TypeError, AttributeError, OSError):
            pass  # best effort: the owner's ipc_collect frees the block at its death
        if isinstance(exc, IpcUnavailable):
            raise
        raise IpcUnavailable(f"the CUDA IPC handle did not open here: {exc}") from exc
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, h["toff"], torch.Size(h["size"]), tuple(h["stride"]))


class Board:
    """The owner's page of shared memory (a memfd) saying which of its RDMA buffers are
    offered for one-sided use: slot ``k`` holds the buffer's id while it is offered, 0
    once dropped. Receivers map it read-only (:class:`BoardView`) through
    ``/proc/<owner pid>/fd/<fd>``, as the owner's shared-memory tensors."""

    def __init__(self, slots: int = BOARD_SLOTS) -> None:
        self.fd = os.memfd_create("mk-ipc-board", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 8 * slots)
        self.page = mmap.mmap(self.fd, 8 * slots)
        self.ino = os.fstat(self.fd).st_ino
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.lock = threading.Lock()
        self.slots: dict[int, int] = {}  #: buffer id -> its slot
        self.free = list(range(slots - 1, -1, -1))

    def claim(self, ident: int) -> int:
        """The slot of buffer ``ident``, claimed now if it had none; -1 when every slot
        is taken (that buffer is then used with a message each time)."""
        with self.lock:
            slot = self.slots.get(ident)
            if slot is None:
                if not self.free:
                    return -1
                slot = self.slots[ident] = self.free.pop()
                struct.pack_into("<q", self.page, 8 * slot, ident)
            return slot

    def clear(self, ident: int) -> None:
        """Buffer ``ident`` is no longer offered (dropped): receivers refuse it from now."""
        with self.lock:
            slot = self.slots.pop(ident, None)
            if slot is not None:
                struct.pack_into("<q", self.page, 8 * slot, 0)
                self.free.append(slot)


class BoardView:
    """A receiver's read-only view of an owner's :class:`Board`."""

    def __init__(self, path: str, ino: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_ino != ino:
                raise OSError(f"{path} is not the owner's board any more")
            self.page = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def offers(self, slot: int, ident: int) -> bool:
        """Whether slot ``slot`` still holds buffer ``ident`` (not dropped)."""
        if not 0 <= slot < len(self.page) // 8:
            return False
        found: int = struct.unpack_from("<q", self.page, 8 * slot)[0]
        return found == ident


#: The owner's board (made by its data-plane server for the first one-sided CUDA RDMA
#: buffer a receiver maps).
board: Board | None = None


#: What a receiver's mapping is kept under: (owner's mesh key id, owner pid, tensor id,
#: dtype).
MappingKey = tuple[str, int, int, str]


@dataclass(eq=False)
class Mapping:
    """An owner's tensor mapped in this process, kept for further reads and writes."""

    key: MappingKey
    tensor: Any  #: the mapped tensor (None once dropped)
    lease: int  #: the owner's lease on it
    owner_pid: int
    ident: int  #: the owner's tensor id
    release: Callable[[int], None]  #: tells the owner that lease is done
    board: BoardView | None = None  #: one-sided use: the owner's board and our slot
    slot: int = -1
    used: float = field(default_factory=time.monotonic)  #: last use
    renewed: float = field(default_factory=time.monotonic)  #: last answer from the owner

    def one_sided(self, now: float) -> bool:
        """Whether this mapping may be used without asking the owner: it offers it on its
        board and answered within :data:`RENEW_SECONDS`."""
        view = self.board  # (once: a drop on another thread sets it to None)
        if view is None or now - self.renewed >= RENEW_SECONDS:
            return False
        return view.offers(self.slot, self.ident)


def idle_seconds(environ: dict[str, str] | None = None) -> float:
    """:data:`MAPPING_IDLE_SECONDS`, or the environment's :data:`IDLE_ENV`."""
    text = (os.environ if environ is None else environ).get(IDLE_ENV, "").strip()
    if not text:
        return MAPPING_IDLE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < LEASE_SECONDS:
        raise ValueError(
            f"{IDLE_ENV}={text!r}: give the seconds a receiver keeps an unused CUDA IPC "
            f"mapping, from 0 to under {LEASE_SECONDS:.0f} (the owner's lease)"
        )
    return value


class Mappings:
    """A receiver's kept mappings, least recently used first. A daemon thread drops those
    idle for ``idle`` seconds, or whose owner is gone, while any is kept.

    Invariants: a mapping is in :attr:`held` until it is dropped, and dropped once (a drop
    names the mapping it means, not only its key: another thread may have kept a new one
    under that key meanwhile); its owner is told (``release``) unless its process is gone
    or it let the lease go already. :meth:`get` hands out the mapped tensor itself: a
    thread that took it copies safely even if the mapping is dropped meanwhile (the
    tensor keeps the handle open until that thread lets it go)."""

    def __init__(
        self,
        idle: float | None = None,
        limit: int = MAX_MAPPINGS,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int], bool] | None = None,
    ) -> None:
        self.idle = idle
        self.limit = limit
        self.clock = clock
        self.alive = alive or _alive
        self.held: OrderedDict[MappingKey, Mapping] = OrderedDict()
        self.lock = threading.Lock()
        self.sweeping = False

    def idle_limit(self) -> float:
        """Seconds a mapping is kept unused (read from the environment once)."""
        if self.idle is None:
            self.idle = idle_seconds()
        return self.idle

    def get(self, key: MappingKey) -> tuple[Mapping, Any] | None:
        """The mapping kept under ``key`` and its mapped tensor (marked used now)."""
        with self.lock:
            found = self.held.get(key)
            if found is None or found.tensor is None:
                return None
            self.held.move_to_end(key)
            found.used = self.clock()
            return found, found.tensor

    def put(self, mapping: Mapping) -> None:
        """Keep ``mapping`` (dropping one it replaces and the least recently used beyond
        :attr:`limit`)."""
        idle = self.idle_limit()
        with self.lock:
            out = [self.held.pop(mapping.key)] if mapping.key in self.held else []
            self.held[mapping.key] = mapping
            while len(self.held) > self.limit:
                out.append(self.held.popitem(last=False)[1])
            start = not self.sweeping
            self.sweeping = True
        for old in out:
            self._close(old, tell=True)
        if start:
            threading.Thread(
                target=self._sweep_loop, args=(min(1.0, max(idle / 2, 0.05)),),
                name="mk-ipc-mappings", daemon=True,
            ).start()  # fmt: skip

    def drop(self, key: MappingKey, tell: bool = True, mapping: Mapping | None = None) -> None:
        """Drop the mapping under ``key`` (only if it is ``mapping``, when given) if kept
        (``tell``: say so to its owner)."""
        with self.lock:
            found = self.held.get(key)
            if found is None or (mapping is not None and found is not mapping):
                return
            del self.held[key]
        self._close(found, tell)

    def drop_tensor(self, key_id: str, pid: int, ident: int) -> None:
        """Drop every mapping of the owner's tensor ``ident`` (any dtype)."""
        with self.lock:
            keys = [k for k in self.held if k[:3] == (key_id, pid, ident)]
        for key in keys:
            self.drop(key)

    def sweep(self, now: float | None = None) -> int:
        """Drop the mappings idle too long or whose owner died; how many."""
        now = self.clock() if now is None else now
        idle = self.idle_limit()
        with self.lock:
            owners = {m.key: self._alive(m.owner_pid) for m in self.held.values()}
            gone = [m for m in self.held.values() if now - m.used >= idle or not owners[m.key]]
            for m in gone:
                del self.held[m.key]
        for m in gone:
            self._close(m, tell=owners[m.key])  # (a dead owner is not written to)
        return len(gone)

    def _alive(self, pid: int) -> bool:
        """Whether the owner ``pid`` lives; True when that cannot be read (it is then
        kept, or told: a word to a dead owner's socket is dropped, harmless)."""
        try:
            return self.alive(pid)
        except Exception:
            return True

    def _close(self, m: Mapping, tell: bool) -> None:
        t0 = time.perf_counter()
        m.tensor = None  # its storage (and counter slot) goes once no copy holds it
        m.board = None
        _timed("unmap", t0)
        if tell:
            try:
                m.release(m.lease)
            except Exception:  # the owner ends the lease on its own (death, deadline)
                pass

    def _sweep_loop(self, period: float) -> None:
        while True:
            time.sleep(period)
            with self.lock:
                if not self.held:
                    self.sweeping = False
                    return
            try:
                self.sweep()
            except Exception:  # the next round tries again: the sweeper never dies
                pass


#: This process's kept mappings (the data-plane client's).
mappings = Mappings()


def map_tensor(
    key: MappingKey,
    h: dict[str, Any],
    dtype: Any,
    owner_pid: int,
    release: Callable[[int], None],
) -> Mapping:
    """The owner's tensor described by ``h`` mapped here (timed as "map"), with the
    owner's board when it offers the tensor for one-sided use."""
    t0 = time.perf_counter()
    tensor = device.open(h, dtype)
    view = None
    if isinstance(h.get("board"), str) and isinstance(h.get("bino"), int):
        try:
            view = BoardView(h["board"], h["bino"])
        except (OSError, ValueError):
            view = None  # not readable here: every use asks the owner
    _timed("map", t0)
    slot = h.get("slot")
    return Mapping(
        key, tensor, int(h["lease"]), owner_pid, key[2], release, view,
        slot if isinstance(slot, int) else -1,
    )  # fmt: skip


def copy_with(mapping: Mapping, mapped: Any, use: Callable[[Any], None]) -> None:
    """Run ``use(mapped)`` (a device copy into or out of ``mapping``'s tensor, taken from
    it by the caller) and wait for it; the mapping stays kept."""
    t0 = time.perf_counter()
    use(mapped)
    device.wait(mapped)  # the copy is done before the caller goes on
    _timed("copy", t0)
    mapping.used = time.monotonic()


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
