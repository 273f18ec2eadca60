"""Mesh references that live in ranks: an ``ActorMesh`` or ``ProcMesh`` passed to an actor.

A mesh pickles (as an endpoint or spawn argument) into a :class:`MeshRef`: the target
mesh's name, key, shape and each rank's peer address (the unix socket its inbox also
listens on). Unpickled in a rank it is a :class:`RemoteActorMesh` / :class:`RemoteProcMesh`
with the same API (adverbs, slicing, spawn, stop); unpickled back in the controller that
owns the mesh it is the controller's own mesh object again.

Calls from a rank go straight to the target ranks (one hop, the same signed messages the
controller sends; see ``wire.kinds``, "Rank -> rank"), never through the controller, so
actor-to-actor traffic does not queue behind the notebook: this process's
:class:`~monarch_kernel.actor.peer_client.PeerClient` sends them and routes the replies,
deaths and lost machines to the futures.

The reference carries the target mesh's key: it travels only inside signed control
messages (CURVE-encrypted across machines), like everything else a rank is given.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator, Sequence
from typing import Any

from monarch_kernel.actor.actor import endpoints_of
from monarch_kernel.actor.peer_client import MeshRef, client
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import Each, Gather, One
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.rank import context
from monarch_kernel.shape import Shape
from monarch_kernel.wire import SerializationError, dumps
from monarch_kernel.wire import kinds as K


def _waiter() -> Any:
    """What a future of a peer call runs before it blocks: in a rank, serve calls from
    other ranks while the main thread waits (see ``Rank.serve_until``)."""
    rt = context._runtime
    return rt.serve_until if rt is not None else None


# -- the handles ------------------------------------------------------------------------


class _RemoteView:
    _ref: MeshRef

    @property
    def shape(self) -> Shape:
        return self._ref.shape

    @property
    def extent(self) -> dict[str, int]:
        return self._ref.shape.extent

    @property
    def sizes(self) -> dict[str, int]:
        return self._ref.shape.extent

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        return _size(self._ref.shape, dim)

    def __len__(self) -> int:
        return len(self._ref.shape)

    def ranks(self) -> list[int]:
        return self._ref.shape.ranks()

    def _sliced(self, dims: dict[str, Any]) -> MeshRef:
        r = self._ref
        return MeshRef(r.mesh, r.key, r.addrs, r.shape.slice(**dims))


def _size(shape: Shape, dim: str | Sequence[str] | None) -> int:
    """Monarch's ``size()``: all ranks, or the product of the named dims' sizes."""
    if dim is None:
        return len(shape)
    dims = [dim] if isinstance(dim, str) else list(dim)
    extent = shape.extent
    n = 1
    for d in dims:
        if d not in extent:
            raise KeyError(f"mesh has no dimension {d!r} (dimensions: {list(extent)})")
        n *= extent[d]
    return n


class RemoteProcMesh(_RemoteView):
    """A process mesh seen from a rank: slice it and spawn actors on it."""

    def __init__(self, ref: MeshRef):
        self._ref = ref

    @property
    def name(self) -> str:
        return self._ref.mesh

    def slice(self, **dims: Any) -> RemoteProcMesh:
        return RemoteProcMesh(self._sliced(dims))

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> RemoteActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every rank of this mesh."""
        payload, buffers = dumps((actor_class, args, kwargs), f"constructor of {name!r}")
        ranks = self._ref.shape.ranks()
        gather = Gather(ranks, self._ref.shape, _waiter())
        header: dict[str, Any] = {"k": K.SPAWN_ACTOR, "a": name}
        rt = context._runtime
        if rt is not None and context.current_actor:
            # Spawned by an actor: it owns the new mesh and supervises it.
            header.update(oa=rt.peer.encode(), ox=rt.cfg["key"], on=context.current_actor)
        client().request(self._ref, ranks, header, payload, buffers, gather)
        gather.future.get()
        return RemoteActorMesh(self._ref, name, actor_class)

    def stop(self, grace: float = 3.0) -> Future[None]:
        """Stop the whole process mesh (as ``ProcMesh.stop`` in the controller does):
        asked of this rank's controller, which owns every mesh; the future completes
        once it is stopped. A mesh cannot be stopped from one of its own ranks."""
        rt = context._runtime
        if rt is None:
            raise RuntimeError("a mesh reference is stopped from a rank")
        c = client()
        c.codec(rt.cfg["key"])  # the controller answers with our mesh's key
        one = One(_waiter())
        rid = c.expect(one, 0)
        req = {"mesh": self._ref.mesh, "key": self._ref.key, "grace": grace}
        req["rt"] = c.reply.encode()
        rt.send({"k": K.STOP_MESH, "r": rt.rank}, pickle.dumps(dict(req, id=rid)))
        return then(one.future, lambda _: None)

    def __reduce__(self) -> tuple[Any, ...]:
        return RemoteProcMesh, (self._ref,)

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self._ref.shape.describe()} (reference)>"


class RemoteActorMesh(_RemoteView):
    """An actor mesh seen from a rank: the same adverbs as in the controller."""

    def __init__(self, ref: MeshRef, name: str, actor_class: type):
        self._ref = ref
        self._name = name
        self._class = actor_class
        self._endpoints = endpoints_of(actor_class)

    @property
    def name(self) -> str:
        return self._name

    def __getattr__(self, attr: str) -> RemoteEndpoint:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr not in self._endpoints:
            eps = ", ".join(sorted(self._endpoints)) or "none"
            raise AttributeError(
                f"{self._class.__name__} has no endpoint {attr!r} (endpoints: {eps})"
            )
        ref = self.__dict__[attr] = RemoteEndpoint(self, attr)
        return ref

    def slice(self, **dims: Any) -> RemoteActorMesh:
        return RemoteActorMesh(self._sliced(dims), self._name, self._class)

    def stop(self) -> Future[None]:
        """Remove this actor from its ranks (the future completes when it is gone)."""
        ranks = self._ref.shape.ranks()
        gather = Gather(ranks, self._ref.shape, _waiter())
        header = {"k": K.STOP_ACTOR, "a": self._name}
        client().request(self._ref, ranks, header, b"", (), gather)
        return then(gather.future, lambda _: None)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_actor_mesh, (self._ref, self._name, self._class)

    def __repr__(self) -> str:
        return (
            f"<ActorMesh {self._name!r} ({self._class.__name__}) "
            f"{self._ref.shape.describe()} (reference)>"
        )


class RemoteEndpoint:
    """One endpoint of a mesh reference, with Monarch's adverbs."""

    def __init__(self, mesh: RemoteActorMesh, method: str):
        self._mesh = mesh
        self._method = method
        sh = mesh._ref.shape
        self._header = {
            "k": K.CALL,
            "a": mesh._name,
            "m": method,
            "sl": [list(sh.labels), list(sh.sizes), list(sh.strides), sh.offset],
        }

    def _payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, Any]:
        what = f"arguments of {self._mesh._class.__name__}.{self._method}"
        try:
            return dumps((args, kwargs), what)
        except SerializationError:
            raise

    def _send(self, ranks: list[int], args: Any, kwargs: Any, obs: Any) -> None:
        payload, buffers = self._payload(args, kwargs)
        client().request(self._mesh._ref, ranks, self._header, payload, buffers, obs)

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        ranks = self._mesh._ref.shape.ranks()
        gather = Gather(ranks, self._mesh._ref.shape, _waiter())
        self._send(ranks, args, kwargs, gather)
        return gather.future

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        ranks = self._mesh._ref.shape.ranks()
        if len(ranks) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one rank, but "
                f"{self._mesh._class.__name__}.{self._method} is on {len(ranks)} ranks; "
                "slice it first or use call()"
            )
        one = One(_waiter())
        self._send(ranks, args, kwargs, one)
        return one.future

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        one = One(_waiter())
        self._send([random.choice(self._mesh._ref.shape.ranks())], args, kwargs, one)
        return one.future

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        self._send(self._mesh._ref.shape.ranks(), args, kwargs, None)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        ranks = self._mesh._ref.shape.ranks()
        each = Each(ranks, _waiter())
        self._send(ranks, args, kwargs, each)
        return each.in_order_of_answers()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through an adverb: {self._method}.call(...), .call_one(...), "
            ".broadcast(...), .choose(...) or .stream(...)"
        )


def then(fut: Future[Any], fn: Any) -> Future[Any]:
    """A future of ``fn(fut's value)`` (``fut``'s error, if it fails)."""
    out: Future[Any] = Future(lambda done: fn(done.get()))

    def done(f: Future[Any]) -> None:
        out.set_result(f)

    fut.add_done_callback(done)
    return out


# -- pickling --------------------------------------------------------------------------


def _rebuild_actor_mesh(ref: MeshRef, name: str, actor_class: type) -> Any:
    """Unpickle an actor mesh reference: the controller's own mesh where it is owned."""
    local = _local_procs(ref)
    if local is not None:
        from monarch_kernel.actor.meshes import ActorMesh

        return ActorMesh(local, name, actor_class, ref.shape)
    return RemoteActorMesh(ref, name, actor_class)


def _rebuild_proc_mesh(ref: MeshRef) -> Any:
    local = _local_procs(ref)
    if local is not None:
        from monarch_kernel.actor.meshes import ProcMesh

        return ProcMesh(local.runtime, ref.shape)
    return RemoteProcMesh(ref)


def _local_procs(ref: MeshRef) -> Any:
    """The controller's ProcMesh for ``ref`` (None in a rank, or not owned here)."""
    if context.in_rank():
        return None
    from monarch_kernel.actor.meshes import ProcMesh
    from monarch_kernel.controller.registry import registry

    for rt in registry.live():
        if rt.name == ref.mesh and rt.key.hex() == ref.key:
            return ProcMesh(rt)
    return None


def mesh_ref(runtime: Any, shape: Shape) -> MeshRef:
    """A reference to ``shape`` of the mesh run by ``runtime`` (a MeshRuntime)."""
    addrs = tuple(info.peer for info in runtime.ranks)
    return MeshRef(runtime.name, runtime.key.hex(), addrs, shape)


__all__ = ["RemoteActorMesh", "RemoteEndpoint", "RemoteProcMesh"]
