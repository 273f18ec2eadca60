"""A surviving rank's view of its mesh after the mesh grew or shrank (``%mesh grow``).

A grow adds ranks after the last one and a plain shrink removes the last ones: then a
survivor's flat rank does not change, only the mesh's shape. A shrink that drops ranks
(or hosts) elsewhere renumbers the survivors in their old order, and the controller
says each one's new rank by its *slot* (its wire id, ``Rank.rank``, which never
changes). :func:`set_world` puts the new shape, and the new rank if there is one, into
the rank's configuration, the torchrun variables (``RANK``, ``LOCAL_RANK``,
``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` ...), ``current_rank()`` and
``current_size()``. The process group is re-formed at the new size right after
(``training.reform.reform``), which reads ``RANK`` and ``WORLD_SIZE`` from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from monarch_kernel.rank import context
from monarch_kernel.rank.env import torchrun_env
from monarch_kernel.shape import Point, Shape

#: How many times this rank's world changed (``TrainingState.world_changed`` compares).
generation = 0


def set_world(
    labels: tuple[str, ...],
    sizes: tuple[int, ...],
    ranks: Mapping[int, int] | None = None,
) -> int:
    """This rank is now in a mesh of dims ``labels`` with extent ``sizes``; ``ranks``:
    slot -> new flat rank of the ranks renumbered by a shrink (this rank keeps its flat
    rank when its slot is not there). Returns the new world size."""
    global generation
    shape = Shape.from_extent(dict(zip(labels, sizes)))
    world = len(shape)
    services = context.services()
    if services is None:  # outside a rank: only the environment
        os.environ["WORLD_SIZE"] = str(world)
        generation += 1
        return world
    cfg = services.config
    rank = int((ranks or {}).get(services.rank, cfg.rank))
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a mesh of {world} ranks")
    per_host = len(Shape.from_extent(dict(zip(labels[1:], sizes[1:])))) if _hosts(labels) else world
    coords = tuple(shape._coords()[rank])
    new = replace(
        cfg,
        rank=rank,
        labels=tuple(labels),
        sizes=tuple(sizes),
        coords=coords,
        world_size=world,
        local_world_size=per_host,
        host=rank // per_host,
        local_rank=rank % per_host,
    )
    runtime = context._runtime
    runtime.config = new
    os.environ.update(torchrun_env(new))
    point = Point(dict(zip(labels, coords)), rank, tuple(sizes))
    context.install(point, dict(zip(labels, sizes)), runtime)
    generation += 1
    return world


def _hosts(labels: tuple[str, ...]) -> bool:
    return bool(labels) and labels[0] == "hosts" and len(labels) > 1


def world_size() -> int:
    """The current world size of this rank's mesh (``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
