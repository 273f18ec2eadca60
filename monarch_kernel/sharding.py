"""Sharded training on the mesh's own dims: FSDP2 and HSDP from ``%mesh`` shapes.

Used inside ranks (``%%remote`` cells, best in a ``--setup`` cell so that a restarted
rank makes the same objects again)::

    from torch.distributed.fsdp import fully_shard
    from monarch_kernel.sharding import device_mesh
    dm = device_mesh()                      # DeviceMesh (hosts=2, gpus=4) on the mesh's group
    fully_shard(model, mesh=dm["gpus"])     # FSDP2 within a host
    fully_shard(model, mesh=dm)             # HSDP: replicate over hosts, shard over gpus

An HSDP model's state survives a rank's death: ``TrainingState`` takes the dead rank's
shards from its replica across the replicate dim.

Sharding by a policy instead of by hand, and errors that name the tensor::

    from monarch_kernel.sharding import shard_model, check
    plan = shard_model(model)               # per block; HSDP across hosts; prints the plan
    plan = shard_model(model, policy="size", min_params=10_000_000, mixed_precision="bf16")
    check(model)                            # ShardingError naming what the ranks disagree on

The ranks compare a model's sharding by themselves before FSDP2's first collective (its
root's first forward) and raise a :class:`ShardingError` naming the parameter or buffer,
its shapes and placements on each rank and the ranks that disagree; a failed DTensor
operation's error gets a note naming its DTensors.
"""

from __future__ import annotations

from monarch_kernel.rank.sharding import hooks as _hooks
from monarch_kernel.rank.sharding.fingerprint import ShardingError, check
from monarch_kernel.rank.sharding.mesh import DeviceMeshError, MeshDims, device_mesh, mesh_dims
from monarch_kernel.rank.sharding.policy import (
    Communication,
    Policy,
    ShardPlan,
    Strategy,
    Unit,
    shard_model,
)

# Ranks install the automatic check at start (rank.runtime); importing this module
# installs it too (idempotent), e.g. in a process that is not a rank.
_hooks.install()

__all__ = [
    "Communication",
    "DeviceMeshError",
    "MeshDims",
    "Policy",
    "ShardPlan",
    "ShardingError",
    "Strategy",
    "Unit",
    "check",
    "device_mesh",
    "mesh_dims",
    "shard_model",
]
