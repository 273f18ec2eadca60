"""A surviving rank's view of its mesh after the mesh grew or shrank (``%mesh grow``).

The controller keeps every survivor's flat rank (ranks are added after the last one
and removed from the end), so only the mesh's shape changes: :func:`set_world` puts
the new shape into the rank's configuration, the torchrun variables (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE`` ...), ``current_rank()`` and
``current_size()``. The process group is re-formed at the new size right after
(``train_pg.reform``), which reads ``RANK`` and ``WORLD_SIZE`` from the environment.
"""

from __future__ import annotations

import os
from dataclasses import replace

from monarch_kernel.rank import context
from monarch_kernel.rank.env import torchrun_env
from monarch_kernel.shape import Point, Shape

#: How many times this rank's world changed (``TrainingState.world_changed`` compares).
generation = 0


def set_world(labels: tuple[str, ...], sizes: tuple[int, ...]) -> int:
    """This rank is now in a mesh of dims ``labels`` with extent ``sizes`` (its flat
    rank is unchanged). Returns the new world size."""
    global generation
    shape = Shape.from_extent(dict(zip(labels, sizes)))
    world = len(shape)
    services = context.services()
    if services is None:  # outside a rank: only the environment
        os.environ["WORLD_SIZE"] = str(world)
        generation += 1
        return world
    cfg = services.config
    if not 0 <= cfg.rank < world:
        raise ValueError(f"rank {cfg.rank} is not in a mesh of {world} ranks")
    per_host = len(Shape.from_extent(dict(zip(labels[1:], sizes[1:])))) if _hosts(labels) else world
    coords = tuple(shape._coords()[cfg.rank])
    new = replace(
        cfg,
        labels=tuple(labels),
        sizes=tuple(sizes),
        coords=coords,
        world_size=world,
        local_world_size=per_host,
        host=cfg.rank // per_host,
        local_rank=cfg.rank % per_host,
    )
    runtime = context._runtime
    runtime.config = new
    os.environ.update(torchrun_env(new))
    point = Point(dict(zip(labels, coords)), cfg.rank, tuple(sizes))
    context.install(point, dict(zip(labels, sizes)), runtime)
    generation += 1
    return world


def _hosts(labels: tuple[str, ...]) -> bool:
    return bool(labels) and labels[0] == "hosts" and len(labels) > 1


def world_size() -> int:
    """The current world size of this rank's mesh (``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
