"""``reduce`` / ``reduce_``: mesh tensors combined across named dims of their mesh (the
only way data crosses ranks), run on the ranks over gloo
(:mod:`monarch_kernel.rank.tensors.collectives`).

``sum avg product min max band bor bxor`` all-reduce; ``stack`` all-gathers into a new
leading dim; with ``scatter=True``, ``sum`` (etc.) reduce-scatters along dim 0 and
``stack`` is an all-to-all along dim 0. ``dims=()`` means every dim of the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.tensor import Tensor, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import Reduce

#: The reductions ``reduce`` knows.
REDUCTIONS = ("stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def _dims(t: Tensor, dims: str | Sequence[str]) -> tuple[str, ...]:
    labels = t._mesh.shape.labels
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if not names:
        return tuple(labels)
    for d in names:
        if d not in labels:
            raise KeyError(f"{d!r} is not a dim of {t._mesh!r} (dims {list(labels)})")
    if len(set(names)) != len(names):
        raise ValueError(f"reducing the same dimension twice: {names}")
    return names


def _one(t: Any, dims: Any, reduction: str, scatter: bool, mesh: Any, inplace: bool) -> Any:
    if not isinstance(t, Tensor):
        return t
    if mesh is not None:
        raise NotImplementedError("reduce(..., mesh=...) is not supported (as in Monarch)")
    if t._dropped:
        raise bad_arguments("DROPPED", "reduce: a mesh tensor that was dropped")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; one of {', '.join(REDUCTIONS)}")
    names = _dims(t, dims)
    m = t._mesh
    n = m.size(names)
    size = tuple(t.shape)
    if scatter:
        if not size or size[0] % n:
            raise TypeError(
                f"reduce with scatter=True over {n} ranks needs dim 0 of the tensor "
                f"divisible by {n}, got shape {size}"
            )
        out_size = size if reduction == "stack" else (size[0] // n, *size[1:])
    else:
        out_size = (n, *size) if reduction == "stack" else size
    if inplace and out_size != size:
        raise TypeError(f"reduce_ with {reduction!r} changes the shape {size} -> {out_size}")
    client = m.client
    if inplace:
        result = t
        with on_fakes():
            t._fake.add_(0)  # the fake's version moves, as the tensor is written
    else:
        with on_fakes():
            fake = torch.empty(out_size, dtype=t.dtype)
        result = new_tensor(fake, m)
    op = Reduce(
        client.new_seq(), t.ref, result.ref, m.shape, names, reduction,
        size, str(t.dtype).removeprefix("torch."), scatter, inplace,
    )  # fmt: skip
    client.issue(m.rank_tuple, op)
    return result


def reduce(
    tensors: Any,
    dims: str | Sequence[str] = (),
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
) -> Any:
    """New mesh tensors: each mesh tensor of ``tensors`` (a pytree) reduced across
    ``dims`` of its mesh (all dims by default) with ``reduction``."""
    return tree_map(lambda t: _one(t, dims, reduction, scatter, mesh, False), tensors)


def reduce_(
    tensors: Any,
    dims: str | Sequence[str] = (),
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
) -> Any:
    """:func:`reduce` in place: each mesh tensor of ``tensors`` is overwritten with the
    result (the reduction must keep its shape)."""
    return tree_map(lambda t: _one(t, dims, reduction, scatter, mesh, True), tensors)


state.reducers.update(reduce=reduce, reduce_=reduce_)
