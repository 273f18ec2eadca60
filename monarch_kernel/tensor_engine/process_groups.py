"""``DeviceMesh.process_group(dims)``: Monarch's ``RemoteProcessGroup``, a process group
over named dims of a mesh that remote functions take as an argument and use with
``torch.distributed`` (``dist.all_reduce(t, group=pg)``).

On each rank the argument arrives as the ``torch.distributed`` group of that rank and
the mesh's ranks that differ from it only along ``dims`` (gloo on CPU ranks), made by
those members the first time a function is given it; the mesh's ranks join the
process mesh's default group first, as before a ``reduce``.
"""

from __future__ import annotations

from typing import Any, Protocol

from monarch_kernel.shape import Shape
from monarch_kernel.tensor_engine.client import Client
from monarch_kernel.wire.tensor_ops import GroupRef


class DeviceMesh(Protocol):
    """What a process group needs of its device mesh (``tensor_engine.mesh`` sits
    above this module)."""

    shape: Shape
    client: Client


class RemoteProcessGroup:
    """The controller's handle of a process group over ``dims`` of ``device_mesh``
    (pass it to a remote function; each rank gets its ``torch.distributed`` group).
    Each ``process_group()`` call makes a new handle (two are never equal, as in
    Monarch), though the ranks make the group of a set of ranks once."""

    def __init__(self, dims: tuple[str, ...], device_mesh: DeviceMesh):
        self.dims = dims
        self.device_mesh = device_mesh
        #: a fresh ref of the mesh's client: names this handle (errors, repr)
        self.ref = device_mesh.client.new_ref()

    def __reduce__(self) -> tuple[Any, ...]:
        # in an op's arguments: what the rank resolves to its group
        return GroupRef, (self.device_mesh.shape, self.dims)

    def __repr__(self) -> str:
        return f"<RemoteProcessGroup {self.dims} of {self.device_mesh!r}>"


def process_group(mesh: DeviceMesh, dims: str | tuple[str, ...] | list[str]) -> RemoteProcessGroup:
    """A :class:`RemoteProcessGroup` over ``dims`` of ``mesh`` (see the module docstring)."""
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if not names:
        raise ValueError("process_group needs at least one dim, e.g. mesh.process_group('gpu')")
    for d in names:
        if d not in mesh.shape.labels:
            raise KeyError(f"{d!r} is not a dim of {mesh!r} (dims {list(mesh.shape.labels)})")
    if len(set(names)) != len(names):
        raise ValueError(f"process_group: a dim named twice in {names}")
    mesh.client.join_world()  # before any group: every rank of the process mesh
    return RemoteProcessGroup(names, mesh)
