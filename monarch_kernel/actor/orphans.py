"""Monarch's rule that a mesh does not outlive its owner, when the owner's process dies.

An actor that spawns an actor mesh owns it: when the owner stops or fails, its rank
stops what it owns first (``rank.supervise.stop_owned``). When the owner's *process*
dies (killed, crashed), nothing runs there any more, so the controller does it: every
actor that an actor of the dead rank owns, on any live mesh of this controller, is
stopped the ordinary way (its ``__cleanup__`` runs, later calls raise
``SupervisionError`` saying it was stopped, a restart of its ranks does not bring it
back), and the death's report names them.

Process meshes an actor started itself (``this_host().spawn_procs`` inside a rank) are
its rank's own children: their host agents end with that process (the parent-death
signal), and their ranks with their agents. A detachable mesh is the exception by
design: it outlives its controller (see ``controller.detach``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from monarch_kernel.actor.actor import Actor
from monarch_kernel.actor.meshes import ActorMesh, ProcMesh
from monarch_kernel.controller.mesh import MeshRuntime, registry

log = logging.getLogger("monarch_kernel.actor")


@dataclass(frozen=True)
class Orphan:
    """Actor ``actor`` on rank ``rank`` of ``mesh``, owned by actor ``owner`` of a rank
    that died."""

    mesh: MeshRuntime
    actor: str
    rank: int
    owner: str


def orphans_of(runtime: MeshRuntime, rank: int) -> list[Orphan]:
    """The actors, on every live mesh, that actors of rank ``rank`` of ``runtime`` own
    (told by their ranks: ``owned`` messages); taken out of those records."""
    peer = runtime.ranks[rank].peer
    if not peer:
        return []
    address, key = list(peer.encode()), runtime.key.hex()
    found: list[Orphan] = []
    for mesh in registry.live():
        for r, info in enumerate(mesh.ranks):
            for actor, owner in list(info.owners.items()):
                if owner.key == key and list(owner.address) == address:
                    info.owners.pop(actor, None)
                    found.append(Orphan(mesh, actor, r, owner.name))
    return found


def describe(orphans: list[Orphan]) -> str:
    """``what its actors owned stops with it: actor mesh 'leaf' on 'given' (ranks 0, 1)``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for o in orphans:
        groups.setdefault((o.mesh.name, o.actor), []).append(o.rank)
    parts = [
        f"actor mesh {actor!r} on {mesh!r} (rank{'s' if len(rs) > 1 else ''} "
        f"{', '.join(str(r) for r in sorted(rs))})"
        for (mesh, actor), rs in groups.items()
    ]
    return "what its actors owned stops with it (Monarch: a mesh does not outlive its owner): " + (
        "; ".join(parts)
    )


def stop_orphans(orphans: list[Orphan]) -> None:
    """Stop ``orphans`` (on a thread of its own: this runs on a mesh's receiving thread,
    and a stop waits for its ranks)."""
    if orphans:
        threading.Thread(target=_stop, args=(orphans,), name="mk-orphans", daemon=True).start()


def _stop(orphans: list[Orphan]) -> None:
    futures = []
    for o in orphans:
        try:
            procs = ProcMesh(o.mesh)
            shape = procs.shape
            info = o.mesh.ranks[o.rank]
            point = shape.slice(**dict(zip(shape.labels, info.coords, strict=True)))
            futures.append((o, ActorMesh(procs, o.actor, Actor, point).stop()))
        except Exception as exc:  # its mesh stopped meanwhile, the rank is gone ...
            log.info("could not stop %s on %s[%d]: %s", o.actor, o.mesh.name, o.rank, exc)
    for o, fut in futures:
        try:
            fut.get(timeout=60)
        except Exception as exc:  # its rank died meanwhile: nothing left to stop
            log.info("stopping %s on %s[%d]: %s", o.actor, o.mesh.name, o.rank, exc)
