"""Mesh tensors between meshes: ``slice_mesh`` (the same local tensors, seen on a slice of
the mesh) and ``to_mesh`` (a copy on another mesh of the same ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.mesh import DeviceMesh
from monarch_kernel.tensor_engine.tensor import Tensor, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import CallOp, Ref

_ALIAS = "aten.alias.default"
_CLONE = "aten.clone.default"


def _onto(t: Tensor, mesh: DeviceMesh, func: str) -> Tensor:
    """A new mesh tensor on ``mesh`` made by ``func`` (alias or clone) of ``t``'s local
    tensor on each of ``mesh``'s ranks (all of them hold one: they are ``t``'s too)."""
    if t._dropped:
        raise bad_arguments("DROPPED", f"{func}: a mesh tensor that was dropped")
    with on_fakes():
        fake = torch.ops.aten.alias.default(t._fake) if func == _ALIAS else t._fake.clone()
    out = new_tensor(fake, mesh)
    client = mesh.client
    client.issue(mesh.rank_tuple, CallOp(client.new_seq(), func, (Ref(t.ref),), {}, (out.ref,)))
    return out


def slice_mesh(tree: Any, **dims: Any) -> Any:
    """Each mesh tensor of ``tree`` on the ranks at ``dims`` of its mesh: the same local
    tensors (views: writes show in both)."""

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        return _onto(t, t._mesh.slice(**dims), _ALIAS)

    return tree_map(one, tree)


def to_mesh(tree: Any, mesh: Any, stream: Any = None) -> Any:
    """Each mesh tensor of ``tree`` copied onto ``mesh`` (a ``DeviceMesh`` or a
    ``ProcMesh``): an independent copy. Only meshes of the same ranks for now (moving
    data between ranks is not built yet)."""
    if stream is not None:
        raise NotImplementedError("to_mesh(..., stream=...): streams are not built yet")
    if not isinstance(mesh, DeviceMesh):
        from monarch_kernel.tensor_engine.mesh import device_mesh

        mesh = device_mesh(mesh._requester, mesh._shape)
    target: DeviceMesh = mesh

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        src: DeviceMesh = t._mesh
        if src.requester is not target.requester or src.rank_tuple != target.rank_tuple:
            raise NotImplementedError(
                f"to_mesh from {src!r} to {target!r}: moving a tensor to other ranks is "
                "not built yet (slice_mesh to the target's ranks first)"
            )
        return _onto(t, target, _CLONE)

    return tree_map(one, tree)


state.reducers.update(slice_mesh=slice_mesh, to_mesh=to_mesh)
