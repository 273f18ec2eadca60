"""The launcher seam: how a backend starts host agents, and the handle it gives back.

Every backend (local today; ray, slurm, lightning and join later) only has to run the
host agent command (``python -m monarch_kernel.host``) on each machine and hand it a
:class:`HostConfig`; everything after that (ranks, calls, supervision) is one code path.
The controller talks to launchers only through these protocols.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class HostConfig:
    """What one host agent needs to join its mesh."""

    host: int  #: index of this host in the mesh
    key: str  #: the mesh's HMAC key, hex (never put on a command line)
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
