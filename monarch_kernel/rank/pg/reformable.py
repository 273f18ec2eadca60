"""A torch.distributed process group that can be aborted and formed again in place.

Two kinds, one class: ``gloo`` (backend ``mkgloo``, CPU tensors) and ``nccl`` (backend
``mknccl``: CUDA tensors by NCCL, in place in the rank's GPU memory through CUDA IPC
(:mod:`.cuda_regions`), and CPU tensors by gloo beside it, as torch's
``cpu:gloo,cuda:nccl``). Either way NCCL and gloo run in the worker, never in the rank.

:class:`ReformableGroup` is a Python ``ProcessGroup`` (torch calls it from C++ too: DDP's
reducer, ``broadcast_coalesced``). Its collectives run in a disposable worker process
that holds a real gloo group (:mod:`.worker`); tensors cross through shared memory
(:mod:`.shm`: one copy in, one copy out; buffers ops repeat, such as DDP's buckets,
are used in place: :mod:`.adopt`) and every op (:mod:`.ops`) returns an
:class:`~.work.OpWork` whose torch Future a reader thread completes. So:

* :meth:`ReformableGroup.abort` kills the worker and fails every pending op at once with
  :class:`ProcessGroupAborted`: a main thread blocked in a collective, even inside DDP's
  backward (C++ waiting on the future, where no KeyboardInterrupt can land), is
  released in milliseconds and the rank lives on;
* :meth:`ReformableGroup.attach` puts a freshly formed worker in place: the *same* Python
  object stays the group, so DDP, FSDP2, ``dist.*`` calls and ``new_group`` groups that
  hold it keep working without being rebuilt (forming workers: :mod:`.backend`).

Threads: ops are issued by user threads (usually the main one), completed by the reader
thread of the current worker, aborted from the control thread. ``_lock`` guards the
worker and the pending ops; ``_send_lock`` keeps ops in id order on the socket.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from monarch_kernel.calls.errors import ProcessGroupAborted
from monarch_kernel.rank.pg import watch
from monarch_kernel.rank.pg.adopt import Adopted, AdoptedStorages
from monarch_kernel.rank.pg.cuda_regions import CudaEntry, CudaStorages
from monarch_kernel.rank.pg.malloc import SHARDING_METHODS, pin_mmap_threshold
from monarch_kernel.rank.pg.ops import CollectiveOps
from monarch_kernel.rank.pg.protocol import (
    Done,
    Failed,
    OpRequest,
    TensorRef,
    Unmap,
    aligned,
    clip_middle,
    encode_options,
)
from monarch_kernel.rank.pg.shm import Slot, SlotPool, dtype_name
from monarch_kernel.rank.pg.spawn import WorkerHandle
from monarch_kernel.rank.pg.work import OpWork, PendingOp

# torch's stubs type the C++ methods as overloads that no Python override can match;
# these are the methods torch really calls (torch/csrc/distributed/c10d/PyProcessGroup.hpp,
# the trampoline).
_ProcessGroup: Any = dist.ProcessGroup

#: Name of the backend the group reports (``dist.get_backend()``).
BACKEND = "mkgloo"
#: The backend of a group whose worker runs NCCL for CUDA tensors (gloo for CPU ones).
NCCL_BACKEND = "mknccl"
#: How a peer's abort (or death) shows up in gloo's errors.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: What a peer's abort means, said after the failed op's name.
PEER_GONE_HINT = " (another rank aborted its process group, or died)"
#: Ops that leave every tensor as it is in a group of one rank (sums, averages, minima
#: of one value; a broadcast from oneself; a barrier alone).
ALONE_IDENTITY = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "reduce", "barrier"})
#: The most characters of the backend's own error text an op's failure keeps (gloo's can
#: carry a C++ stack trace of many kilobytes); past it its middle is left out.
MAX_BACKEND_ERROR = 1000


def failure_text(op_name: str, error: str) -> str:
    """What a user reads when op ``op_name`` failed in the worker with ``error`` (the
    backend's ``Type: message``): our explanation first and in full, so that no cut of
    the text's end loses it, then the backend's text, bounded by :func:`clip_middle`."""
    hint = PEER_GONE_HINT if any(s in error for s in _PEER_GONE) else ""
    return f"{op_name} failed in the process group{hint}: {clip_middle(error, MAX_BACKEND_ERROR)}"


class ReformableGroup(CollectiveOps, _ProcessGroup):
    """A gloo process group in a disposable worker (see the module docstring)."""

    #: Forms every group of the rank again (``pg.backend.reform``, which sets it: that
    #: module makes groups, so this one cannot import it).
    reformer: ClassVar[Callable[[ReformableGroup, str, int, int, int], object] | None] = None

    def __init__(self, rank: int, size: int, group_id: str, timeout_s: float, kind: str = "gloo"):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        #: torch's name of the group (``0`` for the default one); prefixes rendezvous.
        self.group_id = group_id
        self._group_name = group_id
        self._group_desc = ""
        self.timeout_s = timeout_s
        #: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors by NCCL, CPU ones by gloo).
        self.kind = kind
        #: The CUDA device the group's CUDA tensors live on: an ``nccl`` group's first
        #: CUDA tensor's (-1 until then, and for a gloo group). Nothing touches CUDA
        #: before that: a group of CPU tensors on a GPU machine costs no GPU memory.
        self.device = -1
        #: Global ranks of a ``new_group`` group (None: the default group).
        self.global_ranks: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._worker: WorkerHandle | None = None
        self._ops: dict[int, PendingOp] = {}
        self._next_op = 0
        self._aborted: str | None = "not formed yet"
        ids = itertools.count()
        self._pool = SlotPool(lambda: next(ids))
        self._adopted = AdoptedStorages(lambda: next(ids))
        self._cuda = CudaStorages(lambda: next(ids))
        self._coalescing: list[PendingOp] | None = None
        #: Times this group was formed (1 after the first rendezvous).
        self.generation = 0
        #: ``destroy_process_group`` ended it: it is no group of the rank's any more.
        self.destroyed = False

    # -- identity (torch calls these from C++ too) ---------------------------------------
    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def backend_name(self) -> str:
        """``mkgloo`` or ``mknccl``."""
        return NCCL_BACKEND if self.kind == "nccl" else BACKEND

    def getBackendName(self) -> str:
        return self.backend_name

    def _get_backend_name(self) -> str:
        return self.backend_name

    def name(self) -> str:
        return self.backend_name

    # The name torch gives the group (functional collectives and DeviceMesh look groups
    # up by it): the base class keeps it in its backends, and this group has none.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        state = f"aborted: {self._aborted}" if self._aborted else f"{self.pending()} pending"
        where = f"rank {self._rank}/{self._size}"
        return f"<ReformableGroup {self.kind} {self.group_id!r} {where}, {state}>"

    # -- state -------------------------------------------------------------------------
    def pending(self) -> int:
        """Ops issued and not completed yet."""
        return len(self._ops)

    @property
    def aborted(self) -> str | None:
        """Why the group cannot be used now (None: it can)."""
        return self._aborted

    def abort(self, reason: str = "") -> None:
        """Kill the worker and fail every pending op with :class:`ProcessGroupAborted`
        (``reason`` goes into the error). New ops raise until :meth:`attach`."""
        why = reason or "aborted"
        with self._lock:
            self._aborted = why
            worker, self._worker = self._worker, None
            ops = list(self._ops.values())
            self._ops.clear()
        if worker is not None:
            worker.kill()
        error = ProcessGroupAborted(f"the mesh aborted the process group ({why})")
        for op in ops:
            if op.slot is not None:
                self._pool.discard(op.slot)  # the dying worker may still write to it
            op.finish(error)

    def shutdown(self) -> None:
        """``destroy_process_group``: abort, and drop the shared memory."""
        self.destroyed = True
        self.abort("destroyed")
        self._pool.close()
        with self._lock:
            self._adopted.clear()
            self._cuda.clear()

    def attach(self, worker: WorkerHandle, rank: int, size: int) -> None:
        """Use ``worker`` (formed: it answered Ready) from now on, as ``rank`` of ``size``;
        ops still pending on the previous worker fail."""
        self.abort("formed again")
        with self._lock:
            self._worker = worker
            self._rank, self._size = rank, size
            self._aborted = None
            self.generation += 1
        threading.Thread(
            target=self._read, args=(worker,), name=f"mk-pg-{self.group_id}", daemon=True
        ).start()

    def configure(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """Form this group, and every other re-formable group of this rank, again at the
        rendezvous ``master_addr:master_port`` (rank 0 serves a fresh TCPStore there) as
        ``rank`` of ``world_size``; every rank of the new world calls it. The object stays
        the same (DDP and the rest keep it); see :func:`.backend.reform`."""
        if ReformableGroup.reformer is None:
            raise RuntimeError("configure(): monarch_kernel.rank.pg.backend is not loaded")
        ReformableGroup.reformer(self, master_addr, master_port, rank, world_size)

    def mark_stale(self, why: str) -> None:
        """This group cannot be formed again (the world changed under it)."""
        self.abort(why)

    # -- completing ops (the reader thread) ------------------------------------------------
    def _read(self, worker: WorkerHandle) -> None:
        while True:
            try:
                data = worker.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            import pickle

            msg = pickle.loads(data)
            if isinstance(msg, Done):
                self._complete(msg.op_id, None, worker)
            elif isinstance(msg, Failed):
                self._complete(msg.op_id, msg.error, worker)
        with self._lock:
            current = self._worker is worker
        if current:  # not killed by us: it died
            self.abort("its worker process died; see the rank's output for why")

    def _complete(self, op_id: int, error: str | None, worker: WorkerHandle) -> None:
        with self._lock:
            op = self._ops.pop(op_id, None)
        if op is None:
            return  # aborted meanwhile
        failure: BaseException | None = None
        if error is None:
            try:
                with torch.no_grad():
                    for tensor, ref in op.outputs:
                        assert op.slot is not None
                        tensor.copy_(op.slot.view(ref))
            except Exception as exc:
                failure = RuntimeError(f"{op.name}: copying the result back failed: {exc}")
        else:
            failure = RuntimeError(failure_text(op.name, error))
        if op.slot is not None:
            self._release(op.slot, worker)
        op.finish(failure)

    def _release(self, slot: Slot, worker: WorkerHandle) -> None:
        for dropped in self._pool.release(slot):
            if dropped in worker.known:
                worker.known.discard(dropped)
                try:
                    worker.send(Unmap(dropped))
                except OSError:
                    pass

    # -- issuing ops -----------------------------------------------------------------------
    def _run(
        self,
        name: str,
        method: str,
        args: list[Any],
        opts: object,
        ins: Sequence[torch.Tensor] = (),
        outs: Sequence[torch.Tensor] = (),
        value: object = None,
    ) -> OpWork:
        """Issue one op: place its tensors (in place, or copied into its slot), send it;
        the reader copies the slot's ``outs`` back when it is done."""
        if method in SHARDING_METHODS:
            pin_mmap_threshold()  # FSDP2's per-step buffers (see .malloc)
        if self._aborted is not None:
            error = ProcessGroupAborted(
                f"{name} on an aborted process group ({self._aborted}); the mesh forms it "
                "again when the failed cell ends (run the next cell)"
            )
            # a failed Work, not a raise: DDP's reducer then ends its backward cleanly
            op = PendingOp(name, None, [], None)
            op.finish(error)
            return OpWork(op)
        if self._size == 1 and method in ALONE_IDENTITY and not _scales(opts):
            op = self._alone(name, args, value)
        else:
            with self._send_lock:  # ops reach the worker in the order they are issued
                op, spec, regions, cuda = self._lay_out(name, args, ins, outs, value)
                if watch.op_watch is not None:  # step telemetry (None: off)
                    watch.tell(op, ins or outs, self._size)
                self._send(op, method, spec, opts, regions, cuda)
        if self._coalescing is not None:
            self._coalescing.append(op)
        return OpWork(op)

    def _bind(self, t: torch.Tensor) -> None:
        """An ``nccl`` group's first CUDA tensor chooses its device."""
        if self.device < 0 and self.kind == "nccl" and getattr(t, "is_cuda", False):
            self.device = int(t.device.index or 0)

    def _alone(self, name: str, args: list[Any], value: object) -> PendingOp:
        """An op of a group of one that leaves its tensors as they are: done here, with
        no round trip to the worker (a one-rank DDP pays nothing for its group)."""
        tensors = list(_tensors(args))
        for t in tensors:
            self._bind(t)
            _check_tensor(name, t, self.device)
        cuda = [t.device for t in tensors if t.is_cuda][:1]
        op = PendingOp(name, None, [], value, cuda or None)
        op.finish(None)
        return op

    def _lay_out(
        self,
        name: str,
        args: list[Any],
        ins: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor],
        value: object,
    ) -> tuple[PendingOp, list[Any], list[tuple[int, int, int]], list[CudaEntry]]:
        """``(op, args with TensorRefs, regions (id, size, fd) it uses, CUDA storages it
        uses)``: each CPU tensor in an adopted storage, else in the op's slot (inputs
        copied in); each CUDA tensor in place, in the rank's GPU memory."""
        places: dict[int, tuple[Adopted | None, int]] = {}
        tensors: list[torch.Tensor] = []
        cuda: dict[int, tuple[CudaEntry, int, torch.Tensor]] = {}
        total = 0
        self._adopted.begin_op()
        for t in _tensors(args):
            if id(t) in places or id(t) in cuda:
                continue
            self._bind(t)
            _check_tensor(name, t, self.device)
            if t.is_cuda:
                cuda[id(t)] = (*self._cuda.place(t), t)
                continue
            tensors.append(t)
            adopted = self._adopted.place(t)
            if adopted is None:
                places[id(t)] = (None, total)
                total += aligned(t.numel() * t.element_size())
            else:
                places[id(t)] = adopted
        slot = self._pool.acquire(total) if total else None
        regions = {} if slot is None else {slot.id: (slot.id, slot.size, slot.fd)}
        refs: dict[int, TensorRef] = {}
        for t in tensors:
            region, offset = places[id(t)]
            if region is not None:
                regions[region.id] = (region.id, region.size, region.fd)
            rid = region.id if region is not None else slot.id  # type: ignore[union-attr]
            refs[id(t)] = TensorRef(rid, offset, dtype_name(t.dtype), tuple(t.shape))
        for key, (entry, offset, t) in cuda.items():
            refs[key] = TensorRef(entry.id, offset, dtype_name(t.dtype), tuple(t.shape))
        copied = [t for t in tensors if places[id(t)][0] is None]
        if slot is not None:
            with torch.no_grad():
                for t in ins:
                    if id(t) in places and places[id(t)][0] is None:
                        slot.view(refs[id(t)]).copy_(t)
        outputs = [(t, refs[id(t)]) for t in outs if any(t is c for c in copied)]
        devices = None
        if cuda:
            device = torch.device("cuda", self.device)
            # the worker reads the inputs (and writes the outputs) once the op arrives:
            # whatever this stream queued on them must be done by then
            torch.cuda.current_stream(device).synchronize()
            devices = [device]
        op = PendingOp(name, slot, outputs, value, devices)
        entries = list({id(e): e for e, _, _ in cuda.values()}.values())
        return op, _tree(args, lambda t: refs[id(t)]), list(regions.values()), entries

    def _send(
        self,
        op: PendingOp,
        method: str,
        spec: list[Any],
        opts: object,
        regions: list[tuple[int, int, int]],
        cuda: list[CudaEntry],
    ) -> None:
        with self._lock:
            worker = self._worker
            if worker is not None:
                op_id = self._next_op
                self._next_op += 1
                self._ops[op_id] = op
                new = [r for r in regions if r[0] not in worker.known]
                worker.known.update(r[0] for r in new)
                new_cuda = tuple((e.id, e.payload) for e in cuda if e.id not in worker.known)
                worker.known.update(e.id for e in cuda)
                gone = self._adopted.forget_dropped() + self._cuda.forget_dropped()
                dropped = [r for r in gone if r in worker.known]
                worker.known.difference_update(dropped)
        if worker is None:  # aborted between the check and now
            if op.slot is not None:
                self._pool.release(op.slot)
            op.finish(ProcessGroupAborted(f"{op.name}: the process group was aborted"))
            return
        new_regions = tuple((rid, size) for rid, size, _fd in new)
        request = OpRequest(op_id, method, tuple(spec), encode_options(opts), new_regions, new_cuda)
        try:
            for region in dropped:
                worker.send(Unmap(region))
            worker.send(request, [fd for _rid, _size, fd in new] or None)
        except OSError:
            pass  # killed meanwhile: abort() failed the op, or the reader will


def _check_tensor(op: str, t: torch.Tensor, cuda_device: int) -> None:
    """Refuse what the worker cannot use, saying what to do (``cuda_device``: the
    group's CUDA device, -1 for a gloo group)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: expected tensors, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {t.layout} tensors are not supported (dense tensors only)")
    if t.device.type == "cpu":
        return
    if t.device.type != "cuda" or cuda_device < 0:
        raise ValueError(
            f"{op}: the re-formable gloo process group carries CPU tensors, got one on "
            f"{t.device}; use backend='nccl' for GPU tensors"
        )
    if t.device.index != cuda_device:
        raise ValueError(
            f"{op}: the process group's GPU is cuda:{cuda_device}, the tensor is on "
            f"{t.device}; move it there (each rank's GPU is torch.cuda.current_device())"
        )
    if not t.is_contiguous():
        raise ValueError(f"{op}: CUDA tensors must be contiguous (call .contiguous() first)")


def _scales(opts: object) -> bool:
    """Whether ``opts`` reduce with ``PREMUL_SUM`` (which scales even one value)."""
    op = getattr(opts, "reduceOp", None)
    return "PREMUL" in str(getattr(getattr(op, "op", op), "name", ""))


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``args`` (nested lists and tuples), in order."""
    if isinstance(args, torch.Tensor):
        yield args
    elif isinstance(args, (list, tuple)):
        for a in args:
            yield from _tensors(a)


def _tree(args: Any, place: Callable[[torch.Tensor], TensorRef]) -> Any:
    """``args`` with every tensor replaced by its TensorRef."""
    if isinstance(args, torch.Tensor):
        return place(args)
    if isinstance(args, (list, tuple)):
        return [_tree(a, place) for a in args]
    return args
