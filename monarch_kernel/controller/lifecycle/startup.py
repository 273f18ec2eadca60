"""Starting a mesh's host agents and ranks, and waiting for them.

:class:`Starter` builds each host agent's :class:`~monarch_kernel.launchers.base.HostConfig`,
has the launcher start the agents, asks them to fork their ranks (``spawn_ranks``) and
waits until every one is ready. A restart in place (:mod:`.restart`) uses the same
pieces for single ranks and for host agents that were lost.

Waiting happens on the mesh's condition
(:class:`~monarch_kernel.controller.state.phase.MeshLifecycle`); the handlers
that make hosts and ranks ready notify it. A wait fails as soon as the mesh stops, a
host agent it depends on exits or is lost, or its deadline passes: start-up never hangs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from monarch_kernel.calls.errors import MeshStartError, MeshStoppedError
from monarch_kernel.controller.messaging import listener_key
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import HostInfo, RankInfo, RankState
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.launchers.base import HostConfig, Launcher
from monarch_kernel.shape import Shape
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.desk import ControllerId
from monarch_kernel.wire.headers import MeshCommon, RankSpec, SpawnRanks
from monarch_kernel.wire.limits import inherited_env

#: Seconds of controller silence after which a host agent asks whether its controller
#: is gone (its process ended, its connection closed) and, only if it is, shuts down: a
#: controller that is alive but busy keeps its hosts (``host.liveness``).
AGENT_SILENCE_TIMEOUT = 10.0


#: Seconds between two progress reports while a mesh starts.
PROGRESS_EVERY = 1.0


@dataclass(frozen=True)
class StartProgress:
    """How far a mesh's start is: for a progress line while a big mesh starts, and to
    say where its ready time went (the agents, then the ranks)."""

    seconds: float  #: since the start began
    hosts_ready: int
    hosts: int
    ranks_ready: int  #: ranks past STARTING (ready, or dead)
    ranks: int
    agents_seconds: float | None  #: when the last host agent was ready (None: not yet)

    def line(self) -> str:
        """``host agents 8/8 ready in 3.1 s; ranks 40/128 ready (12.4 s)``."""
        if self.agents_seconds is None:
            agents = f"host agents {self.hosts_ready}/{self.hosts} ready"
            return f"{agents}, ranks 0/{self.ranks} ({self.seconds:.1f} s)"
        agents = f"host agents {self.hosts}/{self.hosts} ready in {self.agents_seconds:.1f} s"
        return f"{agents}; ranks {self.ranks_ready}/{self.ranks} ready ({self.seconds:.1f} s)"


class MeshConfig(Protocol):
    """What a mesh was created with (read only): all that start-up needs to know."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> Shape: ...
    @property
    def world(self) -> int: ...
    @property
    def per_host(self) -> int: ...
    @property
    def run_id(self) -> str: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def key(self) -> bytes: ...
    @property
    def hb_timeout(self) -> float: ...
    @property
    def advertise(self) -> str | None: ...
    @property
    def launcher(self) -> Launcher: ...
    @property
    def detach_keep(self) -> float: ...
    @property
    def attach_path(self) -> str: ...
    @property
    def on_failure(self) -> str: ...


class Starter:
    """Starts host agents and ranks of one mesh, and waits for them."""

    def __init__(
        self,
        config: MeshConfig,
        *,
        transport: Transport,
        ranks: list[RankInfo],
        hosts: list[HostInfo],
        requests: RequestTable,
        lifecycle: MeshLifecycle,
        death_text: Callable[[RankInfo], str],
    ):
        self._config = config
        self._name = config.name
        self._transport = transport
        self._ranks = ranks
        self._hosts = hosts
        self._requests = requests
        self._lifecycle = lifecycle
        self._death_text = death_text
        #: The ``common`` part of every ``spawn_ranks`` message (torchrun environment,
        #: the rendezvous of rank 0's host ...); set once the host agents are ready.
        self.common: MeshCommon | None = None
        #: Told how far the start is, every :data:`PROGRESS_EVERY` seconds and when
        #: the agents and the ranks are ready (set by whoever shows it, before start).
        self.progress: Callable[[StartProgress], object] | None = None
        #: How the last :meth:`start` went (its last report): where the time went.
        self.last_start: StartProgress | None = None

    def start(self, deadline: float) -> None:
        """Start every host agent, then every rank; return when all ranks are ready.
        Raises :class:`MeshStartError` (the caller stops what was started)."""
        config = self._config
        report = _Reporter(self)
        handles = config.launcher.start_hosts([self.host_config(h) for h in self._hosts])
        for host, handle in zip(self._hosts, handles):
            host.handle = handle
            self.adopt(host)
        try:
            self.wait(
                lambda: all(h.ready for h in self._hosts), deadline, "host agents", tick=report
            )
            report.agents_ready()
        except MeshStartError as exc:
            missing = [h.slot for h in self._hosts if not h.ready]
            describe = getattr(config.launcher, "describe_missing", None)
            if missing and describe is not None:
                raise MeshStartError(f"{exc}\n{describe(self._name, missing)}") from None
            raise
        master = self._hosts[0]
        self.common = {
            "labels": list(config.shape.labels),
            "sizes": list(config.shape.sizes),
            "world_size": config.world,
            "local_world_size": config.per_host,
            "master_addr": master.addr,
            "master_port": master.port,
            "run_id": config.run_id,
            "mesh": self._name,
            # the ranks take on this process's bound on values unless --env sets theirs
            "env": {**inherited_env(), **config.env},
            "sys_path": [p for p in sys.path if p],
            "cwd": os.getcwd(),
        }
        if self._transport.curve is not None:  # ranks of other machines may call its ranks
            self.common["listener_key"] = listener_key.mesh_key()
        if self._transport.arena is not None:  # large results through shared memory too
            self.common["shm_results"] = 1
        for host in self._hosts:
            self.spawn_ranks([r for r in self._ranks if r.host == host.index])
        self.wait(
            lambda: all(r.state is not RankState.STARTING for r in self._ranks),
            deadline,
            "ranks",
            tick=report,
        )
        report(force=True)
        dead = [r for r in self._ranks if not r.alive]
        if dead:
            raise MeshStartError(
                "ranks died while starting:\n" + "\n".join(self._death_text(r) for r in dead)
            )

    def adopt(self, host: HostInfo) -> None:
        """Let a handle on a remote agent (no pid to kill) tell it to exit."""
        if hasattr(host.handle, "tell_exit"):
            slot, transport = host.slot, self._transport

            def tell_exit() -> None:  # by its slot: it may have left the records (shrink)
                transport.send_host_slot(slot, {"k": K.STOP, "grace": 0.0})

            setattr(host.handle, "tell_exit", tell_exit)  # noqa: B010

    def host_config(self, host: HostInfo) -> HostConfig:
        """What ``host``'s agent needs to join (a fresh CURVE keypair every time); it
        knows itself by its slot (see ``records.Slots``)."""
        h = host.slot
        config, t = self._config, self._transport
        # Longer than our patience with an agent, though a busy controller (a large
        # unpickle, a cell in C code holding the GIL) keeps its hosts anyway: after
        # this silence an agent only checks that we still live. Read here, not bound
        # at import: a test shortens it.
        silence = max(AGENT_SILENCE_TIMEOUT, config.hb_timeout)
        send, recv = t.send_addr, t.recv_addr
        if config.advertise and send.startswith("tcp://"):
            send = f"tcp://{config.advertise}:{send.rsplit(':', 1)[1]}"
            recv = f"tcp://{config.advertise}:{recv.rsplit(':', 1)[1]}"
        # One client keypair per host agent (its ranks use it too); a relaunched host
        # gets a new one and the old one is no longer admitted.
        curve = t.ids.admit_host(h)
        holder = ControllerId.of_this_process()
        return HostConfig(
            h,
            config.key.hex(),
            send,
            recv,
            silence,
            self._name,
            *curve,
            ranks=config.per_host,
            detach_keep=config.detach_keep,
            controller_pid=holder.pid,
            controller_host=holder.hostname,
            controller_started=holder.started,
            attach_file=config.attach_path,
            on_failure=config.on_failure,
            label=host.index,
        )

    def relaunch_host(self, host: HostInfo) -> None:
        """Start a new host agent in place of lost ``host`` (its ranks are dead)."""
        old = host.handle
        if old is not None:
            old.wait_or_kill(0.1)  # a frozen agent: kill it (its ranks die with it)
            old.cleanup()
        host.ready, host.lost, host.last_seen = False, None, time.monotonic()
        (host.handle,) = self._config.launcher.start_hosts([self.host_config(host)])
        self.adopt(host)

    def spawn_ranks(self, ranks: list[RankInfo]) -> None:
        """Ask the host agent of ``ranks`` (all on one host) to fork them; each is
        STARTING until its ``ready`` message (or its death) arrives."""
        specs = []
        for r in ranks:
            r.death, r.pid = None, None
            self._requests.set_state(r, RankState.STARTING)
            spec: RankSpec = {  # a header field (see wire.kinds: spawn_ranks)
                "rank": r.rank,
                "local_rank": r.local_rank,
                "coords": list(r.coords),
                "host": r.host,
                "restart_count": r.restarts,
            }
            if r.slot != r.rank:  # its wire id (records.Slots); absent: its rank
                spec["slot"] = r.slot
            if self._transport.curve is not None:  # peers of other machines may call it
                if not r.peer_secret:
                    r.peer_secret = zmq.curve_keypair()[1].decode()
                spec["peer_secret"] = r.peer_secret
                if r.peer.tcp:
                    spec["peer_port"] = r.peer.tcp_port
            specs.append(spec)
        if specs:
            assert self.common is not None  # set once the host agents are ready
            self._transport.send_host(
                ranks[0].host, SpawnRanks(ranks=specs, common=self.common).encode()
            )

    def wait(
        self,
        cond: Callable[[], bool],
        deadline: float,
        what: str,
        hosts: Sequence[HostInfo] | None = None,
        hint: str = "check the host agents' logs or raise the start timeout",
        tick: Callable[[], object] | None = None,
    ) -> None:
        """Wait until ``cond()``; fail if the mesh stops, one of ``hosts`` (default:
        all) exits or is lost, or ``deadline`` passes (``tick()`` between looks)."""
        lifecycle = self._lifecycle
        with lifecycle.cv:
            while not cond():
                if tick is not None:
                    tick()
                if lifecycle.phase.ended:
                    raise MeshStoppedError(f"mesh {self._name!r} was stopped during: {what}")
                self._check_hosts_started(what, self._hosts if hosts is None else hosts)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MeshStartError(f"mesh {self._name!r}: {what} not ready in time; {hint}")
                lifecycle.cv.wait(min(left, 0.2))

    @staticmethod
    def _check_hosts_started(what: str, hosts: Sequence[HostInfo]) -> None:
        for host in hosts:
            handle = host.handle
            if handle is not None and handle.exit_code() is not None:
                raise MeshStartError(
                    f"host agent {host.index} exited (code {handle.exit_code()}) while "
                    f"starting {what}:\n{handle.log_tail()}"
                )
            if host.lost:
                raise MeshStartError(f"host agent {host.index} lost: {host.lost}")


class _Reporter:
    """The progress of one :meth:`Starter.start` (called while it waits)."""

    def __init__(self, starter: Starter):
        self._starter = starter
        self._t0 = time.monotonic()
        self._last = self._t0
        self._agents: float | None = None

    def agents_ready(self) -> None:
        self._agents = time.monotonic() - self._t0
        self(force=True)

    def __call__(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < PROGRESS_EVERY:
            return
        self._last = now
        st = self._starter
        hosts, ranks = st._hosts, st._ranks
        progress = StartProgress(
            seconds=now - self._t0,
            hosts_ready=sum(h.ready for h in hosts),
            hosts=len(hosts),
            ranks_ready=sum(r.state is not RankState.STARTING for r in ranks)
            if self._agents is not None
            else 0,
            ranks=len(ranks),
            agents_seconds=self._agents,
        )
        st.last_start = progress
        if st.progress is not None:
            st.progress(progress)
