"""Reductions of mesh tensors across ranks (the rank's half of ``reduce``/``reduce_``),
over torch.distributed: gloo on CPU through the mesh's re-formable process group
(:mod:`monarch_kernel.rank.pg`; ``init_process_group`` there picks it), so the stop
button and a rank's death treat them as any collective of a ``%%remote`` cell.

Invariants: every rank of the process mesh joins the default group first (a
``JoinWorld`` record before the first collective); the ranks of a device mesh run the
same reductions and transfers in the same order (each rank's ops are a subsequence of
the controller's one issue order, so no two ranks wait for each other in a circle);
each group of ranks reducing together is made once, by its members only
(``use_local_synchronization``), so a reduction on a slice of the mesh needs only the
slice's ranks; a rank whose input is poisoned still joins, with zeros (a transfer:
sends its error instead), so its peers do not hang, and keeps its output poisoned.
"""

from __future__ import annotations

import itertools
import pickle
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


def _group(shape: Shape, dims: tuple[str, ...], rank: int) -> tuple[Any, tuple[int, ...]]:
    """The process group of ``rank``'s reduction over ``dims`` (made by its members only,
    the first time)."""
    mine = _members(shape, dims, rank)
    if tuple(sorted(mine)) == tuple(range(dist.get_world_size())):
        return None, mine
    group = _groups.get(mine)
    if group is None:
        group = _groups[mine] = dist.new_group(list(mine), use_local_synchronization=True)
    return group, mine


def group_for(shape: Shape, dims: tuple[str, ...]) -> Any:
    """The ``torch.distributed`` group of this rank and the ranks of ``shape`` that
    differ from it only along ``dims`` (a remote function's ``process_group`` argument):
    made by its members the first time; the default group when it is every rank."""
    join_world()
    group, _ = _group(shape, dims, dist.get_rank())
    return dist.group.WORLD if group is None else group


def reduce(op: Reduce, src: Any) -> Any:
    """The result of ``op`` on this rank; ``src`` is the local input or the
    :class:`RankError` it holds (it joins with zeros)."""
    join_world()
    rank = dist.get_rank()
    group, members = _group(op.shape, op.dims, rank)
    n = len(members)
    index = members.index(rank)
    if isinstance(src, RankError):
        src = torch.zeros(op.size, dtype=getattr(torch, op.dtype))
    if n == 1:  # nothing to exchange
        buf = src if op.inplace else src.detach().clone()
        if op.reduction == "stack":
            return buf if op.scatter else buf.unsqueeze(0)
        return buf[0].clone() if op.scatter else buf
    if op.reduction == "stack":
        parts = [torch.empty_like(src) for _ in range(n)]
        dist.all_gather(parts, src.contiguous(), group=group)
        if not op.scatter:
            return torch.stack(parts)
        # all-to-all: row ``index`` of every rank's input, in rank order
        out = torch.stack([p[index] for p in parts])
        if op.inplace:
            src.copy_(out)
            return src
        return out
    buf = src if op.inplace and not op.scatter else src.detach().clone()
    dist.all_reduce(buf, op=_OPS[op.reduction], group=group)
    if op.reduction == "avg":
        if buf.is_floating_point():
            buf.div_(n)
        else:
            buf.floor_divide_(n)
    if op.scatter:  # reduce-scatter: this rank's row of the reduced tensor
        return buf[index].clone()
    return buf


def send_tensor(op: SendTensor, src: Any, rank: int) -> Any:
    """This rank's part of ``op`` (``to_mesh`` between ranks): send ``src`` (the local
    tensor or the :class:`RankError` it holds) to the destinations it is the source of,
    and return what it received as a destination (None where it is none). Pairs run in
    the order given, the same on every rank, so blocking sends and receives never wait
    for each other in a circle."""
    join_world()
    out: Any = None
    for s, d in op.pairs:
        if s == rank and d == rank:
            out = src if isinstance(src, RankError) else src.detach().clone()
        elif s == rank:
            _send_one(src, d)
        elif d == rank:
            out = _recv_one(op, s)
    return out


def _send_one(src: Any, dst: int) -> None:
    if isinstance(src, RankError):
        blob = torch.frombuffer(bytearray(pickle.dumps(src)), dtype=torch.uint8)
        dist.send(torch.tensor([_ERROR, blob.numel()], dtype=torch.long), dst)
        dist.send(blob, dst)
        return
    dist.send(torch.tensor([_DATA, 0], dtype=torch.long), dst)
    dist.send(src.detach().contiguous(), dst)


def _recv_one(op: SendTensor, src: int) -> Any:
    header = torch.empty(2, dtype=torch.long)
    dist.recv(header, src)
    status, nbytes = (int(v) for v in header)
    if status == _ERROR:
        blob = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(blob, src)
        return pickle.loads(blob.numpy().tobytes())
    out = torch.empty(op.size, dtype=getattr(torch, op.dtype))
    dist.recv(out, src)
    return out
