"""Host meshes, process meshes, actor meshes and the endpoint adverbs."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from monarch_kernel.actor.actor import Actor, endpoints_of
from monarch_kernel.actor.peer import (
    _rebuild_actor_mesh,
    _rebuild_proc_mesh,
    _size,
    mesh_ref,
    then,
)
from monarch_kernel.calls.errors import ActorError
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import Each, Gather, One
from monarch_kernel.calls.requester import ActorSpec, CallOptions
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.controller.failures import DEFAULT_GRACE
from monarch_kernel.controller.mesh import DEFAULT_STOP_GRACE, MeshRuntime
from monarch_kernel.controller.records import FailurePolicy, RecoveryReport
from monarch_kernel.controller.registry import registry
from monarch_kernel.launchers import get_launcher
from monarch_kernel.shape import Shape, SliceError
from monarch_kernel.wire import SerializationError, dumps
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header

#: ``factory(procs) -> dashboard widget``, set by :mod:`monarch_kernel.widgets` through
#: :func:`set_dashboard_factory`: the actor layer never imports the widgets layer.
_dashboard_factory: Callable[[ProcMesh], Any] | None = None


def set_dashboard_factory(factory: Callable[[ProcMesh], Any]) -> None:
    """Install what ``ProcMesh.dashboard()`` returns (called by the widgets layer)."""
    global _dashboard_factory
    _dashboard_factory = factory


class HostMesh:
    """A set of hosts (machines) on which process meshes are spawned.

    Its dimensions are the ones :meth:`spawn_procs` puts ahead of ``per_host``'s:
    ``{"hosts": H}`` on H > 1 hosts, none on one host (like Monarch's ``this_host()``,
    a zero-dimensional mesh of one host); ``size()``, ``sizes``, ``extent`` and
    ``len()`` read them as on a process mesh.

    :meth:`shutdown` stops every process mesh spawned from it and releases its launcher;
    as in Monarch, ``async with hosts:`` shuts it down on exit.
    """

    def __init__(self, hosts: int = 1, backend: str = "local", **launcher_options: Any):
        if not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts must be a positive int, got {hosts!r}")
        self.hosts = hosts
        self.backend = backend
        self.launcher = get_launcher(backend, **launcher_options)
        self._lock = threading.Lock()
        #: Meshes spawned from this host mesh (the ones :meth:`shutdown` stops); stopped
        #: ones are dropped at the next spawn.
        self._spawned: list[MeshRuntime] = []
        self._shut_down = False

    # -- shape (Monarch's MeshTrait, read-only) ------------------------------------------

    @property
    def shape(self) -> Shape:
        """``hosts`` as one dimension, or no dimension for a single host."""
        if self.hosts == 1:
            return Shape((), ())
        return Shape(("hosts",), (self.hosts,))

    @property
    def extent(self) -> dict[str, int]:
        return self.shape.extent

    @property
    def sizes(self) -> dict[str, int]:
        return self.shape.extent

    def __len__(self) -> int:
        return self.hosts

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of hosts: all of them, or the product of the named dims' sizes (the
        only dim is ``hosts``, on a mesh of more than one host); KeyError for others."""
        return _size(self.shape, dim)

    # -- process meshes ------------------------------------------------------------------

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        *,
        name: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        on_starting: Callable[[ProcMesh], object] | None = None,
        on_failure: str = "restart",
        grace: float = DEFAULT_GRACE,
        bootstrap: Callable[[], object] | None = None,
    ) -> ProcMesh:
        """Start ``per_host`` ranks on every host; returns when all are ready.

        ``per_host={"gpus": 4}`` gives a mesh with dims ``{"gpus": 4}`` on one host, or
        ``{"hosts": H, "gpus": 4}`` on H hosts. ``name`` must not be taken by a live
        mesh (default: ``procs0``, ``procs1`` ...). ``on_starting(procs)`` is called
        before the ranks start (the kernel shows the dashboard there). More ranks than
        the backend can hold (with those of this controller's other meshes on it) is a
        ValueError before anything starts (see ``Launcher.check_capacity``).

        ``on_failure`` (``restart``, ``stop`` or ``continue``) is what the mesh does when
        a rank dies or fails a call the other ranks still run; ``grace`` is how long
        (seconds) those others get to finish before they are released. See
        :class:`~monarch_kernel.controller.records.FailurePolicy`.

        ``bootstrap`` (Monarch's): a picklable function called with no arguments on
        every rank once it started, before this returns (set up the environment,
        import things); what it raises fails the spawn.

        A host mesh that was shut down spawns nothing: RuntimeError.
        """
        self._check_open()
        per_host = dict(per_host or {"gpus": 1})
        if "hosts" in per_host and self.hosts > 1:
            raise ValueError(
                f"per_host must not contain 'hosts' on a mesh of {self.hosts} hosts "
                "(the hosts dimension is added for you)"
            )
        try:
            policy = FailurePolicy(on_failure)
        except ValueError:
            choices = ", ".join(p.value for p in FailurePolicy)
            raise ValueError(f"on_failure must be one of {choices}; got {on_failure!r}") from None
        running = sum(m.world for m in registry.live() if m.launcher is self.launcher)
        self.launcher.check_capacity(self.hosts * len(Shape.from_extent(per_host)), running)
        with self._lock:  # registered before it starts: a shutdown from now on stops it
            self._check_open()
            runtime = MeshRuntime(  # MeshNameTaken (a ValueError) if a live mesh has it
                name or registry.auto_name("procs"),
                per_host,
                self.hosts,
                self.launcher,
                env=env,
                backend=self.backend,
                on_failure=policy,
                grace=grace,
            )
            self._spawned = [m for m in self._spawned if not m.state.ended]
            self._spawned.append(runtime)
        procs = ProcMesh(runtime)
        from monarch_kernel.actor.api import _watch  # (api imports this module)

        _watch(runtime)
        try:
            if on_starting is not None:
                on_starting(procs)
            runtime.start(timeout=timeout)  # stops the mesh itself if it fails
            if bootstrap is not None:
                procs.spawn("_bootstrap", _Bootstrap, bootstrap).stop().get()
        except BaseException:
            runtime.stop()
            raise
        return procs

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError(
                f"HostMesh(hosts={self.hosts}, backend={self.backend!r}) was shut down: it "
                "spawns no more process meshes; make a new one (this_host() or host_mesh())"
            )

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self, grace: float = DEFAULT_STOP_GRACE) -> Future[None]:
        """Stop every process mesh spawned from this host mesh (every rank and host
        agent; ranks get ``grace`` seconds to exit cleanly, as in ``ProcMesh.stop``) and
        release its launcher (allocations of the ray, slurm, lightning or join
        backends; the local backend's launcher is shared by all local host meshes and
        stays). Later ``spawn_procs`` calls raise RuntimeError.

        Done when this returns; the future (Monarch's ``shutdown()`` returns one) is
        already complete. Shutting down again does nothing."""
        with self._lock:
            first = not self._shut_down
            self._shut_down = True
            spawned, self._spawned = self._spawned, []
        errors: list[BaseException] = []
        for runtime in spawned:
            try:
                runtime.stop(grace=grace)
            except Exception as exc:  # the other meshes still stop
                errors.append(exc)
        if first and self.backend != "local":
            self.launcher.shutdown()  # made for this host mesh alone (get_launcher)
        if errors:
            raise errors[0]
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    async def __aenter__(self) -> HostMesh:
        self._check_open()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await asyncio.to_thread(self.shutdown)

    def __repr__(self) -> str:
        gone = ", shut down" if self._shut_down else ""
        return f"HostMesh(hosts={self.hosts}, backend={self.backend!r}{gone})"


_this_host: HostMesh | None = None
_this_host_lock = threading.Lock()


def this_host() -> HostMesh:
    """The machine this controller runs on: the same host mesh every time (so that
    ``this_host().shutdown()`` stops the process meshes spawned from it), a new one
    once that was shut down."""
    global _this_host
    with _this_host_lock:
        if _this_host is None or _this_host._shut_down:
            _this_host = HostMesh(1, "local")
        return _this_host


def host_mesh(hosts: int = 1, backend: str = "local", **options: Any) -> HostMesh:
    """A mesh of ``hosts`` hosts from ``backend`` (``local`` emulates hosts on this machine)."""
    return HostMesh(hosts, backend, **options)


class _MeshView:
    """Shared slicing behaviour of process and actor meshes."""

    _shape: Shape
    _runtime: MeshRuntime

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def extent(self) -> dict[str, int]:
        return self._shape.extent

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._shape)

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of ranks: of the whole mesh, or the product of the named dims' sizes."""
        return _size(self._shape, dim)

    def _flat_shape(self, name: str) -> Shape:
        """This mesh's ranks as one dimension ``name`` (row-major order)."""
        sh = self._shape
        flat = Shape((name,), (len(sh),), (1,), sh.offset)
        if flat.ranks() != sh.ranks():
            raise SliceError(
                f"cannot flatten {sh.describe()}: its ranks are not contiguous "
                "(a slice with a step or over an inner dimension)"
            )
        return flat

    def ranks(self) -> list[int]:
        """Global ranks of this (sliced) mesh, in row-major order."""
        return self._shape.ranks()

    def _sliced_shape(self, dims: dict[str, Any]) -> Shape:
        return self._shape.slice(**dims)


class ProcMesh(_MeshView):
    """A mesh of rank processes with named dims; spawn actors on it."""

    def __init__(self, runtime: MeshRuntime, shape: Shape | None = None):
        self._runtime = runtime
        self._shape = shape or runtime.shape

    @property
    def name(self) -> str:
        return self._runtime.name

    @property
    def runtime(self) -> MeshRuntime:
        return self._runtime

    def slice(self, **dims: Any) -> ProcMesh:
        return ProcMesh(self._runtime, self._sliced_shape(dims))

    def flatten(self, name: str) -> ProcMesh:
        """The same ranks as one dimension called ``name``."""
        return ProcMesh(self._runtime, self._flat_shape(name))

    def logging_option(
        self,
        stream_to_client: bool = True,
        aggregate_window_sec: int | None = 3,
        level: int = logging.INFO,
    ) -> None:
        """Monarch's switch for forwarding rank output to the client. Here rank output
        always streams to the cell that caused it, batched and never aggregated across
        ranks, so the options are accepted and have no effect."""
        if not isinstance(stream_to_client, bool):
            raise TypeError("stream_to_client must be a bool")

    def __reduce__(self) -> tuple[Any, ...]:
        # Passed to an actor: a live handle there (monarch_kernel.actor.peer).
        return _rebuild_proc_mesh, (mesh_ref(self._runtime, self._shape),)

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every rank of this mesh."""
        if not isinstance(name, str) or not name:
            raise TypeError("spawn(name, ActorClass, *args): name must be a non-empty string")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(
                f"spawn() needs a subclass of monarch_kernel.actor.Actor, got {actor_class!r}"
            )
        what = f"constructor arguments of actor {name!r} ({actor_class.__name__})"
        payload, buffers = _dump_call((actor_class, args, kwargs), args, kwargs, what)
        ranks = self._shape.ranks()
        header = {"k": K.SPAWN_ACTOR, "a": name}
        _gather(self._runtime, ranks, header, payload, buffers, self._shape, f"spawn {name}").get()
        self._runtime.remember_actor(ActorSpec(name, payload, tuple(buffers), frozenset(ranks)))
        return ActorMesh(self, name, actor_class, self._shape)

    def ping(self) -> Future[ValueMesh]:
        """Ask every rank's control thread for its pid and rejected-message count.

        Answered even while the rank's main thread is busy running user code.
        """
        return _gather(
            self._runtime, self._shape.ranks(), {"k": K.PING}, b"", (), self._shape, control=True
        )

    def push(self, **values: Any) -> None:
        """Set names in every rank's cell namespace (also while a --bg cell runs)."""
        payload, buffers = _dump_call(values, (), values, "pushed values")
        _gather(
            self._runtime,
            self._shape.ranks(),
            {"k": K.PUSH},
            payload,
            buffers,
            self._shape,
            control=True,
        ).get()

    def pull(self, *names: str) -> ValueMesh | dict[str, ValueMesh]:
        """Read names from every rank's cell namespace: a ValueMesh per name."""
        if not names:
            raise TypeError("pull() needs at least one variable name")
        payload, buffers = dumps(list(names), "pull request")
        per_rank = _gather(
            self._runtime,
            self._shape.ranks(),
            {"k": K.PULL},
            payload,
            buffers,
            self._shape,
            control=True,
        ).get()
        meshes: dict[str, ValueMesh[Any]] = {
            n: ValueMesh(self._shape, [vals[i] for vals in per_rank.values()])
            for i, n in enumerate(names)
        }
        return meshes[names[0]] if len(names) == 1 else meshes

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in whatever user code the ranks are running."""
        self._runtime.signal_ranks(
            [r for r in self._shape.ranks() if self._runtime.ranks[r].alive], signal.SIGINT
        )

    def restart(self, ranks: list[int] | None = None, timeout: float = 120.0) -> RecoveryReport:
        """Restart in place: bring ``ranks`` (default: the dead ones) back and re-form
        the mesh as it was: the torch process group (if the ranks had one) on every
        rank, actors and setup cells on the restarted ranks. Returns what was done
        (``print(report.describe(name))`` says it in words)."""
        rt = self._runtime
        for r in ranks or ():
            if not 0 <= r < rt.world:
                raise SliceError(f"rank {r} out of range: mesh {rt.name!r} has {rt.world} ranks")
        if ranks is None and len(self._shape) == rt.world:
            return rt.recover(None, timeout)  # the dead ones, once a restart under way ends
        if ranks is None:
            rt.wait_recovered()  # an automatic restart may be bringing them back
            ranks = [r for r in self._shape.ranks() if not rt.ranks[r].alive]
        return rt.recover(ranks, timeout)

    def stop(self, grace: float = DEFAULT_STOP_GRACE) -> Future[None]:
        """Stop every rank and host agent of the whole mesh (not only this slice).

        Ranks get ``grace`` seconds to exit cleanly (``atexit`` handlers, finalizers,
        ``destroy_process_group``) before they are killed."""
        self._runtime.stop(grace=grace)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def dashboard(self) -> Any:
        """This mesh's live dashboard (the same widget every time): shown as a cell's
        last expression, or with ``display(procs.dashboard())``."""
        if _dashboard_factory is None:
            raise RuntimeError("the dashboard needs ipywidgets: import monarch_kernel.widgets")
        return _dashboard_factory(self)

    @property
    def stopped(self) -> bool:
        return self._runtime.state == "stopped"

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self._shape.describe()} ({self._runtime.state})>"


class ActorMesh(_MeshView):
    """An actor spawned on every rank of a (sliced) process mesh."""

    def __init__(self, procs: ProcMesh, name: str, actor_class: type, shape: Shape):
        self._procs = procs
        self._runtime = procs._runtime
        self._name = name
        self._class = actor_class
        self._shape = shape
        self._ranks = shape.ranks()  # shapes never change: computed once, never mutated
        self._endpoints = endpoints_of(actor_class)

    @property
    def name(self) -> str:
        return self._name

    def __getattr__(self, attr: str) -> EndpointRef:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr not in self._endpoints:
            eps = ", ".join(sorted(self._endpoints)) or "none"
            raise AttributeError(
                f"{self._class.__name__} has no endpoint {attr!r} (endpoints: {eps}); "
                "mark methods with @endpoint"
            )
        ref = self.__dict__[attr] = EndpointRef(self, attr)  # later lookups skip this
        return ref

    def slice(self, **dims: Any) -> ActorMesh:
        return ActorMesh(self._procs, self._name, self._class, self._sliced_shape(dims))

    def flatten(self, name: str) -> ActorMesh:
        """The same actors as one dimension called ``name``."""
        return ActorMesh(self._procs, self._name, self._class, self._flat_shape(name))

    def stop(self) -> Future[None]:
        """Remove this actor from its ranks; the future completes once it is gone
        (``.get()`` or ``await`` it, as in Monarch)."""
        header = {"k": K.STOP_ACTOR, "a": self._name}
        ranks, name, rt = self._ranks, self._name, self._runtime

        def forget(_: object) -> None:
            rt.forget_actor(name, ranks)

        return then(_gather(rt, ranks, header, b"", (), self._shape, ""), forget)

    def __reduce__(self) -> tuple[Any, ...]:
        # Passed to an actor: a live handle there (monarch_kernel.actor.peer).
        return _rebuild_actor_mesh, (mesh_ref(self._runtime, self._shape), self._name, self._class)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} ({self._class.__name__}) {self._shape.describe()}>"


class EndpointRef:
    """One endpoint of an actor mesh, with Monarch's adverbs."""

    def __init__(self, mesh: ActorMesh, method: str):
        self._mesh = mesh
        self._method = method
        self._what = f"{mesh._name}.{method}"  # for RequestStarted: built once, not per call
        #: The slice called, when it is not the whole mesh (``context().message_rank``).
        self._slice = slice_header(mesh._shape, mesh._runtime.shape)

    @property
    def _where(self) -> str:
        return f"{self._mesh._class.__name__}.{self._method}"

    def _header(self) -> Header:
        header: Header = {"k": K.CALL, "a": self._mesh._name, "m": self._method}
        if self._slice is not None:
            header["sl"] = self._slice
        return header

    def _request(self, rank: int, payload: bytes, buffers: Sequence[Buffer]) -> Future[Any]:
        rt = self._mesh._runtime
        one = One(rt.wait_for)
        options = CallOptions(what=self._what, waited=True)
        rt.request([rank], self._header(), payload, buffers, one, options)
        return one.future

    def _payload(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bytes, Sequence[Buffer]]:
        try:
            return dumps((args, kwargs))
        except SerializationError:
            return _dump_call((args, kwargs), args, kwargs, self._where)  # names the culprit

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        """Call every rank; the future gives a ValueMesh (or one grouped ActorError)."""
        payload, buffers = self._payload(args, kwargs)
        mesh = self._mesh
        what = self._what
        return _gather(
            mesh._runtime, mesh._ranks, self._header(), payload, buffers, mesh._shape, what
        )

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call the single rank of a one-point mesh; the future gives its value."""
        ranks = self._mesh._ranks
        if len(ranks) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one rank, but {self._where} is on "
                f"{len(ranks)} ranks ({self._mesh._shape.describe()}); slice it first, e.g. "
                f".slice({self._mesh._shape.labels[-1]}=0), or use call()"
            )
        payload, buffers = self._payload(args, kwargs)
        return self._request(ranks[0], payload, buffers)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call one rank, the least busy live one."""
        rt = self._mesh._runtime
        alive = [r for r in self._mesh._shape.ranks() if rt.ranks[r].alive]
        if not alive:
            rt.check_alive(self._mesh._shape.ranks())
        rank = min(alive, key=lambda r: rt.ranks[r].outstanding)
        payload, buffers = self._payload(args, kwargs)
        return self._request(rank, payload, buffers)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Fire and forget on every rank; exceptions go to the mesh's supervision."""
        payload, buffers = self._payload(args, kwargs)
        self._mesh._runtime.send(self._mesh._ranks, self._header(), payload, buffers)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Call every rank; yield one future per rank in the order they answer."""
        payload, buffers = self._payload(args, kwargs)
        mesh = self._mesh
        each = Each(mesh._ranks)
        options = CallOptions(what=self._what)
        mesh._runtime.request(mesh._ranks, self._header(), payload, buffers, each, options)
        return each.in_order_of_answers()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through an adverb: {self._method}.call(...), .call_one(...), "
            ".broadcast(...), .choose(...) or .stream(...)"
        )


class _Bootstrap(Actor):
    """Runs ``spawn_procs(bootstrap=fn)``'s function on each rank (then is stopped)."""

    def __init__(self, fn: Callable[[], object]):
        fn()


# -- helpers ---------------------------------------------------------------------------


def slice_header(shape: Shape, whole: Shape | None) -> list[Any] | None:
    """Header value ``sl`` of calls to ``shape`` (None when it is the ``whole`` mesh)."""
    if whole is not None and shape == whole:
        return None
    return [list(shape.labels), list(shape.sizes), list(shape.strides), shape.offset]


def _dump_call(
    obj: object, args: tuple[Any, ...], kwargs: dict[str, Any], what: str
) -> tuple[bytes, list[Any]]:
    try:
        return dumps(obj, what)
    except SerializationError:
        pass
    # Say which argument is the culprit.
    for i, a in enumerate(args):
        dumps(a, f"argument {i} of {what}")
    for k, v in kwargs.items():
        dumps(v, f"argument {k!r} of {what}")
    return dumps(obj, what)  # the class itself (raises with its own message)


def _gather(
    rt: MeshRuntime,
    ranks: list[int],
    header: Header,
    payload: bytes,
    buffers: Sequence[Buffer],
    shape: Shape | None,
    what: str = "",
    control: bool = False,
) -> Future[ValueMesh[Any]]:
    """Send a request to ``ranks``; the future gives a ValueMesh (or a grouped error)."""
    gather = Gather(ranks, shape, rt.wait_for)
    options = CallOptions(what=what, control=control, waited=True)
    rt.request(ranks, header, payload, buffers, gather, options)
    return gather.future


__all__ = ["ActorError", "ActorMesh", "EndpointRef", "HostMesh", "ProcMesh"]
