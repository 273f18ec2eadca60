"""A torch.distributed process group that can be aborted and formed again in place.

:class:`ReformableGroup` is a Python ``ProcessGroup`` (torch calls it from C++ too: DDP's
reducer, ``broadcast_coalesced``). Its collectives run in a disposable worker process
that holds a real gloo group (:mod:`.pg_worker`); tensors cross through shared memory
(:mod:`.pg_shm`: one copy in, one copy out) and every op returns a :class:`_Work` whose
torch Future a reader thread completes. So:

* :meth:`ReformableGroup.abort` kills the worker and fails every pending op at once with
  :class:`ProcessGroupAborted`: a main thread blocked in a collective, even inside DDP's
  backward (C++ waiting on the future, where no KeyboardInterrupt can land), is
  released in milliseconds and the rank lives on;
* :meth:`ReformableGroup.attach` puts a freshly formed worker in place: the *same* Python
  object stays the group, so DDP, FSDP2, ``dist.*`` calls and ``new_group`` groups that
  hold it keep working without being rebuilt (forming workers: :mod:`.pg_backend`).

Threads: ops are issued by user threads (usually the main one), completed by the reader
thread of the current worker, aborted from the control thread. ``_lock`` guards the
worker and the pending ops; ``_send_lock`` keeps ops in id order on the socket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.rank.pg_protocol import (
    Done,
    Failed,
    OpRequest,
    TensorRef,
    Unmap,
    aligned,
    encode_options,
)
from monarch_kernel.rank.pg_shm import Slot, SlotPool, dtype_name
from monarch_kernel.rank.pg_spawn import WorkerHandle
from monarch_kernel.rank.pg_worker import EACH

# torch's stubs type the C++ methods as overloads that no Python override can match
# (and miss the options classes); these are the classes and methods torch really calls
# (see torch/csrc/distributed/c10d/PyProcessGroup.hpp, the trampoline).
_ProcessGroup: Any = dist.ProcessGroup
_WorkBase: Any = dist.Work
_d: Any = dist

#: Name of the backend the group reports (``dist.get_backend()``).
BACKEND = "mkgloo"
#: How a peer's abort (or death) shows up in gloo's errors.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class ProcessGroupAborted(RuntimeError):
    """A collective was cut short because the process group was aborted (a failure on
    another rank, or the stop button); the mesh forms the group again afterwards."""


def _value(future: Any) -> Any:
    return future.value()


@dataclass(eq=False)
class _Op:
    """One op in flight.

    ``future`` (what ``get_future()`` gives) is a ``then`` of the future we complete:
    torch's ``Future.set_exception`` from Python completes a future *successfully* with
    the exception object as its value, which C++ waiters (DDP's reducer) take for the
    result; a callback that raises is how an error reaches C++ as an error.
    """

    name: str
    slot: Slot | None
    outputs: list[tuple[torch.Tensor, TensorRef]]
    value: object
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self._base: Any = torch.futures.Future()
        self.future: Any = self._base.then(_value)

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        try:
            if error is None:
                self._base.set_result(self.value)
            else:
                self._base.set_exception(error)
        finally:
            self.done.set()


class _Work(_WorkBase):
    """What an op returns: ``wait()`` (interruptible), ``get_future()``."""

    def __init__(self, op: _Op):
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if seconds is None or seconds <= 0:  # torch's kNoTimeout is 0
            while not self._op.done.wait(1.0):  # Ctrl-C lands between waits
                pass
        elif not self._op.done.wait(seconds):
            raise RuntimeError(f"{self._op.name} did not complete within {seconds:.1f}s")
        if self._op.error is not None:
            raise self._op.error
        return True

    def get_future(self) -> Any:
        return self._op.future

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self) -> BaseException | None:
        return self._op.error

    def result(self) -> Any:
        self.wait()
        return self._op.value

    def synchronize(self) -> None:
        self.wait()


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


class ReformableGroup(_ProcessGroup):
    """A gloo process group in a disposable worker (see the module docstring)."""

    def __init__(self, rank: int, size: int, group_id: str, timeout_s: float):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        #: torch's name of the group (``0`` for the default one); prefixes rendezvous.
        self.group_id = group_id
        self.timeout_s = timeout_s
        #: Global ranks of a ``new_group`` group (None: the default group).
        self.global_ranks: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._worker: WorkerHandle | None = None
        self._ops: dict[int, _Op] = {}
        self._next_op = 0
        self._aborted: str | None = "not formed yet"
        self._pool = SlotPool()
        self._coalescing: list[_Op] | None = None
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

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        state = f"aborted: {self._aborted}" if self._aborted else f"{self.pending()} pending"
        return f"<ReformableGroup {self.group_id!r} rank {self._rank}/{self._size}, {state}>"

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
        the same (DDP and the rest keep it); see :func:`.pg_backend.reform`."""
        from monarch_kernel.rank import pg_backend

        pg_backend.reform(self, master_addr, master_port, rank, world_size)

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
            hint = ""
            if any(s in error for s in _PEER_GONE):
                hint = " (another rank aborted its process group, or died)"
            failure = RuntimeError(f"{op.name} failed in the process group: {error}{hint}")
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
    ) -> _Work:
        """Issue one op: lay its tensors out in a slot, copy ``ins`` in, send it; the
        reader copies ``outs`` back when it is done."""
        if self._aborted is not None:
            err = ProcessGroupAborted(
                f"{name} on an aborted process group ({self._aborted}); the mesh forms it "
                "again when the failed cell ends (run the next cell)"
            )
            # a failed Work, not a raise: DDP's reducer then ends its backward cleanly
            op = _Op(name, None, [], None)
            op.finish(err)
            return _Work(op)
        refs: dict[int, TensorRef] = {}
        total = 0

        def place(t: torch.Tensor) -> TensorRef:
            nonlocal total
            ref = refs.get(id(t))
            if ref is None:
                _check_tensor(name, t)
                ref = refs[id(t)] = TensorRef(total, dtype_name(t.dtype), tuple(t.shape))
                total += aligned(t.numel() * t.element_size())
            return ref

        spec = _tree(args, place)
        slot = self._pool.acquire(total) if refs else None
        if slot is not None:
            with torch.no_grad():
                for t in ins:
                    slot.view(refs[id(t)]).copy_(t)
        op = _Op(name, slot, [(t, refs[id(t)]) for t in outs], value)
        self._send(op, method, spec, opts)
        if self._coalescing is not None:
            self._coalescing.append(op)
        return _Work(op)

    def _send(self, op: _Op, method: str, spec: list[Any], opts: object) -> None:
        slot = op.slot
        with self._send_lock:
            with self._lock:
                worker = self._worker
                if worker is None:
                    error = ProcessGroupAborted(f"{op.name}: the process group was aborted")
                else:
                    op_id = self._next_op
                    self._next_op += 1
                    self._ops[op_id] = op
                    new: tuple[tuple[int, int], ...] = ()
                    if slot is not None and slot.id not in worker.known:
                        worker.known.add(slot.id)
                        new = ((slot.id, slot.size),)
            if worker is None:  # aborted between the check and now
                if slot is not None:
                    self._pool.release(slot)
                op.finish(error)
                return
            request = OpRequest(
                op_id,
                method,
                tuple(spec),
                encode_options(opts),
                -1 if slot is None else slot.id,
                new,
            )
            try:
                worker.send(request, [slot.fd] if new and slot is not None else None)
            except OSError:
                pass  # killed meanwhile: abort() failed the op, or the reader will

    # -- the collectives -------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> _Work:
        tensors = _as_list(tensors)
        opts = _reduce_opts(opts, _d.AllreduceOptions)
        return self._run("allreduce", "allreduce", [tensors], opts, tensors, tensors, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = _reduce_opts(opts, _d.AllreduceCoalescedOptions)
        name = "allreduce_coalesced"
        return self._run(name, name, [tensors], opts, tensors, tensors, tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> _Work:
        tensors = _as_list(tensors)
        if opts is None or isinstance(opts, int):
            root, opts = opts or 0, _d.BroadcastOptions()
            opts.rootRank = root
        root_here = opts.rootRank == self._rank
        ins, outs = (tensors, []) if root_here else ([], tensors)
        return self._run("broadcast", "broadcast", [tensors], opts, ins, outs, tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: Any, opts: Any = None) -> _Work:
        inputs = _as_list(inputs)
        opts = opts or _d.AllgatherOptions()
        args = [outputs, inputs]
        return self._run("allgather", "allgather", args, opts, inputs, _flat(outputs), outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = opts or _d.AllgatherOptions()
        name = "allgather_coalesced"
        return self._run(name, name, [outputs, inputs], opts, inputs, _flat(outputs), outputs)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work:
        opts = opts or _d.AllgatherOptions()
        args = [output, input]
        return self._run(
            "all_gather_into_tensor", "_allgather_base", args, opts, [input], [output], [output]
        )

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = opts or _d.AllgatherOptions()
        method = EACH + "_allgather_base"
        return self._run(
            "all_gather_into_tensor (coalesced)",
            method,
            [outputs, inputs],
            opts,
            inputs,
            outputs,
            outputs,
        )

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, outputs: Any, inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        outputs = _as_list(outputs)
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        args = [outputs, inputs]
        return self._run(
            "reduce_scatter", "reduce_scatter", args, opts, _flat(inputs), outputs, outputs
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work:
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        args = [output, input]
        return self._run(
            "reduce_scatter_tensor", "_reduce_scatter_base", args, opts, [input], [output], [output]
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        method = EACH + "_reduce_scatter_base"
        return self._run(
            "reduce_scatter_tensor (coalesced)",
            method,
            [outputs, inputs],
            opts,
            inputs,
            outputs,
            outputs,
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Work:
        opts = opts or _d.AllToAllOptions()
        args = [output, input, list(output_split_sizes), list(input_split_sizes)]
        return self._run(
            "all_to_all_single", "alltoall_base", args, opts, [input], [output], [output]
        )

    alltoall_base = all_to_all_single

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = opts or _d.AllToAllOptions()
        return self._run(
            "all_to_all", "alltoall", [outputs, inputs], opts, inputs, outputs, outputs
        )

    def barrier(self, opts: Any = None) -> _Work:
        return self._run("barrier", "barrier", [], opts or _d.BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        return self._run("send", "send", [tensors, dst, tag], None, tensors, [], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        return self._run("recv", "recv", [tensors, src, tag], None, [], tensors, tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> _Work:
        tensors = _as_list(tensors)
        opts = _reduce_opts(opts, _d.ReduceOptions)
        outs = tensors if opts.rootRank == self._rank else []
        return self._run("reduce", "reduce", [tensors], opts, tensors, outs, tensors)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = opts or _d.GatherOptions()
        return self._run(
            "gather", "gather", [outputs, inputs], opts, inputs, _flat(outputs), outputs
        )

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        opts = opts or _d.ScatterOptions()
        return self._run(
            "scatter", "scatter", [outputs, inputs], opts, _flat(inputs), outputs, outputs
        )

    # -- coalescing (``dist._coalescing_manager`` with a device) ---------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> _Work:
        ops, self._coalescing = self._coalescing or [], None
        op = _Op("coalesced ops", None, [], None)
        if not ops:
            op.finish(None)
            return _Work(op)
        futures = torch.futures.collect_all([o.future for o in ops])

        def settle(_: Any) -> None:
            errors = [o.error for o in ops if o.error is not None]
            op.finish(errors[0] if errors else None)

        futures.add_done_callback(settle)
        return _Work(op)

    # -- what it does not do ---------------------------------------------------------------
    def _unsupported(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"{what} is not supported by the mesh's re-formable gloo process group; "
                "initialise with MONARCH_KERNEL_REFORMABLE_PG=0 for plain gloo"
            )

        return refuse

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("monitored_barrier")()

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv from any source")()

    def split_group(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("split_group")()


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_opts(opts: Any, cls: Callable[[], Any]) -> Any:
    """An options object from None, a ReduceOp, or an options object."""
    if opts is None or not hasattr(opts, "timeout"):
        made = cls()
        if opts is not None:
            made.reduceOp = opts if isinstance(opts, _d.ReduceOp) else _d.ReduceOp(opts)
        return made
    return opts


def _check_tensor(op: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: expected tensors, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{op}: the re-formable gloo process group carries CPU tensors, got one on "
            f"{t.device}; use backend='nccl' for GPU tensors"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {t.layout} tensors are not supported (dense tensors only)")


def _tree(args: Any, place: Callable[[torch.Tensor], TensorRef]) -> Any:
    """``args`` with every tensor replaced by its TensorRef."""
    if isinstance(args, torch.Tensor):
        return place(args)
    if isinstance(args, (list, tuple)):
        return [_tree(a, place) for a in args]
    return args
