"""What is specific to meshes handed to ranks: how a mesh handle is pickled and
re-attached, and the rank-side :class:`PeerRequester`.

A ``ProcMesh`` or ``ActorMesh`` passed to an actor (as an endpoint or spawn argument)
pickles into a :class:`~monarch_kernel.calls.requester.MeshRef` (the mesh's name, key,
whole shape and each rank's peer address) plus the shape it refers to. Unpickled
(:func:`attach`) in a rank it is the same class over a :class:`PeerRequester`; unpickled
back in the controller that owns the mesh it is a handle over that controller's
``MeshRuntime``.

Calls from a rank go straight to the target ranks (one hop, the same signed messages the
controller sends; see ``wire.kinds``, "Rank -> rank"), never through the controller, so
actor-to-actor traffic does not queue behind the notebook:
:class:`~monarch_kernel.actor.peer.client.PeerClient` sends them and routes the replies,
deaths and lost machines to the futures.

A reference follows its mesh when it grows or shrinks: the controller sends every live
rank the new ``MeshRef`` (``calls.mesh_refs``), and each :class:`PeerRequester` of that
mesh in this process takes it on; handles on the whole mesh over it (``actor.resize``)
then cover the new shape, and calls go to the ranks' addresses and slots as they are
now. A reference unpickled later takes the newest one known here.
"""

from __future__ import annotations

import pickle
import random
import sys
import weakref
from collections.abc import Sequence
from typing import cast

from monarch_kernel.actor.peer.client import client
from monarch_kernel.actor.resize import resized
from monarch_kernel.calls import mesh_refs
from monarch_kernel.calls.future import Future, Waiter, then
from monarch_kernel.calls.gather import One
from monarch_kernel.calls.reply import RequestObserver
from monarch_kernel.calls.requester import PLAIN, ActorSpec, CallOptions, MeshRef, Requester
from monarch_kernel.rank import context
from monarch_kernel.shape import Shape
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.reports import StopRequest


def rank_waiter() -> Waiter | None:
    """What a future of a peer call runs before it blocks: in a rank, serve calls from
    other ranks while the main thread waits (see ``Rank.serve_until``)."""
    svc = context.services()
    return svc.serve_until if svc is not None else None


class PeerRequester:
    """The :class:`~monarch_kernel.calls.requester.Requester` of a mesh reference in a
    rank: requests go straight to the target ranks through this process's
    :class:`~monarch_kernel.actor.peer.client.PeerClient`. It takes on the newest
    reference to its mesh this process hears of (see the module)."""

    #: Whole-mesh handles over it follow the mesh's resizes (``actor.resize.follow``).
    follows_resizes = True

    def __init__(self, ref: MeshRef, follows: bool = True):
        """``follows``: take on newer references to the mesh (False: ``ref`` is not the
        whole mesh's, as ``this_proc()``'s)."""
        self._ref = mesh_refs.newest(ref) if follows else ref
        self.follows_resizes = follows
        if follows:
            _requesters.add(self)

    def _take(self, ref: MeshRef) -> None:
        """A newer reference to its mesh: take it on; handles on the whole mesh follow."""
        mine = self._ref
        if (ref.mesh, ref.key) != (mine.mesh, mine.key) or ref.generation <= mine.generation:
            return
        self._ref = ref
        resized(self)

    @property
    def name(self) -> str:
        return self._ref.mesh

    @property
    def shape(self) -> Shape:
        return self._ref.shape

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
        if options.control:
            raise RuntimeError(
                f"push(), pull() and ping() of mesh {self.name!r} are only available in the "
                "notebook that started it; from a rank, call an endpoint of an actor on it"
            )
        return client().request(self._ref, ranks, header, payload, buffers, observer)

    def send(
        self, ranks: list[int], header: Header, payload: bytes, buffers: Sequence[Buffer]
    ) -> None:
        client().request(self._ref, ranks, header, payload, buffers, None)

    @property
    def waiter(self) -> Waiter | None:
        return rank_waiter()

    def on_machine(self, ranks: Sequence[int], machine: str) -> bool:
        """Whether every one of ``ranks`` is a process of ``machine`` reached over its
        unix socket (its CUDA memory can then be mapped by CUDA IPC from here)."""
        addrs = self._ref.addrs
        for rank in ranks:
            addr = addrs[rank] if 0 <= rank < len(addrs) else None
            if not addr or addr.machine != machine or not addr.ipc:
                return False
        return True

    def choose(self, ranks: list[int]) -> int:
        # A rank does not know how busy the others are: any one of them.
        return random.choice(ranks)

    def actor_spawned(self, spec: ActorSpec) -> None:
        """Nothing to do here: each target rank tells its own controller (which
        re-creates the actor with its owner when the rank restarts)."""

    def actor_stopped(self, name: str, ranks: list[int]) -> None:
        """As :meth:`actor_spawned`: the target ranks tell their controller."""

    def reference(self) -> MeshRef:
        return self._ref

    def stop_mesh(self, grace: float) -> Future[None]:
        """Asked of this rank's controller, which owns every mesh; the future completes
        once it is stopped."""
        svc = context.services()
        if svc is None:
            raise RuntimeError("a mesh reference is stopped from a rank")
        c = client()
        c.codec(svc.key)  # the controller answers with our mesh's key
        one = One(rank_waiter())
        rid = c.expect(one, 0)
        req = StopRequest(
            mesh=self._ref.mesh, key=self._ref.key, grace=grace, rt=c.reply.encode(), id=rid
        )
        notice = H.RankNotice(kind=K.STOP_MESH, rank=svc.rank)
        svc.send(notice.encode(), pickle.dumps(req))
        return then(one.future, lambda _: None)

    def spawn_owner(self) -> H.Owner | None:
        svc = context.services()
        if svc is not None and context.current_actor:
            # Spawned by an actor: it owns the new mesh and supervises it.
            return H.Owner(address=svc.peer.encode(), key=svc.key, name=context.current_actor)
        return None

    def __repr__(self) -> str:
        return f"<PeerRequester {self._ref.mesh!r}>"


#: Every PeerRequester of this process (weakly): told of newer references.
_requesters: weakref.WeakSet[PeerRequester] = weakref.WeakSet()


def _newer(ref: MeshRef) -> None:
    for requester in list(_requesters):
        requester._take(ref)


mesh_refs.subscribe(_newer)


# -- re-attaching ---------------------------------------------------------------------


#: Meshes this very process serves (the controller's ``this_proc()``, see
#: ``actor.client_proc``), by (name, key hex): a handle on them unpickled here is theirs.
local_meshes: dict[tuple[str, str], Requester] = {}


def attach(ref: MeshRef) -> Requester:
    """The requester of an unpickled mesh handle: this process's own mesh, or the
    controller's own runtime where it owns ``ref``'s mesh, else a :class:`PeerRequester`."""
    local = local_meshes.get((ref.mesh, ref.key))
    if local is not None:
        return local
    # Looked up only where the controller is loaded: a rank never imports it.
    registry_module = sys.modules.get("monarch_kernel.controller.mesh")
    if registry_module is not None and not context.in_rank():
        for rt in registry_module.registry.live():
            if rt.name == ref.mesh and rt.key.hex() == ref.key:
                return cast(Requester, rt)
    return PeerRequester(ref)


__all__ = ["PeerRequester", "attach", "local_meshes", "rank_waiter"]
