"""Data-parallel replicas: find a rank's training state, digest it, copy it from one rank
to the others, and repair DDP after its process group was re-formed.

The public piece for other code (e.g. a rank restored from a live peer) is
:func:`broadcast_state`: every rank of the group calls it with corresponding objects in
the same order, and afterwards they all hold the state ``src`` had::

    from monarch_kernel.rank.replicas.replicas import broadcast_state
    nbytes = broadcast_state([ddp, opt, sched], src=0)   # models, optimizers, tensors ...

The mesh uses the rest after the stop button or a failure in a collective loop:
:func:`digest_namespace` on every rank, ``calls.replica_plan.plan_sync`` on the
controller, :func:`sync_namespace` on every rank if the replicas differ.

How far each rank got is counted with torch's global optimizer step hooks
(:func:`install_step_counter`, installed in the warm template): a rank that ran
``opt.step()`` of the interrupted step has one step more than one that did not, and one
stopped inside it is marked as cut short (partly updated), so that a replica holding a
whole step is copied rather than it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FunctionType, ModuleType
from typing import Any

from monarch_kernel.calls.replica_plan import ObjectDigest, ReplicaDigest, SyncReport
from monarch_kernel.rank.replicas import opt_steps
from monarch_kernel.rank.replicas.fsdp_reset import reset_fsdp
from monarch_kernel.rank.replicas.opt_steps import optimizer_steps
from monarch_kernel.rank.replicas.shards import broadcast_shards, local_tensor, replica_ranks
from monarch_kernel.rank.replicas.state_copy import broadcast_state

install_step_counter = opt_steps.install


# -- finding the training state ---------------------------------------------------------
def find_training_state(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The data-parallel training objects in ``namespace`` (and one attribute level into
    plain objects, e.g. ``trainer.model``): DDP models, FSDP2 (sharded) models, the
    optimizers over their parameters, and those optimizers' LR schedulers; name ->
    object, models first."""
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    values = dict(_candidates(namespace))
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def take(kind: type, accept: Any = None) -> None:
        for name, value in values.items():
            if (
                isinstance(value, kind)
                and id(value) not in seen
                and (accept is None or accept(value))
            ):
                found[name] = value
                seen.add(id(value))

    take(DDP)
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if isinstance(fsdp_module, type):  # the outermost FSDP2 modules (not their layers)
        inner = {
            id(sub)
            for v in values.values()
            if isinstance(v, torch.nn.Module)
            for sub in list(v.modules())[1:]
        }
        take(fsdp_module, lambda m: id(m) not in inner)
    params = {id(p) for m in found.values() for p in m.parameters()}
    take(torch.optim.Optimizer, lambda o: _params_of(o) and _params_of(o) <= params)
    optimizers = {id(o) for o in found.values() if isinstance(o, torch.optim.Optimizer)}
    scheduler = torch.optim.lr_scheduler.LRScheduler
    take(scheduler, lambda s: id(getattr(s, "optimizer", None)) in optimizers)
    return found


def settled_training_state(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`find_training_state` after putting every FSDP2 model among them back to its
    sharded, idle state (:func:`.fsdp_reset.reset_fsdp`).

    Why: a step cut short (the stop button) leaves FSDP2 mid-iteration, with the layers
    whose forward or backward was running unsharded: their modules then hold the
    gathered plain tensors instead of the DTensors the optimizer trains, so the
    optimizer would not be found as the model's on this rank, while on a replica
    stopped elsewhere it would (its state then left out of the comparison and the
    copy, and the replicas left different).

    Every DDP object's reducer is reset too (:func:`reset_ddp`): a rank stopped inside
    a backward between two buckets' all-reduces (none in flight, so the process group
    was not aborted and re-formed, which resets them) is left expecting the rest, and
    its next forward fails with "Expected to have finished reduction in the prior
    iteration". Invariant: every rank of the group runs this (the replica check's
    cells run on all of them), so their reducers rebuild their buckets alike."""
    reset_ddp()
    found = find_training_state(namespace)
    if sum(reset_fsdp(obj) for obj in found.values()):  # (its optimizers are found now)
        return find_training_state(namespace)
    return found


def _candidates(namespace: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for name in sorted(namespace):
        if name.startswith("_"):
            continue
        value = namespace[name]
        yield name, value
        if _plain_object(value):
            for attr, inner in sorted(vars(value).items()):
                if not attr.startswith("_"):
                    yield f"{name}.{attr}", inner


def _plain_object(value: Any) -> bool:
    import torch

    if isinstance(value, (type, ModuleType, FunctionType, torch.nn.Module, torch.optim.Optimizer)):
        return False
    return isinstance(getattr(value, "__dict__", None), dict)


def _params_of(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


# -- digests ----------------------------------------------------------------------------
def _kind(obj: Any) -> str:
    import torch

    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "scheduler"


def _tensor_bytes(t: Any) -> Any:
    """A uint8 numpy view of ``t``'s data (a CPU copy first if needed)."""
    import torch

    t = local_tensor(t).detach()  # a shard: this rank's part
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def digest(obj: Any) -> tuple[str, int, str]:
    """``(hex digest, tensor bytes, layout)`` of a model's parameters and buffers, or of
    any other object's ``state_dict()``; the layout (:func:`layout`) tells replicas built
    differently from replicas whose values drifted."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    nbytes = 0
    if isinstance(obj, torch.nn.Module):
        items: Iterator[tuple[str, Any]] = iter([*obj.named_parameters(), *obj.named_buffers()])
    else:
        items = _flatten(obj.state_dict(), "")
    for key, value in items:
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            data = _tensor_bytes(value)
            h.update(data)
            nbytes += data.nbytes
        else:
            h.update(repr(value).encode())
    return h.hexdigest(), nbytes, layout(obj)


def layout(obj: Any) -> str:
    """A hash of what ``obj`` is built of, not of its values: the names, dtypes and
    global and local shapes of a model's parameters and buffers, or of the parameters an
    optimizer trains (not its state, which a fresh optimizer has not made yet); '' for
    anything else."""
    import torch

    if isinstance(obj, torch.nn.Module):
        tensors = [*obj.named_parameters(), *obj.named_buffers()]
    elif isinstance(obj, torch.optim.Optimizer):
        tensors = [
            (f"{g}.{i}", p)
            for g, group in enumerate(obj.param_groups)
            for i, p in enumerate(group["params"])
        ]
    else:
        return ""
    h = hashlib.blake2b(digest_size=16)
    for key, t in tensors:
        h.update(f"{key}:{t.dtype}{tuple(t.shape)}:{tuple(local_tensor(t).shape)};".encode())
    return h.hexdigest()


def _flatten(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key in sorted(tree, key=str):
            yield from _flatten(tree[key], f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from _flatten(item, f"{prefix}/{i}")
    else:
        yield prefix, tree


def digest_namespace(namespace: Mapping[str, Any], rank: int | None = None) -> ReplicaDigest:
    """This rank's :class:`ReplicaDigest` of the training objects in ``namespace``."""
    import torch

    if rank is None:
        rank = _rank()
    objects = []
    state = settled_training_state(namespace)
    sharded = _sharded_models(state)
    # (each model's replicas read once: an optimizer has its model's)
    replicas_of = {id(m): replica_ranks(m) or () for m in sharded.values()}
    for name, obj in state.items():
        hexdigest, nbytes, built = digest(obj)
        is_optimizer = isinstance(obj, torch.optim.Optimizer)
        steps = optimizer_steps(obj) if is_optimizer else None
        torn = is_optimizer and opt_steps.step_cut_short(obj)
        model = sharded.get(name) or _model_of(obj, sharded)
        replicas = replicas_of[id(model)] if model is not None else ()
        objects.append(
            ObjectDigest(name, _kind(obj), hexdigest, nbytes, steps, replicas, built, torn)
        )
    return ReplicaDigest(rank, tuple(objects))


def _sharded_models(state: Mapping[str, Any]) -> dict[str, Any]:
    """The training objects that are models with sharded (DTensor) parameters."""
    return {
        name: obj
        for name, obj in state.items()
        if hasattr(obj, "named_parameters") and replica_ranks(obj) is not None
    }


def _model_of(obj: Any, models: Mapping[str, Any]) -> Any:
    """The sharded model among ``models`` whose parameters ``obj`` (an optimizer, or a
    scheduler's optimizer) trains, if any."""
    optimizer = getattr(obj, "optimizer", obj)
    params = _params_of(optimizer) if hasattr(optimizer, "param_groups") else set()
    for model in models.values():
        if params and params <= {id(p) for p in model.parameters()}:
            return model
    return None


def _rank() -> int:
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# -- making replicas the same again -----------------------------------------------------
def sync_namespace(
    namespace: Mapping[str, Any],
    names: Sequence[str],
    src: int | None,
    shard_names: Sequence[str] = (),
    shard_sources: Mapping[int, int] | None = None,
) -> SyncReport:
    """Copy the training objects ``names`` (see :func:`find_training_state`) from rank
    ``src`` (None: none) to this rank over the default process group, and the sharded
    ones ``shard_names`` from ``shard_sources[this rank]`` within this rank's replicate
    group (a rank not in ``shard_sources``: its group's shards agree). Every rank calls
    it with the same arguments. Returns what was sent and this rank's digest after."""
    t0 = time.monotonic()
    state = settled_training_state(namespace)
    missing = [n for n in [*names, *shard_names] if n not in state]
    if missing:
        raise ValueError(f"not a training object on this rank: {', '.join(missing)}")
    nbytes = 0
    if src is not None and names:
        nbytes = broadcast_state([state[n] for n in names], src)
        _share_bucket_layouts([state[n] for n in names], src)
    source = (shard_sources or {}).get(_rank())
    if source is not None and shard_names:
        # each sharded model with its optimizers, in the same order on every rank
        objects = {n: state[n] for n in shard_names}
        models = _sharded_models(objects)
        for name, model in models.items():
            mine = [model] + [
                o for n, o in objects.items() if n != name and _model_of(o, {name: model}) is model
            ]
            nbytes += broadcast_shards(mine, model, source)
    _align_training_steps(namespace)
    seconds = time.monotonic() - t0
    return SyncReport(nbytes, seconds, digest_namespace(namespace))


def _align_training_steps(namespace: Mapping[str, Any]) -> None:
    """Every rank's ``TrainingState`` loops on ``state.step``: a rank that took a more
    advanced replica's state takes its step count too (the most advanced one), or its
    loop would run one step more than the others' and wait for them forever at its
    last collective. Collective: every rank calls it."""
    import torch.distributed as dist

    states = sorted(
        ((name, obj) for name, obj in _candidates(namespace) if _is_training_state(obj)),
        key=lambda item: item[0],
    )
    mine = [(name, int(obj.step)) for name, obj in states]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for name, obj in states:
        steps = [dict(theirs).get(name) for theirs in gathered if theirs]
        known = [step for step in steps if step is not None]
        if known:
            obj.step = max(known)


def _is_training_state(obj: Any) -> bool:
    """A ``monarch_kernel.training.TrainingState`` (which sits above this package)."""
    return type(obj).__name__ == "TrainingState" and hasattr(obj, "stepping")


def _share_bucket_layouts(objects: Sequence[Any], src: int) -> None:
    """Give the DDP models among ``objects`` rank ``src``'s gradient bucket layout where
    theirs differs (collective: every rank calls it with the same objects).

    Why: a rank whose DDP object was built anew (restarted, its set-up cells run again)
    holds its gradients in parameter order until its second step, while the others'
    buckets are in the order their gradients became ready; the all-reduce sums buckets
    element by element, so the next step would mix up gradients and the replicas would
    silently drift apart (see ``ddp_layout.adopt_layout``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from monarch_kernel.rank.replicas.ddp_layout import adopt_layout, bucket_layout

    models = [o for o in objects if isinstance(o, DDP)]
    if not models:
        return
    import torch.distributed as dist

    layouts: list[Any] = [[bucket_layout(m) for m in models]]
    dist.broadcast_object_list(layouts, src)
    for model, layout in zip(models, layouts[0], strict=True):
        if layout and layout != bucket_layout(model):
            adopt_layout(model, layout)


def reset_ddp(groups: Sequence[Any] | None = None) -> int:
    """Reset the reducer of every DDP object this rank made, or of those on one of
    ``groups`` (a backward cut short, by an abort of their group or by the stop button
    between two buckets, leaves it expecting the rest: "Expected to have finished
    reduction in the prior iteration"): its next iteration rebuilds buckets as on every
    other rank that reset its own. Returns how many were reset."""
    ids = None if groups is None else {id(g) for g in groups}
    models = [
        ddp
        for ddp in list(opt_steps.ddps)
        if ids is None or id(getattr(ddp, "process_group", None)) in ids
    ]
    for ddp in models:
        ddp._update_process_group(ddp.process_group)
    return len(models)


__all__ = [
    "broadcast_state",
    "digest",
    "digest_namespace",
    "find_training_state",
    "install_step_counter",
    "optimizer_steps",
    "reset_ddp",
    "settled_training_state",
    "sync_namespace",
]
