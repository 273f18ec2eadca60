"""Which ranks hold the same shards as this one, and how sharded state travels.

An FSDP2 model's parameters are ``DTensor``s on a ``DeviceMesh``: along a mesh dim whose
placement is ``Shard`` each rank holds a different part, along one whose placement is
``Replicate`` (HSDP's replicate dim) the ranks hold the same part. So a rank's state
exists whole on exactly the ranks that share its coordinates on every sharded dim:
:func:`replica_ranks`. A dead rank's shards are taken from one of them.

On the data plane a ``DTensor`` travels as its local tensor (:func:`local_tensor`); the
receiver puts it back into its own DTensor (the model's, in place) or wraps it like the
parameter it belongs to (an optimizer's moments: :func:`like_param`).
"""

from __future__ import annotations

import sys
from typing import Any


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor`` (without importing torch.distributed.tensor)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(value, cls)


def local_tensor(value: Any) -> Any:
    """A DTensor's local part (the tensor this rank holds); any other value as it is."""
    return value.to_local() if is_dtensor(value) else value


def replica_ranks(model: Any) -> tuple[int, ...] | None:
    """The global ranks whose shards of ``model`` equal this rank's (this rank among
    them), or None when no parameter or buffer is a sharded DTensor (every rank holds
    the whole state). ``(this rank,)`` alone: the model is sharded with no replica
    (FSDP2 over every rank)."""
    if model is None or _dtensor_type() is None:
        return None
    found: set[int] | None = None
    for value in model.state_dict().values():
        if not is_dtensor(value):
            continue
        placements = value.placements
        if not any(type(p).__name__ == "Shard" for p in placements):
            continue
        same = _same_shard_ranks(value.device_mesh, placements)
        found = same if found is None else found & same
    return None if found is None else tuple(sorted(found))


def _same_shard_ranks(mesh: Any, placements: Any) -> set[int]:
    """Ranks of ``mesh`` whose coordinates equal this rank's on every dim whose
    placement is a ``Shard`` (the others replicate)."""
    coord = mesh.get_coordinate()
    grid = mesh.mesh
    if coord is None:  # not in this mesh: it holds nothing of it
        return set()
    index = []
    for dim, placement in enumerate(placements):
        index.append(coord[dim] if type(placement).__name__ == "Shard" else slice(None))
    return {int(r) for r in grid[tuple(index)].flatten().tolist()}


def like_param(value: Any, param: Any) -> Any:
    """``value`` (a plain tensor taken from a replica) as a DTensor laid out like
    ``param`` when ``param`` is one and ``value`` has the shape of its local part (an
    optimizer's moments); anything else as it is."""
    if not is_dtensor(param) or is_dtensor(value):
        return value
    import torch

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    local = param.to_local()
    if tuple(value.shape) != tuple(local.shape):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def optimizer_state_like_params(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` taken from a replica (plain tensors) with every
    per-parameter tensor made a DTensor like its parameter in ``optimizer`` (so that
    ``load_state_dict`` gives an FSDP2 optimizer the state it had)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = state.get("state", {})
    for index, entry in per_param.items():
        if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict):
            param = params[index]
            for key, value in list(entry.items()):
                entry[key] = like_param(value, param)
    return state


# -- making the replicas of each shard the same again (the stop button) ----------------------
def shard_tensors(obj: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of every tensor this rank holds of ``obj`` (a sharded model: its
    parameters' and buffers' local parts; an optimizer: its state's), in an order the
    same on every rank, each the tensor itself (written in place)."""
    import torch

    out: list[tuple[str, Any]] = []
    if isinstance(obj, torch.nn.Module):
        for name, value in [*obj.named_parameters(), *obj.named_buffers()]:
            out.append((name, local_tensor(value).data))
        return out
    state = getattr(obj, "state", {})
    params = [p for group in obj.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key in sorted(state.get(param, {})):
            value = state[param][key]
            if isinstance(value, torch.Tensor):
                out.append((f"{index}/{key}", local_tensor(value)))
    return out


def replicate_group(model: Any) -> Any:
    """The process group over the ranks that hold the same shards of ``model`` as this
    one (HSDP's replicate dim), or None when there is no such dim."""
    for value in model.state_dict().values():
        if not is_dtensor(value):
            continue
        placements = value.placements
        dims = [i for i, p in enumerate(placements) if type(p).__name__ == "Replicate"]
        if not any(type(p).__name__ == "Shard" for p in placements):
            continue
        if len(dims) != 1:
            return None
        return value.device_mesh.get_group(dims[0])
    return None


#: An optimizer's per-parameter state as its tensors' ``(shape, dtype, a DTensor, device
#: type)`` by parameter index and key: what a replica must hold before the values can
#: travel.
StateSkeleton = dict[int, dict[str, tuple[tuple[int, ...], str, bool, str]]]


def optimizer_state_skeleton(optimizer: Any) -> StateSkeleton:
    """The shapes of ``optimizer``'s per-parameter state tensors (local parts), by the
    parameter's index in its ``param_groups`` (:data:`StateSkeleton`)."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: StateSkeleton = {}
    for index, param in enumerate(params):
        entry = optimizer.state.get(param)
        if not entry:
            continue
        out[index] = {
            key: (tuple(local_tensor(v).shape), str(v.dtype), is_dtensor(v), v.device.type)
            for key, v in entry.items()
            if isinstance(v, torch.Tensor)
        }
    return out


def conform_optimizer_state(optimizer: Any, skeleton: StateSkeleton) -> None:
    """Give ``optimizer`` per-parameter state tensors laid out as ``skeleton`` (a
    replica's), zero-filled where it had none or other shapes, and drop the state the
    replica does not have, so that the replica's values can be copied in.

    Why: an optimizer makes its state lazily inside its first ``step()``; a stop there
    leaves it without state (or with part of it) while a replica has it all."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        want = skeleton.get(index, {})
        entry = optimizer.state.get(param)
        if not want:
            if entry:
                del optimizer.state[param]
            continue
        entry = optimizer.state[param]  # (a defaultdict: made if missing)
        for key in [k for k, v in entry.items() if isinstance(v, torch.Tensor) and k not in want]:
            del entry[key]
        for key, (shape, dtype, sharded, device) in want.items():
            have = entry.get(key)
            if (
                isinstance(have, torch.Tensor)
                and tuple(local_tensor(have).shape) == shape
                and str(have.dtype) == dtype
                and is_dtensor(have) == sharded
                and have.device.type == device
            ):
                continue
            # on this rank's device of the replica's device type (an Adam on CUDA: its
            # moments on the parameter's GPU, its step counter on the CPU)
            where = local_tensor(param).device if device != "cpu" else torch.device("cpu")
            kind = getattr(torch, dtype.rsplit(".", 1)[-1])
            local = torch.zeros(shape, dtype=kind, device=where)
            entry[key] = like_param(local, param) if sharded else local


def broadcast_shards(objects: list[Any], model: Any, src: int) -> int:
    """Copy rank ``src``'s local shards of ``objects`` (the sharded model and its
    optimizers) to the other ranks of this rank's replicate group; every rank of the
    group calls it. An optimizer takes the source's state layout (one stopped before it
    made its state gets it) and its ``opt.step()`` count and cut-short mark. Raises
    naming the tensor when the ranks' shards do not match."""
    import torch
    import torch.distributed as dist

    from monarch_kernel.rank.replicas import opt_steps

    group = replicate_group(model)
    if group is None:
        raise ValueError("the model has no replicate dim: its shards have no replica")
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    box: list[Any] = [
        [
            (optimizer_state_skeleton(o), opt_steps.optimizer_steps(o), opt_steps.step_cut_short(o))
            for o in optimizers
        ]
    ]
    dist.broadcast_object_list(box, src=src, group=group)
    receiving = dist.get_rank() != src
    failed = ""
    if receiving:
        try:
            for optimizer, (skeleton, _, _) in zip(optimizers, box[0], strict=True):
                conform_optimizer_state(optimizer, skeleton)
        except Exception as exc:  # out of GPU memory ...: said to the others below
            failed = f"{type(exc).__name__}: {exc}"
    tensors = [nt for obj in objects for nt in shard_tensors(obj)]
    # (the device type too: replicas on different devices would broadcast over
    # different backends and wait for each other forever)
    metas: list[Any] = [(name, tuple(t.shape), str(t.dtype), t.device.type) for name, t in tensors]
    if failed:  # every rank of the group still takes part in the gather: no one waits
        metas = [("(making this rank's optimizer state failed)", failed)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, metas, group=group)
    if failed:
        raise RuntimeError(f"making the optimizer state to copy into failed here: {failed}")
    members = dist.get_process_group_ranks(group)
    for rank, theirs in zip(members, gathered):
        if theirs != metas:
            diff = next(
                (
                    f"{a[0]}: {a[1:]} here, {b[1:]} on rank {rank}"
                    for a, b in zip(metas, theirs)
                    if a != b
                ),
                f"{len(metas)} tensors here, {len(theirs)} on rank {rank}",
            )
            raise ValueError(f"the replicas' shards differ in layout ({diff}): cannot copy")
    nbytes = 0
    for _, tensor in tensors:
        dist.broadcast(tensor, src=src, group=group)
        nbytes += tensor.numel() * tensor.element_size()
    if receiving:
        for optimizer, (_, steps, cut_short) in zip(optimizers, box[0], strict=True):
            opt_steps.set_optimizer_steps(optimizer, steps)
            opt_steps.set_step_cut_short(optimizer, cut_short)
    return nbytes
