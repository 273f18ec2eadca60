"""The launcher seam: how a backend starts host agents, and the handle it gives back.

Every backend (local today; ray, slurm, lightning and join later) only has to run the
host agent command (``python -m monarch_kernel.host``) on each machine and hand it a
:class:`HostConfig`; everything after that (ranks, calls, supervision) is one code path.
The controller talks to launchers only through these protocols.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import zmq

from monarch_kernel.wire.netaddr import is_loopback, route_source

log = logging.getLogger("monarch_kernel.launchers")


@dataclass(frozen=True)
class HostConfig:
    """What one host agent needs to join its mesh."""

    #: this host agent's id in the mesh (its slot: its index when it was made, kept for
    #: its life; see ``controller.state.records.Slots``)
    host: int
    key: str  #: the mesh's signing key, hex (never put on a command line)
    send: str  #: the controller's endpoint that sends to hosts and ranks
    recv: str  #: the controller's endpoint that receives from them
    hb_timeout: float  #: seconds without a controller heartbeat before the agent exits
    mesh: str  #: the mesh's name (for logs)
    #: CurveZMQ keys (z85) when the controller listens on tcp: its public key, and the
    #: keypair this host agent and its ranks connect with (admitted by the controller's
    #: ZAP handler). Empty on unix sockets. Never on a command line.
    curve_server: str = ""
    curve_public: str = ""
    curve_secret: str = ""
    #: Ranks this host will run (engines reserve as many GPUs on the machine).
    ranks: int = 1
    #: A ``--detachable`` mesh: seconds the agent and its ranks run on without a
    #: controller (0: the agent exits with its controller, the default).
    detach_keep: float = 0.0
    #: The controller starting it (pid, hostname, process start time): a detachable
    #: mesh's agent knows its holder is gone as soon as that process is.
    controller_pid: int = 0
    controller_host: str = ""
    controller_started: float = 0.0
    #: The mesh's attach file (a detachable mesh), removed when the agent stops unattached.
    attach_file: str = ""
    #: The mesh's failure policy, which a detachable mesh's agent applies while no
    #: controller holds the mesh (``restart``: it restarts a rank that dies).
    on_failure: str = ""
    #: The host's index in the mesh now, as users see it (``host 2: ...``); -1: ``host``.
    #: They differ once a shrink dropped a host other than the last one.
    label: int = -1

    @property
    def shown(self) -> int:
        """The host's number to show users (``label``, else ``host``)."""
        return self.label if self.label >= 0 else self.host

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@runtime_checkable
class HostHandle(Protocol):
    """A started host agent, as its launcher sees it."""

    @property
    def pid(self) -> int | None:
        """The agent's pid where the launcher knows it (None for remote agents)."""
        ...

    def exit_code(self) -> int | None:
        """The agent's exit code once it ended, else None."""
        ...

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines the agent wrote (for start-up errors)."""
        ...

    def wait_or_kill(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the agent to exit, then make it."""
        ...

    def cleanup(self) -> None:
        """Release what the launcher holds for this agent (pipes, logs, jobs)."""
        ...


@runtime_checkable
class RemoteHostHandle(HostHandle, Protocol):
    """A host agent on another machine that joins by itself (join and the engines): the
    dashboard shows how each is doing until it has joined."""

    @property
    def joined(self) -> bool:
        """Whether the agent presented its credential and got its configuration."""
        ...

    def status(self) -> str:
        """A few words: what to run, what the engine is doing, where it joined from.
        Never blocks."""
        ...

    def notice(self) -> str | None:
        """A warning to show while the mesh lives (e.g. a Studio's idle sleep), or None."""
        ...


@runtime_checkable
class ReservingHandle(Protocol):
    """A host handle of a detachable mesh whose engine reservation outlives the kernel
    (ray, slurm): its record for the attach file (``launchers.reservation``)."""

    @property
    def reservation(self) -> dict[str, Any] | None:
        """The reservation's JSON record, or None when nothing outlives the kernel."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts host agents for meshes."""

    #: The backend's name (``local`` ...).
    name: str

    @property
    def same_machine(self) -> bool:
        """True when every host agent runs on the controller's machine (unix sockets
        can then carry the control plane)."""
        ...

    def check_capacity(self, ranks: int, running: int = 0) -> None:
        """Raise ValueError, naming the limit and how to change it, if this backend
        cannot hold ``ranks`` more ranks besides the ``running`` ones this controller
        already has on it. Called before a mesh starts anything."""
        ...

    def start_hosts(self, configs: list[HostConfig]) -> list[HostHandle]:
        """Start one host agent per config; return at once (they connect back)."""
        ...

    def shutdown(self) -> None:
        """Release what the launcher holds beyond single meshes (pre-warmed agents)."""
        ...


# -- network security shared by the controller's sockets and the join endpoint -----------


@dataclass
class Curve:
    """A mesh's CurveZMQ server keypair and the client public keys its ZAP handler admits
    (z85, as ``zmq.curve_keypair`` gives them). Only keys the controller handed out (one
    per host agent, shared by that host's ranks) are in ``allowed``."""

    public: bytes
    secret: bytes
    allowed: set[bytes] = field(default_factory=set)
    #: Connections refused by the ZAP handler (unknown client keys).
    refused: int = 0

    @classmethod
    def new(cls) -> Curve:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: admit ``key`` only if the controller handed it out."""
        if key in self.allowed:
            return True
        self.refused += 1
        log.warning("ZAP %s refused a connection with an unknown CURVE key", domain)
        return False


_auth_lock = threading.Lock()
_authenticator: Any = None


def zap(domain: str, provider: Any) -> None:
    """Register ``provider`` (``callback(domain, key) -> bool``) for ZAP ``domain`` with
    the one authenticator of the shared context, started on first use; ``None`` removes
    the domain."""
    global _authenticator
    with _auth_lock:
        if _authenticator is None:
            from zmq.auth.thread import ThreadAuthenticator

            _authenticator = ThreadAuthenticator(zmq.Context.instance(), log=log)
            _authenticator.start()
        if provider is None:
            _authenticator.credentials_providers.pop(domain, None)
        else:
            _authenticator.configure_curve_callback(domain, credentials_provider=provider)


def curve_server(sock: zmq.Socket[bytes], curve: Curve | Any, domain: str) -> None:
    """Make ``sock`` a CURVE server whose clients are admitted by ``curve.callback``."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    zap(domain, curve)


def address_towards(host: str) -> str | None:
    """The local address this machine uses to reach ``host`` (an engine's head node: the
    machines it runs on most likely reach us at that address too), or None when there is
    no route or it is a loopback address."""
    try:
        addr = route_source(host)
    except OSError:
        return None
    return None if is_loopback(addr) else addr
