"""The process-group worker: a disposable process that holds a real gloo group (and,
for an ``nccl`` group, a real NCCL group beside it for CUDA tensors).

It runs :func:`serve` on its end of a SOCK_SEQPACKET socket (see :mod:`.protocol`):
join a rendezvous once (:class:`~.protocol.Configure`), then start each
:class:`~.protocol.OpRequest` on its gloo group and report :class:`~.protocol.Done`
or :class:`~.protocol.Failed` from the completion callback (gloo's own threads).
The main loop never blocks in a collective, so the socket closing (the rank aborting
the group, or dying) ends the worker at once, whatever its collectives are doing.

NCCL ops (any CUDA tensor in the op) are enqueued on the NCCL group; the main loop makes
its stream wait for the op and records a CUDA event after it, and a completion thread
waits for that event (the kernels finished on the GPU) before it reports Done. A hung
NCCL kernel (a dead peer) therefore blocks only that thread: killing the worker frees
its context, communicators and kernels, and NCCL's watchdog, should it fire, takes down
this worker and never the rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from monarch_kernel.rank.pg.cuda_regions import CudaRegion
from monarch_kernel.rank.pg.malloc import SHARDING_METHODS, pin_mmap_threshold
from monarch_kernel.rank.pg.protocol import (
    MAX_FDS,
    MAX_MESSAGE,
    ConfigFailed,
    Configure,
    Done,
    Failed,
    OpRequest,
    Ready,
    TensorRef,
    Unmap,
    decode_options,
    error_text,
)
from monarch_kernel.rank.pg.shm import Slot, map_slot

#: Prefix of an OpRequest method that runs a per-tensor op over pairs of tensors (the
#: ``*_coalesced`` forms gloo lacks): ``each:_allgather_base``.
EACH = "each:"


def serve(sock: socket.socket) -> None:
    """Serve the rank on ``sock`` until it closes (then return: the caller exits)."""
    import torch

    torch.set_num_threads(1)
    _Worker(sock).loop()


class _Worker:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.slots: dict[int, Slot | CudaRegion] = {}
        self.pg: Any = None
        #: The NCCL group of an ``nccl`` worker (CUDA tensors); ``pg`` is its gloo one.
        self.nccl: Any = None
        #: Where and how to form it: ``(store, Configure, timeout)`` (an ``nccl`` worker).
        self.nccl_at: tuple[Any, Configure, timedelta] | None = None
        #: ``(op_id, CUDA event after the op)`` for the completion thread.
        self.completions: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

    def send(self, msg: object) -> None:
        data = pickle.dumps(msg, protocol=5)
        with self.send_lock:
            try:
                self.sock.send(data)
            except OSError:  # the rank is gone: the main loop ends us
                pass

    def loop(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
            except OSError:
                return
            if not data:
                return
            msg = pickle.loads(data)
            if isinstance(msg, OpRequest):
                self.run(msg, fds)
            elif isinstance(msg, Configure):
                self.configure(msg)
            elif isinstance(msg, Unmap):
                slot = self.slots.pop(msg.region, None)
                if slot is not None:
                    slot.close()

    def configure(self, msg: Configure) -> None:
        import torch.distributed as dist

        try:
            os.environ.update(msg.env)
            timeout = timedelta(seconds=msg.timeout_s)
            store = dist.TCPStore(
                msg.host, msg.port, is_master=False, wait_for_workers=False, timeout=timeout
            )
            prefixed = dist.PrefixStore(msg.prefix, store)
            self.pg = dist.ProcessGroupGloo(prefixed, msg.rank, msg.size, timeout)
            if msg.backend == "nccl":  # formed at its first CUDA op (the device is known then)
                self.nccl_at = (store, msg, timeout)
                threading.Thread(target=self._complete_cuda, name="mk-pg-cuda", daemon=True).start()
        except Exception as exc:
            self.send(ConfigFailed(error_text(exc)))
            return
        self.send(Ready())

    def run(self, req: OpRequest, fds: list[int]) -> None:
        for (region, size), fd in zip(req.new_regions, fds):
            self.slots[region] = map_slot(region, size, fd)
        try:
            for region, payload in req.new_cuda:
                self.slots[region] = CudaRegion(payload)
            if self.pg is None:
                raise RuntimeError("the worker has no process group (not configured)")
            args = _resolve(req.args, self.slots)
            opts = decode_options(req.options)
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = True  # the rank waits on our answer, never on the worker's op
            if req.new_cuda or _cuda_device(args) >= 0:
                self._start_cuda(req.op_id, req.method, args, opts)
                return
            if req.method in SHARDING_METHODS:
                pin_mmap_threshold()  # FSDP2's per-step buffers (see .malloc)
            future = self._start(req.method, args, opts)
        except Exception as exc:
            self.send(Failed(req.op_id, error_text(exc)))
            return
        op_id = req.op_id
        future.add_done_callback(lambda f: self._finished(op_id, f))

    def _start_cuda(self, op_id: int, method: str, args: list[Any], opts: object) -> None:
        """Enqueue an op on the NCCL group; the completion thread reports it."""
        import torch

        if self.nccl is None:
            if self.nccl_at is None:
                raise RuntimeError("CUDA tensors on a gloo process group (the rank sent them)")
            self.nccl = _form_nccl(*self.nccl_at, _cuda_device(args))
        for work in _issue(self.nccl, method, args, opts):
            if work is not None:  # None: a synchronous op, already on this stream
                work.wait()  # NCCL: this stream waits for the op's stream (the CPU does not)
        done = torch.cuda.Event()
        done.record()
        self.completions.put((op_id, done))

    def _complete_cuda(self) -> None:
        """Report each NCCL op once its kernels finished (in issue order)."""
        while True:
            op_id, event = self.completions.get()
            try:
                event.synchronize()
            except Exception as exc:
                self.send(Failed(op_id, error_text(exc)))
                continue
            self.send(Done(op_id))

    def _start(self, method: str, args: list[Any], opts: object) -> Any:
        import torch

        works = _issue(self.pg, method, args, opts)
        if method.startswith(EACH):
            return torch.futures.collect_all([_future(w) for w in works])
        return _future(works[0])

    def _finished(self, op_id: int, future: Any) -> None:
        try:
            value = future.value()
            if isinstance(value, list):  # collect_all: a list of futures
                for sub in value:
                    if hasattr(sub, "value"):
                        sub.value()
        except Exception as exc:
            self.send(Failed(op_id, error_text(exc)))
            return
        self.send(Done(op_id))


def _form_nccl(store: Any, msg: Configure, timeout: timedelta, device: int) -> Any:
    """The NCCL group of an ``nccl`` worker on CUDA device ``device`` (every rank forms
    it at the same op: the group's first on CUDA tensors), connected by one all-reduce."""
    import torch
    import torch.distributed as dist

    if msg.device >= 0:
        device = msg.device
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    prefixed = dist.PrefixStore(msg.prefix + "nccl/", store)
    nccl: Any = dist.ProcessGroupNCCL(prefixed, msg.rank, msg.size, options)
    probe = torch.zeros(1, device=torch.device("cuda", device))
    nccl.allreduce([probe]).wait()
    torch.cuda.synchronize(device)
    return nccl


def _issue(group: Any, method: str, args: list[Any], opts: object) -> list[Any]:
    """Start ``method`` of ``group`` (gloo or NCCL) on ``args``: its Works (one per pair
    of tensors for an ``each:`` method)."""
    if method.startswith(EACH):
        call = getattr(group, method[len(EACH) :])
        outputs, inputs = args
        return [call(o, i, opts) for o, i in zip(outputs, inputs)]
    call = getattr(group, method)
    return [call(*args) if opts is None else call(*args, opts)]


def _cuda_device(tree: Any) -> int:
    """The device index of the first CUDA tensor in ``tree`` (-1: there is none)."""
    if isinstance(tree, (list, tuple)):
        for t in tree:
            found = _cuda_device(t)
            if found >= 0:
                return found
        return -1
    return int(tree.device.index or 0) if getattr(tree, "is_cuda", False) else -1


def _resolve(tree: Any, regions: dict[int, Slot | CudaRegion]) -> Any:
    """``tree`` with every TensorRef replaced by its view in its region."""
    if isinstance(tree, TensorRef):
        region = regions.get(tree.region)
        if region is None:
            raise RuntimeError(f"an op names region {tree.region}, which was never sent")
        return region.view(tree)
    if isinstance(tree, (list, tuple)):
        return [_resolve(t, regions) for t in tree]
    return tree


def _future(work: Any) -> Any:
    """The torch Future of a gloo Work (one completed by a thread for works without)."""
    import torch

    try:
        return work.get_future()
    except RuntimeError:  # send/recv works have no future
        future: Any = torch.futures.Future()

        def wait() -> None:
            try:
                work.wait()
                future.set_result(None)
            except Exception as exc:
                future.set_exception(exc)

        threading.Thread(target=wait, name="mk-pg-wait", daemon=True).start()
        return future


def run_child(body: Callable[[socket.socket], None], sock: socket.socket) -> None:
    """Run ``body(sock)`` in a freshly forked child and exit (never returns or raises)."""
    code = 0
    try:
        body(sock)
    except BaseException:
        code = 1
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        os._exit(code)
