"""CUDA tensors in calls to ranks of the caller's own machine go by CUDA IPC.

An endpoint argument is pickled into the call's message. For a CUDA tensor that means a
copy to host memory in the caller, the bytes through the socket and a copy back onto the
device in the receiver: about 1 GB/s on an H200 (``bench/results/gpu.md``). When a rank,
or the notebook once CUDA is in use in its process (:func:`may_share`), calls ranks of its
own machine (``call``, ``call_one``, ``choose``, ``stream``: the calls that are answered),
each CUDA tensor of :data:`MIN_BYTES` or more in the arguments, at any depth, travels
instead as a data-plane handle (:class:`~.ref.TensorRef`):

* the caller copies it on its device (the value as of the call, as a pickled argument
  is: the caller may change its tensor as soon as the call returns) and shares the copy
  (``Server.share``; the notebook's process joins the data plane for it);
* the receiver, unpickling the arguments, reads the copy device to device by CUDA IPC
  (``TensorRef.get``: onto its current CUDA device, as a pickled CUDA tensor is; staged
  through pinned memory where IPC cannot be used; on its CPU where it has no CUDA), lets
  go of its mapping at once (``ipc_done``) and says it has its copy (``read_done``);
* the caller drops the copy once every receiver said so (an endpoint that runs for an
  hour does not keep it that long), or, at the latest, when the call is over: every rank
  answered or failed (a rank that dies before it read the copy cannot keep it).

Calls that are not answered (``broadcast``, ``send`` without a port) keep the pickled
path: nothing would say when the copy may be dropped. So do calls to ranks of other
machines, calls from a notebook that has not used CUDA, and tensors under
:data:`MIN_BYTES` (a handle costs a
request and a mapping, about a millisecond: the bytes' own time at about 1 MiB).
``MONARCH_KERNEL_CUDA_IPC=0`` turns it off with the rest of CUDA IPC.

Whether a tensor qualifies is the device's word (``cuda_ipc.device.shareable``), so the
tests run it on machines without a GPU with host shared memory in CUDA's place
(``tests/ipc_host_memory.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from monarch_kernel.calls.future import Future, after_all
from monarch_kernel.rank import context
from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.client import client, join_as_controller, owner_dead
from monarch_kernel.rank.dataplane.common import SHM_MIN_BYTES, counters_
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.dataplane.transport import alloc_conf, expandable_segments, ipc_enabled
from monarch_kernel.wire.peer_address import this_machine

#: CUDA tensors of at least this many bytes go as handles (smaller ones are pickled).
MIN_BYTES = SHM_MIN_BYTES


class OnMachine(Protocol):
    """A requester that can say where its ranks run (a mesh reference in a rank:
    ``actor.peer.requester.PeerRequester``)."""

    def on_machine(self, ranks: Sequence[int], machine: str) -> bool: ...


class Snapshots:
    """The copies one call's CUDA arguments were shared as, dropped once the call is
    over. :meth:`reduce` is the serializer's hook (``wire.serialize.tensors_reduced_by``).

    Invariant: every copy this shares is released by its last receiver's ``read_done``
    (``Server.read_done``) or by :meth:`release`, called when the call's last future
    completes or when the call could not be sent, whichever comes first (a release of a
    copy already released does nothing)."""

    def __init__(self, requester: OnMachine, ranks: Sequence[int]) -> None:
        self.idents: list[int] = []
        self._requester = requester
        self._ranks = ranks
        self._usable: bool | None = None  # (asked at the first large tensor only)
        #: id(tensor) -> (tensor, its reduction): each tensor is copied once per call
        self._made: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        self._lock = threading.Lock()
        self._released = False

    def usable(self) -> bool:
        """Whether handles may be sent: CUDA IPC is on and usable here, and every target
        is a process of this machine (this process a rank, or the notebook's, which
        joins the data plane to share them)."""
        if self._usable is None:
            runtime = context.services()
            machine = runtime.config.hostname if runtime is not None else this_machine()
            self._usable = (
                bool(machine) and ipc_here() and self._requester.on_machine(self._ranks, machine)
            )
        return self._usable

    def results_by_handle(self) -> bool:
        """Whether the call asks for its results' CUDA tensors as handles too (``rp``,
        ``dataplane.cuda_results``): from a rank (the notebook's results are pickled)."""
        return context.in_rank() and self.usable()

    def reduce(self, t: Any) -> tuple[Any, ...] | None:
        """``t`` as a handle on a copy of it (see the module), or None: pickled as usual.
        A tensor pickled again (the serializer's fallback to cloudpickle, or the error
        path naming an argument) gets the same handle, not another copy."""
        if not large_plain(t):  # (first: every tensor of every call from a rank comes here)
            return None
        done = self._made.get(id(t))
        if done is not None:
            return done[1]
        if not self.usable():
            return None
        ref = share_copy(t, reads=len(self._ranks))
        if ref is None:
            return None  # after all: pickled through host memory, as without
        with self._lock:
            self.idents.append(ref.id)
        counters_["ipc_arguments"] += 1
        reduced = (_received, (ref, t.requires_grad, is_parameter(t)))
        self._made[id(t)] = (t, reduced)  # (``t`` kept: its id stays its own meanwhile)
        return reduced

    def release_after(self, futures: Sequence[Future[Any]]) -> None:
        """Drop the copies once every one of ``futures`` (the call's) has completed."""
        self._made = {}  # (pickled: the call's own tensors are not kept for it)
        if self.idents:
            after_all(futures, self.release)

    def release(self) -> None:
        """Drop the copies now (a receiver that maps one keeps it until it lets go)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            idents, self.idents = self.idents, []
            self._made = {}
        if idents:
            from monarch_kernel.rank.dataplane.plane import server

            owner = server()
            for ident in idents:
                owner.release(ident)


def may_share() -> bool:
    """Whether this process looks through its calls for CUDA tensors: a rank, or the
    notebook's process once CUDA is in use there (a notebook without CUDA pays this
    check alone on its calls)."""
    return context.in_rank() or cuda_ipc.device.in_use()


def ipc_here() -> bool:
    """Whether CUDA IPC is on in this process (``MONARCH_KERNEL_CUDA_IPC``, read each
    time) and its allocator's memory can be shared (read once, as torch reads its
    allocator settings once)."""
    return ipc_enabled() and not _expandable_here()


@functools.cache
def _expandable_here() -> bool:
    return expandable_segments(alloc_conf())


def large_plain(t: Any) -> bool:
    """Whether ``t`` goes as a handle: a plain tensor (or Parameter) the device can share,
    strided, of :data:`MIN_BYTES` or more (subclasses such as DTensor keep their own
    reduction)."""
    if not cuda_ipc.device.shareable(t) or t.numel() * t.element_size() < MIN_BYTES:
        return False
    import torch

    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    return not (t.is_sparse or t.layout != torch.strided or t.is_quantized or t.is_nested)


def is_parameter(t: Any) -> bool:
    import torch

    return type(t) is torch.nn.Parameter


def share_copy(t: Any, reads: int, holder: int = 0) -> TensorRef | None:
    """A handle on a copy of ``t`` on its device, shared to be read ``reads`` times (and
    kept no longer than process ``holder`` lives, when given: ``Server.share``); None
    where no copy can be made (no room on the device, no data plane here). The copy is
    waited for on the current stream, as ``t.cpu()`` waited: it is ``t`` as it is now,
    whatever the caller queues after."""
    import torch

    from monarch_kernel.rank.dataplane.plane import server

    try:
        if not context.in_rank():
            join_as_controller()  # the notebook's process shares from a data plane of its own
        read_done.start()  # (its readers' words come to the serving thread, not this one:
        # started here all the same, so that it runs before any finalizer needs it)
        copy = t.detach().clone(memory_format=torch.contiguous_format)
        cuda_ipc.device.settle(copy)
        return server().share(copy, reads=reads, holder=holder)
    except Exception:
        return None


def read_copy(ref: TensorRef, requires_grad: bool, parameter: bool) -> Any:
    """A private copy of the tensor ``ref`` names, its mapping let go of at once (it is
    read once), with the sender's requires_grad and Parameter-ness. The reader may be
    the notebook's own process (an actor of ``this_proc()`` there): it joins the data
    plane, as for RDMA buffers."""
    import torch

    runtime = context.services()
    if runtime is None:
        join_as_controller()
    read_done.start()
    with _rank_device(runtime.config.local_rank if runtime is not None else None):
        t = ref.get()
    cuda_ipc.mappings.drop_tensor(ref.key_id, ref.pid, ref.id)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rank_device(local_rank: int | None) -> contextlib.AbstractContextManager[Any]:
    """On a thread of a rank other than its main one (the reply thread forwarding a
    result to a port, an actor loop started before CUDA was), the rank's GPU as the
    current device (CUDA's current device is per thread, device 0 where never set),
    as on its main thread (``rank.device.bind_gpu``); elsewhere nothing."""
    torch = sys.modules.get("torch")
    if (
        local_rank is None
        or torch is None
        or threading.current_thread() is threading.main_thread()
        or not torch.cuda.is_initialized()
    ):
        return contextlib.nullcontext()
    return torch.cuda.device(local_rank % torch.cuda.device_count())  # type: ignore[no-any-return]


class ReadDone:
    """Tells the owners of copies this process read, or will never read, that it is done
    with them (``read_done``), from a thread of its own: the reading thread may end
    right after (its socket, closed with it, would drop the word unsent) or be
    collecting garbage in the middle of another socket's use (an unread reply). A word
    that is lost is not an error: the owner drops the copy by its other rule.

    Started by :meth:`start` on the ordinary paths that lead to words (sharing or
    reading a copy, a rank asking for results by handle), so that :meth:`tell`, which a
    reply's finalizer calls, only queues; a forked child starts afresh."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], Sequence[TensorRef]]] = queue.SimpleQueue()
        self._pid = 0  # the process whose thread runs (none yet)
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread in this process, if it is not running."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                threading.Thread(target=self._run, name="mk-read-done", daemon=True).start()
                self._pid = os.getpid()  # (after: a start that failed is tried again)

    def tell(self, refs: Callable[[], Sequence[TensorRef]]) -> None:
        """Say ``read_done`` for each of ``refs()`` (called on the thread: it may unpickle)."""
        self._queue.put(refs)
        if self._pid != os.getpid() and not self._lock.locked():
            self.start()  # (not started on an ordinary path: cannot happen)

    def _run(self) -> None:
        while True:
            what = self._queue.get()
            try:
                refs = what()
                c = client()
            except Exception:  # (our own payloads, a data plane joined: cannot happen)
                continue
            for ref in refs:
                try:
                    if owner_dead(ref, c.machine):  # its socket is let go of: not kept
                        c.forget(ref)
                    else:
                        c.notify(ref, {"op": "read_done", "id": ref.id})
                except Exception:
                    pass


#: This process's teller (``cuda_results`` uses it too).
read_done = ReadDone()


def _received(ref: TensorRef, requires_grad: bool, parameter: bool) -> Any:
    """The receiver's side of :meth:`Snapshots.reduce`: its private copy; the caller may
    drop its own at once (``read_done``; if lost, the caller drops it when the call is
    over)."""
    t = read_copy(ref, requires_grad, parameter)
    read_done.tell(lambda: (ref,))
    return t
