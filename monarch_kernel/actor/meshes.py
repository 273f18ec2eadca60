"""Process meshes, actor meshes and the endpoint adverbs: one set of classes for the
notebook and for ranks.

A handle holds a :class:`~monarch_kernel.calls.requester.Requester` and the (sliced)
shape it refers to. In the notebook the requester is the controller's ``MeshRuntime``;
in a rank that was handed a mesh it is a ``PeerRequester``
(:mod:`monarch_kernel.actor.peer.requester`) that calls the
target ranks directly. The adverbs, the gathering of replies and the errors are the same
code on both sides; what only the owner of a mesh can do (restart it, interrupt it, show
its dashboard, push/pull variables) says so when asked in a rank.

This module never imports the controller: a rank that uses actors loads none of it.
Starting meshes (``this_host().spawn_procs``) is in :mod:`.hosts`.

**Endpoints win over mesh attributes**, as in Monarch: an actor with an endpoint called
``size``, ``slice``, ``stop``, ``name``, ``flatten`` ... gets its endpoint from
``mesh.size``; the mesh's own attribute stays reachable through the class, e.g.
``ActorMesh.slice(mesh, gpus=0)``, ``ActorMesh.size(mesh)``, ``ActorMesh.name(mesh)``.
"""

from __future__ import annotations

import logging
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from monarch_kernel import config
from monarch_kernel.actor import local_context
from monarch_kernel.actor.actor import Actor, check_endpoint_kinds, endpoints_of
from monarch_kernel.actor.channels import report_unhandled
from monarch_kernel.actor.endpoints import (
    ActorTarget,
    EndpointRef,
    NotAnEndpoint,
    dump_call,
    failed_init,
    gather,
    mesh_tensor_args,
)
from monarch_kernel.actor.mesh_view import MeshView, mesh_attribute
from monarch_kernel.actor.peer.requester import attach
from monarch_kernel.actor.resize import follow, resized
from monarch_kernel.calls.errors import ActorError, SupervisionError
from monarch_kernel.calls.future import Future, then
from monarch_kernel.calls.requester import ActorSpec, CallOptions, MeshRef, Requester
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.rank import context as rank_context
from monarch_kernel.rank.supervise import MeshFailure, failure_reason, own
from monarch_kernel.shape import Shape, SliceError
from monarch_kernel.wire import dumps
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header

#: Seconds a spawn may wait, besides its constructors' own limit (``actor_spawn_max_idle``,
#: timed by each rank), for the rank to start them: the work sent before it (a long cell).
SPAWN_QUEUE_WAIT = 600.0

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from monarch_kernel.controller.state.records import RecoveryReport

T = TypeVar("T")

#: Seconds ranks get to exit cleanly on a stop (as ``MeshRuntime.stop``'s default).
STOP_GRACE = 3.0

#: ``factory(procs) -> dashboard widget``, set by :mod:`monarch_kernel.widgets` through
#: :func:`set_dashboard_factory`: the actor layer never imports the widgets layer.
_dashboard_factory: Callable[[ProcMesh], Any] | None = None


def set_dashboard_factory(factory: Callable[[ProcMesh], Any]) -> None:
    """Install what ``ProcMesh.dashboard()`` returns (called by the widgets layer)."""
    global _dashboard_factory
    _dashboard_factory = factory


class ProcMesh(MeshView):
    """A mesh of rank processes with named dims; spawn actors on it."""

    def __init__(self, requester: Requester, shape: Shape | None = None):
        self._requester = requester
        self._shape = shape or requester.shape
        follow(self, requester, self._shape)

    def _take_shape(self, shape: Shape) -> None:
        self._shape = shape

    @property
    def name(self) -> str:
        """The mesh's name (as given to ``%mesh`` or ``spawn_procs``)."""
        return self._requester.name

    def grow(
        self, ranks: int | str | None = None, hosts: int | str | None = None, timeout: float = 120.0
    ) -> Any:
        """Add ``ranks`` ranks (a mesh on one host) or ``hosts`` hosts to the running
        mesh; survivors keep their processes and state. While a ``--bg`` cell runs a
        ``TrainingState`` loop it happens at a step boundary and the new ranks join it
        with a live replica's state. Returns a report (``print(report.describe())``)."""
        rt = self._controller("grow()")
        report = rt.grow(_plus(ranks), _plus(hosts), timeout)
        resized(self._requester)
        return report

    def shrink(
        self,
        ranks: int | str | None = None,
        hosts: int | str | None = None,
        timeout: float = 120.0,
        *,
        drop_ranks: int | str | Sequence[int] | None = None,
        drop_hosts: int | str | Sequence[int] | None = None,
    ) -> Any:
        """Keep ``ranks`` ranks (0 .. ranks-1) or ``hosts`` hosts; the others stop. Or
        drop given ranks or hosts, anywhere (``drop_ranks=[1, 3]``, ``drop_hosts=1``):
        the survivors keep their processes and state and are renumbered in their old
        order (``RANK``, ``current_rank()``, the process group's rank; old ranks 0, 2, 3
        become 0, 1, 2). Returns a report (``print(report.describe())``)."""
        rt = self._controller("shrink()")
        report = rt.shrink(
            _text(ranks), _text(hosts), timeout, _numbers(drop_ranks), _numbers(drop_hosts)
        )
        resized(self._requester)
        return report

    def slice(self, **dims: Any) -> ProcMesh:
        """The ranks at ``dims`` (ints or slices), e.g. ``procs.slice(gpus=0)``."""
        return ProcMesh(self._requester, self._shape.slice(**dims))

    def flatten(self, name: str) -> ProcMesh:
        """The same ranks as one dimension called ``name``."""
        return ProcMesh(self._requester, self._flat_shape(name))

    def rename(self, **names: str) -> ProcMesh:
        """The same ranks with dims renamed: ``procs.rename(host="dp", gpu="tp")``."""
        from monarch_kernel.shape import rename_dims

        return ProcMesh(self._requester, rename_dims(self._shape, names))

    def split(self, **how: Any) -> ProcMesh:
        """The same ranks with dims split into several, row-major:
        ``procs.split(host=("dp", "pp"), gpu=("tp",), pp=2)`` (one size per split may
        be left out and is inferred)."""
        from monarch_kernel.shape import split_dims

        return ProcMesh(self._requester, split_dims(self._shape, how))

    def to_table(self) -> str:
        """The process grid as text: each coordinate's global rank."""
        from monarch_kernel.shape import grid_table

        return grid_table(self._shape)

    # -- the tensor engine (monarch_kernel.tensor_engine) ------------------------------
    def activate(self) -> Any:
        """Make this mesh the active device mesh now: until the ``with`` block ends (or
        ``.deactivate()``), torch ops issued here create and operate on mesh tensors,
        one local tensor per rank. Activations nest."""
        from monarch_kernel.tensor_engine.mesh import device_mesh

        return device_mesh(self._requester, self._shape).activate()

    def rank(self, dims: str | Sequence[str]) -> Any:
        """A mesh tensor holding each rank's coordinate along ``dims`` (0-d int64)."""
        from monarch_kernel.tensor_engine.mesh import device_mesh

        return device_mesh(self._requester, self._shape).rank(dims)

    rank_tensor = rank

    @property
    def rank_tensors(self) -> Any:
        """Each rank's position in the mesh (row-major over all dims), as a mesh tensor
        (``ranks()`` stays the list of global ranks; the device mesh's ``.ranks`` is
        this tensor, as in Monarch)."""
        from monarch_kernel.tensor_engine.mesh import device_mesh

        return device_mesh(self._requester, self._shape).ranks

    def logging_option(
        self,
        stream_to_client: bool = True,
        aggregate_window_sec: int | None = 3,
        level: int = logging.INFO,
    ) -> Future[None]:
        """Monarch's logging options of the mesh's processes. ``level`` (Monarch's) is the
        Python root logger's level on every rank of this mesh (``logging.INFO`` lets an
        actor's ``logging.info(...)`` through; it shows under the cell that caused it,
        with the ``[actor=...]`` prefix). Rank output always streams to the cell that
        caused it, batched and never aggregated across ranks, so the other options are
        checked and have no effect.

        Monarch's is a coroutine: the future returned here, completed once every rank
        has the level, can be awaited, given to ``asyncio.run`` or read with ``.get()``."""
        from monarch_kernel.actor.log_level import check_level, set_root_level

        if not isinstance(stream_to_client, bool):
            raise TypeError("stream_to_client must be a bool")
        check_level(level)
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec is only valid when stream_to_client is True")
        set_root_level(self, level)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def __reduce__(self) -> tuple[Any, ...]:
        # Passed to an actor: a live handle there (see monarch_kernel.actor.peer.requester).
        return rebuild_proc_mesh, (self._requester.reference(), self._shape)

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every rank of this mesh. A mesh
        tensor among the arguments (of this process mesh, on every rank of it spawned
        on) reaches each rank's constructor as that rank's local tensor, after the ops
        issued before (Monarch's rule, as for endpoint arguments)."""
        if not isinstance(name, str) or not name:
            raise TypeError("spawn(name, ActorClass, *args): name must be a non-empty string")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(
                f"spawn() needs a subclass of monarch_kernel.actor.Actor, got {actor_class!r}"
            )
        check_endpoint_kinds(actor_class)  # before anything is sent, as Monarch
        ranks = self._shape.ranks()
        args, kwargs = mesh_tensor_args(self._requester, ranks, args, kwargs)
        what = f"constructor arguments of actor {name!r} ({actor_class.__name__})"
        payload, buffers = dump_call((actor_class, args, kwargs), args, kwargs, what)
        # Spawned by an actor (of a rank, or of the controller's own process): it owns them.
        owner = local_context.owner() or self._requester.spawn_owner()
        # Monarch's actor_spawn_max_idle: each rank fails the actor whose constructor has
        # not returned by then (timed there from its start, not behind earlier work)
        limit = config.seconds(config.get("actor_spawn_max_idle"))
        header = H.SpawnActor(actor=name, owner=owner, limit=limit).encode()
        options = CallOptions(what=f"spawn {name}", waited=True)
        constructed = self._gather(ranks, header, payload, buffers, options)
        failed_init.pop((self.name, name), None)
        try:
            constructed.get(timeout=limit + SPAWN_QUEUE_WAIT)
        except SupervisionError:
            raise  # the mesh or a rank is gone: nothing was constructed there
        except ActorError as exc:
            # Monarch's way: spawn() returns; the failure goes to supervision and later
            # calls raise SupervisionError naming the constructor's exception.
            return self._init_failed(name, actor_class, exc, owner is None)
        except TimeoutError:
            if constructed.done():
                raise
            raise TimeoutError(
                f"spawn of actor {name!r} on mesh {self.name!r}: {actor_class.__name__}"
                f".__init__ had not started and returned within "
                f"{limit + SPAWN_QUEUE_WAIT:g}s on rank(s) {', '.join(map(str, ranks))} "
                "(the rank is still running something before it: a cell, another "
                "constructor; a slow constructor needs configure(actor_spawn_max_idle=...))"
            ) from None
        spec = ActorSpec(name, payload, tuple(buffers), frozenset(ranks))
        self._requester.actor_spawned(spec)
        mesh = ActorMesh(self, name, actor_class, self._shape)
        if owner is not None and local_context.owner() is None and rank_context.in_rank():
            own(owner.name, mesh)  # an actor of this rank spawned it: it stops with it
        return mesh

    def _init_failed(
        self, name: str, actor_class: type, exc: ActorError, unowned: bool
    ) -> ActorMesh:
        """A constructor raised on some ranks: the actor mesh is failed (its calls raise
        :class:`SupervisionError`, in Monarch's words), and supervision hears of it: the
        owning actor's ``__supervise__`` (told by the target rank), else
        ``unhandled_fault_hook`` here (``unowned``)."""
        first = exc.failures[0] if exc.failures else None
        cls = actor_class.__name__
        if first is None:
            message = f"actor {name!r} ({cls}) failed in its constructor: {exc}"
        else:
            who = f"{self.name}/{name}[{first.get('rank', -1)}]"
            reason = textwrap.indent(failure_reason(first).rstrip("\n"), "  ")
            message = (
                f"The actor {who} and all its descendants have failed:\n{reason}\n"
                f"({cls}.__init__ raised {first['type']}: {first['message']}; spawn it again)"
            )
        failed_init[(self.name, name)] = SupervisionError(message, exc.failures, exc)
        if unowned:  # Monarch: one event per failed actor (rank), each to the hook once
            for failure in exc.failures:
                report_unhandled(MeshFailure(self.name, name, failure.get("rank", -1), failure))
        return ActorMesh(self, name, actor_class, self._shape)

    def ping(self) -> Future[ValueMesh[Any]]:
        """Ask every rank's control thread for its pid and rejected-message count.

        Answered even while the rank's main thread is busy running user code.
        """
        return self._gather(self._shape.ranks(), {"k": K.PING}, b"", (), _CONTROL)

    def push(self, **values: Any) -> None:
        """Set names in every rank's cell namespace (also while a --bg cell runs)."""
        payload, buffers = dump_call(values, (), values, "pushed values")
        self._gather(self._shape.ranks(), {"k": K.PUSH}, payload, buffers, _CONTROL).get()

    def pull(self, *names: str) -> ValueMesh[Any] | dict[str, ValueMesh[Any]]:
        """Read names from every rank's cell namespace: a ValueMesh per name."""
        if not names:
            raise TypeError("pull() needs at least one variable name")
        payload, buffers = dumps(list(names), "pull request")
        ranks = self._shape.ranks()
        per_rank = self._gather(ranks, {"k": K.PULL}, payload, buffers, _CONTROL).get()
        meshes: dict[str, ValueMesh[Any]] = {
            n: ValueMesh(self._shape, [vals[i] for vals in per_rank.values()])
            for i, n in enumerate(names)
        }
        return meshes[names[0]] if len(names) == 1 else meshes

    def _gather(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        options: CallOptions,
    ) -> Future[ValueMesh[Any]]:
        return gather(self._requester, ranks, header, payload, buffers, self._shape, options)

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in whatever user code the ranks are running (the
        tensor-engine ops sent so far among it stop, as with the stop button; those
        sent after run)."""
        rt = self._controller("interrupt()")
        live = [r for r in self._shape.ranks() if rt.ranks[r].alive]
        engine = sys.modules.get("monarch_kernel.tensor_engine.client")
        client = engine.existing_client(self._requester) if engine is not None else None
        if client is not None:
            client.interrupt(live)
        else:
            rt.signal_ranks(live, signal.SIGINT)

    def restart(self, ranks: list[int] | None = None, timeout: float = 120.0) -> RecoveryReport:
        """Restart in place: bring ``ranks`` (default: the dead ones) back and re-form
        the mesh as it was: the torch process group (if the ranks had one) on every
        rank, actors and setup cells on the restarted ranks. Returns what was done
        (``print(report.describe(name))`` says it in words)."""
        rt = self._controller("restart()")
        for r in ranks or ():
            if not 0 <= r < rt.world:
                raise SliceError(f"rank {r} out of range: mesh {rt.name!r} has {rt.world} ranks")
        if ranks is None and len(self._shape) == rt.world:
            return rt.recover(None, timeout)  # the dead ones, once a restart under way ends
        if ranks is None:
            rt.wait_recovered()  # an automatic restart may be bringing them back
            ranks = rt.dead_ranks(self._shape.ranks())
        return rt.recover(ranks, timeout)

    def stop(self, grace: float = STOP_GRACE) -> Future[None]:
        """Stop every rank and host agent of the whole mesh (not only this slice).

        Ranks get ``grace`` seconds to exit cleanly (``atexit`` handlers, finalizers,
        ``destroy_process_group``) before they are killed. In the notebook it is done
        when this returns; from a rank the future completes once the controller stopped
        it (a mesh cannot be stopped from one of its own ranks). Errors of its
        tensor-engine ops that nothing fetched are written to stderr first."""
        engine = sys.modules.get("monarch_kernel.tensor_engine.client")
        if engine is not None:  # (only where the tensor engine was used)
            engine.report_before_stop(self._requester)
        return self._requester.stop_mesh(grace)

    def dashboard(self) -> Any:
        """This mesh's live dashboard (the same widget every time): shown as a cell's
        last expression, or with ``display(procs.dashboard())``."""
        self._controller("dashboard()")
        if _dashboard_factory is None:
            raise RuntimeError("the dashboard needs ipywidgets: import monarch_kernel.widgets")
        return _dashboard_factory(self)

    @property
    def stopped(self) -> bool:
        """Whether the mesh was stopped (False for a reference in a rank: not known)."""
        try:
            return self._controller("stopped").state == "stopped"
        except RuntimeError:  # the controller's own process says so itself
            return bool(getattr(self._requester, "stopped", False))

    def __repr__(self) -> str:
        try:
            state = str(self._controller("state").state)
        except RuntimeError:
            state = "reference"
            if hasattr(self._requester, "stopped"):  # the controller's own process
                state = "this process" + (", stopped" if self.stopped else "")
        return f"<ProcMesh {self.name!r} {self._shape.describe()} ({state})>"


class ActorMesh(MeshView):
    """An actor spawned on every rank of a (sliced) process mesh.

    Its endpoints are attributes (``counters.incr``); one named like a mesh attribute
    shadows it (see the module docstring)."""

    def __class_getitem__(cls, item: Any) -> type[ActorMesh]:
        """``ActorMesh[Counter]`` in annotations evaluated at run time (Monarch's
        ``ActorMesh`` is generic): the class itself."""
        return cls

    def __init__(self, procs: ProcMesh, name: str, actor_class: type, shape: Shape):
        self._procs = procs
        self._requester = procs._requester
        self._name = name
        self._class = actor_class
        self._shape = shape
        # computed once; changed in place only when the whole mesh grows or shrinks
        self._ranks = shape.ranks()
        self._endpoints = endpoints_of(actor_class)
        self._target = ActorTarget(self._requester, name, actor_class, shape, self._ranks)
        for ep in self._endpoints.keys() & _SHADOWABLE:
            self.__dict__[ep] = EndpointRef(self._target, ep)  # the endpoint wins
        follow(self, self._requester, shape)

    def _take_shape(self, shape: Shape) -> None:
        self._shape = shape
        self._ranks[:] = shape.ranks()  # endpoint references share this list
        object.__setattr__(self._target, "shape", shape)  # and read the target's shape

    @mesh_attribute
    def name(self) -> str:
        """The actor mesh's name (as given to ``spawn``)."""
        return self._name

    def __getattr__(self, attr: str) -> EndpointRef:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr not in self._endpoints:
            if callable(getattr(self._class, attr, None)):
                # a method that is no endpoint: as_endpoint(mesh.method) makes it one
                # (typed as endpoints are: Monarch's types say it is the method)
                return NotAnEndpoint(self._target, attr)  # type: ignore[return-value]
            eps = ", ".join(sorted(self._endpoints)) or "none"
            raise AttributeError(
                f"{self._class.__name__} has no endpoint {attr!r} (endpoints: {eps}); "
                "mark methods with @endpoint"
            )
        ref = self.__dict__[attr] = EndpointRef(self._target, attr)  # later lookups skip this
        return ref

    def slice(self, **dims: Any) -> ActorMesh:
        """The actors at ``dims`` (ints or slices), e.g. ``counters.slice(gpus=0)``."""
        return ActorMesh(self._procs, self._name, self._class, self._shape.slice(**dims))

    def flatten(self, name: str) -> ActorMesh:
        """The same actors as one dimension called ``name``."""
        return ActorMesh(self._procs, self._name, self._class, self._flat_shape(name))

    def stop(self) -> Future[None]:
        """Remove this actor from its ranks; the future completes once it is gone
        (``.get()`` or ``await`` it, as in Monarch)."""
        header: Header = {"k": K.STOP_ACTOR, "a": self._name}
        ranks, name, requester = self._ranks, self._name, self._requester
        options = CallOptions(waited=True)
        done = gather(requester, ranks, header, b"", (), self._shape, options)

        def forget(_: object) -> None:
            requester.actor_stopped(name, ranks)

        return then(done, forget)

    def __reduce__(self) -> tuple[Any, ...]:
        # Passed to an actor: a live handle there (see monarch_kernel.actor.peer.requester).
        ref = self._requester.reference()
        return rebuild_actor_mesh, (ref, self._shape, self._name, self._class)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} ({self._class.__name__}) {self._shape.describe()}>"


#: Attributes of an actor mesh that an endpoint of the same name replaces on its meshes.
_SHADOWABLE = frozenset(n for n in dir(ActorMesh) if not n.startswith("_"))
#: Requests to the ranks' control threads (push, pull, ping), whose caller waits.
_CONTROL = CallOptions(control=True, waited=True)


def _plus(n: int | str | None) -> str | None:
    """``2`` -> ``"+2"`` (a count to add); strings as given."""
    if n is None or isinstance(n, str):
        return n
    return f"+{n}" if n >= 0 else str(n)


def _text(n: int | str | None) -> str | None:
    return None if n is None else str(n)


def _numbers(n: int | str | Sequence[int] | None) -> str | None:
    """``[1, 3]`` -> ``"1,3"``; an int or a string (``"1,3"``, ``"2-4"``) as given."""
    if n is None or isinstance(n, str):
        return n
    if isinstance(n, int):
        return str(n)
    return ",".join(str(int(x)) for x in n)


def procs_of(mesh: ActorMesh) -> ProcMesh:
    """The process mesh (slice) an actor mesh lives on, whatever its endpoints are called."""
    return ProcMesh(mesh._requester, mesh._shape)


def _whole_now(requester: Requester, ref: MeshRef, shape: Shape) -> Shape:
    """A handle pickled on the whole mesh as ``ref`` saw it covers the whole mesh as it
    is now (it grew or shrank since); a slice keeps its shape."""
    return requester.shape if shape == ref.shape else shape


def rebuild_proc_mesh(ref: MeshRef, shape: Shape) -> ProcMesh:
    """Unpickle a process mesh handle (see :mod:`monarch_kernel.actor.peer.requester`)."""
    requester = attach(ref)
    return ProcMesh(requester, _whole_now(requester, ref, shape))


def rebuild_actor_mesh(ref: MeshRef, shape: Shape, name: str, actor_class: type) -> ActorMesh:
    """Unpickle an actor mesh handle (see :mod:`monarch_kernel.actor.peer.requester`)."""
    requester = attach(ref)
    return ActorMesh(ProcMesh(requester), name, actor_class, _whole_now(requester, ref, shape))


__all__ = [
    "ActorError",
    "ActorMesh",
    "EndpointRef",
    "MeshView",
    "ProcMesh",
    "mesh_attribute",
    "procs_of",
]
