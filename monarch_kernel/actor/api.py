"""Monarch's runtime helpers: ``context()``, ``current_actor_name()``, ``this_proc()``,
``Accumulator``, ``get_or_spawn_controller`` and the default
``unhandled_fault_hook``. Channels are in :mod:`.channels`."""

from __future__ import annotations

import logging
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from monarch_kernel.actor import local_context
from monarch_kernel.actor.meshes import ProcMesh
from monarch_kernel.actor.peer.client import client
from monarch_kernel.actor.peer.requester import PeerRequester, rank_waiter
from monarch_kernel.calls.future import Future, after_all, then
from monarch_kernel.calls.gather import One
from monarch_kernel.calls.requester import MeshRef
from monarch_kernel.rank import actor_logs as _actor_logs
from monarch_kernel.rank import context as rank_context
from monarch_kernel.rank.errors import ActorAborted
from monarch_kernel.rank.runtime import ResponsePort
from monarch_kernel.rank.supervise import MeshFailure
from monarch_kernel.shape import Point, Shape
from monarch_kernel.wire import dumps
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import AskRequest

log = logging.getLogger("monarch_kernel.actor")
R = TypeVar("R")
A = TypeVar("A")


# -- context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """The running actor (Monarch's ``context().actor_instance``).

    ``rank`` is its point in its process mesh, ``actor_id`` a readable id
    (``mesh/actor[rank]``; ``client`` in the controller), ``proc`` its own process as
    a one-point process mesh (what :func:`this_proc` returns)."""

    rank: Point
    actor_id: str
    proc_id: str
    name: str
    #: the actor's class, fully qualified (Monarch's ``class_name``); "" for the client
    class_name: str = ""

    def __str__(self) -> str:
        """Monarch's form: ``<root>.<__main__.Trainer trainer{'gpus': 1/2}>`` (the
        client is ``<root>``)."""
        if not self.class_name:
            return "<root>"
        rank = str(self.rank) if len(self.rank) > 0 else ""
        return f"<root>.<{self.class_name} {self.name}{rank}>"

    __repr__ = __str__

    @property
    def proc(self) -> ProcMesh:
        """This actor's own process, a one-point process mesh (:func:`this_proc`)."""
        return this_proc()

    @property
    def proc_mesh(self) -> ProcMesh:
        """The whole process mesh this actor runs on (Monarch's): in a rank, every rank
        of its mesh (asked of the controller once); in the controller, its own process
        (:func:`this_proc`)."""
        if not rank_context.in_rank():
            return this_proc()
        global _whole_mesh
        if _whole_mesh is None:
            _whole_mesh = _ask_controller("proc_mesh", ()).get()
        return _whole_mesh

    def abort(self, reason: str | None = None) -> None:
        """Monarch's ``abort``: stop the running actor with a failure. Its current call
        fails with ``reason``, later calls to it fail saying it aborted, and its creator's
        supervision hears of it (``__supervise__`` of an owning actor, else the
        controller's ``unhandled_fault_hook``); its process and other actors run on.
        Raises (a BaseException): call it from the actor's endpoint, on its thread."""
        in_actor = rank_context.in_rank() and self.name
        if not in_actor and local_context.current() is None:
            raise RuntimeError("abort() stops an actor: call it inside an actor's endpoint")
        raise ActorAborted(reason)


#: A rank's whole process mesh (``Instance.proc_mesh``), once asked for.
_whole_mesh: ProcMesh | None = None


@dataclass(frozen=True)
class Context:
    """Monarch's ``context()``: the running actor and the current message's rank."""

    actor_instance: Instance

    @property
    def message_rank(self) -> Point:
        """This rank's point within the slice the current message was sent to (its
        ``.rank`` the index in that slice); ``actor_instance.rank`` is its point in
        the whole process mesh."""
        return rank_context.message_rank()


def context() -> Context:
    """Information about the actor running this code (the client in the controller,
    outside of the actors of its own process)."""
    svc = rank_context.services()
    if svc is None:
        point = Point({}, 0)
        local = local_context.current()
        if local is not None:  # an actor of the controller's own process (this_proc())
            proc = f"{local.proc}[0]"
            return Context(Instance(point, f"{local.proc}/{local.actor}[0]", proc, local.actor))
        return Context(Instance(point, "client", "client", "client"))
    point = rank_context.current_rank()
    mesh = svc.config.mesh_name or "mesh"
    proc = f"{mesh}[{point.rank}]"
    name = rank_context.current_actor or ""
    cls = _class_name(svc.actors.get(name)) if name else ""
    return Context(Instance(point, f"{mesh}/{name}[{point.rank}]", proc, name, cls))


def _class_name(actor: object) -> str:
    if actor is None:
        return ""
    cls = type(actor)
    return f"{cls.__module__}.{cls.__qualname__}"


def actor_label() -> str | None:
    """``str(context().actor_instance)`` inside an actor of a rank, else None (the
    ``[actor=...]`` prefix of ``logging`` records: ``rank.actor_logs``)."""
    if not rank_context.in_rank() or not rank_context.current_actor:
        return None
    return str(context().actor_instance)


def current_actor_name() -> str:
    """The id of the actor running this code, e.g. ``trainers/trainer[3]``."""
    return context().actor_instance.actor_id


def this_proc() -> ProcMesh:
    """This process as a one-point process mesh: spawn actors on it.

    In a rank: its own process (an actor spawned here lives in this rank). In the
    controller: the controller's own process, as in Monarch's client: its actors run
    here, each on a thread of its own (see :mod:`.client_proc`)."""
    svc = rank_context.services()
    if svc is not None:
        cfg = svc.config
        world = cfg.world_size
        me = rank_context.current_rank().rank  # its rank now (svc.rank: its wire id)
        none = PeerAddress("")
        addrs = tuple(svc.peer if r == me else none for r in range(world))
        slots = tuple(svc.rank if r == me else -1 for r in range(world))
        whole = Shape.from_extent(dict(zip(cfg.labels, cfg.sizes)))
        ref = MeshRef(cfg.mesh_name or "mesh", cfg.key, addrs, whole, slots)
        return ProcMesh(PeerRequester(ref, follows=False), Shape((), (), (), me))
    from monarch_kernel.actor.hosts import client_proc

    return client_proc()


# -- supervision at the root ------------------------------------------------------------


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Called in the controller for a failure nobody handled: an exception under
    ``broadcast`` (or in an actor spawned by an actor, that no ``__supervise__`` on the
    way up handled) or a rank that died. Replace it to act on failures::

        import monarch_kernel.actor as actor
        actor.unhandled_fault_hook = my_hook

    The default prints the failure on stderr (in a notebook: under the running cell)
    and returns; unlike Monarch's, it never ends the controller (a notebook kernel).
    It is called once per failure nobody handled."""
    print(f"unhandled failure: {failure}", file=sys.stderr, flush=True)


# -- controllers ------------------------------------------------------------------------


def get_or_spawn_controller(name: str, cls: type, *args: Any, **kwargs: Any) -> Future[Any]:
    """The singleton actor ``name`` of this controller, spawned (with ``cls(*args,
    **kwargs)``) on :func:`this_proc` the first time; a future of its one-point mesh."""
    if rank_context.in_rank():  # asked of the controller, which owns the singletons
        return _ask_controller("get_or_spawn_controller", (name, cls, args, kwargs))
    from monarch_kernel.actor.hosts import controller_singleton

    fut: Future[Any] = Future()
    fut.set_result(controller_singleton(name, cls, args, kwargs))
    return fut


def _ask_controller(op: str, arguments: tuple[Any, ...]) -> Future[Any]:
    """Ask this rank's controller for operation ``op`` of the actor API (see
    ``controller.messaging.asks``); the future gives its answer."""
    svc = rank_context.services()
    assert svc is not None  # asked in ranks only
    call, buffers = dumps(arguments, f"arguments of {op}()")
    if buffers:
        raise TypeError(f"{op}() arguments must pickle in-band")
    c = client()
    c.codec(svc.key)  # the controller answers with this mesh's key
    one = One(rank_waiter())
    rid = c.expect(one, 0)
    req = AskRequest(op=op, id=rid, rt=c.reply.encode(), call=call)
    svc.send(H.RankNotice(kind=K.ASK, rank=svc.rank).encode(), pickle.dumps(req))
    return one.future


# -- accumulator ------------------------------------------------------------------------


class Accumulator(Generic[R, A]):
    """Fold the answers of every rank of an endpoint's call (Monarch's ``Accumulator``):
    ``Accumulator(counters.value, 0, lambda acc, v: acc + v).accumulate().get()``."""

    def __init__(self, endpoint: Any, identity: A, combine: Callable[[A, R], A]):
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call every rank now; the future folds their answers in arrival order."""
        futures = list(self._endpoint.stream(*args, **kwargs))
        identity, combine = self._identity, self._combine

        def fold(_: object) -> A:
            acc = identity
            for f in futures:
                acc = combine(acc, f.get())
            return acc

        done: Future[None] = Future()
        after_all(futures, lambda: done.set_result(None))
        return then(done, fold)


__all__ = [
    "Accumulator",
    "Context",
    "Instance",
    "MeshFailure",
    "ResponsePort",
    "context",
    "current_actor_name",
    "get_or_spawn_controller",
    "this_proc",
    "unhandled_fault_hook",
]


_actor_logs.label = actor_label  # the [actor=...] prefix of logging records in actors
