"""Mesh tensors as arguments of actor endpoints (Monarch's rule): a mesh tensor passed to
an endpoint of an actor on the same process mesh arrives on each rank as that rank's
local tensor, after every op issued before the call.

The actor layer's packing of a call's arguments calls :func:`local_shards` when this
module is loaded (mesh tensors exist only then). It replaces each mesh tensor by a
:class:`~monarch_kernel.wire.tensor_ops.LocalShard` (its ref) and sends the ops buffered
for the mesh first: ops and actor calls reach a rank through the one ordered channel of
its process mesh, and the rank runs a call only after the ``tensor_ops`` messages before
it, so the endpoint sees the tensor those ops left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.calls.requester import Requester
from monarch_kernel.tensor_engine.tensor import Tensor, check_access, dropped_error
from monarch_kernel.wire.tensor_ops import LocalShard


def local_shards(
    requester: Requester, ranks: Sequence[int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a call to actors on ``ranks`` of ``requester``'s process
    mesh, with each mesh tensor (in tuples, lists, dicts) replaced by its ref, read on
    each rank as the local tensor. Unchanged (the same objects) when none is there.
    A mesh tensor of another process mesh, or not on every called rank, raises
    ``ValueError``; a dropped or mutably borrowed one raises as an op would."""
    if not _holds_mesh_tensor(args) and not _holds_mesh_tensor(kwargs):
        return args, kwargs  # the common case, on every actor call: a quick walk only
    flat, spec = tree_flatten((args, kwargs))
    clients = []
    for x in flat:
        if not isinstance(x, Tensor):
            continue
        what = "an actor endpoint's argument"
        if x._dropped:
            raise dropped_error(what, x)
        check_access(what, (x,))
        mesh = x._mesh
        if mesh.requester is not requester or not set(ranks) <= set(mesh.rank_tuple):
            raise ValueError(
                "monarch Tensors sent to an actor must be located on the same process as "
                f"the actor: this one is on {mesh!r}, the actor on ranks {list(ranks)} of "
                f"mesh {requester.name!r} (move it there with to_mesh, or pass "
                "monarch_kernel.inspect(t) to send its values)"
            )
        if mesh.client not in clients:
            clients.append(mesh.client)
    for client in clients:  # the ops that made the tensors go first, in order
        client.flush()
    wire = [LocalShard(x.ref) if isinstance(x, Tensor) else x for x in flat]
    new_args, new_kwargs = tree_unflatten(wire, spec)
    return tuple(new_args), new_kwargs


#: Types that hold no mesh tensor (skipped at once by the walk).
_LEAVES = frozenset({int, float, str, bytes, bool, type(None), complex})


def _holds_mesh_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` has a mesh tensor in it (in tuples, lists and dicts, as far as
    ``tree_flatten`` looks). A few µs for a call's usual arguments; ``tree_flatten``
    itself costs ten times that, too much for every actor call."""
    kind = type(value)
    if kind in _LEAVES:
        return False
    if kind is Tensor:
        return True
    if kind is torch.Tensor:  # a plain local tensor
        return False
    if depth > 64:  # absurdly nested: let tree_flatten decide
        return True
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return isinstance(value, Tensor)
    for v in value:  # noqa: SIM110  (a loop, not any(): this runs on every actor call)
        if type(v) not in _LEAVES and _holds_mesh_tensor(v, depth + 1):
            return True
    return False
