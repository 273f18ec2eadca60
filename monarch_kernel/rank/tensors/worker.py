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
"""

from __future__ import annotations

import importlib
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from monarch_kernel.rank import context
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.tensors import collectives
from monarch_kernel.shape import Shape
from monarch_kernel.wire.tensor_ops import (
    ALL_SHARDS,
    MAX_UNREPORTED,
    CallOp,
    Drop,
    Fetch,
    FetchReply,
    RankCoord,
    RankError,
    Reduce,
    Ref,
    RemoteFunction,
    Report,
    ReportReply,
)

#: This rank's worker, once the first ``tensor_ops`` message made it.
_current: list[TensorWorker] = []


def current() -> TensorWorker | None:
    """This rank's :class:`TensorWorker` (None before the first ``tensor_ops``)."""
    return _current[0] if _current else None


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
        #: root errors since the last :class:`Report` (at most ``MAX_UNREPORTED``), and
        #: how many more failed
        self._unreported: list[RankError] = []
        self._more = 0
        # Ranks forked from one template share its RNG state: mesh tensors from
        # ``torch.rand`` differ per rank (Monarch's rule), so each rank draws a seed.
        torch.seed()
        _current[:] = [self]

    # -- the loop --------------------------------------------------------------------
    def run(self, payload: bytes | memoryview, request: str | None) -> None:
        """Run one message's records; answer ``request`` (a fetch) at the end."""
        records = pickle.loads(payload)
        rank = context.current_rank().rank
        reply: FetchReply | ReportReply | None = None
        for rec in records:
            kind = type(rec)
            if kind is CallOp:
                self._call(rec, rank)
            elif kind is Drop:
                refs = self.refs
                for r in rec.refs:
                    refs.pop(r, None)
            elif kind is RankCoord:
                self._rank_coord(rec, rank)
            elif kind is Reduce:
                self._reduce(rec, rank)
            elif kind is Fetch:
                reply = self._fetch(rec, rank)
            elif kind is Report:
                reply = ReportReply(tuple(self._unreported), self._more)
                self._unreported, self._more = [], 0
        if request is not None:
            self.outbox.reply(request, reply or FetchReply(None), "tensor fetch")

    # -- ops -------------------------------------------------------------------------
    def _call(self, op: CallOp, rank: int) -> None:
        self.ops_run += 1
        refs = self.refs
        try:
            args = self._resolve(op.args)
            kwargs = self._resolve(op.kwargs) if op.kwargs else {}
        except _Poisoned as p:
            self._poison(op.results, op.mutates, p.error)
            return
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
                raise _Poisoned(
                    RankError(-1, context.current_rank().rank, "KeyError",
                              f"mesh tensor ref {value.id} is not on this rank (dropped?)", "")
                ) from None  # fmt: skip
            if type(found) is RankError:
                raise _Poisoned(found)
            return found
        if kind is tuple or kind is list:
            return kind(self._resolve(v) for v in value)
        if kind is dict:
            return {k: self._resolve(v) for k, v in value.items()}
        return value

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
        else:
            import cloudpickle

            assert func.pickled is not None
            fn = cloudpickle.loads(func.pickled)
        found: Callable[..., Any] = fn
        self._funcs[key] = found
        return found

    def _rank_coord(self, op: RankCoord, rank: int) -> None:
        coords = coordinates(op.shape, rank)
        value = 0
        for dim in op.dims:
            i = op.shape.labels.index(dim)
            value = value * op.shape.sizes[i] + coords[i]
        self.refs[op.result] = torch.tensor(value, dtype=torch.long)

    def _reduce(self, op: Reduce, rank: int) -> None:
        src = self.refs.get(op.src)
        if src is None:
            src = RankError(op.seq, rank, "KeyError", f"ref {op.src} is not on this rank", "")
        try:
            out = collectives.reduce(op, src)
        except Exception as exc:
            err = self._failed(op.seq, rank, exc)
            self.refs[op.result] = err
            if op.inplace:
                self.refs[op.src] = err
            return
        if isinstance(src, RankError):
            out = src  # joined the collective with zeros; the result stays poisoned
        self.refs[op.result] = out

    # -- values back -----------------------------------------------------------------
    def _fetch(self, op: Fetch, rank: int) -> FetchReply:
        errors: list[tuple[int, RankError]] = []
        values: list[Any] | None = [] if op.shard in (rank, ALL_SHARDS) else None
        for i, r in enumerate(op.refs):
            found = self.refs.get(r, _MISSING)
            if found is _MISSING:
                found = RankError(
                    -1, rank, "KeyError", f"mesh tensor ref {r} is not on this rank", ""
                )
            if type(found) is RankError:
                errors.append((i, found))
                found = None
            if values is not None:
                if isinstance(found, torch.Tensor):
                    found = found.detach().cpu().clone()
                values.append(found)
        return FetchReply(values, errors)


_MISSING = object()


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
