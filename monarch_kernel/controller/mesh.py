"""The controller side of one process mesh: a façade over its parts.

A :class:`MeshRuntime` is what the layers above hold. It wires together:

* :mod:`~monarch_kernel.controller.records`: what is known of each rank and host;
* :mod:`~monarch_kernel.controller.transport`: sockets and every send path;
* :mod:`~monarch_kernel.controller.receiver`: who reads replies (the receive token and
  the I/O thread);
* :mod:`~monarch_kernel.controller.inbound`: the handler of each incoming message kind;
* :mod:`~monarch_kernel.controller.requests`: outstanding requests and their observers;
* :mod:`~monarch_kernel.controller.supervision`: heartbeats, deaths, lost hosts;
* :mod:`~monarch_kernel.controller.events`: the lifecycle events it emits;
* :mod:`~monarch_kernel.controller.streams`: where rank output goes.

and adds the mesh-wide operations: start, request, signal, restart, stop.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from monarch_kernel.calls.errors import (
    MeshStartError,
    MeshStoppedError,
    RankDiedError,
    format_ranks,
)
from monarch_kernel.calls.future import Future, Waiter
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import PLAIN, ActorSpec, CallOptions, MeshRef
from monarch_kernel.controller.events import (
    EventBus,
    MeshPhaseChanged,
    MeshRecovered,
    RequestKind,
    RequestStarted,
)
from monarch_kernel.controller.failures import DEFAULT_GRACE, FailureHandler
from monarch_kernel.controller.inbound import Inbound
from monarch_kernel.controller.receiver import Awaitable, Receiver
from monarch_kernel.controller.records import (
    GONE,
    FailurePolicy,
    HostInfo,
    MeshPhase,
    RankInfo,
    RankState,
    RecoveryReport,
    SetupCell,
)
from monarch_kernel.controller.registry import MeshSummary, registry
from monarch_kernel.controller.requests import RequestTable, new_request_id
from monarch_kernel.controller.streams import RankLogs, StreamRouter
from monarch_kernel.controller.supervision import Supervisor
from monarch_kernel.controller.transport import Transport
from monarch_kernel.launchers.base import HostConfig, Launcher
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Codec, dumps
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header, new_key
from monarch_kernel.wire.headers import Owner, SpawnActor

__all__ = ["MeshRuntime", "new_request_id"]

#: Seconds without a host agent's heartbeat (sent every 0.5 s) before it is lost.
DEFAULT_HB_TIMEOUT = 2.5
#: Longest a request waits for a restart in place (which has its own deadlines) to end.
RECOVERY_WAIT = 600.0
#: Seconds a host agent waits for a silent controller before it shuts down.
AGENT_SILENCE_TIMEOUT = 10.0
#: Seconds ranks get to exit cleanly on a stop (atexit, finalizers) before SIGKILL.
DEFAULT_STOP_GRACE = 3.0
#: The controller's own questions to ranks' control threads while it re-forms a mesh.
_INTERNAL_CONTROL = CallOptions(control=True, internal=True)


class MeshRuntime:
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
    ):
        """``bind``: where the controller's sockets listen: a host address (tcp on a
        random port), a full ``tcp://`` or ``ipc://`` endpoint, or ``"ipc"`` for unix
        sockets in a private (0700) directory. By default ``"ipc"`` when every host is
        on this machine (the local launcher), else the launcher's ``bind`` attribute if it
        has one, else ``127.0.0.1``. ``advertise``: the address host agents connect to
        when it differs from the bound one (a wildcard bind; default: the launcher's
        ``advertise`` attribute). Tcp sockets are CURVE servers (see ``Transport``).
        ``on_failure`` and ``grace``: see :mod:`~monarch_kernel.controller.failures`.
        """
        if grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        if hosts < 1:
            raise ValueError(f"a mesh needs at least one host, got hosts={hosts}")
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
        self.started_at = time.time()
        self.state = MeshPhase.STARTING
        self.run_id = uuid.uuid4().hex[:12]
        self.key = new_key()
        self.codec = Codec(self.key)
        self.ranks = [
            RankInfo(r, r // self.per_host, r % self.per_host, c)
            for r, c in enumerate(self.shape._coords())
        ]
        self.hosts = [HostInfo(h) for h in range(hosts)]
        #: Actors spawned on this mesh, re-created on restarted ranks.
        self.actors: dict[str, ActorSpec] = {}
        #: Cells re-run on restarted ranks (after the process group is re-formed).
        self.setup_cells: list[SetupCell] = []
        #: Backend of the ranks' torch.distributed process group, once one was seen.
        self.pg_backend: str | None = None
        self.last_recovery: RecoveryReport | None = None
        #: Why the last restart in place failed (None if it did not).
        self.recovery_error: str | None = None
        self._recover_lock = threading.Lock()
        self._recovery_thread: int | None = None
        self._ports: dict[str, int] = {}
        self.events = EventBus()
        self.output = StreamRouter(self.events)
        self.logs = RankLogs(self.events, name, self.run_id)
        self.requests = RequestTable(name, self.ranks, self.events)
        self._cv = threading.Condition()
        self._common: Header = {}
        registry.add(self)  # before any socket exists: a taken name costs nothing
        try:
            if bind is None:
                bind = "ipc" if launcher.same_machine else getattr(launcher, "bind", "127.0.0.1")
            self.advertise = advertise or getattr(launcher, "advertise", None)
            self.transport = Transport(name, self.codec, self.ranks, bind)
        except BaseException:
            registry.forget(self)
            raise
        self.supervisor = Supervisor(self)
        self.inbound = Inbound(self)
        self.receiver = Receiver(
            name, self.transport, self.inbound.handle, self.supervisor.tick, self.requests.__bool__
        )
        self.failures = FailureHandler(self, FailurePolicy(on_failure), grace)

    # -- start-up --------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Start host agents and ranks; return when every rank is ready."""
        deadline = time.monotonic() + timeout
        try:
            configs = [self._host_config(h) for h in range(self.n_hosts)]
            handles = self.launcher.start_hosts(configs)
            for host, handle in zip(self.hosts, handles):
                host.handle = handle
                self._adopt(host)
            try:
                self._wait(lambda: all(h.ready for h in self.hosts), deadline, "host agents")
            except MeshStartError as exc:
                missing = [h.index for h in self.hosts if not h.ready]
                describe = getattr(self.launcher, "describe_missing", None)
                if missing and describe is not None:
                    raise MeshStartError(f"{exc}\n{describe(self.name, missing)}") from None
                raise
            master = self.hosts[0]
            self._common = {
                "labels": list(self.shape.labels),
                "sizes": list(self.shape.sizes),
                "world_size": self.world,
                "local_world_size": self.per_host,
                "master_addr": master.addr,
                "master_port": master.port,
                "run_id": self.run_id,
                "mesh": self.name,
                "env": self.env,
                "sys_path": [p for p in sys.path if p],
                "cwd": os.getcwd(),
            }
            for host in self.hosts:
                self._spawn_ranks([r for r in self.ranks if r.host == host.index])
            self._wait(
                lambda: all(r.state is not RankState.STARTING for r in self.ranks),
                deadline,
                "ranks",
            )
            dead = [r for r in self.ranks if not r.alive]
            if dead:
                raise MeshStartError(
                    "ranks died while starting:\n" + "\n".join(self.death_text(r) for r in dead)
                )
        except BaseException:
            self.stop()
            raise
        self._set_phase(MeshPhase.RUNNING)

    def _adopt(self, host: HostInfo) -> None:
        """Let a handle on a remote agent (no pid to kill) tell it to exit."""
        if hasattr(host.handle, "tell_exit"):
            index = host.index

            def tell_exit() -> None:
                self.transport.send_host(index, {"k": K.STOP, "grace": 0.0})

            setattr(host.handle, "tell_exit", tell_exit)  # noqa: B010

    def _host_config(self, h: int) -> HostConfig:
        t = self.transport
        # The agent's own patience with a silent controller is longer than ours with it:
        # a controller busy for a few seconds (a large unpickle) must not lose its hosts.
        silence = max(AGENT_SILENCE_TIMEOUT, 4 * self.hb_timeout)
        send, recv = t.send_addr, t.recv_addr
        if self.advertise and send.startswith("tcp://"):
            send = f"tcp://{self.advertise}:{send.rsplit(':', 1)[1]}"
            recv = f"tcp://{self.advertise}:{recv.rsplit(':', 1)[1]}"
        # One client keypair per host agent (its ranks use it too); a relaunched host
        # gets a new one and the old one is no longer admitted.
        curve = t.admit_host(h)
        return HostConfig(
            h, self.key.hex(), send, recv, silence, self.name, *curve, ranks=self.per_host
        )

    def _spawn_ranks(self, ranks: list[RankInfo]) -> None:
        specs = []
        for r in ranks:
            r.death, r.pid = None, None
            self.requests.set_state(r, RankState.STARTING)
            spec: dict[str, Any] = {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "coords": list(r.coords),
                "host": r.host,
                "restart_count": r.restarts,
            }
            if self.transport.curve is not None:  # peers of other machines may call it
                if not r.peer_secret:
                    r.peer_secret = zmq.curve_keypair()[1].decode()
                spec["peer_secret"] = r.peer_secret
                if r.peer.tcp:
                    spec["peer_port"] = r.peer.tcp_port
            specs.append(spec)
        if specs:
            self.transport.send_host(
                ranks[0].host, {"k": K.SPAWN_RANKS, "ranks": specs, "common": self._common}
            )

    def _wait(
        self,
        cond: Callable[[], bool],
        deadline: float,
        what: str,
        hosts: Sequence[HostInfo] | None = None,
        hint: str = "check the host agents' logs or raise the start timeout",
    ) -> None:
        """Wait until ``cond()``; fail if the mesh stops, one of ``hosts`` (default:
        all) exits or is lost, or ``deadline`` passes."""
        with self._cv:
            while not cond():
                if self.state.ended:
                    raise MeshStoppedError(f"mesh {self.name!r} was stopped during: {what}")
                self._check_hosts_started(what, self.hosts if hosts is None else hosts)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MeshStartError(f"mesh {self.name!r}: {what} not ready in time; {hint}")
                self._cv.wait(min(left, 0.2))

    def _check_hosts_started(self, what: str, hosts: Sequence[HostInfo]) -> None:
        for host in hosts:
            handle = host.handle
            if handle is not None and handle.exit_code() is not None:
                raise MeshStartError(
                    f"host agent {host.index} exited (code {handle.exit_code()}) while "
                    f"starting {what}:\n{handle.log_tail()}"
                )
            if host.lost:
                raise MeshStartError(f"host agent {host.index} lost: {host.lost}")

    def notify(self) -> None:
        """Wake threads waiting for ranks or hosts to change state (start, restart)."""
        with self._cv:
            self._cv.notify_all()

    # -- requests ------------------------------------------------------------------------
    def check_alive(self, ranks: Sequence[int]) -> None:
        """Raise if the mesh stopped or one of ``ranks`` is dead."""
        if self.state.ended:
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
        if self.state is MeshPhase.RECOVERING and not options.during_restart:
            self.wait_recovered(RECOVERY_WAIT)
        self.check_alive(ranks)
        self._make_room(options.wait_for_room)
        rid = request_id or new_request_id()
        header["i"] = rid
        header["w"] = 1
        control, what = options.control, options.what
        kind = RequestKind.of(header["k"], control)
        self.requests.add(rid, ranks, observer, kind, what, options.internal)
        if self.state.ended:  # stop() ran since check_alive: it cannot have failed this one
            self.requests.fail_request(rid, MeshStoppedError(f"mesh {self.name!r} is stopped"))
            return rid
        if self.events.wants(RequestStarted):
            self.events.emit(RequestStarted(self.name, rid, tuple(ranks), kind, what))
        if control:
            for r in ranks:
                self.transport.send_control(r, header, payload)
        else:
            self.transport.send(ranks, header, payload, buffers)
        # A rank may have died between the check and the send; fail it now if so.
        for r in ranks:
            if self.ranks[r].state in GONE:
                self.receiver.post(self._fail_gone, r)
        if not options.waited:
            self.receiver.ensure_reader()
        return rid

    def wait_recovered(self, timeout: float | None = None) -> None:
        """Block (interruptibly) while the mesh restarts ranks after a failure.

        The thread doing the restart, and the receiving thread (whose replies it
        waits for), never wait here.
        """
        me = threading.get_ident()
        if me == self._recovery_thread or self.receiver.on_receiving_thread:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.state is MeshPhase.RECOVERING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise MeshStartError(
                        f"mesh {self.name!r} is still restarting ranks after {timeout:.0f}s"
                    )
                self._cv.wait(0.1 if left is None else min(left, 0.1))

    def _fail_gone(self, rank: int) -> None:
        info = self.ranks[rank]
        self.requests.fail_rank(rank, RankDiedError(self.death_text(info), info.death, self.name))

    def send(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
        wait: bool = True,
    ) -> None:
        """Fire and forget: send to ``ranks``' main threads (FIFO per rank); errors go to
        supervision (:class:`FaultReported`). Flow control as for :meth:`request`."""
        self.check_alive(ranks)
        self._make_room(wait)
        self.transport.send(ranks, header, payload, buffers)

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

    def wait_for(self, fut: Awaitable, timeout: float | None) -> None:
        """A :class:`~monarch_kernel.calls.future.Future`'s waiter: receive replies
        in the calling thread while it waits (see :mod:`.receiver`)."""
        self.receiver.wait_for(fut, timeout)

    # -- the rest of the Requester protocol (calls.requester) ----------------------------
    @property
    def waiter(self) -> Waiter:
        """Futures of this mesh's requests receive their replies while they wait."""
        return self.wait_for

    def choose(self, ranks: list[int]) -> int:
        """The least busy live rank of ``ranks`` (``choose()``)."""
        alive = [r for r in ranks if self.ranks[r].alive]
        if not alive:
            self.check_alive(ranks)
        return min(alive, key=lambda r: self.ranks[r].outstanding)

    def actor_spawned(self, spec: ActorSpec) -> None:
        """``spec`` was spawned: re-create it on its ranks when they restart."""
        self.remember_actor(spec)

    def actor_stopped(self, name: str, ranks: list[int]) -> None:
        """Actor ``name`` was stopped on ``ranks``: not re-created there any more."""
        self.forget_actor(name, ranks)

    def reference(self) -> MeshRef:
        """A reference to this mesh that ranks can call it through (rank to rank)."""
        return MeshRef(self.name, self.key.hex(), tuple(i.peer for i in self.ranks), self.shape)

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
        for host, group in self._by_host(list(ranks)).items():
            self.transport.send_host(host, {"k": K.KILL_RANKS, "d": group})

    def signal_ranks(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` through their host agents."""
        for host, group in self._by_host(ranks).items():
            self.transport.send_host(host, {"k": K.SIGNAL_RANKS, "d": group, "sig": int(sig)})

    def _by_host(self, ranks: list[int]) -> dict[int, list[int]]:
        by_host: dict[int, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.ranks[r].host, []).append(r)
        return by_host

    # -- actors to re-create on restart ------------------------------------------------
    def remember_actor(self, spec: ActorSpec) -> None:
        """``spec`` was spawned: re-create it on its ranks when they restart."""
        self.actors[spec.name] = spec

    def forget_actor(self, name: str, ranks: Sequence[int]) -> None:
        """Actor ``name`` was stopped on ``ranks``: do not re-create it there."""
        spec = self.actors.get(name)
        if spec is None:
            return
        left = spec.ranks - set(ranks)
        if left:
            self.actors[name] = dataclasses.replace(spec, ranks=frozenset(left))
        else:
            del self.actors[name]

    def death_text(self, info: RankInfo) -> str:
        """Why ``info``'s rank is not running, with its last output lines."""
        return self.supervisor.death_text(info)

    # -- restart in place ------------------------------------------------------------
    def remember_setup(self, cell: SetupCell) -> None:
        """Re-run ``cell`` on ranks when they restart (after the process group)."""
        self.setup_cells.append(cell)

    def forget_setup(self) -> list[SetupCell]:
        """Re-run no setup cell on restarts any more; returns those forgotten."""
        cells, self.setup_cells = self.setup_cells, []
        return cells

    def restart_ranks(self, ranks: list[int], timeout: float = 60.0) -> None:
        """Kill (if alive) and start again the given ranks on their hosts; hosts that
        were lost get a new host agent first.

        Never leaves a rank STARTING: a rank that does not come up in time is marked
        DEAD (with why) and a :class:`MeshStartError` says which.
        """
        self.check_alive([])
        deadline = time.monotonic() + timeout
        involved = [self.hosts[h] for h in sorted({self.ranks[r].host for r in ranks})]
        lost = [h for h in involved if h.lost]
        for lost_host in lost:  # all at once: each takes a moment to start
            self._relaunch_host(lost_host)
        self._wait(
            lambda: all(h.ready for h in lost), deadline, "host agents (started again)", lost
        )
        alive = [r for r in ranks if self.ranks[r].alive]
        self.kill_ranks(alive)
        self._wait(
            lambda: all(not self.ranks[r].alive for r in ranks), deadline, "rank exits", involved
        )
        infos = [self.ranks[r] for r in ranks]
        for info in infos:
            self.transport.reset_seq(info.rank)
            info.restarts += 1
            info.tail.clear()
            info.kill_reason = None
        for index in {i.host for i in infos}:
            self._spawn_ranks([i for i in infos if i.host == index])
        try:
            self._wait(
                lambda: all(self.ranks[r].state is not RankState.STARTING for r in ranks),
                deadline,
                "restarted ranks",
                involved,
            )
        except BaseException as exc:
            # Never left "starting": a late rank is declared dead now (and killed, so
            # that it does not come up unsupervised later).
            late = [r for r in ranks if self.ranks[r].state is RankState.STARTING]
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.kill_ranks(late)
            for r in late:
                self.receiver.post(
                    self.supervisor.rank_died, self.ranks[r], {"reason": f"did not start: {why}"}
                )
            self.receiver.ensure_reader()
            raise
        dead = [self.ranks[r] for r in ranks if not self.ranks[r].alive]
        if dead:
            raise MeshStartError(
                "ranks died while restarting:\n" + "\n".join(self.death_text(r) for r in dead)
            )

    def _relaunch_host(self, host: HostInfo) -> None:
        """Start a new host agent in place of lost ``host`` (its ranks are dead)."""
        old = host.handle
        if old is not None:
            old.wait_or_kill(0.1)  # a frozen agent: kill it (its ranks die with it)
            old.cleanup()
        host.ready, host.lost, host.last_seen = False, None, time.monotonic()
        (host.handle,) = self.launcher.start_hosts([self._host_config(host.index)])
        self._adopt(host)

    def new_port(self, host: int = 0, timeout: float = 10.0) -> int:
        """A free port on ``host`` (for a new torch.distributed rendezvous)."""
        rid = new_request_id()
        self.transport.send_host(host, {"k": K.NEW_PORT, "i": rid})
        self.receiver.ensure_reader()
        deadline = time.monotonic() + timeout
        self._wait(
            lambda: rid in self._ports,
            deadline,
            f"a free port from host {host}",
            [self.hosts[host]],
            "its host agent did not answer",
        )
        return self._ports.pop(rid)

    def port_received(self, rid: str, port: int) -> None:
        """A host agent answered :meth:`new_port` (receiving thread)."""
        self._ports[rid] = port
        self.notify()

    def recover(
        self,
        ranks: Sequence[int] | None = None,
        timeout: float = 120.0,
        reason: str = "",
        skip: frozenset[int] = frozenset(),
    ) -> RecoveryReport:
        """Restart in place: bring ``ranks`` (default: the dead ones but ``skip``) back
        and re-form the mesh as it was created.

        In order: the ranks are restarted (their hosts too, if lost); the torch
        process group, if the ranks had one, is re-created on every rank with a new
        rendezvous; actors are re-created and setup cells re-run on the restarted
        ranks. New requests wait meanwhile; one restart runs at a time (a second
        caller waits for the first, then restarts what is still dead). Returns what
        was done; problems while re-forming (a setup cell that raised) are in the
        report, a rank that cannot start raises :class:`MeshStartError` (and is left
        DEAD, never STARTING).
        """
        with self._recover_lock:
            self.check_alive([])
            t0 = time.monotonic()
            deadline = t0 + timeout
            if ranks is None:
                ranks = [r.rank for r in self.ranks if not r.alive and r.rank not in skip]
            targets = sorted(set(ranks))
            self.begin_recovery()
            self._recovery_thread = threading.get_ident()
            self.recovery_error = None
            problems: list[str] = []
            backend = None
            try:
                broken = self._learn_process_group([r.rank for r in self.ranks if r.alive])
                if targets:
                    self.restart_ranks(targets, max(1.0, deadline - time.monotonic()))
                if self.pg_backend is not None and (targets or broken):
                    backend = self._reform_process_group(deadline, problems)
                actors = self._respawn_actors(targets, deadline, problems)
                setups = self._rerun_setup(targets, deadline, problems) if targets else ()
            except BaseException as exc:
                self.recovery_error = str(exc).splitlines()[0] if str(exc) else repr(exc)
                raise
            finally:
                self._recovery_thread = None
                with self._cv:  # a stop meanwhile wins
                    if self.state is MeshPhase.RECOVERING:
                        self.state = MeshPhase.RUNNING
                        self._cv.notify_all()
                self._emit_phase()
            report = RecoveryReport(
                tuple(targets),
                backend,
                actors,
                setups,
                time.monotonic() - t0,
                tuple(problems),
                reason,
            )
            self.last_recovery = report
        if self.events.wants(MeshRecovered):
            self.events.emit(MeshRecovered(self.name, report))
        return report

    def begin_recovery(self) -> None:
        """Mark the mesh RECOVERING now (a restart follows on another thread)."""
        with self._cv:
            if self.state is not MeshPhase.RUNNING:
                return
            self.state = MeshPhase.RECOVERING
        self._emit_phase()

    def _learn_process_group(self, ranks: list[int]) -> bool:
        """Ask live ranks about their process group; True if one of them had one that
        is gone now (aborted, or broken by a dead peer): it must be re-formed."""
        if not ranks:
            return False
        collect = _Collect(ranks)
        rid = self.request(ranks, {"k": K.PING}, b"", (), collect, _INTERNAL_CONTROL)
        self._finish(collect, rid, time.monotonic() + 2.0)  # a rank stuck holding the GIL
        broken = False
        for reply in list(collect.replies):
            if reply.ok:
                info = reply.value("ping")
                if isinstance(info, dict) and info.get("pg"):
                    self.pg_backend = str(info["pg"])
                    broken = broken or not info.get("pg_live")
        return broken

    def _reform_process_group(self, deadline: float, problems: list[str]) -> str | None:
        live = [r.rank for r in self.ranks if r.alive]
        if len(live) != self.world:
            problems.append(
                f"process group not re-formed: rank(s) {format_ranks(self._dead())} are dead"
            )
            return None
        port = self.new_port(0)
        addr = self.hosts[0].addr
        self._common["master_port"] = port
        code = (
            "from monarch_kernel.rank.distributed import reform_process_group as _mk_reform\n"
            f"_mk_reform({addr!r}, {port}, {self.pg_backend!r})\n"
            "del _mk_reform\n"
        )
        failed = self._run_cell(live, code, "restart: process group", (), deadline)
        if failed:
            problems.append(f"re-forming the process group failed: {failed}")
            return None
        return self.pg_backend

    def _respawn_actors(
        self, targets: list[int], deadline: float, problems: list[str]
    ) -> tuple[str, ...]:
        done = []
        for spec in list(self.actors.values()):
            on = [r for r in targets if r in spec.ranks and self.ranks[r].alive]
            if not on:
                continue
            collect = _Collect(on)
            header = SpawnActor(actor=spec.name, owner=spec.owner).encode()
            rid = self.request(
                on,
                header,
                spec.payload,
                spec.buffers,
                collect,
                CallOptions(what=f"spawn {spec.name}", internal=True),
            )
            failed = self._finish(collect, rid, deadline)
            if failed:
                problems.append(f"re-creating actor {spec.name!r} failed: {failed}")
            else:
                done.append(spec.name)
        return tuple(done)

    def _rerun_setup(
        self, targets: list[int], deadline: float, problems: list[str]
    ) -> tuple[str, ...]:
        done = []
        on = [r for r in targets if self.ranks[r].alive]
        for cell in list(self.setup_cells):
            failed = self._run_cell(on, cell.code, cell.label, cell.header, deadline)
            if failed:
                problems.append(f"setup cell {cell.label} failed: {failed}")
                break  # later setup cells likely need this one
            done.append(cell.label)
        return tuple(done)

    def _run_cell(
        self,
        ranks: list[int],
        code: str,
        label: str,
        header: Sequence[str],
        deadline: float,
    ) -> str:
        """Run ``code`` as a cell on ``ranks``; '' or what went wrong."""
        if not ranks:
            return ""
        payload, buffers = dumps({"code": code, "cell": label, "header": list(header)}, "cell")
        collect = _Collect(ranks)
        options = CallOptions(what=f"cell {label}", internal=True)
        rid = self.request(ranks, {"k": K.EXEC}, payload, buffers, collect, options)
        return self._finish(collect, rid, deadline)

    def _finish(self, collect: _Collect, rid: str, deadline: float) -> str:
        """Wait for one of the controller's own requests; on timeout, cancel it and give
        up on it, so that it neither runs later nor keeps its ranks BUSY."""
        failed = collect.wait(deadline)
        if collect.future.done():
            return failed
        self.cancel_request(rid)
        error = MeshStartError(f"mesh {self.name!r}: no answer in time while re-forming it")
        self.receiver.post(self.requests.abandon, rid, set(self.requests.waiting(rid)), error)
        return failed

    def _dead(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.alive]

    # -- stopping --------------------------------------------------------------------
    def stop(self, timeout: float = 10.0, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stop every rank and host agent of this mesh; idempotent.

        Ranks are asked to exit cleanly (``atexit`` handlers, finalizers,
        ``destroy_process_group``) and killed if still running after ``grace`` seconds.
        """
        with self._cv:
            if self.state.ended:
                return
            self.state = MeshPhase.STOPPING
            self._cv.notify_all()  # requests waiting for a recovery give up
        self._emit_phase()
        for host in self.hosts:
            self.transport.send_host(host.index, {"k": K.STOP, "grace": float(grace)})
        deadline = time.monotonic() + timeout + grace
        for host in self.hosts:
            if host.handle is not None:
                host.handle.wait_or_kill(max(0.5, deadline - time.monotonic()))
        for info in self.ranks:  # each rank's end is told, with the requests it fails
            if info.alive:
                self.supervisor.rank_died(info, {"reason": "the mesh was stopped", "expected": 1})
        self.requests.fail_all(
            lambda: MeshStoppedError(f"mesh {self.name!r} was stopped while this call was running")
        )
        with self._cv:
            self.state = MeshPhase.STOPPED  # nothing runs any more; what is left is local
        self.receiver.stop()
        self.transport.close()
        for host in self.hosts:
            if host.handle is not None:
                host.handle.cleanup()
        registry.discard(self)
        self.logs.close()
        self._emit_phase()

    def _set_phase(self, phase: MeshPhase) -> None:
        with self._cv:
            self.state = phase
        self._emit_phase()

    def _emit_phase(self) -> None:
        if self.events.wants(MeshPhaseChanged):
            self.events.emit(MeshPhaseChanged(self.name, self.state))

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


class _Collect:
    """Observer of the controller's own requests (re-forming a mesh): all replies."""

    def __init__(self, ranks: list[int]):
        self._left = len(ranks)
        self._lock = threading.Lock()
        self.replies: list[Reply] = []
        self.lost: list[str] = []
        self.future: Future[None] = Future()

    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            self.replies.append(reply)
            self._left -= 1
            done = self._left == 0
        if done:
            self.future.set_result(None)

    def on_lost(self, rank: int, error: BaseException) -> None:
        with self._lock:
            self.lost.append(f"rank {rank}: {str(error).splitlines()[0]}")
            self._left -= 1
            done = self._left == 0
        if done:
            self.future.set_result(None)

    def wait(self, deadline: float) -> str:
        """'' when every rank succeeded, else a one-line summary of what failed."""
        try:
            self.future.get(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return "no answer in time"
        problems = list(self.lost)
        for reply in self.replies:
            if not reply.ok and reply.report is not None:
                rep = reply.report
                problems.append(f"rank {reply.rank}: {rep.get('type')}: {rep.get('message')}")
        return "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
