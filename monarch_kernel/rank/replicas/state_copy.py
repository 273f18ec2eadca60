"""Copying training state from one rank to the others over a process group.

:func:`broadcast_state` is the one entry point (re-exported by :mod:`.replicas`): the
source rank sends a small pickled *skeleton* of each object (names, shapes, dtypes, the
non-tensor parts of state dicts), every rank checks it matches its own objects, then the
tensor data goes as flat per-dtype buffers of at most :data:`CHUNK_BYTES` (a few large
broadcasts, not one per tensor), received straight into the parameters where it can.

Devices: a skeleton names each tensor's device type, and a receiving rank makes the
tensors of a state dict on its own device of that type (an Adam optimizer on CUDA keeps
its moments on the GPU and its ``step`` counters on the CPU: each goes where the source
keeps it). Buffers are packed per dtype *and* device: one flat buffer never mixes CPU and
CUDA tensors (``torch.cat`` refuses), and each goes over the group's backend for its
device (NCCL for CUDA, the gloo beside it for CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Tensor data is broadcast in flat buffers of at most this many bytes (per dtype).
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class _Meta:
    """A tensor's place in a state skeleton."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    device: str = "cpu"  #: the device type on the source ("cpu", "cuda" ...)


#: ``(kind, structure with _Meta leaves for tensors, optimizer steps and whether its last
#: step was cut short, or None)``
Skeleton = tuple[str, Any, "tuple[int, bool] | None"]


def broadcast_state(objects: Sequence[Any], src: int, group: Any = None) -> int:
    """Copy the state of ``objects`` on rank ``src`` into the same objects on every rank
    of ``group`` (default: the default process group; ``src`` is a rank of ``group``);
    returns the bytes of tensor data sent.

    Collective: every rank calls it with corresponding objects in the same order.
    ``nn.Module`` (DDP too): parameters and buffers, copied in place (names and shapes
    must match on every rank, else ValueError before any tensor data moves);
    ``torch.Tensor``: in place; anything else with ``state_dict()`` and
    ``load_state_dict()`` (optimizers, LR schedulers, GradScaler ...): its state dict,
    loaded on the others (an optimizer's ``opt.step()`` count and cut-short mark
    follow it).
    """
    import torch.distributed as dist

    me = dist.get_rank(group)
    box: list[Any] = [[_skeleton(o) for o in objects] if me == src else None]
    dist.broadcast_object_list(box, group=group, group_src=src)
    skeletons: list[Skeleton] = box[0]
    problem = ""
    try:
        if len(skeletons) != len(objects):
            raise ValueError(
                f"rank {src} sent the state of {len(skeletons)} objects, this rank has "
                f"{len(objects)}"
            )
        targets = [_targets(o, s, me == src) for o, s in zip(objects, skeletons)]
    except ValueError as exc:
        problem, targets = str(exc), []
    except Exception as exc:  # making the receiving tensors (out of GPU memory ...)
        problem, targets = f"{type(exc).__name__}: {exc}", []
    # Every rank learns whether all can take the state before any data moves (a rank
    # that raised alone would leave the others waiting in the broadcasts).
    fine = _all_agree(not problem, group)
    if problem:
        raise ValueError(f"broadcast_state: {problem}")
    if not fine:
        raise ValueError("broadcast_state: another rank's objects do not match the source's")
    nbytes = _broadcast_tensors([t for ts in targets for t in ts], src, group)
    if me != src:
        for obj, skeleton, tensors in zip(objects, skeletons, targets):
            _load(obj, skeleton, tensors)
    return nbytes


def _all_agree(ok: bool, group: Any) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _skeleton(obj: Any) -> Skeleton:
    import torch

    from monarch_kernel.rank.replicas.opt_steps import optimizer_steps, step_cut_short

    if isinstance(obj, torch.nn.Module):
        named = [*obj.named_parameters(), *obj.named_buffers()]
        return "module", [(n, _meta(i, t)) for i, (n, t) in enumerate(named)], None
    if isinstance(obj, torch.Tensor):
        return "tensor", _meta(0, obj), None
    count = iter(range(1 << 62))

    def strip(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return _meta(next(count), tree)
        if isinstance(tree, dict):
            return {k: strip(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(strip(v) for v in tree)
        return tree

    steps = (
        (optimizer_steps(obj), step_cut_short(obj))
        if isinstance(obj, torch.optim.Optimizer)
        else None
    )
    return "state_dict", strip(obj.state_dict()), steps


def _meta(index: int, t: Any) -> _Meta:
    return _Meta(index, str(t.dtype).rsplit(".", 1)[-1], tuple(t.shape), t.device.type)


def _says(m: _Meta) -> str:
    return f"{m.dtype}{list(m.shape)} on {m.device}"


def _local_device(device_type: str) -> Any:
    """This rank's device of ``device_type``: its current CUDA device for "cuda"."""
    import torch

    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _targets(obj: Any, skeleton: Skeleton, is_src: bool) -> list[Any]:
    """The tensors of ``obj`` the data goes into (or comes from, on the source), in
    skeleton order; fresh ones for a state dict on a receiving rank."""
    import torch

    kind, tree, _steps = skeleton
    if kind == "module":
        named = [*obj.named_parameters(), *obj.named_buffers()]
        mine = [(n, _meta(i, t)) for i, (n, t) in enumerate(named)]
        if mine != tree:
            theirs = dict(tree)
            diff = [
                f"{n}: {_says(m)} here, {_says(theirs[n]) if n in theirs else 'none'} there"
                for n, m in mine
                if theirs.get(n) != m
            ] or sorted(set(theirs) - {n for n, _ in mine})
            raise ValueError(
                f"the model differs from the source rank's ({len(tree)} tensors there, "
                f"{len(mine)} here; first difference: {diff[:1]})"
            )
        return [t.detach() for _, t in named]
    if kind == "tensor":
        if _meta(0, obj) != tree:
            raise ValueError(f"a tensor of {_says(_meta(0, obj))} here, {_says(tree)} there")
        return [obj.detach()]
    metas = sorted(_metas(tree), key=lambda m: m.index)
    if is_src:
        return [t.detach() for t in _tensors(obj.state_dict())]
    return [
        torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=_local_device(m.device))
        for m in metas
    ]


def _metas(tree: Any) -> list[_Meta]:
    if isinstance(tree, _Meta):
        return [tree]
    if isinstance(tree, dict):
        return [m for v in tree.values() for m in _metas(v)]
    if isinstance(tree, (list, tuple)):
        return [m for v in tree for m in _metas(v)]
    return []


def _tensors(tree: Any) -> list[Any]:
    """The tensors of a state dict, in the order :func:`_skeleton` numbered them."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _broadcast_tensors(tensors: list[Any], src: int, group: Any) -> int:
    """Broadcast ``tensors`` from ``src`` (in place on the others), packed per dtype and
    device type in flat buffers of at most CHUNK_BYTES; returns the bytes sent."""
    import torch
    import torch.distributed as dist

    by_dtype: dict[tuple[Any, str], list[Any]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device.type), []).append(t)
    total = 0
    for group_tensors in by_dtype.values():
        for chunk in _chunks(group_tensors):
            flat = (
                torch.cat([t.reshape(-1) for t in chunk])
                if len(chunk) > 1
                else chunk[0].reshape(-1).clone()
            )
            dist.broadcast(flat, group=group, group_src=src)
            total += flat.numel() * flat.element_size()
            offset = 0
            with torch.no_grad():
                for t in chunk:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view(t.shape))
                    offset += n
    return total


def _chunks(tensors: list[Any]) -> list[list[Any]]:
    chunks: list[list[Any]] = [[]]
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if chunks[-1] and size + n > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(t)
        size += n
    return [c for c in chunks if c]


def _load(obj: Any, skeleton: Skeleton, tensors: list[Any]) -> None:
    """Put received state into ``obj`` (modules and tensors were filled in place)."""
    import torch

    from monarch_kernel.rank.replicas.opt_steps import set_optimizer_steps, set_step_cut_short

    kind, tree, steps = skeleton
    if kind != "state_dict":
        return

    def fill(node: Any) -> Any:
        if isinstance(node, _Meta):
            return tensors[node.index]
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(fill(v) for v in node)
        return node

    obj.load_state_dict(fill(tree))
    if steps is not None and isinstance(obj, torch.optim.Optimizer):
        set_optimizer_steps(obj, steps[0])
        set_step_cut_short(obj, steps[1])
