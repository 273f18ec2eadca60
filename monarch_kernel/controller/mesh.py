"""The controller side of one process mesh: a façade over its parts.

A :class:`MeshRuntime` is what the layers above hold. It wires together:

* :mod:`~monarch_kernel.controller.state.records`: what is known of each rank and host;
* :mod:`~monarch_kernel.controller.state.phase`: the mesh's phase and the condition to wait on;
* :mod:`~monarch_kernel.controller.messaging.transport`: sockets and every send path;
* :mod:`~monarch_kernel.controller.messaging.receiver`: who reads replies (the receive token and
  the I/O thread);
* :mod:`~monarch_kernel.controller.messaging.inbound`: the handler of each incoming message kind;
* :mod:`~monarch_kernel.controller.state.requests`: outstanding requests and their observers;
* :mod:`~monarch_kernel.controller.lifecycle.supervision`: heartbeats, deaths, lost hosts;
* :mod:`~monarch_kernel.controller.lifecycle.failures`: the failure policy;
* :mod:`~monarch_kernel.controller.lifecycle.startup`: starting host agents and ranks;
* :mod:`~monarch_kernel.controller.lifecycle.restart`: restart in place;
* :mod:`~monarch_kernel.controller.state.events`: the lifecycle events it emits;
* :mod:`~monarch_kernel.controller.messaging.streams`: where rank output goes.

and adds the mesh-wide operations: request, send, signal, kill, stop. The parts get the
siblings they use in their constructors (never this class); where one needs a mesh
operation it names it in a small protocol that this class implements.

Restart in place and resizing are delegated by :class:`~.mesh_recovery.RestartAndResize`,
a mixin. At about 600 lines this module is still over the project's ~450-line guideline:
it is the one object the layers above hold; the wiring below passes ``self`` to each
part as the small protocol that part names, which a second mixin could not do without
casts.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import time
import uuid
from collections.abc import Sequence

from monarch_kernel.calls.errors import MeshStoppedError, RankDiedError
from monarch_kernel.calls.future import Future, Waiter
from monarch_kernel.calls.reply import RequestObserver
from monarch_kernel.calls.requester import PLAIN, CallOptions, MeshRef
from monarch_kernel.controller.attach_file import MeshIdentity, file_for
from monarch_kernel.controller.elastic.resize import Resizer
from monarch_kernel.controller.lifecycle.control_probe import ControlProbe
from monarch_kernel.controller.lifecycle.failures import DEFAULT_GRACE, FailureHandler
from monarch_kernel.controller.lifecycle.restart import Restarter
from monarch_kernel.controller.lifecycle.startup import Starter
from monarch_kernel.controller.lifecycle.supervision import Supervisor
from monarch_kernel.controller.mesh_recovery import RestartAndResize
from monarch_kernel.controller.messaging.inbound import Inbound
from monarch_kernel.controller.messaging.receiver import Awaitable, Receiver
from monarch_kernel.controller.messaging.streams import RankLogs, StreamRouter
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, RequestKind, RequestStarted
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import (
    GONE,
    FailurePolicy,
    HostInfo,
    MeshPhase,
    MeshRecipe,
    RankEnd,
    RankInfo,
    RankState,
    Slots,
    slots_by_host,
)
from monarch_kernel.controller.state.registry import MeshRegistry, MeshSummary
from monarch_kernel.controller.state.requests import RequestTable, new_request_id
from monarch_kernel.controller.telemetry.steps import MeshTelemetry
from monarch_kernel.controller.training.recovery import PeerRecovery
from monarch_kernel.controller.training.round_mesh import PeerMesh
from monarch_kernel.launchers.base import Launcher
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Codec
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.chunks import check_size
from monarch_kernel.wire.codec import Buffer, Header, new_key
from monarch_kernel.wire.headers import Owner
from monarch_kernel.wire.osutil import cpu_count
from monarch_kernel.wire.spin import spin_seconds

__all__ = ["MeshRuntime", "new_request_id", "registry"]

log = logging.getLogger("monarch_kernel.controller")

#: Seconds without a host agent's heartbeat (sent every 0.5 s) before it is lost.
DEFAULT_HB_TIMEOUT = 2.5
#: Longest a request waits for a restart in place (which has its own deadlines) to end.
RECOVERY_WAIT = 600.0
#: Seconds ranks get to exit cleanly on a stop (atexit, finalizers) before SIGKILL.
DEFAULT_STOP_GRACE = 3.0
#: While a mesh stops, how often STOP is sent again to agents that were not ready.
STOP_RESEND_INTERVAL = 0.1
#: The failure policy's pings behind a release step (``probe``): to the control
#: threads, the controller's own (no policy applies), sent even while ranks restart,
#: never waiting for room (a full queue is for main threads, not control threads).
_PROBE = CallOptions(
    what="release probe", control=True, internal=True, wait_for_room=False, during_restart=True
)


class MeshRuntime(RestartAndResize):
    """Controller state of one process mesh (``hosts`` host agents × ``per_host`` ranks).

    Thread safety: any thread may call :meth:`request`, :meth:`send`, :meth:`stop` ...;
    the records (``ranks``, ``hosts``) are written by the controller only and may be
    read by anyone at any time.
    """

    def __init__(
        self,
        name: str,
        per_host: dict[str, int],
        hosts: int,
        launcher: Launcher,
        env: dict[str, str] | None = None,
        hb_timeout: float = DEFAULT_HB_TIMEOUT,
        bind: str | None = None,
        backend: str | None = None,
        advertise: str | None = None,
        on_failure: FailurePolicy = FailurePolicy.RESTART,
        grace: float = DEFAULT_GRACE,
        detach_keep: float = 0.0,
        identity: MeshIdentity | None = None,
    ):
        """``bind``: where the controller's sockets listen: a host address (tcp on a
        random port), a full ``tcp://`` or ``ipc://`` endpoint, or ``"ipc"`` for unix
        sockets in a private (0700) directory. By default ``"ipc"`` when every host is
        on this machine (the local launcher), else the launcher's ``bind`` attribute if it
        has one, else ``127.0.0.1``. ``advertise``: the address host agents connect to
        when it differs from the bound one (a wildcard bind; default: the launcher's
        ``advertise`` attribute). Tcp sockets are CURVE servers (see ``Transport``).
        ``on_failure`` and ``grace``: see :mod:`~monarch_kernel.controller.lifecycle.failures`.
        ``detach_keep`` > 0: a detachable mesh, whose agents and ranks run on that many
        seconds without a controller (:mod:`~monarch_kernel.controller.detach.release`);
        ``identity``: take over such a mesh (its key, run and addresses) instead of
        making a new one (:mod:`~monarch_kernel.controller.detach.adopt`).

        Long on purpose: it sets the mesh's records in dependency order before :meth:`_open` and
        :meth:`_wire` make the parts.
        """
        if grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        if hosts < 1:
            raise ValueError(f"a mesh needs at least one host, got hosts={hosts}")
        self.spin = spin_seconds()  # a bad MONARCH_KERNEL_SPIN_US fails before anything opens
        extent = ({"hosts": hosts} if hosts > 1 else {}) | dict(per_host)
        self.name = name
        self.shape = Shape.from_extent(extent)
        self.n_hosts = hosts
        self.per_host = len(Shape.from_extent(per_host))
        self.launcher = launcher
        self.backend = backend or launcher.name
        self.env = dict(env or {})
        self.hb_timeout = hb_timeout
        self.world = len(self.shape)
        self.started_at = identity.started_at if identity else time.time()
        self.run_id = identity.run_id if identity else uuid.uuid4().hex[:12]
        self.key = identity.key if identity else new_key()
        self.codec = Codec(self.key)
        self.detach_keep = detach_keep
        #: The smallest world size ``on_failure='shrink:N'`` may leave.
        self.shrink_min = 1
        #: A detachable mesh's attach file (see ``controller.attach_file``), else "".
        self.attach_path = file_for(name) if detach_keep > 0 else ""
        #: Why this controller let go of the mesh while it runs on (``release``), else "".
        self.released = ""
        self.ranks = [
            RankInfo(r, r // self.per_host, r % self.per_host, c)
            for r, c in enumerate(self.shape._coords())
        ]
        self.hosts = [HostInfo(h) for h in range(hosts)]
        #: wire ids (slots) -> logical ranks and hosts (see ``records``)
        self.slots = Slots(self.ranks, self.hosts)
        #: How many times the mesh was resized (a mesh reference of an older
        #: generation is replaced by a newer one where both are seen: ``MeshRef``).
        self.generation = 0
        self.recipe = MeshRecipe()
        self.events = EventBus()
        self.lifecycle = MeshLifecycle(name, self.events)
        self.output = StreamRouter(self.events)
        self.logs = RankLogs(self.events, name, self.run_id)
        self.requests = RequestTable(name, self.ranks, self.events)
        self._open(launcher, bind, advertise, identity)
        self._wire(FailurePolicy(on_failure), grace)

    def _open(
        self,
        launcher: Launcher,
        bind: str | None,
        advertise: str | None,
        identity: MeshIdentity | None = None,
    ) -> None:
        """Register the mesh, then bind its sockets (see ``__init__`` for ``bind``)."""
        registry.add(self)  # before any socket exists: a taken name costs nothing
        try:
            #: Whether every rank runs on this machine (then they share its CPUs with
            #: this process: see the receiver's spin).
            self.same_machine = launcher.same_machine
            if bind is None:
                bind = "ipc" if launcher.same_machine else getattr(launcher, "bind", "127.0.0.1")
            self.advertise: str | None = advertise or getattr(launcher, "advertise", None)
            reuse = identity.endpoints if identity else None
            self.transport = Transport(
                self.name,
                self.codec,
                self.ranks,
                bind,
                reuse,
                self.hosts,
                self.slots,
                # a detachable mesh's ranks outlive this process: sockets only
                lanes=self.detach_keep <= 0,
            )
        except BaseException:
            registry.forget(self)
            raise

    def _wire(self, policy: FailurePolicy, grace: float) -> None:
        """Make the parts, each with the siblings it uses; start receiving last."""
        # The receiver is made first (the others post work to it) and started last,
        # once every part that handles messages and ticks exists.
        self.receiver = Receiver(
            self.name,
            self.transport,
            self.requests.__bool__,
            self.spin,
            spin_below=cpu_count() if self.same_machine else None,
        )
        self.failures = FailureHandler(
            self.name,
            policy,
            grace,
            actions=self,
            ranks=self.ranks,
            requests=self.requests,
            events=self.events,
            lifecycle=self.lifecycle,
            post=self.receiver.post,
            has_process_group=lambda: self.recipe.pg_backend is not None,
        )
        self.peers = PeerRecovery(
            self.name,
            ranks=self.ranks,
            requests=self.requests,
            policy=self.failures,
            # the PeerMesh is made with the restart parts, later: looked up when used
            make_runner=lambda rid, payload, buffers, dead: (
                self.resizer.runner_for_death(rid, payload, buffers, dead, self.peers.finished)
                or self.peer_mesh.runner(rid, payload, buffers, dead, self.peers.finished)
            ),
            raise_parked=lambda rid, ranks, why: self.peer_mesh.raise_parked(rid, ranks, why),
            events=self.events,
        )
        self.supervisor = Supervisor(
            self.name,
            ranks=self.ranks,
            hosts=self.hosts,
            lifecycle=self.lifecycle,
            transport=self.transport,
            requests=self.requests,
            events=self.events,
            post=self.receiver.post,
            restarts=self.failures,
            hb_timeout=self.hb_timeout,
            claim=self.peers.claim,
        )
        self._wire_restarts()

    def _wire_restarts(self) -> None:
        """Make start-up, restart in place and the message handlers; start receiving.

        Long on purpose: the wiring of the parts is a list of constructor calls naming what each
        part is given; one place to read who depends on whom.
        """
        self.starter = Starter(
            self,
            transport=self.transport,
            ranks=self.ranks,
            hosts=self.hosts,
            requests=self.requests,
            lifecycle=self.lifecycle,
            death_text=self.supervisor.death_text,
        )
        self.restarter = Restarter(
            self.name,
            self,
            ranks=self.ranks,
            hosts=self.hosts,
            recipe=self.recipe,
            starter=self.starter,
            lifecycle=self.lifecycle,
            transport=self.transport,
            receiver=self.receiver,
            requests=self.requests,
            events=self.events,
            rank_died=self.supervisor.rank_died,
        )
        self.inbound = Inbound(
            self,
            ranks=self.ranks,
            hosts=self.hosts,
            transport=self.transport,
            requests=self.requests,
            events=self.events,
            recipe=self.recipe,
            notify=self.lifecycle.notify,
            rank_died=self.supervisor.rank_died,
            port_received=self.restarter.port_received,
            find_mesh=registry.get,
            on_train=self.peers.on_notice,
            slots=self.slots,
            on_ready=self._rank_ready,
        )
        #: The ranks' step telemetry: the dashboard's step view, stragglers named.
        self.telemetry = MeshTelemetry(
            self.name, self.ranks, rank_of=lambda slot: self.slots.rank.get(slot)
        )
        self.inbound.add_handler(K.STEPS, self.telemetry.on_steps)
        self.inbound.add_handler(K.HOST_STEPS, self.telemetry.on_host_steps)
        self.peer_mesh = PeerMesh(
            self.name,
            self,
            ranks=self.ranks,
            hosts=self.hosts,
            recipe=self.recipe,
            restarter=self.restarter,
            transport=self.transport,
            requests=self.requests,
            events=self.events,
            post=self.receiver.post,
        )
        self.resizer = Resizer(
            self,
            lambda: sum(
                m.world for m in registry.live() if m.launcher is self.launcher and m is not self
            ),
        )
        self.receiver.start(self.inbound.handle, self._tick)
        self.transport.on_batch = self.receiver.kick  # batched broadcasts: see send()

    @property
    def on_failure(self) -> str:
        """The failure policy's name (``restart``, ``stop``, ``continue``)."""
        return str(self.failures.policy)

    @property
    def state(self) -> MeshPhase:
        """The mesh's phase (see :class:`~monarch_kernel.controller.state.records.MeshPhase`)."""
        return self.lifecycle.phase

    # -- start-up --------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Start host agents and ranks; return when every rank is ready."""
        try:
            self.starter.start(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        self.lifecycle.set(MeshPhase.RUNNING)

    # -- requests ------------------------------------------------------------------------
    def check_alive(self, ranks: Sequence[int]) -> None:
        """Raise if the mesh stopped or one of ``ranks`` is dead."""
        if self.lifecycle.phase.ended:
            raise MeshStoppedError(f"mesh {self.name!r} is stopped; create a new mesh")
        for r in ranks:
            info = self.ranks[r]
            if info.state in GONE:
                raise RankDiedError(self.death_text(info), info.death, self.name)

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
        """Send a request expecting one reply per rank; ``observer`` hears of each.

        ``options`` says how (see :class:`~monarch_kernel.calls.requester.CallOptions`).
        ``request_id``: one from :func:`new_request_id`, when the caller must know it
        before the request is sent (to route its output).
        """
        check_size(header, payload, buffers)  # before it is a request that waits
        if self.lifecycle.phase is MeshPhase.RECOVERING and not options.during_restart:
            self.restarter.wait_recovered(RECOVERY_WAIT)
        self.check_alive(ranks)
        self._make_room(options.wait_for_room)
        rid = request_id or new_request_id()
        header["i"] = rid
        header["w"] = 1
        control, what = options.control, options.what
        kind = RequestKind.of(header["k"], control)
        self.requests.add(rid, ranks, observer, kind, what, options.internal)
        if kind is RequestKind.CELL and not options.internal:  # re-sent if a rank dies
            self.peers.remember_cell(rid, payload, buffers)
        if self.lifecycle.phase.ended:  # stop() ran since check_alive: it did not fail this
            self.requests.fail_request(rid, MeshStoppedError(f"mesh {self.name!r} is stopped"))
            return rid
        if self.events.wants(RequestStarted):
            self.events.emit(RequestStarted(self.name, rid, tuple(ranks), kind, what))
        if control:
            for r in ranks:
                self.transport.send_control(r, header, payload, buffers)
        else:
            self.transport.send(ranks, header, payload, buffers)
        # A rank may have died between the check and the send (its death was handled
        # before this request was in the table): fail this request's part of it now.
        for r in ranks:
            if self.ranks[r].state in GONE:
                self.receiver.post(self._fail_gone, rid, r)
        if not options.waited:
            self.receiver.ensure_reader()
        return rid

    def follow_request(
        self,
        ranks: list[int],
        request_id: str,
        observer: RequestObserver,
        kind: RequestKind,
        what: str,
    ) -> None:
        """Follow a request an earlier controller of this (detachable) mesh sent: its
        ranks answer it to this one now. Nothing is sent."""
        self.requests.add(request_id, ranks, observer, kind, what, False)
        if self.events.wants(RequestStarted):
            self.events.emit(RequestStarted(self.name, request_id, tuple(ranks), kind, what))
        for r in ranks:
            if self.ranks[r].state in GONE:
                self.receiver.post(self._fail_gone, request_id, r)
        self.receiver.ensure_reader()

    def _fail_gone(self, rid: str, rank: int) -> None:
        """Request ``rid`` was sent to ``rank`` as it died: fail that part of it (not the
        rank's part of every request: a training cell's is kept for its recovery)."""
        info = self.ranks[rank]
        error = RankDiedError(self.death_text(info), info.death, self.name)
        self.requests.fail_part(rid, rank, error)

    def send(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
        wait: bool = True,
    ) -> None:
        """Fire and forget: send to ``ranks``' main threads (FIFO per rank); errors go to
        supervision (:class:`FaultReported`). Flow control as for :meth:`request`; as
        a request, it waits while the mesh restarts ranks (sent meanwhile, it would go
        to a rank not started yet)."""
        check_size(header, payload, buffers)
        if self.lifecycle.phase is MeshPhase.RECOVERING:
            self.restarter.wait_recovered(RECOVERY_WAIT)
        self.check_alive(ranks)
        self._make_room(wait)
        # small calls made back to back travel batched (controller.messaging.batching)
        self.transport.send_fire(ranks, header, payload, buffers)

    def _make_room(self, wait: bool) -> None:
        # The token holder never waits: the replies it reads are what lets ranks drain.
        if not self.receiver.on_receiving_thread:
            self.transport.wait_for_room(wait)

    def answer_input(
        self, rank: int, serial: int, line: str | None = None, error: str | None = None
    ) -> None:
        """Answer rank ``rank``'s ``input()`` number ``serial``: with ``line``, or make
        it raise EOFError with ``error``."""
        header: Header = {"k": K.INPUT_REPLY, "n": serial}
        if error is not None:
            header["e"] = error
        else:
            header["v"] = line or ""
        if self.ranks[rank].alive:
            self.transport.send_control(rank, header)

    def send_control(self, rank: int, header: Header, payload: bytes = b"") -> None:
        """Send to a rank's control thread (served even while its main thread is busy)."""
        self.transport.send_control(rank, header, payload)

    def probe(self, ranks: Sequence[int]) -> ControlProbe:
        """Ping the control threads of ``ranks`` behind what was sent to them: each
        answer says when that rank had handled it (see
        :mod:`~monarch_kernel.controller.lifecycle.control_probe`). Never raises: a
        ping that cannot be sent counts as answered."""
        probe = ControlProbe()
        live = [r for r in ranks if self.ranks[r].alive]
        probe.answer_all(set(ranks) - set(live))
        if live:
            try:
                self.request(live, {"k": K.PING}, b"", (), probe, _PROBE)
            except Exception as exc:  # a rank died meanwhile, the mesh stopped ...
                log.debug("mesh %s: no probe of ranks %s: %s", self.name, live, exc)
                probe.answer_all(live)
        return probe

    def wait_for(self, fut: Awaitable, timeout: float | None) -> None:
        """A :class:`~monarch_kernel.calls.future.Future`'s waiter: receive replies
        in the calling thread while it waits (see
        :mod:`monarch_kernel.controller.messaging.receiver`)."""
        self.receiver.wait_for(fut, timeout)

    # -- the rest of the Requester protocol (calls.requester) ----------------------------
    @property
    def waiter(self) -> Waiter:
        """Futures of this mesh's requests receive their replies while they wait."""
        return self.wait_for

    def on_machine(self, ranks: Sequence[int], machine: str) -> bool:
        """Whether every one of ``ranks`` is a process of ``machine`` that listens on a
        unix socket (its device memory can then be mapped by CUDA IPC from there:
        ``rank.dataplane.cuda_args``)."""
        infos = self.ranks
        for r in ranks:
            peer = infos[r].peer if 0 <= r < len(infos) else None
            if peer is None or peer.machine != machine or not peer.ipc:
                return False
        return True

    def choose(self, ranks: list[int]) -> int:
        """The least busy live rank of ``ranks`` (``choose()``)."""
        alive = [r for r in ranks if self.ranks[r].alive]
        if not alive:
            self.check_alive(ranks)
        return min(alive, key=lambda r: self.ranks[r].outstanding)

    def reference(self) -> MeshRef:
        """A reference to this mesh that ranks can call it through (rank to rank)."""
        ranks = list(self.ranks)
        return MeshRef(
            self.name,
            self.key.hex(),
            tuple(i.peer for i in ranks),
            self.shape,
            tuple(i.slot for i in ranks),
            self.generation,
        )

    def publish_reference(self) -> None:
        """Tell every live rank of this controller's meshes this mesh's reference as it
        is now (it was resized): mesh handles they hold follow (``calls.mesh_refs``)."""
        payload = pickle.dumps([self.reference()])
        for mesh in registry.live():
            mesh.send_references(payload)

    def send_references(self, payload: bytes, ranks: Sequence[int] | None = None) -> None:
        """A ``mesh_ref`` control message (``payload``: pickled references) to ``ranks``
        (default: every live, started one); one that cannot take it is left alone."""
        for info in [self.ranks[r] for r in ranks] if ranks is not None else list(self.ranks):
            if info.alive and info.state is not RankState.STARTING:
                try:
                    self.transport.send_control(info.rank, {"k": K.MESH_REF}, payload)
                except Exception:  # stopping, or it left meanwhile
                    pass

    def _rank_ready(self, rank: int) -> None:
        """A rank started (receiving thread): the meshes resized before it know their
        shape only from here (handles in the actors it is given)."""
        refs = [m.reference() for m in registry.live() if m.generation]
        if refs:
            self.send_references(pickle.dumps(refs), [rank])

    def stop_mesh(self, grace: float) -> Future[None]:
        """:meth:`stop`, as a completed future (Monarch's ``stop()`` returns one)."""
        self.stop(grace=grace)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def spawn_owner(self) -> Owner | None:
        """The notebook owns no actors: nothing it spawns has an owner."""
        return None

    def cancel_request(self, request_id: str) -> list[int]:
        """Interrupt request ``request_id`` on the ranks still running it (skip it on
        those that have not started it); returns those ranks (empty: it is done)."""
        pending = self.requests.get(request_id)
        if pending is not None:
            pending.cancelled = True
        running = [r for r in sorted(self.requests.waiting(request_id)) if self.ranks[r].alive]
        for r in running:
            self.transport.send_control(r, {"k": K.CANCEL, "c": request_id})
        return running

    def kill_ranks(self, ranks: Sequence[int]) -> None:
        """SIGKILL ``ranks`` through their host agents (their exits are reported as
        expected, unless a ``kill_reason`` was set on them: then they are DEAD)."""
        for host, group in slots_by_host(self.ranks, ranks).items():
            self.transport.send_host(host, {"k": K.KILL_RANKS, "d": group})

    def signal_ranks(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` through their host agents."""
        for host, group in slots_by_host(self.ranks, ranks).items():
            self.transport.send_host(host, {"k": K.SIGNAL_RANKS, "d": group, "sig": int(sig)})

    def death_text(self, info: RankInfo) -> str:
        """Why ``info``'s rank is not running, with its last output lines."""
        return self.supervisor.death_text(info)

    # -- stopping --------------------------------------------------------------------
    def stop(self, timeout: float = 10.0, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stop every rank and host agent of this mesh; idempotent.

        Ranks are asked to exit cleanly (``atexit`` handlers, finalizers,
        ``destroy_process_group``) and killed if still running after ``grace`` seconds.
        """
        if not self.lifecycle.begin_stop():
            return
        stop: Header = {"k": K.STOP, "grace": float(grace)}
        for host in self.hosts:
            self.transport.send_host(host.index, stop)
        deadline = time.monotonic() + timeout + grace
        self._stop_late_agents(stop, deadline)
        for host in self.hosts:
            if host.handle is not None:
                host.handle.wait_or_kill(max(0.5, deadline - time.monotonic()))
        for info in self.ranks:  # each rank's end is told, with the requests it fails
            if info.alive:
                self.supervisor.rank_died(info, RankEnd("the mesh was stopped", expected=True))
        self.requests.fail_all(
            lambda: MeshStoppedError(f"mesh {self.name!r} was stopped while this call was running")
        )
        # Nothing runs any more; what is left is local (announced when it is done).
        self.lifecycle.set(MeshPhase.STOPPED, announce=False)
        self.receiver.stop()
        self.inbound.close()
        self.transport.close()
        for host in self.hosts:
            if host.handle is not None:
                host.handle.cleanup()
        registry.discard(self)
        self.logs.close()
        self.lifecycle.announce()

    def _tick(self, now: float) -> None:
        """About twice a second, on the receiving thread: heartbeats and lost hosts,
        then the inbound side's housekeeping."""
        self.supervisor.tick(now)
        self.inbound.tick(now)

    def _stop_late_agents(self, stop: Header, deadline: float) -> None:
        """Send ``stop`` again to agents that had not said ready when it was sent.

        A STOP sent before an agent connected is dropped (the ROUTER has no route to it
        yet): a start that timed out or was interrupted would otherwise wait the whole
        stop timeout for agents that connect a moment later and never hear it.
        """
        # Only agents whose process the launcher sees (a pid): their exit is known, so
        # this ends as soon as they are gone (a remote agent's stays unknown).
        late = [h for h in self.hosts if not h.ready and h.handle and h.handle.pid]
        while late and time.monotonic() < deadline:
            late = [h for h in late if h.handle is not None and h.handle.exit_code() is None]
            for host in late:
                self.transport.send_host(host.index, stop)
            if late:
                time.sleep(STOP_RESEND_INTERVAL)

    def release(self, why: str) -> bool:
        """Let go of a detachable mesh without stopping it (its kernel shuts down, or
        another kernel took it over): requests fail saying ``why`` ("was detached ..."),
        the sockets close but their directory stays for the next controller, and the
        ranks and agents run on. False if the mesh had ended already. Not on the
        receiving thread (it waits for that thread to end)."""
        if not self.lifecycle.begin_stop():
            return False
        self.released = why
        self.requests.fail_all(lambda: MeshStoppedError(f"mesh {self.name!r} {why}"))
        self.lifecycle.set(MeshPhase.STOPPED, announce=False)
        self.receiver.stop()
        self.inbound.close()
        self.transport.close(keep_addresses=True)
        registry.discard(self)
        self.logs.close()
        self.lifecycle.announce()
        return True

    def summary(self) -> MeshSummary:
        """This mesh as one row of the ``%mesh`` table."""
        alive = sum(1 for r in self.ranks if r.alive)
        return MeshSummary(
            self.name,
            self.shape.describe(),
            self.backend,
            alive,
            self.world,
            self.state,
            self.started_at,
        )

    def __repr__(self) -> str:
        return f"<MeshRuntime {self.name!r} {self.shape.describe()} {self.state}>"


#: The kernel's one registry of live meshes (one kernel = one controller): every
#: ``MeshRuntime`` registers itself when it is created and leaves when it stops.
registry: MeshRegistry[MeshRuntime] = MeshRegistry()


@atexit.register
def _stop_all_at_exit() -> None:
    registry.stop_all(timeout=3)
