"""``reduce`` / ``reduce_``: mesh tensors combined across named dims of their mesh (the
only way data crosses ranks), run on the ranks over gloo
(:mod:`monarch_kernel.rank.tensors.collectives`).

``sum avg product min max band bor bxor`` all-reduce; ``stack`` all-gathers into a new
leading dim; with ``scatter=True`` (one dim of size n; the tensor's dim 0 is n),
``sum`` (etc.) reduce-scatters (rank i keeps row i of the sum: dim 0 goes) and
``stack`` is an all-to-all (rank i gets row i of every rank's tensor, stacked).
``dims=()`` means every dim of the mesh. Monarch's rules and messages; a reduction on a
slice of a process mesh runs on the slice's ranks only.

The stop button stops a reduction wherever it is on the ranks (waiting for a peer held
in a remote function, or in flight): its output and the ops queued after it hold
"stopped by the user", and the next cell's reductions run on the group formed again in
place (:mod:`monarch_kernel.rank.tensors.collectives`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.tensor import (
    Tensor,
    check_access,
    check_stream,
    dropped_error,
    new_tensor,
    on_fakes,
)
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


def _one(
    t: Any, dims: Any, reduction: str, scatter: bool, mesh: Any, inplace: bool, out: Any = None
) -> Any:
    if not isinstance(t, Tensor):
        return t
    if mesh is not None:
        raise NotImplementedError("reduce(..., mesh=...) is not supported (as in Monarch)")
    if t._dropped:
        raise dropped_error("reduce", t)
    names = _dims(t, dims)
    if len(names) > 1 and (reduction == "stack" or scatter):
        raise ValueError(
            f"reduction {reduction} or scatter = {scatter} is not valid for multiple dimensions"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction} not supported, reductions are {REDUCTIONS}")
    what = f"reduce({t!r}, {names}, reduction={reduction})"
    if torch.is_grad_enabled() and t.requires_grad:
        raise bad_arguments(
            "REQUIRES_GRAD",
            f"{what}: this tensor requires gradients but this operation does not work with "
            "autograd (reduce under torch.no_grad(), or reduce t.detach())",
        )
    stream = check_stream(what, [t], state.active_stream())
    check_access(what, [t], [t] if inplace else [x for x in (out,) if x is not None])
    m = t._mesh
    n = m.size(names)
    size = tuple(t.shape)
    if scatter:
        if not size or size[0] != n:
            raise TypeError(
                f"When scattering results the outer most dimension of tensor with sizes "
                f"({list(size)}) must match the size ({n})"
            )
        out_size = size if reduction == "stack" else size[1:]
    else:
        out_size = (n, *size) if reduction == "stack" else size
    client = m.client
    if inplace:
        if out is not None:
            raise ValueError("`out` cannot be used with inplace reduce.")
        if scatter:
            raise ValueError(
                f"reduction {reduction} is not valid for in-place operation because "
                "the output size will not match the input size."
            )
        if out_size != size:
            raise TypeError(f"reduce_ with {reduction!r} changes the shape {size} -> {out_size}")
        result = t
        with on_fakes():
            t._fake.add_(0)  # the fake's version moves, as the tensor is written
    elif out is not None:
        if not isinstance(out, Tensor) or out._mesh != m:
            raise bad_arguments("WRONG_MESH", f"{what}: out= must be a mesh tensor of {m!r}")
        if tuple(out.shape) != out_size:
            raise ValueError(
                f"The given output shape, {out.shape}, is incorrect. "
                f"Reduce expects the shape to be {torch.Size(out_size)}."
            )
        result = out
        with on_fakes():
            out._fake.add_(0)
    else:
        with on_fakes():
            fake = torch.empty(out_size, dtype=t.dtype)
        result = new_tensor(fake, m, stream)
    client.join_world()
    op = Reduce(
        client.new_seq(), t.ref, result.ref, m.shape, names, reduction,
        size, str(t.dtype).removeprefix("torch."), scatter, inplace,
        None if out is None else out.ref,
    )  # fmt: skip
    client.issue(m.rank_tuple, op)
    return result


def reduce(
    tensors: Any,
    dims: str | Sequence[str] = (),
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
    out: Any = None,
) -> Any:
    """New mesh tensors: each mesh tensor of ``tensors`` (a pytree) reduced across
    ``dims`` of its mesh (all dims by default) with ``reduction``; ``out``: a mesh
    tensor the result is written into (and returned). ``stack`` and ``scatter`` take
    one dim; with ``scatter``, dim 0 of the tensor is the dim's size."""
    return tree_map(lambda t: _one(t, dims, reduction, scatter, mesh, False, out), tensors)


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
