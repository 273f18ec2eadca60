"""Reductions of mesh tensors across ranks (the rank's half of ``reduce``/``reduce_``)
and transfers between them (``to_mesh``), over torch.distributed: gloo on CPU through
the mesh's re-formable process group (:mod:`monarch_kernel.rank.pg`;
``init_process_group`` there picks it), so the stop button and a rank's death release
them as they release any collective of a ``%%remote`` cell, and the group is formed
again in place.

Each collective starts with a *gate* (:func:`_agree`): every member says on the default
group's rendezvous store (the TCPStore rank 0 serves) whether it goes ahead, was stopped
by the user, or needs the group formed again; none starts the collective unless all go
ahead, so a stopped rank never leaves its peers waiting inside gloo, and all members
form an aborted group again at the same point of their op streams.

Invariants:

* Every rank of the process mesh joins the default group first (a ``JoinWorld`` record
  before the first collective).
* The members of a collective run the same collectives in the same order (each rank's
  ops are a subsequence of the controller's one issue order), so no two ranks wait for
  each other in a circle, and a gate is named by its op's ``seq``: the same on every
  member, never reused.
* Each group of ranks reducing or transferring together is made once, by its members
  only (``use_local_synchronization``), after its first gate: a reduction on a slice of
  the mesh needs only the slice's ranks. A transfer runs on the group of its ranks (its
  own group, not the default one), so that a re-form needs only them.
* Every member passes every gate, even when it will not run the collective: a rank the
  user stopped says so (the others raise :class:`Stopped` too, and nobody starts it); a
  rank whose input is poisoned goes ahead with zeros (a transfer: sends its error
  instead) and keeps its output poisoned.
* A gloo op that did not complete (the stop button during it: :class:`Stopped`; a
  peer's abort; the mesh's abort when a rank died) leaves its group aborted here; the
  next gate of that group forms it again on every member before anything runs on it.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.shape import Shape
from monarch_kernel.wire.tensor_ops import RankError, Reduce, SendTensor

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: a sum, divided
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}

#: member ranks -> their group (made once; None: the default group)
_groups: dict[tuple[int, ...], Any] = {}

#: What a transfer's header says (``[status, nbytes]``): the tensor follows, or the
#: source's error (pickled, ``nbytes`` long) does.
_DATA, _ERROR = 0, 1

#: A member's word at a gate: go ahead; form the group again first (it is aborted
#: here); stopped by the user; its input is poisoned (``error`` + what it holds).
_GO, _REFORM, _STOP, _ERROR_WORD = b"go", b"reform", b"stop", b"error"
#: Why the stop button aborts a group (the text its pending ops fail with).
STOP_REASON = "stopped by the user"
#: Longest pause between two looks at the store while a gate waits for its members.
_POLL_MAX = 0.02

#: A context in which the stop button's SIGINT raises KeyboardInterrupt (the worker's:
#: the rank's main thread then runs "user code").
Interruptible = Callable[[], contextlib.AbstractContextManager[None]]


class Stopped(Exception):
    """The stop button stopped a collective: on this rank, or on member ``rank`` before
    it started (then it did not run anywhere). ``in_flight``: it had started."""

    def __init__(self, rank: int, in_flight: bool):
        super().__init__(f"stopped by the user on rank {rank}")
        self.rank = rank
        self.in_flight = in_flight


class PeerPoisoned(Exception):
    """A member of a process group given to a remote function holds an error in the
    op's inputs: the function runs on no member (its collectives would wait for it)."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank}'s input to this op holds an error: {text}")
        self.rank = rank


def join_world() -> None:
    """Join the mesh's default process group if this rank has none (collective: every
    rank of the process mesh runs it, from a :class:`JoinWorld` record)."""
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")  # the rank's env names the rendezvous


def _members(shape: Shape, dims: tuple[str, ...], rank: int) -> tuple[int, ...]:
    """The ranks of ``shape`` reducing together with ``rank`` over ``dims``: those whose
    coordinates differ from ``rank``'s only along ``dims``, in row-major order."""
    labels = shape.labels
    index = shape.ranks().index(rank)
    coords = []
    for size in reversed(shape.sizes):
        coords.append(index % size)
        index //= size
    coords.reverse()
    red = [i for i, label in enumerate(labels) if label in dims]
    base = shape.offset + sum(
        c * shape.strides[i] for i, c in enumerate(coords) if labels[i] not in dims
    )
    ranks = []
    for moving in itertools.product(*(range(shape.sizes[i]) for i in red)):
        ranks.append(base + sum(c * shape.strides[i] for i, c in zip(red, moving)))
    return tuple(ranks)


def _is_world(members: tuple[int, ...]) -> bool:
    return tuple(sorted(members)) == tuple(range(dist.get_world_size()))


def _made(members: tuple[int, ...]) -> Any:
    """The group object of ``members`` if it exists here (the default group's for the
    whole world), else None."""
    if _is_world(members):
        return dist.distributed_c10d._get_default_group()
    return _groups.get(members)


def _group(members: tuple[int, ...]) -> Any:
    """The process group of ``members`` (None: the default group), made by its members
    only, the first time."""
    if _is_world(members):
        return None
    group = _groups.get(members)
    if group is None:
        group = _groups[members] = _new_group(members)
    return group


def _new_group(members: tuple[int, ...]) -> Any:
    """``new_group(members)`` made by the members only, named after them alone. torch's
    own name for such a group hashes the members *and the number of groups the process
    made before*, which differs between members that each reduced on slices of their own
    (then their halves of one group would meet under two names, and wait forever)."""
    c10d = dist.distributed_c10d
    name = c10d.GroupName("mk-te-" + "-".join(map(str, members)))
    named = c10d._process_group_name
    c10d._process_group_name = lambda ranks, use_hashed_name: name
    try:
        return dist.new_group(list(members), use_local_synchronization=True)
    finally:
        c10d._process_group_name = named


def group_for(
    shape: Shape,
    dims: tuple[str, ...],
    tag: str,
    stopped: bool,
    interruptible: Interruptible,
    poisoned: str | None = None,
) -> Any:
    """The ``torch.distributed`` group of this rank and the ranks of ``shape`` that
    differ from it only along ``dims`` (a remote function's ``process_group`` argument),
    once its members passed the gate ``tag`` (made by them the first time; the default
    group when it is every rank). ``stopped``: the user stopped this rank (raises
    :class:`Stopped`); ``poisoned``: the op's input holds this error here, so the
    function runs nowhere (raises :class:`PeerPoisoned`, here and on the others)."""
    join_world()
    rank = dist.get_rank()
    members = _members(shape, dims, rank)
    _agree(tag, members, rank, stopped, interruptible, poisoned)
    group = _group(members)
    return dist.group.WORLD if group is None else group


def reduce(op: Reduce, src: Any, stopped: bool, interruptible: Interruptible) -> Any:
    """The result of ``op`` on this rank; ``src`` is the local input or the
    :class:`RankError` it holds (it joins with zeros). ``stopped``: the user stopped
    this rank (it passes the gate saying so and raises :class:`Stopped`)."""
    join_world()
    rank = dist.get_rank()
    members = _members(op.shape, op.dims, rank)
    n = len(members)
    index = members.index(rank)
    if n > 1:
        _agree(str(op.seq), members, rank, stopped, interruptible)
    elif stopped:
        raise Stopped(rank, in_flight=False)
    group = _group(members) if n > 1 else None
    if isinstance(src, RankError):
        src = torch.zeros(op.size, dtype=getattr(torch, op.dtype))
    if n == 1:  # nothing to exchange
        buf = src if op.inplace else src.detach().clone()
        if op.reduction == "stack":
            return buf if op.scatter else buf.unsqueeze(0)
        return buf[0].clone() if op.scatter else buf
    if op.reduction == "stack":
        parts = [torch.empty_like(src) for _ in range(n)]
        work = dist.all_gather(parts, src.contiguous(), group=group, async_op=True)
        _finish(work, group, members, rank, str(op.seq), interruptible)
        if not op.scatter:
            return torch.stack(parts)
        # all-to-all: row ``index`` of every rank's input, in rank order
        out = torch.stack([p[index] for p in parts])
        if op.inplace:
            src.copy_(out)
            return src
        return out
    buf = src if op.inplace and not op.scatter else src.detach().clone()
    work = dist.all_reduce(buf, op=_OPS[op.reduction], group=group, async_op=True)
    _finish(work, group, members, rank, str(op.seq), interruptible)
    if op.reduction == "avg":
        if buf.is_floating_point():
            buf.div_(n)
        else:
            buf.floor_divide_(n)
    if op.scatter:  # reduce-scatter: this rank's row of the reduced tensor
        return buf[index].clone()
    return buf


def send_tensor(
    op: SendTensor, src: Any, rank: int, stopped: bool, interruptible: Interruptible
) -> Any:
    """This rank's part of ``op`` (``to_mesh`` between ranks): send ``src`` (the local
    tensor or the :class:`RankError` it holds) to the destinations it is the source of,
    and return what it received as a destination (None where it is none). Pairs run in
    the order given, the same on every rank, so blocking sends and receives never wait
    for each other in a circle. ``stopped``: as for :func:`reduce`."""
    join_world()
    members = tuple(sorted({r for pair in op.pairs for r in pair}))
    tag = str(op.seq)
    if len(members) > 1:
        _agree(tag, members, rank, stopped, interruptible)
    elif stopped:
        raise Stopped(rank, in_flight=False)
    group = _group(members) if len(members) > 1 else None
    out: Any = None
    for s, d in op.pairs:
        if s == rank and d == rank:
            out = src if isinstance(src, RankError) else src.detach().clone()
        elif s == rank:
            for t in _outgoing(src):
                _finish(dist.isend(t, d, group=group), group, members, rank, tag, interruptible)
        elif d == rank:
            out = _recv_one(op, s, group, members, rank, interruptible)
    return out


def _outgoing(src: Any) -> list[torch.Tensor]:
    """What a source sends: a header, then the tensor or its pickled error."""
    if isinstance(src, RankError):
        blob = torch.frombuffer(bytearray(pickle.dumps(src)), dtype=torch.uint8)
        return [torch.tensor([_ERROR, blob.numel()], dtype=torch.long), blob]
    return [torch.tensor([_DATA, 0], dtype=torch.long), src.detach().contiguous()]


def _recv_one(
    op: SendTensor,
    src: int,
    group: Any,
    members: tuple[int, ...],
    rank: int,
    interruptible: Interruptible,
) -> Any:
    tag = str(op.seq)

    def recv(t: torch.Tensor) -> torch.Tensor:
        _finish(dist.irecv(t, src, group=group), group, members, rank, tag, interruptible)
        return t

    status, nbytes = (int(v) for v in recv(torch.empty(2, dtype=torch.long)))
    if status == _ERROR:
        blob = recv(torch.empty(nbytes, dtype=torch.uint8))
        return pickle.loads(blob.numpy().tobytes())
    return recv(torch.empty(op.size, dtype=getattr(torch, op.dtype)))


# -- the gate and the ops in flight ----------------------------------------------------
def _store() -> Any:
    """The default group's rendezvous store (rank 0 serves it)."""
    return dist.distributed_c10d._get_default_store()


def _reformable(group: Any) -> Any:
    """``group`` (or the default group for None) if it is a re-formable group, else None."""
    if group is None or group is dist.group.WORLD:
        group = dist.distributed_c10d._get_default_group()
    from monarch_kernel.rank.pg.reformable import ReformableGroup

    return group if isinstance(group, ReformableGroup) else None


def _prefix(tag: str, members: tuple[int, ...]) -> str:
    return f"mk/te/{tag}/{'-'.join(map(str, sorted(members)))}/"


def _agree(
    tag: str,
    members: tuple[int, ...],
    rank: int,
    stopped: bool,
    interruptible: Interruptible,
    poisoned: str | None = None,
) -> None:
    """The gate before collective ``tag`` of ``members``: say this rank's word on the
    store and wait (interruptibly) for every member's. Raises :class:`Stopped` if a
    member was stopped (this one included), :class:`PeerPoisoned` if one's input is
    poisoned (``poisoned``: this rank's is); forms the group again first if a member's
    copy of it is aborted."""
    store = _store()
    prefix = _prefix(tag, members)
    mine = prefix + str(rank)
    existing = _made(members)
    group = _reformable(existing) if existing is not None else None
    if stopped:
        store.set(mine, _STOP)
        _leave(store, prefix, members)
        raise Stopped(rank, in_flight=False)
    if poisoned is not None:
        word = _ERROR_WORD + b" " + poisoned.encode()
    elif group is not None and group.aborted is not None:
        word = _REFORM
    else:
        word = _GO
    store.set(mine, word)
    keys = [prefix + str(r) for r in members]
    # The mesh aborts every group when a rank dies (the default group says so too), or
    # re-forms them around the restarted rank (on another thread of this rank, while
    # this one waits): either way a member this gate waits for is gone.
    watched = [g for g in (group, _reformable(None)) if g is not None]
    seen = [(g.aborted, g.generation) for g in watched]
    try:
        with interruptible():
            pause = 0.0002
            while not store.check(keys):
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
                now = [(g.aborted, g.generation) for g in watched]
                if now != seen:  # the mesh aborted it or formed it again (a rank died)
                    missing = [r for r in members if not store.check([prefix + str(r)])]
                    why = next(w[0] or "formed again" for w, was in zip(now, seen) if w != was)
                    raise RuntimeError(
                        f"the mesh aborted the process group while rank {rank} waited for "
                        f"rank(s) {missing} to start a collective: {why}"
                    )
    except KeyboardInterrupt:
        # Those that have not read this rank's word yet start nothing; those that have
        # wait for it inside the collective until their own stop (or this abort, which
        # closes this rank's connections) releases them: formed again at the next gate.
        store.set(mine, _STOP)
        if group is not None:
            store.set(prefix + "stopped", str(rank))  # what their failed op then says
            group.abort(STOP_REASON)
        _leave(store, prefix, members)
        raise Stopped(rank, in_flight=False) from None
    words = store.multi_get(keys)
    _leave(store, prefix, members)
    for r, w in zip(members, words):
        if w == _STOP:
            raise Stopped(r, in_flight=False)
    for r, w in zip(members, words):
        if w.startswith(_ERROR_WORD):
            if r == rank:
                raise PeerPoisoned(r, poisoned or "")
            raise PeerPoisoned(r, w[len(_ERROR_WORD) + 1 :].decode(errors="replace"))
    if _REFORM in words and existing is not None:
        _form_again(existing, prefix)


def _leave(store: Any, prefix: str, members: tuple[int, ...]) -> None:
    """This rank is done with gate ``prefix``: the last member to leave deletes its keys
    (the store is rank 0's memory)."""
    if store.add(prefix + "left", 1) == len(members):
        for r in members:
            store.delete_key(prefix + str(r))
        store.delete_key(prefix + "left")


def _form_again(group: Any, prefix: str) -> None:
    """Form ``group`` again with its members (each is here, at the same gate)."""
    reformable = _reformable(group)
    if reformable is None:  # plain gloo (MONARCH_KERNEL_REFORMABLE_PG=0): cannot be
        raise RuntimeError(
            "a member's process group was aborted and it is not re-formable (plain gloo): "
            "restart the mesh"
        )
    from monarch_kernel.rank.pg.backend import form_group

    form_group(reformable, prefix + "form/")


def _finish(
    work: Any,
    group: Any,
    members: tuple[int, ...],
    rank: int,
    tag: str,
    interruptible: Interruptible,
) -> None:
    """Wait for ``work`` (an op of collective ``tag`` on ``group``): the stop button
    interrupts the wait (the group is aborted here: its pending op fails on the other
    members too, and it is formed again at its next gate). Any failure leaves the group
    aborted here; a failure caused by a member's stop raises :class:`Stopped`."""
    stopped_key = _prefix(tag, members) + "stopped"
    try:
        with interruptible():
            work.wait()
        return
    except KeyboardInterrupt:
        reformable = _reformable(group)
        with contextlib.suppress(Exception):  # said before the abort the others see
            _store().set(stopped_key, str(rank))
        if reformable is not None:
            reformable.abort(STOP_REASON)
        raise Stopped(rank, in_flight=True) from None
    except Exception:
        reformable = _reformable(group)
        if reformable is not None and reformable.aborted is None:
            reformable.abort("a collective on it failed")
        try:
            store = _store()
            by = int(store.get(stopped_key)) if store.check([stopped_key]) else None
        except Exception:  # the store is gone with rank 0: the error says more
            by = None
        if by is not None:
            raise Stopped(by, in_flight=True) from None
        raise
