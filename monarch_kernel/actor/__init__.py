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

``HostMesh``, ``host_mesh`` and ``this_host`` (which start meshes, and so need the
controller) are imported on first use: a rank that only defines and calls actors never
loads the controller or the launchers. In a rank, a module that imports the functions
among them (the import line above, in a module of actors that ranks import) gets a stand-in
that imports the controller on its first call, so that importing it costs each rank
nothing (about 0.1-0.2 s of CPU per rank otherwise, paid by every rank of a big mesh).
"""

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch_kernel.actor.actor import Actor, concurrent_endpoint, endpoint
from monarch_kernel.actor.api import (
    Accumulator,
    Context,
    Instance,
    MeshFailure,
    context,
    current_actor_name,
    get_or_spawn_controller,
    this_proc,
    unhandled_fault_hook,
)
from monarch_kernel.actor.channels import Channel, Port, PortReceiver, RankedPortReceiver
from monarch_kernel.actor.endpoints import as_endpoint, send
from monarch_kernel.actor.meshes import ActorMesh, EndpointRef, ProcMesh
from monarch_kernel.calls.errors import (
    ActorError,
    MeshStartError,
    MeshStoppedError,
    MonarchError,
    RankDiedError,
    SupervisionError,
)
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.rank.context import current_rank, current_size
from monarch_kernel.rank.context import in_rank as _in_rank
from monarch_kernel.shape import Point, Shape, SliceError
from monarch_kernel.wire.serialize import SerializationError

if TYPE_CHECKING:
    from monarch_kernel.actor.hosts import (
        HostMesh,
        host_mesh,
        hosts_from_config,
        shutdown_context,
        this_host,
    )

#: Names served by :mod:`monarch_kernel.actor.hosts`, imported when first asked for.
_FROM_HOSTS = frozenset(
    {"HostMesh", "host_mesh", "hosts_from_config", "shutdown_context", "this_host"}
)


#: Those of them that are functions: a rank that imports one gets :func:`_deferred`.
_DEFERRABLE = frozenset({"host_mesh", "hosts_from_config", "shutdown_context", "this_host"})
_HOSTS = "monarch_kernel.actor.hosts"
_deferred_made: dict[str, Callable[..., Any]] = {}


def __getattr__(name: str) -> Any:
    if name in _FROM_HOSTS:
        if name in _DEFERRABLE and _HOSTS not in sys.modules and _in_rank():
            return _deferred(name)
        from monarch_kernel.actor import hosts

        return getattr(hosts, name)
    raise AttributeError(f"module 'monarch_kernel.actor' has no attribute {name!r}")


def _deferred(name: str) -> Callable[..., Any]:
    """``hosts.<name>``, imported when first called (the same function each time)."""
    made = _deferred_made.get(name)
    if made is not None:
        return made

    def call(*args: Any, **kwargs: Any) -> Any:
        from monarch_kernel.actor import hosts

        return getattr(hosts, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = f"``monarch_kernel.actor.hosts.{name}``, imported on the first call."
    _deferred_made[name] = call
    return call


__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Context",
    "EndpointRef",
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
    "SupervisionError",
    "ValueMesh",
    "as_endpoint",
    "concurrent_endpoint",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "send",
    "shutdown_context",
    "get_or_spawn_controller",
    "host_mesh",
    "hosts_from_config",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
