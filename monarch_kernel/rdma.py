"""Monarch's ``monarch.rdma`` over the data plane: :class:`RDMABuffer`.

An ``RDMABuffer(data)`` names memory of the process that made it (a rank, or the
controller): a contiguous tensor or a writable memoryview, kept in place (never copied).
It pickles into a small handle that travels like any value (an endpoint argument, a
result), and whoever holds it reads the owner's bytes with ``read_into(dst)`` or writes
them with ``write_from(src)``; both return a :class:`~monarch_kernel.calls.future.Future`
(``.get()`` or ``await``) of None. ``drop()`` ends the offer.

There is no RDMA hardware path: bytes move as :func:`monarch_kernel.share`'s do.
Within a host, a CUDA buffer read into or written from CUDA memory is mapped by CUDA IPC
and copied device to device (``rank.dataplane.cuda_ipc``; pinned host memory between
hosts, or where IPC is off or fails). The mapping is kept for the next use, which asks
the owner only to synchronize its device (a reader sees what the owner did to the buffer
before the read). A buffer made with ``RDMABuffer(t, one_sided=True)`` is used one-sided
after its first use, as Monarch's RDMA: a device copy straight from or into the owner's
memory, no message; the owner then finishes its GPU work on the buffer
(``torch.cuda.synchronize()``) before it tells anyone to read it, and does not resize it.
A dropped buffer is refused either way. A CPU buffer of ``SHM_MIN_BYTES`` or more that
owns its storage lives in shared memory from the moment it is made (its storage is moved
there in place), and readers and writers of the host copy straight from and into it
without asking the owner; anything else goes over the owner's data socket (a unix
socket on its machine, TCP or CURVE between machines), served by its ``mk-dataplane``
thread while the owner runs on. Requests are signed with the owner's mesh key and carry
a nonce, as every data-plane request. A read or write waiting for an owner on its own
machine fails at once when the owner dies (its pid); across machines after ``timeout``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from monarch_kernel.calls.future import Future
from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.client import OwnerDiedError, client, join_as_controller
from monarch_kernel.rank.dataplane.common import counters_
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.dataplane.transport import Transport

__all__ = [
    "RDMAAction",
    "RDMABuffer",
    "RDMAError",
    "get_rdma_backend",
    "is_ibverbs_available",
    "is_rdma_available",
]

#: What :func:`get_rdma_backend` and ``RDMABuffer.backend`` say.
BACKEND = "dataplane"

_pool: concurrent.futures.ThreadPoolExecutor | None = None


class RDMAError(RuntimeError):
    """A read or write of an RDMA buffer failed: dropped, owner gone, bad size."""


def is_rdma_available() -> bool:
    """Always True: buffers move over the data plane (shared memory, sockets)."""
    return True


def is_ibverbs_available() -> bool:
    """False: no ibverbs path here."""
    return False


def get_rdma_backend() -> str:
    """The transport behind :class:`RDMABuffer` (Monarch's function): always
    ``"dataplane"`` here (shared memory or sockets), never ibverbs."""
    return BACKEND


def _in_process() -> None:
    """Join the data plane from the controller's process (ranks are in it already)."""
    from monarch_kernel.rank import context

    if context.services() is None:
        join_as_controller()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    # A few threads of their own: a sync endpoint may block in .get() on the main thread
    # (each thread keeps its own sockets to the owners it talked to).
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="mk-rdma")
    return _pool


def _as_bytes(data: Any, what: str) -> Any:
    """A uint8 CPU tensor over ``data``'s memory (a contiguous tensor or memoryview)."""
    import torch

    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError(f"{what} must be a contiguous tensor")
        return data.detach().reshape(-1).view(torch.uint8)
    if isinstance(data, (memoryview, bytearray)):
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError(f"{what} must be a c-contiguous memoryview")
        if mv.readonly:
            raise ValueError(f"{what} is a read-only memoryview")
        mv = mv.cast("B")
        if not len(mv):
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mv, dtype=torch.uint8)
    raise TypeError(f"{what} must be a torch.Tensor or a memoryview, not {type(data).__name__}")


class RDMABuffer:
    """Memory of this process that other processes read and write in place."""

    def __init__(self, data: Any, *, one_sided: bool = False) -> None:
        """Offer ``data`` (kept in place). ``one_sided``: a CUDA buffer mapped by a
        reader of this host is then read and written with no message to this process
        (see the module's docstring for what the owner promises then)."""
        from monarch_kernel.rank.dataplane.plane import server

        raw = _as_bytes(data, "RDMABuffer data")
        if not raw.numel():
            raise ValueError("Cannot create RDMABuffer with size 0.")
        _in_process()
        self._ref: TensorRef = server().share(raw, writable=True, one_sided=one_sided)
        self._dropped = False

    @classmethod
    def _rebuild(cls, ref: TensorRef) -> RDMABuffer:
        buf = cls.__new__(cls)
        buf._ref, buf._dropped = ref, False
        return buf

    def __reduce__(self) -> tuple[Any, ...]:
        return (RDMABuffer._rebuild, (self._ref,))

    @property
    def backend(self) -> str:
        return BACKEND

    def size(self) -> int:
        """The buffer's size in bytes."""
        return self._ref.nbytes

    @property
    def owner(self) -> str:
        """Who holds the memory: ``rank R (pid P on MACHINE)`` or the controller."""
        ref = self._ref
        who = "the controller" if ref.owner < 0 else f"rank {ref.owner}"
        return f"{who} (pid {ref.pid} on {ref.machine})"

    def __repr__(self) -> str:
        state = ", dropped" if self._dropped else ""
        return f"RDMABuffer({self.size()} bytes, owned by {self.owner}{state})"

    # -- reads and writes ----------------------------------------------------------
    def read_into(self, dst: Any, *, timeout: int = 60) -> Future[None]:
        """Read the buffer into ``dst`` (a contiguous tensor or writable memoryview of at
        least ``size()`` bytes). A CUDA buffer into CUDA memory of its host: device to
        device by CUDA IPC; else through (pinned) host memory. A future of None."""
        self._check()
        out = _as_bytes(dst, "read_into's dst")
        if out.numel() < self.size():
            raise ValueError(
                f"read_into's dst has {out.numel()} bytes; the buffer has {self.size()}"
            )
        out = out[: self.size()]
        ref = self._ref

        def read_staged() -> None:
            import torch

            raw = out
            if out.device.type != "cpu":  # into pinned host memory, then one copy up
                raw = cuda_ipc.pinned_like((out.numel(),), torch.uint8)
            done = False
            if ref._use_shm("auto"):
                try:
                    client().read_shm(ref, raw)
                    done = True
                except PermissionError:
                    pass  # /proc/<pid>/fd of the owner not openable here: its socket
            if not done:
                client().read_socket(ref, raw, timeout)
            counters_["bytes_in"] += ref.nbytes
            if raw is not out:
                out.copy_(raw)
                if ref.cuda:
                    counters_["bytes_staged"] += ref.nbytes

        def read_ipc(mapped: Any) -> None:
            out.copy_(mapped)

        if self._ipc(out):
            return self._submit(self._by_ipc(read_ipc, read_staged, "bytes_in", timeout), "read")
        return self._submit(read_staged, "read")

    def write_from(self, src: Any, *, timeout: int = 60) -> Future[None]:
        """Write ``src`` (a contiguous tensor or memoryview of at most ``size()`` bytes)
        into the start of the buffer, in the owner's memory. A CUDA tensor into a CUDA
        buffer of its host: device to device by CUDA IPC; else through host memory. A
        future of None."""
        self._check()
        if hasattr(src, "device") and src.device.type != "cpu":
            into = _as_bytes(src, "write_from's src")
            if into.numel() > self.size():
                raise ValueError(
                    f"write_from's src has {into.numel()} bytes; the buffer has {self.size()}"
                )

            def write_ipc(mapped: Any) -> None:
                mapped[: into.numel()].copy_(into)

            if self._ipc(into):

                def staged() -> None:  # the handle did not open here
                    self._writer(memoryview(into.cpu().numpy()), timeout, staged=True)()

                return self._submit(self._by_ipc(write_ipc, staged, "bytes_out", timeout), "write")
            src = src.cpu()
            data = memoryview(_as_bytes(src, "write_from's src").numpy())
            return self._submit(self._writer(data, timeout, staged=True), "write")
        if isinstance(src, (bytes, memoryview)) and memoryview(src).readonly:
            data = memoryview(src).cast("B")  # only read from
        else:
            data = memoryview(_as_bytes(src, "write_from's src").numpy())
        if len(data) > self.size():
            raise ValueError(
                f"write_from's src has {len(data)} bytes; the buffer has {self.size()}"
            )
        return self._submit(self._writer(data, timeout), "write")

    def _writer(self, data: memoryview, timeout: float, staged: bool = False) -> Any:
        """Work that writes ``data`` (host memory) into the buffer: its shared memory
        within a host, else the owner's socket. ``staged``: the bytes came from CUDA."""
        ref = self._ref
        if len(data) > self.size():
            raise ValueError(
                f"write_from's src has {len(data)} bytes; the buffer has {self.size()}"
            )

        def write() -> None:
            if not (ref.same_host() and client().write_shm(ref, data)):
                client().write_socket(ref, data, timeout)
            counters_["bytes_out"] += len(data)
            if staged:
                counters_["bytes_staged"] += len(data)

        return write

    def drop(self) -> Future[None]:
        """End the offer: the owner forgets the buffer (its memory stays the owner's), and
        any later read or write, by any holder, raises :class:`RDMAError`."""
        if self._dropped:
            return Future._resolved(None)
        self._dropped = True
        ref = self._ref
        cuda_ipc.mappings.drop_tensor(ref.key_id, ref.pid, ref.id)  # ours, if kept
        return self._submit(lambda: client().request(ref, {"op": "release", "id": ref.id}), "drop")

    # -- helpers -------------------------------------------------------------------
    def _ipc(self, local: Any) -> bool:
        """Whether a copy between this CUDA buffer and ``local`` (a tensor here) goes by
        CUDA IPC (``rank.dataplane.transport``)."""
        import torch

        if not (self._ref.cuda and local.is_cuda):
            return False
        return self._ref.cuda_transport() is Transport.IPC and torch.cuda.is_available()

    def _by_ipc(self, use: Any, staged: Any, counter: str, timeout: float) -> Any:
        """Work that maps the buffer by CUDA IPC and runs ``use(mapped)`` (a device copy;
        ``counter`` counts its bytes); ``staged()`` instead where the handle does not
        open here."""
        import torch

        ref = self._ref

        def work() -> None:
            try:
                client().ipc_copy(ref, torch.uint8, use, timeout, one_sided=True)
            except cuda_ipc.IpcUnavailable:
                counters_["ipc_fallbacks"] += 1
                staged()
                return
            counters_[counter] += ref.nbytes

        return work

    def _check(self) -> None:
        if self._dropped:
            raise RDMAError(f"{self!r}: it was dropped and can no longer be read or written")
        _in_process()

    def _submit(self, work: Any, what: str) -> Future[None]:
        fut: Future[None] = Future()

        def run() -> None:
            try:
                work()
            except OwnerDiedError as exc:
                fut.set_exception(RDMAError(f"RDMABuffer {what} failed: {exc}"))
            except RuntimeError as exc:
                if "released or never shared" in str(exc):
                    exc = RDMAError(
                        f"{self!r} was dropped by its owner: it can no longer be read or written"
                    )
                fut.set_exception(exc)
            except BaseException as exc:  # handed to whoever waits
                fut.set_exception(exc)
            else:
                fut.set_result(None)

        _executor().submit(run)
        return fut


class RDMAAction:
    """Monarch's batched RDMA operations: not provided (use the buffer's methods)."""

    def __init__(self) -> None:
        raise NotImplementedError(
            "RDMAAction is not provided by monarch_kernel: use RDMABuffer.read_into / "
            "write_from (each returns a future; gather several with asyncio.gather)"
        )
