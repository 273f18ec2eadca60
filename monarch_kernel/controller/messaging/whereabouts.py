"""Where a rank of a mesh is now: the answer to a process that holds an old reference
to it and could not reach it (``actor/peer/resolve.py``; the ``where_is_rank`` ask).

A rank restarted on a relaunched host agent (possibly on another machine) listens at a
new address; the controller learned it from the rank's ``ready``. The answer waits
while the mesh restarts ranks (as the notebook's own calls do), so that a caller reaches
the rank once its actors are back, and says why when the rank is really gone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.state.records import MeshPhase, RankInfo, RankState
from monarch_kernel.wire.peer_address import PeerAddress, RankLocation

#: How often a rank that is starting outside a recovery is looked at again.
_STARTING_POLL = 0.05
_NOWHERE = PeerAddress("")


class LocatableMesh(Protocol):
    """What :func:`locate_rank` reads of a mesh (``MeshRuntime`` provides it)."""

    @property
    def ranks(self) -> Sequence[RankInfo]: ...
    @property
    def state(self) -> MeshPhase: ...
    def wait_recovered(self, timeout: float | None = None) -> None: ...
    def death_text(self, info: RankInfo) -> str: ...


def locate_rank(mesh: LocatableMesh | None, name: str, rank: int, wait: float) -> RankLocation:
    """Where rank ``rank`` of mesh ``name`` (``mesh``, None if no live mesh of this
    controller has that name and key) is now, waiting up to ``wait`` seconds while the
    mesh restarts ranks."""
    stopped = f"rank {rank} of mesh {name!r} is gone: the mesh was stopped"
    if mesh is None:
        return RankLocation(_NOWHERE, 0, False, stopped)
    if not 0 <= rank < len(mesh.ranks):
        raise ValueError(f"mesh {name!r} has no rank {rank} (it has {len(mesh.ranks)})")
    deadline = time.monotonic() + wait
    try:
        mesh.wait_recovered(wait)
    except MeshStartError:
        waited = f" (waited {wait:.0f}s)" if wait else ""
        why = f"rank {rank} of mesh {name!r} is still being restarted{waited}"
        return RankLocation(_NOWHERE, mesh.ranks[rank].restarts, False, why)
    info = mesh.ranks[rank]
    while info.state is RankState.STARTING and time.monotonic() < deadline:
        time.sleep(_STARTING_POLL)  # restarted by hand (not a recovery): until it is up
    if mesh.state.ended:
        return RankLocation(_NOWHERE, info.restarts, False, stopped)
    if info.alive and info.peer and info.state is not RankState.STARTING:
        return RankLocation(info.peer, info.restarts, True)
    why = (
        mesh.death_text(info)
        if info.death is not None
        else f"rank {rank} of mesh {name!r} is {info.state.value}"
    )
    return RankLocation(_NOWHERE, info.restarts, False, why)


__all__ = ["LocatableMesh", "locate_rank"]
