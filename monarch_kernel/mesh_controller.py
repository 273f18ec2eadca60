"""Monarch's ``monarch.mesh_controller`` names: :class:`RemoteException`, raised by the
fetch of a mesh tensor that depends on an op that failed on a rank, and
:func:`spawn_tensor_engine`."""

from __future__ import annotations

from typing import Any

from monarch_kernel.tensor_engine.errors import RemoteException
from monarch_kernel.tensor_engine.mesh import DeviceMesh, device_mesh


def spawn_tensor_engine(proc_mesh: Any) -> DeviceMesh:
    """The device mesh of ``proc_mesh``'s ranks (nothing to spawn here: every rank
    serves ``tensor_ops`` messages from its start)."""
    return device_mesh(proc_mesh._requester, proc_mesh._shape)


__all__ = ["RemoteException", "spawn_tensor_engine"]
