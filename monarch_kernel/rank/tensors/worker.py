""":class:`TensorWorker`: runs the records of ``tensor_ops`` messages on a rank.

Invariants:

* Records run in the order the controller issued them (one message at a time, on the
  main thread, in the inbox's ``q`` order), so a ref is always defined before it is read
  and dropped only after its last reader ran.
* An op that raises stores one :class:`RankError` in each of its outputs and in each input
  it mutates; an op that reads a poisoned ref stores *that same* error (the root cause,
  with the seq of the op that failed) in its outputs without running. Nothing is sent
  when an op fails: errors travel in the answers to fetches, and the root errors (one
  per op that raised here) also in the answer to the next :class:`Report` (a notebook
  cell's end), which reports each once.
* The stop button (SIGINT, then the controller's :class:`Resume` after the cell's ops)
  stops this rank wherever it is: in an op's function (user code: KeyboardInterrupt),
  waiting at a collective's gate or inside a collective (the wait is interruptible; the
  collective's group is aborted here and formed again at its next gate), or between two
  records (seen at the next one). The SIGINT alone does not say which ops it stops: one
  that lands before the rank began the cell's ops (still on their way, or being read)
  would stop none. So the controller also tells the control thread the last op it
  stopped (``tensor_stop``, :meth:`TensorWorker.stop_through`): an op up to that one
  that has not run does not run, whenever the signal lands. The worker then runs no op
  until :class:`Resume`:
  their outputs hold the interruption ("stopped by the user"), and each collective or
  transfer among them is passed at its gate as stopped, so no peer starts it or waits
  for this rank (:mod:`.collectives`). A peer stopped before a collective started makes
  it fail here too, with the same words.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves

from monarch_kernel.rank import context
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.tensors import collectives
from monarch_kernel.shape import Shape
from monarch_kernel.wire.tensor_ops import (
    ALL_SHARDS,
    MAX_UNREPORTED,
    BorrowCreate,
    BorrowDrop,
    CallOp,
    Drop,
    Fetch,
    FetchReply,
    GroupRef,
    JoinWorld,
    RankCoord,
    RankError,
    Reduce,
    Ref,
    RemoteFunction,
    Report,
    ReportReply,
    Resume,
    SendTensor,
    shard_lookup,
)

#: This rank's worker, once the first ``tensor_ops`` message made it.
_current: list[TensorWorker] = []


def current() -> TensorWorker | None:
    """This rank's :class:`TensorWorker` (None before the first ``tensor_ops``)."""
    return _current[0] if _current else None


#: Records that are not ops (the controller does not count them as issued).
_NOT_OPS = frozenset({Drop, Fetch, Report, Resume})


class MeshTensorError(RuntimeError):
    """A mesh tensor passed to an actor endpoint holds an error on this rank (an op
    that made it failed here), or is not here."""


class _Poisoned(Exception):
    """An input of the op holds an error: the op does not run."""

    def __init__(self, error: RankError):
        self.error = error


class TensorWorker:
    """This rank's local tensors (ref -> tensor or :class:`RankError`) and the loop that
    runs records against them."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        #: ref -> the local tensor (or any value an op produced), or the error it holds
        self.refs: dict[int, Any] = {}
        self._funcs: dict[Any, Callable[..., Any]] = {}
        self.ops_run = 0
        #: gates of the current op's process groups passed already (:meth:`_gates`)
        self._gated: set[str] = set()
        #: the answer to the message's request (a fetch or a report), once run
        self._reply: FetchReply | ReportReply | None = None
        #: records run that the controller counts as ops (all but drops, fetches,
        #: reports and resumes): sent with the rank's stats, for the dashboard
        self.ops_done = 0
        #: root errors since the last :class:`Report` (at most ``MAX_UNREPORTED``), and
        #: how many more failed
        self._unreported: list[RankError] = []
        self._more = 0
        #: the first ref an op defined here (None before): a missing ref below it was
        #: made before this process, by the rank this one restarted
        self.first_ref: int | None = None
        #: set when the stop button stopped this rank: ops until the next
        #: :class:`Resume` do not run and hold it (collectives are passed as stopped)
        self.interrupted: RankError | None = None
        #: records are being run now (a SIGINT then stops them)
        self._running = False
        #: a SIGINT came while records ran: the next record stops this rank
        self._sigint = False
        #: SIGINTs this rank was told of, and how many of them the last Resume followed
        #: (see :meth:`_resume`)
        self._sigints = 0
        self._sigints_resumed = 0
        #: ops numbered up to this were stopped (``tensor_stop``, set by the control
        #: thread; -1: none): those not run yet do not run. Kept past a Resume that does
        #: not reach it (a later stop, told before that Resume was read).
        self._stop_through = -1
        #: the ``through`` of the last Resume: ops up to it are not stopped by a
        #: ``tensor_stop`` (a new controller numbers its ops from 0 again)
        self._resumed_through = -1
        #: ``in_user_code`` of the main thread when the message began (put back after
        #: an interruption that landed before a block could put it back)
        self._outside = False
        #: the rank's main-thread state (what its SIGINT handler reads), found through
        #: that handler: an op's function runs as user code, which SIGINT interrupts
        handler = signal.getsignal(signal.SIGINT)
        main = getattr(handler, "__self__", None)
        self._main = main if hasattr(main, "in_user_code") else None
        if self._main is not None:  # told of every SIGINT, wherever it lands
            told = self._main.on_interrupt

            def on_interrupt() -> None:
                self._sigints += 1
                if self._running:
                    self._sigint = True
                if told is not None:
                    told()

            self._main.on_interrupt = on_interrupt
        # Ranks forked from one template share its RNG state: mesh tensors from
        # ``torch.rand`` differ per rank (Monarch's rule), so each rank draws a seed.
        torch.seed()
        _current[:] = [self]
        shard_lookup[:] = [self.local_shard]

    # -- the loop --------------------------------------------------------------------
    def run(self, payload: bytes | memoryview, request: str | None) -> None:
        """Run one message's records; answer ``request`` (a fetch) at the end."""
        records = pickle.loads(payload)
        rank = context.current_rank().rank
        if self.first_ref is None:
            self._first_defined(records)
        main = self._main
        self._outside = main.in_user_code if main is not None else False
        self._running = True
        try:
            self._run_records(records, rank)
        finally:
            self._running = False
        if request is not None:
            self.outbox.reply(request, self._reply or FetchReply(None), "tensor fetch")
        self._reply = None

    def _run_records(self, records: list[Any], rank: int) -> None:
        self._reply = None
        for rec in records:
            kind = type(rec)
            if (
                self.interrupted is None
                and (self._sigint or self._stop_through >= 0)  # (a stop told: rare)
                and kind not in _NOT_OPS
            ):
                seq = getattr(rec, "seq", -1)
                if self._sigint or self._resumed_through < seq <= self._stop_through:
                    self.interrupted = _stop_error(seq, rank)
                    self._release_busy()
            if kind is CallOp:
                try:
                    self._call(rec, rank)
                except KeyboardInterrupt as exc:  # landed around the op's function
                    self._put_back()  # (even before _call put the flag back)
                    self._interrupt(rec, rank, str(exc))
            elif kind is Drop:
                refs = self.refs
                for r in rec.refs:
                    refs.pop(r, None)
            elif kind is RankCoord:
                self._rank_coord(rec, rank)
            elif kind is Reduce or kind is SendTensor:
                try:
                    if kind is Reduce:
                        self._reduce(rec, rank)
                    else:
                        self._send_tensor(rec, rank)
                except KeyboardInterrupt:  # landed just outside the collective's waits
                    self._put_back()
                    self._stop_collective(rec, rank)
            elif kind is BorrowCreate:
                self._borrow_create(rec, rank)
            elif kind is BorrowDrop:
                self._borrow_drop(rec)
            elif kind is JoinWorld:
                self._join_world(rank)
            elif kind is Resume:
                self._resume(rec)
            elif kind is Fetch:
                self._reply = self._fetch(rec, rank)
            elif kind is Report:
                self._reply = ReportReply(tuple(self._unreported), self._more)
                self._unreported, self._more = [], 0
            if kind not in _NOT_OPS:
                self.ops_done += 1

    def _first_defined(self, records: list[Any]) -> None:
        for rec in records:
            results = getattr(rec, "results", None)
            if results is None:
                result = getattr(rec, "result", None)
                results = () if result is None else (result,)
            if results:
                self.first_ref = min(results)
                return

    def local_shard(self, ref: int) -> Any:
        """The local tensor of ``ref``: a mesh tensor passed to an actor endpoint on
        this mesh arrives as it. Raises what the tensor holds when an op failed on it."""
        rank = context.current_rank().rank
        found = self.refs.get(ref, _MISSING)
        if found is _MISSING:
            err = self.missing(ref, rank)
        elif type(found) is RankError:
            err = found
        else:
            return found
        raise MeshTensorError(
            f"the mesh tensor passed to this endpoint holds an error on rank {rank}: "
            f"{err.error_type}: {err.message}" + (f"\n{err.traceback}" if err.traceback else "")
        )

    # -- ops -------------------------------------------------------------------------
    # -- the stop button -------------------------------------------------------------
    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """A block the stop button interrupts (KeyboardInterrupt): the rank's main
        thread runs "user code" in it (a collective's wait, here)."""
        main = self._main
        if main is None:
            yield
            return
        outer, main.in_user_code = main.in_user_code, True
        try:
            yield
        finally:
            main.in_user_code = outer

    def stop_through(self, through: int) -> None:
        """``tensor_stop`` (the control thread): ops numbered up to ``through`` that have
        not run yet do not run (until the Resume sent after them). One told after the
        Resume sent after it was read is old: ignored."""
        if through > self._resumed_through:
            self._stop_through = through

    def _resume(self, rec: Resume) -> None:
        """:class:`Resume`: run the ops after it again. The controller sent this rank a
        SIGINT before it, through the host agent, and this record straight: should the
        signal come later, it would stop the ops after the record. So the record first
        waits (up to :data:`RESUME_WAIT`) until this rank was told of a SIGINT since the
        last Resume."""
        if self._main is not None:
            deadline = time.monotonic() + RESUME_WAIT
            while self._sigints == self._sigints_resumed and time.monotonic() < deadline:
                time.sleep(0.001)
            self._sigints_resumed = self._sigints
        self.interrupted = None
        self._sigint = False
        self._resumed_through = rec.through
        if self._stop_through <= rec.through:
            self._stop_through = -1

    def _put_back(self) -> None:
        """After an interruption: the main thread is not in user code, as before the
        message (the KeyboardInterrupt may have landed before a block put it back)."""
        if self._main is not None:
            self._main.in_user_code = self._outside

    def _interrupt(self, op: CallOp, rank: int, why: str = "") -> None:
        """The stop button interrupted ``op``: it and the ops until :class:`Resume` hold
        the interruption (a fetch raises it), and do not run. ``why``: what the op was
        doing, when its interruption says (an rref waiting for its actor)."""
        if self.interrupted is None:
            self.interrupted = _stop_error(op.seq, rank, why=why)
            self._release_busy()
        self._pass_gates(op, stopped=True)
        self._poison(op.results, op.mutates, self.interrupted)

    @staticmethod
    def _release_busy() -> None:
        """Abort the groups that have a collective in flight here (one the op's function
        waited in): its peers are released, and the group is formed again at its next
        gate (:mod:`.collectives`)."""
        if "monarch_kernel.rank.pg.backend" in sys.modules:
            from monarch_kernel.rank.pg import distributed

            distributed.release_collectives(collectives.STOP_REASON)

    def _stop_collective(self, op: Reduce | SendTensor, rank: int) -> None:
        """The stop button's KeyboardInterrupt landed in ``op`` outside the waits that
        take it: this rank stops there (the groups with an op in flight are aborted;
        a peer that waits for it is released by its own stop, or by the abort)."""
        if self.interrupted is None:
            self.interrupted = _stop_error(op.seq, rank)
        self._release_busy()
        if isinstance(op, Reduce):
            self.refs[op.result] = self.interrupted
            if op.inplace:
                self.refs[op.src] = self.interrupted
        elif any(d == rank for _, d in op.pairs):
            self.refs[op.result] = self.interrupted

    def _stopped(self, seq: int, rank: int, stop: collectives.Stopped, what: str) -> RankError:
        """The error a stopped collective's outputs hold here; this rank's own stop also
        stops the ops after it (until :class:`Resume`)."""
        if stop.rank == rank:
            self._put_back()
            if self.interrupted is None:
                self.interrupted = _stop_error(seq, rank, what if stop.in_flight else "")
                self._release_busy()
            return self.interrupted
        if stop.in_flight:
            text = f"the stop button interrupted this {what} on rank {stop.rank} while it ran"
        else:
            text = (
                f"rank {stop.rank} was interrupted by the stop button, so this {what} did not run"
            )
        return RankError(seq, rank, "KeyboardInterrupt", f"{STOPPED}: {text}", "")

    def _call(self, op: CallOp, rank: int) -> None:
        self.ops_run += 1
        self._gated = set()
        if self.interrupted is not None:
            self._pass_gates(op, stopped=True)
            self._poison(op.results, op.mutates, self.interrupted)
            return
        main = self._main
        outer = False
        if main is not None:  # the op is user code: the stop button's SIGINT lands in it
            outer, main.in_user_code = main.in_user_code, True
        try:
            self._run_op(op, rank)
        finally:
            if main is not None:
                main.in_user_code = outer

    def _run_op(self, op: CallOp, rank: int) -> None:
        refs = self.refs
        try:
            args = self._resolve(op.args)
            kwargs = self._resolve(op.kwargs) if op.kwargs else {}
        except _Poisoned as p:
            # its process groups' other members must not run the function either
            self._pass_gates(op, poisoned=f"{p.error.error_type}: {p.error.message}")
            self._poison(op.results, op.mutates, p.error)
            return
        try:
            groups = self._gates(op, rank)
        except collectives.Stopped as stop:
            self._pass_gates(op, stopped=True)
            self._poison(op.results, op.mutates, self._stopped(op.seq, rank, stop, "op"))
            return
        except collectives.PeerPoisoned as peer:
            self._pass_gates(op, poisoned=str(peer))
            err = RankError(op.seq, rank, "PeerPoisoned", str(peer), "")
            self._poison(op.results, op.mutates, err)
            return
        except Exception as exc:  # a process-group argument could not be made
            self._pass_gates(op, poisoned=f"{type(exc).__name__}: {exc}")
            self._poison(op.results, op.mutates, self._failed(op.seq, rank, exc))
            return
        if groups:
            args = _with_groups(args, groups)
            kwargs = _with_groups(kwargs, groups)
        try:
            fn = self._function(op.func)
            out = fn(*args, **kwargs)
        except Exception as exc:
            self._poison(op.results, op.mutates, self._failed(op.seq, rank, exc))
            return
        results = op.results
        if not results:
            return
        if op.whole or (len(results) == 1 and isinstance(out, torch.Tensor)):
            refs[results[0]] = out
            return
        leaves = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        for ref, value in zip(results, leaves):
            refs[ref] = value

    def missing(self, ref: int, rank: int) -> RankError:
        """The error of a ref this rank does not hold: dropped, or, for a ref made
        before this worker's first (refs only grow), lost when the rank restarted."""
        first = self.first_ref
        if first is None or ref < first:
            return RankError(
                -1, rank, "TensorLost",
                f"mesh tensor ref {ref} was lost: rank {rank} restarted (or joined the "
                "mesh) after it was made; make it again", "",
            )  # fmt: skip
        return RankError(
            -1, rank, "KeyError", f"mesh tensor ref {ref} is not on this rank (dropped?)", ""
        )

    def _failed(self, seq: int, rank: int, exc: BaseException) -> RankError:
        """The error of op ``seq``, which raised ``exc`` here (kept for the next report)."""
        err = _error(seq, rank, exc)
        if len(self._unreported) < MAX_UNREPORTED:
            self._unreported.append(err)
        else:
            self._more += 1
        return err

    def _poison(self, results: tuple[int, ...], mutates: tuple[int, ...], err: RankError) -> None:
        refs = self.refs
        for r in results:
            refs[r] = err
        for r in mutates:
            refs[r] = err

    def _resolve(self, value: Any) -> Any:
        """``value`` with each :class:`Ref` replaced by this rank's tensor."""
        kind = type(value)
        if kind is Ref:
            try:
                found = self.refs[value.id]
            except KeyError:
                raise _Poisoned(self.missing(value.id, context.current_rank().rank)) from None
            if type(found) is RankError:
                raise _Poisoned(found)
            return found
        if kind is GroupRef:  # DeviceMesh.process_group(dims): after the gates
            return value
        if kind is tuple or kind is list:
            return kind(self._resolve(v) for v in value)
        if kind is dict:
            return {k: self._resolve(v) for k, v in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
            return kind(*(self._resolve(v) for v in value))
        node = SUPPORTED_NODES.get(kind)
        if node is not None:  # another pytree node (an OpaqueRef, whose key is a Ref)
            children, spec = node.flatten_fn(value)
            return node.unflatten_fn([self._resolve(v) for v in children], spec)
        return value

    def _gates(self, op: CallOp, rank: int) -> dict[int, Any]:
        """Pass the gate of each process group among ``op``'s arguments (a remote
        function's ``DeviceMesh.process_group``) with its other members: id of the
        :class:`GroupRef` -> the group. Raises what the first gate raised (the others
        are passed as stopped then, by :meth:`_pass_gates`)."""
        found: dict[int, Any] = {}
        if isinstance(op.func, str):  # a torch op takes no process group
            return found
        for i, ref in enumerate(_group_refs((op.args, op.kwargs))):
            tag = f"{op.seq}.{i}"
            self._gated.add(tag)
            found[id(ref)] = collectives.group_for(
                ref.shape, ref.dims, tag, False, self._interruptible
            )
        return found

    def _pass_gates(self, op: CallOp, stopped: bool = False, poisoned: str | None = None) -> None:
        """Pass the gates of ``op``'s process groups not passed yet, saying the function
        does not run here (stopped by the user, or ``poisoned``), so that it runs on no
        other member either."""
        if isinstance(op.func, str):
            return
        gated = self._gated
        for i, ref in enumerate(_group_refs((op.args, op.kwargs))):
            tag = f"{op.seq}.{i}"
            if tag in gated:
                continue
            gated.add(tag)
            try:
                collectives.group_for(
                    ref.shape, ref.dims, tag, stopped, self._interruptible, poisoned
                )
            except (collectives.Stopped, collectives.PeerPoisoned):
                pass  # what this rank said, or a peer's: the op does not run either way
            except Exception:  # the store is gone (rank 0 died): nobody waits at it
                pass

    def _function(self, func: str | RemoteFunction) -> Callable[..., Any]:
        key: Any = func if isinstance(func, str) else (func.path, func.pickled)
        fn: Any = self._funcs.get(key)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
        if isinstance(func, str):
            ns, name, overload = func.split(".")
            fn = getattr(getattr(getattr(torch.ops, ns), name), overload)
        elif func.path is not None:
            module, _, attr = func.path.rpartition(".")
            fn = getattr(importlib.import_module(module), attr)
            # a module-level ``@remote`` function: its module holds the remote wrapper
            fn = getattr(fn, "remote_impl", fn)
        else:
            import cloudpickle

            assert func.pickled is not None
            fn = cloudpickle.loads(func.pickled)
        found: Callable[..., Any] = fn
        self._funcs[key] = found
        return found

    def _rank_coord(self, op: RankCoord, rank: int) -> None:
        if self.interrupted is not None:
            self.refs[op.result] = self.interrupted
            return
        coords = coordinates(op.shape, rank)
        value = 0
        for dim in op.dims:
            i = op.shape.labels.index(dim)
            value = value * op.shape.sizes[i] + coords[i]
        self.refs[op.result] = torch.tensor(value, dtype=torch.long)

    def _reduce(self, op: Reduce, rank: int) -> None:
        src = self.refs.get(op.src, _MISSING)
        if src is _MISSING:
            src = self.missing(op.src, rank)
        try:
            out = collectives.reduce(op, src, self.interrupted is not None, self._interruptible)
        except collectives.Stopped as stop:
            err = self._stopped(op.seq, rank, stop, "reduction")
            self.refs[op.result] = err
            if op.inplace:
                self.refs[op.src] = err
            return
        except Exception as exc:
            err = self._failed(op.seq, rank, exc)
            self.refs[op.result] = err
            if op.inplace:
                self.refs[op.src] = err
            return
        if isinstance(src, RankError):
            out = src  # joined the collective with zeros; the result stays poisoned
        elif op.out is not None:
            target = self.refs.get(op.out)
            if isinstance(target, torch.Tensor):
                target.copy_(out)
                out = target
        self.refs[op.result] = out
        if op.out is not None and op.out != op.result:
            self.refs[op.out] = out

    def _send_tensor(self, op: SendTensor, rank: int) -> None:
        is_source = any(s == rank for s, _ in op.pairs)
        src = self.refs.get(op.src, _MISSING) if is_source else None
        if src is _MISSING:
            src = self.missing(op.src, rank)
        stopped = self.interrupted is not None
        try:
            out = collectives.send_tensor(op, src, rank, stopped, self._interruptible)
        except collectives.Stopped as stop:
            err = self._stopped(op.seq, rank, stop, "transfer")
            if any(d == rank for _, d in op.pairs):
                self.refs[op.result] = err
            return
        except Exception as exc:
            err = self._failed(op.seq, rank, exc)
            if any(d == rank for _, d in op.pairs):
                self.refs[op.result] = err
            return
        if any(d == rank for _, d in op.pairs):
            self.refs[op.result] = out

    def _borrow_create(self, op: BorrowCreate, rank: int) -> None:
        found = self.refs.get(op.src, _MISSING)
        self.refs[op.result] = self.missing(op.src, rank) if found is _MISSING else found

    def _borrow_drop(self, op: BorrowDrop) -> None:
        refs = self.refs
        if op.mutable:
            # what the borrowing stream's ops broke, the lender sees
            err = next((refs[r] for r in op.borrowed if type(refs.get(r)) is RankError), None)
            if err is not None:
                for r in op.origin:
                    if r in refs:
                        refs[r] = err
        for r in op.borrowed:
            refs.pop(r, None)

    def _join_world(self, rank: int) -> None:
        try:
            collectives.join_world()
        except Exception as exc:  # the next collective fails with it too
            self._failed(-1, rank, exc)

    # -- values back -----------------------------------------------------------------
    def _fetch(self, op: Fetch, rank: int) -> FetchReply:
        errors: list[tuple[int, RankError]] = []
        values: list[Any] | None = [] if op.shard in (rank, ALL_SHARDS) else None
        for i, r in enumerate(op.refs):
            found = self.refs.get(r, _MISSING)
            if found is _MISSING:
                found = self.missing(r, rank)
            if type(found) is RankError:
                errors.append((i, found))
                found = None
            if values is not None:
                if isinstance(found, torch.Tensor):
                    found = found.detach().cpu().clone()
                values.append(found)
        return FetchReply(values, errors)


_MISSING = object()

#: Seconds a Resume waits for the SIGINT sent before it, should the signal (through the
#: host agent) come after the record (straight from the controller).
RESUME_WAIT = 5.0

#: What the outputs of ops the stop button stopped say (a fetch raises it).
STOPPED = "stopped by the user"


def _stop_error(seq: int, rank: int, in_flight: str = "", why: str = "") -> RankError:
    """The interruption that op ``seq`` and the ops after it hold on ``rank`` (until
    :class:`Resume`); ``in_flight``: what was running (a reduction, a transfer);
    ``why``: what the interrupted op said it was doing."""
    if why:
        text = (
            f"interrupted by the stop button on rank {rank} ({why}); this op and the ops "
            "after it in the stopped cell did not run"
        )
    elif in_flight:
        text = (
            f"interrupted by the stop button while this {in_flight} ran on rank {rank} "
            "(it and the ops after it in the stopped cell did not complete)"
        )
    else:
        text = (
            f"interrupted by the stop button on rank {rank} (this op and the ops after it "
            "in the stopped cell did not run)"
        )
    return RankError(seq, rank, "KeyboardInterrupt", f"{STOPPED}: {text}", "")


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to each leaf (containers and pytree nodes are
    walked, in the order :meth:`TensorWorker._resolve` walks them)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_walk(v, leaf) for v in value)
    if kind is dict:
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return kind(*(_walk(v, leaf) for v in value))
    node = SUPPORTED_NODES.get(kind)
    if node is not None:
        children, spec = node.flatten_fn(value)
        return node.unflatten_fn([_walk(v, leaf) for v in children], spec)
    return leaf(value)


def _group_refs(value: Any, found: list[GroupRef] | None = None) -> list[GroupRef]:
    """The process groups among an op's arguments, in the order :func:`_walk` meets
    them (the same on every rank)."""
    found = [] if found is None else found
    kind = type(value)
    if kind is GroupRef:
        found.append(value)
    elif kind is tuple or kind is list or isinstance(value, tuple):  # NamedTuples too
        for v in value:
            _group_refs(v, found)
    elif kind is dict:
        for v in value.values():
            _group_refs(v, found)
    else:
        node = SUPPORTED_NODES.get(kind)
        if node is not None:
            for v in node.flatten_fn(value)[0]:
                _group_refs(v, found)
    return found


def _with_groups(value: Any, groups: dict[int, Any]) -> Any:
    """``value`` with each :class:`GroupRef` replaced by its group (its gate passed)."""
    return _walk(value, lambda v: groups.get(id(v), v) if type(v) is GroupRef else v)


def coordinates(shape: Shape, rank: int) -> tuple[int, ...]:
    """``rank``'s coordinates in ``shape`` (a global rank of it)."""
    index = shape.ranks().index(rank)
    coords = []
    for size in reversed(shape.sizes):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


def _error(seq: int, rank: int, exc: BaseException) -> RankError:
    """The error of op ``seq`` that raised ``exc``; its traceback starts below this
    module's frame (the op's function and what it called)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return RankError(seq, rank, type(exc).__name__, str(exc), text)
