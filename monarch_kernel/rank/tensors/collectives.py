"""Reductions of mesh tensors across ranks (the rank's half of ``reduce``/``reduce_``),
over torch.distributed: gloo on CPU through the mesh's re-formable process group
(:mod:`monarch_kernel.rank.pg`; ``init_process_group`` there picks it), so the stop
button and a rank's death treat them as any collective of a ``%%remote`` cell.

Invariants: every rank of the device mesh runs the same reductions in the same order
(they come in one ordered stream); each group of ranks reducing together is made once per
rank set and made by *every* rank of the mesh in the same order (``new_group`` is
collective); a rank whose input is poisoned still joins, with zeros, so its peers do not
hang, and keeps its output poisoned.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.shape import Shape
from monarch_kernel.wire.tensor_ops import RankError, Reduce

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


def _ensure_world(shape: Shape) -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")  # the rank's env names the rendezvous
    if sorted(shape.ranks()) != list(range(dist.get_world_size())):
        raise NotImplementedError(
            "reduce over a slice of a process mesh is not built yet: reduce on the whole mesh"
        )


def _members(shape: Shape, dims: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every group of ranks reducing together over ``dims``, in a fixed order."""
    labels = shape.labels
    keep = [i for i, label in enumerate(labels) if label not in dims]
    red = [i for i, label in enumerate(labels) if label in dims]
    groups = []
    for fixed in itertools.product(*(range(shape.sizes[i]) for i in keep)):
        ranks = []
        for moving in itertools.product(*(range(shape.sizes[i]) for i in red)):
            flat = shape.offset
            for i, c in zip(keep, fixed):
                flat += c * shape.strides[i]
            for i, c in zip(red, moving):
                flat += c * shape.strides[i]
            ranks.append(flat)
        groups.append(tuple(ranks))
    return groups


def _group(shape: Shape, dims: tuple[str, ...], rank: int) -> tuple[Any, tuple[int, ...]]:
    groups = _members(shape, dims)
    world = tuple(range(dist.get_world_size()))
    mine = next(g for g in groups if rank in g)
    if tuple(sorted(mine)) == world:
        return None, mine
    if mine not in _groups:
        for g in groups:  # collective: every rank makes every group, in one order
            if g not in _groups:
                _groups[g] = dist.new_group(list(g))
    return _groups[mine], mine


def reduce(op: Reduce, src: Any) -> Any:
    """The result of ``op`` on this rank; ``src`` is the local input or the
    :class:`RankError` it holds (it joins with zeros)."""
    _ensure_world(op.shape)
    rank = dist.get_rank()
    group, members = _group(op.shape, op.dims, rank)
    n = len(members)
    index = members.index(rank)
    if isinstance(src, RankError):
        src = torch.zeros(op.size, dtype=getattr(torch, op.dtype))
    if op.reduction == "stack":
        parts = [torch.empty_like(src) for _ in range(n)]
        dist.all_gather(parts, src.contiguous(), group=group)
        if not op.scatter:
            return torch.stack(parts)
        # all-to-all: chunk ``index`` of every rank's input, in rank order
        out = torch.cat([p.chunk(n)[index] for p in parts])
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
    if op.scatter:  # reduce-scatter: this rank's chunk of the reduced tensor
        return buf.chunk(n)[index].clone()
    return buf
