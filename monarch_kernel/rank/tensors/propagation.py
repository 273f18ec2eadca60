"""Cached propagation's run on a rank (a remote function itself, named by its path):
the remote function's outputs, each tensor replaced by its
:class:`~monarch_kernel.wire.output_patterns.OutputPattern`, which says whose storage it
uses (an argument's, an earlier output's, or its own)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.wire.output_patterns import OutputPattern, StorageOwner
from monarch_kernel.wire.tensor_ops import RemoteFunction


def output_patterns(func: RemoteFunction, *args: Any, **kwargs: Any) -> Any:
    """Run ``func(*args, **kwargs)`` (this rank's tensors for the mesh tensors) and
    return its outputs with each tensor replaced by its pattern."""
    from monarch_kernel.rank.tensors.worker import current

    worker = current()
    if worker is None:
        raise RuntimeError("output_patterns runs as a tensor-engine op on a rank")
    leaves = tree_flatten((args, kwargs))[0]
    out = worker._function(func)(*args, **kwargs)
    return patterns(leaves, out)


def patterns(leaves: list[Any], out: Any) -> Any:
    """``out`` with each tensor replaced by its pattern, its storage found among the
    tensors of ``leaves`` (the call's arguments, pytree leaf order) and earlier outputs."""
    owners: dict[Any, tuple[StorageOwner, int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            owners.setdefault(x.untyped_storage(), (StorageOwner.ARGUMENT, i))
    flat, spec = tree_flatten(out)
    made = 0
    found: list[Any] = []
    for x in flat:
        if not isinstance(x, torch.Tensor):
            found.append(x)
            continue
        storage = x.untyped_storage()
        owner, index = owners.get(storage, (StorageOwner.NEW, 0))
        if owner is StorageOwner.NEW:
            owners[storage] = (StorageOwner.OUTPUT, made)
        found.append(
            OutputPattern(
                size=tuple(x.shape),
                stride=tuple(x.stride()),
                dtype=str(x.dtype).removeprefix("torch."),
                storage_offset=int(x.storage_offset()),
                owner=owner,
                index=index,
                storage_numel=storage.nbytes() // x.element_size(),
            )
        )
        made += 1
    return tree_unflatten(found, spec)
