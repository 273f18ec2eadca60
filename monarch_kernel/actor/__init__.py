"""Public actor API, with PyTorch Monarch's names.

A Monarch user's actor code runs after changing only the import line::

    from monarch_kernel.actor import Actor, endpoint, this_host, current_rank

    class Counter(Actor):
        def __init__(self, start: int):
            self.v = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.v += by
            return self.v

    procs = this_host().spawn_procs(per_host={"gpus": 4})
    counters = procs.spawn("counters", Counter, 0)
    counters.incr.call(2).get()          # ValueMesh, one value per rank
"""

from monarch_kernel.actor.actor import Actor, concurrent_endpoint, endpoint
from monarch_kernel.actor.api import (
    Accumulator,
    Channel,
    Context,
    Instance,
    MeshFailure,
    Port,
    PortReceiver,
    RankedPortReceiver,
    context,
    current_actor_name,
    get_or_spawn_controller,
    this_proc,
    unhandled_fault_hook,
)
from monarch_kernel.actor.meshes import (
    ActorMesh,
    HostMesh,
    ProcMesh,
    host_mesh,
    this_host,
)
from monarch_kernel.calls.errors import (
    ActorError,
    MeshStartError,
    MeshStoppedError,
    MonarchError,
    RankDiedError,
)
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.rank.context import current_rank, current_size
from monarch_kernel.shape import Point, Shape, SliceError
from monarch_kernel.wire.serialize import SerializationError

__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Context",
    "Future",
    "HostMesh",
    "Instance",
    "MeshFailure",
    "MeshStartError",
    "MeshStoppedError",
    "MonarchError",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "RankDiedError",
    "RankedPortReceiver",
    "SerializationError",
    "Shape",
    "SliceError",
    "ValueMesh",
    "concurrent_endpoint",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "get_or_spawn_controller",
    "host_mesh",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
