"""Mesh tensors between meshes: ``slice_mesh`` (the same local tensors, seen on a slice of
the mesh) and ``to_mesh`` (a copy on another mesh of the same process mesh: on the same
ranks a local copy; between ranks point to point, over the re-formable process group of
the transfer's ranks, which the stop button stops as it stops a reduction).

``to_mesh`` matches dims by name (Monarch's rule): a dim of the destination that the
source has must have the same size there, and the rank at a destination coordinate
gets the tensor of the source rank at the same coordinates; a dim the source lacks is
broadcast (every rank along it gets the same tensor); a dim of the source that the
destination lacks is an error.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.mesh import DeviceMesh, device_mesh
from monarch_kernel.tensor_engine.streams import Stream
from monarch_kernel.tensor_engine.tensor import (
    Tensor,
    check_access,
    dropped_error,
    new_tensor,
    on_fakes,
)
from monarch_kernel.wire.tensor_ops import CallOp, Ref, SendTensor

_ALIAS = "aten.alias.default"
_CLONE = "aten.clone.default"


def _onto(t: Tensor, mesh: DeviceMesh, func: str, stream: Stream) -> Tensor:
    """A new mesh tensor on ``mesh`` made by ``func`` (alias or clone) of ``t``'s local
    tensor on each of ``mesh``'s ranks (all of them hold one: they are ``t``'s too)."""
    with on_fakes():
        fake = torch.ops.aten.alias.default(t._fake) if func == _ALIAS else t._fake.clone()
    out = new_tensor(fake, mesh, stream)
    client = mesh.client
    client.issue(mesh.rank_tuple, CallOp(client.new_seq(), func, (Ref(t.ref),), {}, (out.ref,)))
    return out


def slice_mesh(tree: Any, **dims: Any) -> Any:
    """Each mesh tensor of ``tree`` on the ranks at ``dims`` of its mesh: the same local
    tensors (views: writes show in both)."""

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t._dropped:
            raise dropped_error("slice_mesh", t)
        return _onto(t, t._mesh.slice(**dims), _ALIAS, t.stream)

    return tree_map(one, tree)


def _caller_level() -> int:
    """The ``stacklevel`` of the innermost caller outside this package and torch (a
    warning names the user's line)."""
    import os
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = (package, os.path.dirname(torch.__file__))
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def pairs(src: DeviceMesh, dst: DeviceMesh) -> list[tuple[int, int]]:
    """``(source rank, destination rank)`` for every rank of ``dst``, in its order:
    dims matched by name, those ``src`` lacks broadcast (see the module docstring)."""
    src_sh, dst_sh = src.shape, dst.shape
    broadcast = [d for d in dst_sh.labels if d not in src_sh.labels]
    for d in dst_sh.labels:
        if d in src_sh.labels and src_sh.extent[d] != dst_sh.extent[d]:
            raise ValueError(
                f"dimension {d} of destination device_mesh has a different length than "
                "the source tensor"
            )
    missing = [d for d in src_sh.labels if d not in dst_sh.labels]
    if missing:
        raise ValueError(f"destination mesh does not have dimensions {set(missing)}")
    for d in broadcast:
        warnings.warn(
            f"to_mesh is broadcasting along {d} dimension. This is implemented "
            "inefficiently and should only be used for initialization.",
            stacklevel=_caller_level(),
        )
    out = []
    src_ranks = src.rank_tuple
    for coords, rank in zip(itertools.product(*(range(s) for s in dst_sh.sizes)), dst.rank_tuple):
        where = dict(zip(dst_sh.labels, coords))
        out.append((src_ranks[src_sh.index_of({d: where[d] for d in src_sh.labels})], rank))
    return out


def to_mesh(tree: Any, mesh: Any, stream: Any = None) -> Any:
    """Each mesh tensor of ``tree`` copied onto ``mesh`` (a ``DeviceMesh`` or a
    ``ProcMesh`` of the same process mesh), on ``stream`` (default: the tensor's): an
    independent copy. Dims are matched by name, missing ones broadcast (see the module
    docstring); data moves between ranks over the process group of the ranks involved."""
    if not isinstance(mesh, DeviceMesh):
        mesh = device_mesh(mesh._requester, mesh._shape)
    target: DeviceMesh = mesh

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        what = f"{t!r}.to_mesh({target!r})"
        if t._dropped:
            raise dropped_error(what, t)
        if torch.is_grad_enabled() and t.requires_grad:
            raise bad_arguments(
                "REQUIRES_GRAD",
                f"{what}: this tensor requires gradients but to_mesh does not work with "
                "autograd (move t.detach(), or wrap the move in a grad_function)",
            )
        check_access(what, [t])
        src: DeviceMesh = t._mesh
        out_stream = t.stream if stream is None else stream
        if src.requester is not target.requester:
            raise NotImplementedError(
                f"to_mesh from {src!r} to {target!r}: meshes of two process meshes "
                "(only meshes of one process mesh exchange tensors)"
            )
        moves = pairs(src, target)
        if all(s == d for s, d in moves):  # the same ranks: a local copy
            return _onto(t, target, _CLONE, out_stream)
        with on_fakes():
            fake = t._fake.clone()
        out = new_tensor(fake, target, out_stream)
        client = target.client
        client.join_world()
        ranks = tuple(sorted({r for pair in moves for r in pair}))
        op = SendTensor(
            client.new_seq(), t.ref, out.ref, tuple(moves), tuple(t.shape),
            str(t.dtype).removeprefix("torch."),
        )  # fmt: skip
        client.issue(ranks, op)
        return out

    return tree_map(one, tree)


state.reducers.update(slice_mesh=slice_mesh, to_mesh=to_mesh)
