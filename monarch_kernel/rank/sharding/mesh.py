"""``device_mesh()``: torch's ``DeviceMesh`` over the mesh's own dims and names.

A mesh started as ``%mesh NAME --hosts 2 --gpus 4 --dist`` has dims ``("hosts", "gpus")``
of sizes ``(2, 4)`` and a process group over its 8 ranks, flat rank = row-major
position (``hosts`` major). :func:`device_mesh` makes the ``DeviceMesh`` of exactly
that shape and order, its dims named as the mesh's (or renamed / split, for views such
as ``("replicate", "shard")``), so that ``fully_shard(model, mesh=dm["gpus"])`` (FSDP2)
and ``fully_shard(model, mesh=dm)`` (HSDP) run on the mesh's re-formable group.

Its subgroups are ``new_group`` groups of the re-formable backend: the stop button and
a restarted rank re-form them with the default group (see
:mod:`monarch_kernel.rank.pg.backend`). Made in a ``--setup`` cell, a restarted rank
makes them again when its set-up cells run again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from monarch_kernel.rank import context, world


class DeviceMeshError(ValueError):
    """``device_mesh()`` was asked for something the mesh cannot be."""


@dataclass(frozen=True)
class MeshDims:
    """The dims a ``DeviceMesh`` is made with: names and sizes, outermost first."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __str__(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


def mesh_dims() -> MeshDims:
    """This rank's mesh dims (``hosts``, ``gpus`` ...) as they are now (a grow or shrink
    changes them)."""
    extent = context.current_size() if context.in_rank() else {}
    if not extent:
        world_size = world.world_size()
        return MeshDims(("ranks",), (world_size,))
    return MeshDims(tuple(extent), tuple(int(v) for v in extent.values()))


def view(
    dims: MeshDims,
    rename: Mapping[str, str] | None = None,
    split: Mapping[str, Mapping[str, int] | Sequence[tuple[str, int]]] | None = None,
) -> MeshDims:
    """``dims`` with some split into several (``split={"gpus": {"dp": 2, "tp": -1}}``:
    sizes multiply to the dim's size, one may be -1) and then renamed
    (``rename={"hosts": "replicate", "gpus": "shard"}``). Raises :class:`DeviceMeshError`
    naming the dim and the sizes when they do not fit."""
    names: list[str] = []
    sizes: list[int] = []
    split = dict(split or {})
    for bad in sorted(set(split) - set(dims.names)):
        raise DeviceMeshError(
            f"device_mesh(split=...): the mesh has no dim {bad!r}; its dims are {dims}"
        )
    for name, size in zip(dims.names, dims.sizes):
        if name not in split:
            names.append(name)
            sizes.append(size)
            continue
        parts = list(dict(split[name]).items())
        known = math.prod(s for _, s in parts if s != -1)
        unknown = [n for n, s in parts if s == -1]
        if len(unknown) > 1 or any(s == 0 or s < -1 for _, s in parts):
            raise DeviceMeshError(
                f"device_mesh(split={{{name!r}: ...}}): sizes must be positive, one of them "
                f"may be -1; got {dict(parts)}"
            )
        if unknown:
            if known == 0 or size % known:
                raise DeviceMeshError(
                    f"device_mesh(split=...): dim {name!r} of size {size} cannot be split "
                    f"into {dict(parts)}: {size} is not a multiple of {known}"
                )
            parts = [(n, size // known if s == -1 else s) for n, s in parts]
        elif known != size:
            raise DeviceMeshError(
                f"device_mesh(split=...): dim {name!r} has size {size}, but {dict(parts)} "
                f"multiply to {known}"
            )
        names += [n for n, _ in parts]
        sizes += [s for _, s in parts]
    rename = dict(rename or {})
    for bad in sorted(set(rename) - set(names)):
        raise DeviceMeshError(
            f"device_mesh(rename=...): no dim {bad!r} to rename; the dims are "
            f"{MeshDims(tuple(names), tuple(sizes))}"
        )
    names = [rename.get(n, n) for n in names]
    if len(set(names)) != len(names):
        raise DeviceMeshError(f"device_mesh(): dim names must differ, got {tuple(names)}")
    return MeshDims(tuple(names), tuple(sizes))


#: (dims, device type, world generation, default group) -> the DeviceMesh made for them.
_made: dict[tuple[MeshDims, str, int, int], Any] = {}


def device_mesh(
    device_type: str | None = None,
    *,
    rename: Mapping[str, str] | None = None,
    split: Mapping[str, Mapping[str, int] | Sequence[tuple[str, int]]] | None = None,
) -> Any:
    """torch's ``DeviceMesh`` over this mesh's own dims, on its process group.

    ``device_type``: ``"cuda"`` where the mesh's group runs NCCL (the default with
    CUDA), else ``"cpu"``. ``split`` / ``rename`` give a view of the dims (see
    :func:`view`), e.g. ``device_mesh(rename={"hosts": "replicate", "gpus": "shard"})``
    for HSDP. The same call on the same mesh returns the same object (its subgroups are
    made once); after the mesh grew or shrank it makes a new one. A renamed view shares
    the mesh's subgroups; a split one makes its own, so make it in a ``--setup`` cell (a
    restarted rank makes again only what the set-up cells make).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise DeviceMeshError(
            "device_mesh() needs the mesh's process group: start the mesh with --dist "
            "(%mesh NAME ... --dist), or call torch.distributed.init_process_group() first"
        )
    dims = view(mesh_dims(), rename, split)
    size = dist.get_world_size()
    if math.prod(dims.sizes) != size:
        raise DeviceMeshError(
            f"device_mesh(): the mesh's dims {dims} hold {math.prod(dims.sizes)} ranks but "
            f"the process group has {size} (WORLD_SIZE={os.environ.get('WORLD_SIZE')}); "
            "was the group made for another mesh?"
        )
    if device_type is None:
        nccl = dist.get_backend() in ("nccl", "mknccl") or "nccl" in str(dist.get_backend())
        device_type = "cuda" if nccl and torch.cuda.is_available() else "cpu"
    default = dist.distributed_c10d._get_default_group()
    key = (dims, device_type, world.generation, id(default))
    made = _made.get(key)
    if made is None and not split and rename:
        # A renamed view shares the mesh's groups (no new subgroups to re-form)
        base = device_mesh(device_type)
        made = DeviceMesh.from_group(
            [base.get_group(i) for i in range(base.ndim)],
            device_type,
            mesh=base.mesh,
            mesh_dim_names=dims.names,
        )
    if made is None:
        made = init_device_mesh(device_type, dims.sizes, mesh_dim_names=dims.names)
        for old in [k for k in _made if k[2] != world.generation or k[3] != id(default)]:
            del _made[old]
        _made[key] = made
    return made
