"""Where meshes start: host meshes (``this_host()``, ``host_mesh()``) and
``spawn_procs``, the controller's side of the actor API.

This is the only part of :mod:`monarch_kernel.actor` that reaches the controller and the
launchers; ``monarch_kernel.actor`` imports it on first use of one of its names, so a rank
that only uses actors never loads it (see ``tests/test_layering.py``).

Size: a little over the project's ~450-line habit: Monarch's host-mesh API
(``HostMesh``, ``this_host``, ``spawn_procs``) and the controller-side singletons it
needs are one surface, the only actor module that imports the controller.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from monarch_kernel import config
from monarch_kernel.actor.actor import Actor
from monarch_kernel.actor.channels import report_unhandled, tell_owner
from monarch_kernel.actor.client_proc import ClientProc
from monarch_kernel.actor.mesh_view import size_of
from monarch_kernel.actor.meshes import STOP_GRACE, ActorMesh, ProcMesh
from monarch_kernel.actor.orphans import describe as describe_orphans
from monarch_kernel.actor.orphans import orphans_of, stop_orphans
from monarch_kernel.actor.peer import resolve as peer_resolve
from monarch_kernel.actor.resize import resized
from monarch_kernel.calls.future import Future
from monarch_kernel.controller.detach.release import detach_option
from monarch_kernel.controller.detach.release import enable as enable_detach
from monarch_kernel.controller.lifecycle.failures import DEFAULT_GRACE
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.controller.messaging.asks import ASK_HANDLERS, AskingMesh
from monarch_kernel.controller.messaging.whereabouts import locate_rank
from monarch_kernel.controller.state.events import FaultReported, MeshEvent, MeshResized, RankDied
from monarch_kernel.controller.state.records import FailurePolicy, RankState, parse_policy
from monarch_kernel.launchers import get_launcher
from monarch_kernel.rank.supervise import PROCESS_ENDED, MeshFailure
from monarch_kernel.shape import Extent, Shape
from monarch_kernel.wire import fd_limit, loads
from monarch_kernel.wire.peer_address import PeerAddress, RankLocation
from monarch_kernel.wire.reports import AskRequest, FailureReport

log = logging.getLogger("monarch_kernel.actor")


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
        #: Environment every process mesh spawned here gets (``spawn_procs(env=)`` adds
        #: to it); a ``ProcessJob``'s ``env``.
        self.default_env: dict[str, str] = {}

    # -- shape (Monarch's MeshTrait, read-only) ------------------------------------------

    @property
    def shape(self) -> Shape:
        """``hosts`` as one dimension, or no dimension for a single host."""
        if self.hosts == 1:
            return Shape((), ())
        return Shape(("hosts",), (self.hosts,))

    @property
    def extent(self) -> Extent:
        """``{hosts: H}`` (Monarch's ``Extent``), ``{}`` for one host."""
        return Extent(self.shape.labels, self.shape.sizes)

    @property
    def _labels(self) -> list[str]:
        return list(self.shape.labels)

    @property
    def sizes(self) -> dict[str, int]:
        return self.shape.extent

    def __len__(self) -> int:
        return self.hosts

    @property
    def is_fake_in_process(self) -> bool:
        """Monarch's flag for a host mesh emulated inside the client process: False, as
        in Monarch 0.7 (this one's ranks are processes of their own)."""
        return False

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of hosts: all of them, or the product of the named dims' sizes (the
        only dim is ``hosts``, on a mesh of more than one host); KeyError for others."""
        return size_of(self.shape, dim)

    # -- process meshes ------------------------------------------------------------------

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        *,
        name: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        on_starting: Callable[[ProcMesh], object] | None = None,
        on_failure: str = "restart",
        grace: float = DEFAULT_GRACE,
        bootstrap: Callable[[], object] | None = None,
        detachable: bool = False,
        keep: float | str | None = None,
    ) -> ProcMesh:
        """Start ``per_host`` ranks on every host; returns when all are ready (within
        ``timeout`` seconds; default the configured ``host_spawn_ready_timeout``, 120 s).

        ``per_host={"gpus": 4}`` gives a mesh with dims ``{"gpus": 4}`` on one host, or
        ``{"hosts": H, "gpus": 4}`` on H hosts. ``name`` must not be taken by a live
        mesh (default: ``procs0``, ``procs1`` ...). ``on_starting(procs)`` is called
        before the ranks start (the kernel shows the dashboard there). More ranks than
        the backend can hold (with those of this controller's other meshes on it) is a
        ValueError before anything starts (see ``Launcher.check_capacity``).

        ``on_failure`` (``restart``, ``stop`` or ``continue``) is what the mesh does when
        a rank dies or fails a call the other ranks still run; ``grace`` is how long
        (seconds) those others get to finish before they are released. See
        :class:`~monarch_kernel.controller.state.records.FailurePolicy`.

        ``bootstrap`` (Monarch's): a picklable function called with no arguments on
        every rank once it started, before this returns (set up the environment,
        import things); what it raises fails the spawn.

        ``detachable``: the ranks outlive this controller, for ``keep`` (seconds or
        ``"2h"``; default 2 hours) without one; another kernel takes the mesh over with
        ``monarch_kernel.attach(name)`` (see :mod:`monarch_kernel.controller.detach.release`).

        A host mesh that was shut down spawns nothing: RuntimeError.

        Long on purpose: Monarch's keyword arguments are checked and turned into one ``MeshRuntime``
        in the order a reader follows (the checks, the runtime, its start, the bootstrap).
        """
        self._check_open()
        if timeout is None:
            timeout = config.seconds(config.get("host_spawn_ready_timeout"))
        per_host = dict(per_host or {"gpus": 1})
        if "hosts" in per_host and self.hosts > 1:
            raise ValueError(
                f"per_host must not contain 'hosts' on a mesh of {self.hosts} hosts "
                "(the hosts dimension is added for you)"
            )
        policy, minimum = _failure_policy(on_failure)
        detach_keep = detach_option(self.backend, name, detachable, keep)
        running = sum(m.world for m in registry.live() if m.launcher is self.launcher)
        ranks = self.hosts * len(Shape.from_extent(per_host))
        self.launcher.check_capacity(ranks, running)
        fd_limit.ensure(sum(m.world for m in registry.live()) + ranks)
        env = {**self.default_env, **(env or {})} or None
        runtime = self._new_runtime(name, per_host, env, policy, grace, detach_keep)
        runtime.shrink_min = minimum
        runtime.events.subscribe(lambda _ev: resized(runtime), MeshResized)
        procs = ProcMesh(runtime)
        watch_faults(runtime)
        try:
            if on_starting is not None:
                on_starting(procs)
            runtime.start(timeout=timeout)  # stops the mesh itself if it fails
            if bootstrap is not None:
                procs.spawn("_bootstrap", _Bootstrap, bootstrap).stop().get()
            if detach_keep:
                enable_detach(runtime)
        except BaseException:
            runtime.stop()
            raise
        return procs

    def _new_runtime(
        self,
        name: str | None,
        per_host: dict[str, int],
        env: dict[str, str] | None,
        policy: FailurePolicy,
        grace: float,
        detach_keep: float = 0.0,
    ) -> MeshRuntime:
        """The controller side of a new mesh, registered here before it starts (a
        shutdown from then on stops it)."""
        with self._lock:
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
                detach_keep=detach_keep,
            )
            self._spawned = [m for m in self._spawned if not m.state.ended]
            self._spawned.append(runtime)
        return runtime

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError(
                f"HostMesh(hosts={self.hosts}, backend={self.backend!r}) was shut down: it "
                "spawns no more process meshes; make a new one (this_host() or host_mesh())"
            )

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self, grace: float = STOP_GRACE) -> Future[None]:
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


def _failure_policy(on_failure: str) -> tuple[FailurePolicy, int]:
    """The policy and the smallest size a ``shrink`` may leave (``shrink:2``)."""
    return parse_policy(on_failure)


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


def hosts_from_config(name: str) -> HostMesh:
    """The host mesh ``name`` of this project's configuration (Monarch's): what
    ``monarch_kernel.config.configure(host_meshes={name: {"hosts": N, "backend": B,
    **launcher_options}})`` says, so that the same program runs on emulated hosts here
    and on a cluster there; by default two emulated hosts on this machine, as in
    Monarch."""
    spec = dict(config.get("host_meshes").get(name) or {"hosts": 2, "backend": "local"})
    hosts = spec.pop("hosts", 1)
    backend = spec.pop("backend", "local")
    return HostMesh(hosts, backend, **spec)


def shutdown_context(host_timeout: float | None = None) -> Future[None]:
    """Stop everything this controller started (Monarch's ``shutdown_context``): every
    live process mesh (ranks get ``host_timeout`` seconds to exit cleanly, default
    ``STOP_GRACE``) and the host meshes' launchers. Done when it returns; the future is
    already complete. The process can start new meshes afterwards."""
    grace = STOP_GRACE if host_timeout is None else host_timeout
    errors: list[BaseException] = []
    for runtime in registry.live():
        try:
            runtime.stop(grace=grace)
        except Exception as exc:  # the others still stop
            errors.append(exc)
    with _this_host_lock:
        host = _this_host
    if host is not None:
        host.shutdown(grace)
    _stop_client_proc(grace)  # the actors of this process (this_proc())
    if errors:
        raise errors[0]
    return Future._resolved(None)


class _Bootstrap(Actor):
    """Runs ``spawn_procs(bootstrap=fn)``'s function on each rank (then is stopped)."""

    def __init__(self, fn: Callable[[], object]):
        fn()


# -- supervision at the root ------------------------------------------------------------


def watch_faults(runtime: MeshRuntime) -> None:
    """Hand a controller mesh's unanswered failures and deaths to the fault hook
    (``monarch_kernel.actor.unhandled_fault_hook``); deaths of actors that an actor of
    another rank owns go to their owner instead, and a death that failed a ``%%remote``
    cell is said by that cell's error (not a failure nobody handled). A dead rank's
    actors' owned actor meshes are stopped, and its report says so (``orphans``)."""
    name = runtime.name

    def on_event(event: MeshEvent) -> None:
        if isinstance(event, FaultReported):
            actor = str(event.report.get("actor", ""))
            path = tuple(event.report.get("path") or ())
            failure = MeshFailure(name, actor, event.rank, event.report, path)
        elif isinstance(event, RankDied) and event.state is RankState.DEAD:
            if event.claimed:
                return  # its training state is recovered from peers: handled
            d = event.death
            message = f"{d.process_phrase} (rank {d.rank} on host {d.host})"
            orphaned = orphans_of(runtime, event.rank)  # its actors' meshes stop with it
            if orphaned:
                message += "; " + describe_orphans(orphaned)
                stop_orphans(orphaned)
            report: FailureReport = {"type": PROCESS_ENDED, "message": message}
            info = runtime.ranks[event.rank]
            owned, info.owners = info.owners, {}
            for actor, owner in owned.items():  # their owners supervise them
                tell_owner(owner, name, actor, event.rank, report)
            if owned or event.in_cell:
                return  # handled by the owners, or told by the failed cell's error
            failure = MeshFailure(name, "", event.rank, report)
        else:
            return
        report_unhandled(failure)

    runtime.events.subscribe(on_event, FaultReported, RankDied)


# -- what the controller process itself runs ----------------------------------------------

_client_proc: ClientProc | None = None
_client_proc_lock = threading.Lock()


def client_proc() -> ProcMesh:
    """``this_proc()`` in the controller: the controller's own process, whose actors run
    here on threads of their own (as Monarch runs them in the client process); a new one
    once it was stopped (``this_proc().stop()``, ``shutdown_context()``)."""
    global _client_proc
    with _client_proc_lock:
        if _client_proc is None or _client_proc.stopped:
            _client_proc = ClientProc()
        return ProcMesh(_client_proc)


def _stop_client_proc(grace: float) -> None:
    with _client_proc_lock:
        proc = _client_proc
    if proc is not None:
        proc.stop(grace)


_singletons: dict[str, ActorMesh] = {}
#: One lock per singleton name: a singleton's constructor may ask for another one.
_singleton_locks: dict[str, threading.Lock] = {}
_singletons_lock = threading.Lock()


def controller_singleton(
    name: str, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ActorMesh:
    """``get_or_spawn_controller`` in the controller: actor ``name``, spawned on
    :func:`client_proc` the first time (again once that was stopped)."""
    with _singletons_lock:
        lock = _singleton_locks.setdefault(name, threading.Lock())
    with lock:
        mesh = _singletons.get(name)
        if mesh is None or mesh._procs.stopped:
            mesh = _singletons[name] = client_proc().spawn(name, cls, *args, **kwargs)
        return mesh


def _ask_get_or_spawn(asker: AskingMesh, req: AskRequest) -> ActorMesh:
    """A rank's ``get_or_spawn_controller``, run in the controller: the actor mesh
    (pickled back to the rank as a live reference to the controller's process)."""
    name, cls, args, kwargs = loads(req["call"], (), "get_or_spawn_controller arguments")
    return controller_singleton(name, cls, args, kwargs)


def _ask_proc_mesh(asker: AskingMesh, req: AskRequest) -> ProcMesh:
    """A rank's ``context().actor_instance.proc_mesh``: its whole mesh (pickled back as a
    live reference)."""
    for runtime in registry.live():
        if runtime is asker:
            return ProcMesh(runtime)
    raise LookupError(f"mesh {asker.name!r} is not running")


ASK_HANDLERS["get_or_spawn_controller"] = _ask_get_or_spawn
ASK_HANDLERS["proc_mesh"] = _ask_proc_mesh


def where_is(mesh: str, key: str, rank: int, wait: float, slot: int = -1) -> RankLocation:
    """Where rank ``rank`` of this controller's mesh ``mesh`` (if ``key`` is its key) is
    now (see ``actor/peer/resolve.py``). ``slot`` (>= 0): the process the asker's
    reference names, which a shrink may have renumbered since: looked up by it."""
    runtime = registry.get(mesh)
    if runtime is not None and not hmac.compare_digest(runtime.key.hex(), key):
        runtime = None  # only a holder of a reference may ask
    if runtime is not None and slot >= 0:
        now = runtime.slots.rank.get(slot)
        if now is None:
            why = f"rank {rank} of mesh {mesh!r} is gone: a shrink removed it from the mesh"
            return RankLocation(PeerAddress(""), 0, False, why)
        rank = now
    return locate_rank(runtime, mesh, rank, wait)


def _ask_where(asker: AskingMesh, req: AskRequest) -> RankLocation:
    """A rank's question where a rank of a mesh it holds a reference to is now."""
    mesh, key, rank, wait, *rest = loads(req["call"], (), "where_is_rank arguments")
    slot = int(rest[0]) if rest else -1
    wait = min(float(wait), peer_resolve.LOCATE_WAIT)
    return where_is(str(mesh), str(key), int(rank), wait, slot)


ASK_HANDLERS[peer_resolve.WHERE] = _ask_where
peer_resolve.local_locator = where_is  # this process asks itself

__all__ = [
    "HostMesh",
    "client_proc",
    "controller_singleton",
    "host_mesh",
    "hosts_from_config",
    "shutdown_context",
    "this_host",
    "watch_faults",
]
