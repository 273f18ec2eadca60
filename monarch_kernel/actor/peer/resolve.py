"""Finding a rank again after it moved.

A mesh reference (:class:`~monarch_kernel.calls.requester.MeshRef`) carries each rank's
peer address as it was when the reference was made. A rank restarted by its own host
agent listens where it did (same unix path, TCP port and CURVE key), but one whose host
was relaunched (a lost host agent started again: ``controller/lifecycle/restart.py``, by the
local launcher or the engines, possibly on another machine) listens somewhere else.

So when a connection to a rank fails, or was lost (the rank may have been restarted
since: a new incarnation), the process's
:class:`~.client.PeerClient` asks the controller that owns the
mesh where the rank is now (:func:`locate`: an ``ask`` of operation :data:`WHERE`). The
controller answers once the mesh is no longer restarting ranks, with a
:class:`~monarch_kernel.wire.peer_address.RankLocation`: the rank's address now, or why
it is gone. The client then calls it there, or fails the call with ``RankDiedError``
saying why. A rank asking about a rank of its own mesh is answered at once (the restart
may be waiting for the asking rank itself).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Protocol

from monarch_kernel.calls.errors import MonarchError, RankDiedError
from monarch_kernel.calls.gather import One
from monarch_kernel.calls.reply import RequestObserver
from monarch_kernel.calls.requester import MeshRef
from monarch_kernel.rank import context
from monarch_kernel.wire import Codec
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.peer_address import PeerAddress, RankLocation
from monarch_kernel.wire.reports import AskRequest

#: The ``ask`` operation a rank asks its controller where a rank of a mesh is now.
WHERE = "where_is_rank"
#: How long the controller may wait for the mesh to finish restarting ranks before it
#: answers (seconds), and how much longer the asker waits for that answer.
LOCATE_WAIT = 120.0
_ANSWER_SLACK = 15.0

#: In the controller's own process (which asks itself, not over the wire):
#: ``fn(mesh, key, rank, wait, slot) -> RankLocation``; set by ``actor/hosts.py``.
local_locator: Callable[[str, str, int, float, int], RankLocation] | None = None


class AskingClient(Protocol):
    """What :func:`locate` uses of the process's ``PeerClient``."""

    @property
    def reply(self) -> PeerAddress: ...

    def codec(self, key: str) -> Codec: ...

    def expect(self, observer: RequestObserver, rank: int) -> str: ...


def locate(
    client: AskingClient, ref: MeshRef, rank: int, wait: float = LOCATE_WAIT
) -> RankLocation | None:
    """Where rank ``rank`` of ``ref``'s mesh is now, asked of the controller (which
    waits up to ``wait`` seconds while the mesh restarts ranks). None where there is
    nobody to ask: a process that is neither a rank nor the owning controller."""
    svc = context.services()
    slot = ref.slot(rank)  # the process the reference names (renumbered since? its slot)
    if svc is None:
        return local_locator(ref.mesh, ref.key, rank, wait, slot) if local_locator else None
    client.codec(svc.key)  # the controller answers signed with our own mesh's key
    if ref.key == svc.key:
        # A rank of the very mesh: its restart may be waiting for this rank (its
        # controller's messages wait for the endpoint that asks): never wait for it.
        wait = 0.0
    one = One(svc.serve_until)
    rid = client.expect(one, 0)
    call = pickle.dumps((ref.mesh, ref.key, rank, wait, slot))
    req = AskRequest(op=WHERE, id=rid, rt=client.reply.encode(), call=call)
    svc.send(H.RankNotice(kind=K.ASK, rank=svc.rank).encode(), pickle.dumps(req))
    try:
        where = one.future.get(timeout=wait + _ANSWER_SLACK)
    except (MonarchError, TimeoutError) as exc:  # the mesh is gone, or no answer
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        message = f"rank {rank} of mesh {ref.mesh!r} cannot be found again: {first}"
        raise RankDiedError(message, mesh=ref.mesh) from None
    if not isinstance(where, RankLocation):
        message = f"rank {rank} of mesh {ref.mesh!r}: unexpected answer {where!r}"
        raise RankDiedError(message, mesh=ref.mesh)
    return where


def gone(ref: MeshRef, rank: int, where: RankLocation | None) -> RankDiedError | None:
    """The error for a call to a rank that ``where`` says is not running (None if it
    runs): the controller's words (its death, or its mesh stopped)."""
    if where is not None and where.alive and where.address:
        return None
    why = where.why if where is not None else ""
    return RankDiedError(why or f"rank {rank} of mesh {ref.mesh!r} is not running", mesh=ref.mesh)


__all__ = ["LOCATE_WAIT", "WHERE", "gone", "local_locator", "locate"]
