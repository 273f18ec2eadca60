"""The seam every mesh handle sends through: the :class:`Requester` protocol.

A :class:`~monarch_kernel.actor.meshes.ProcMesh` or ``ActorMesh`` does not know where it
lives. In the notebook its requester is the controller's ``MeshRuntime`` (it owns the
mesh: sockets to every rank, supervision, restarts); in a rank that was handed a mesh
reference it is a :class:`~monarch_kernel.actor.peer.requester.PeerRequester`, which sends
the same signed messages straight to the target ranks. Both deliver one
:class:`~monarch_kernel.calls.reply.Reply` per rank to the request's observer, so the
adverbs, the gathering and the errors are one code path on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from monarch_kernel.calls.future import Future, Waiter
from monarch_kernel.calls.reply import RequestObserver
from monarch_kernel.shape import Shape
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.headers import Owner
from monarch_kernel.wire.peer_address import PeerAddress


@dataclass(frozen=True, slots=True)
class CallOptions:
    """How a request is sent (the notebook's controller reads all of them; a rank's
    requester only ``what``). Frozen: make one per call site, once.

    ``what``: how people call it (``cell 5``, ``counters.incr``), for the
    ``RequestStarted`` event. ``control``: to the ranks' control threads (served while
    their main thread is busy). ``waited``: the caller will block on the future (and
    receive the replies itself); otherwise the I/O thread receives them. ``wait_for_room``:
    when the queues for busy ranks are full, wait (interruptibly) rather than raise
    ``BackpressureError``. ``internal``: sent by the controller itself while it re-forms
    the mesh (no failure policy applies). ``during_restart``: send even while ranks
    restart (what goes to a starting rank is lost: only for callers that cope with
    silent ranks).
    """

    what: str = ""
    control: bool = False
    waited: bool = False
    wait_for_room: bool = True
    internal: bool = False
    during_restart: bool = False


#: The options of a plain request (nothing special).
PLAIN = CallOptions()


@dataclass(frozen=True)
class ActorSpec:
    """How an actor mesh was spawned, to spawn it again on restarted ranks."""

    name: str
    payload: bytes
    buffers: tuple[Buffer, ...]
    ranks: frozenset[int]
    #: The owner actor when an actor of some rank spawned it: the re-created actor is
    #: supervised by it again.
    owner: Owner | None = field(default=None)


@dataclass(frozen=True)
class MeshRef:
    """What a pickled mesh handle carries: enough to reach the mesh's ranks directly
    from another process (see :mod:`monarch_kernel.actor.peer.requester`). The key travels only
    inside signed control messages (CURVE-encrypted across machines)."""

    mesh: str  #: the process mesh's name
    key: str  #: its signing key (hex)
    addrs: tuple[PeerAddress, ...]  #: where each global rank listens (false: not ready)
    shape: Shape  #: the whole mesh's shape
    #: Each global rank's wire id (its slot: what its replies name it by); empty: its
    #: rank. They differ once a shrink renumbered the ranks.
    slots: tuple[int, ...] = ()
    #: How many times the mesh had been resized when this was made: where a process
    #: holds references of several generations, the newest wins (``actor.peer``).
    generation: int = 0

    def slot(self, rank: int) -> int:
        """The wire id of global rank ``rank``."""
        slots = self.slots
        return slots[rank] if rank < len(slots) and slots[rank] >= 0 else rank


class Requester(Protocol):
    """Sends requests to ranks of one process mesh and hands their answers back.

    ``ranks`` are global ranks of the mesh; one reply (or one loss) per rank reaches the
    observer, on a thread of the requester's (it must not block).
    """

    @property
    def name(self) -> str:
        """The process mesh's name."""
        ...

    @property
    def shape(self) -> Shape:
        """The whole mesh's shape (handles hold slices of it)."""
        ...

    def request(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver,
        options: CallOptions = PLAIN,
        request_id: str | None = None,
    ) -> str:
        """Send ``header`` + payload to each of ``ranks``; returns the request id.
        ``request_id``: one the caller chose (to route output before it is sent)."""
        ...

    def send(
        self, ranks: list[int], header: Header, payload: bytes, buffers: Sequence[Buffer]
    ) -> None:
        """Fire and forget (``broadcast``): failures go to the mesh's supervision."""
        ...

    @property
    def waiter(self) -> Waiter | None:
        """What futures of this requester run before they block (receive or serve
        calls meanwhile); None when another thread always receives."""
        ...

    def choose(self, ranks: list[int]) -> int:
        """The rank of ``ranks`` that ``choose()`` calls (a live one)."""
        ...

    def actor_spawned(self, spec: ActorSpec) -> None:
        """``spec`` was spawned (the owner re-creates it on restarted ranks)."""
        ...

    def actor_stopped(self, name: str, ranks: list[int]) -> None:
        """Actor ``name`` was stopped on ``ranks``."""
        ...

    def reference(self) -> MeshRef:
        """A picklable reference to this mesh, for another process."""
        ...

    def stop_mesh(self, grace: float) -> Future[None]:
        """Stop every rank and host agent of the whole mesh."""
        ...

    def spawn_owner(self) -> Owner | None:
        """The owner of actors spawned from here: the actor of this rank that spawns
        them (it supervises them); None in the notebook."""
        ...
