"""What the controller knows about a mesh's ranks and hosts: plain records and states.

These records are read by every layer above (the actor API, the kernel, the dashboard)
and written only by the controller's own modules, on the thread that holds the receive
token (see :mod:`monarch_kernel.controller.receiver`) or under the mesh's condition.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from monarch_kernel.launchers.base import HostHandle
from monarch_kernel.wire.osutil import describe_exit
from monarch_kernel.wire.reports import RankStats

#: Whole output lines kept per rank (for death reports and the dashboard).
TAIL_LINES = 50


class _TextEnum(str, Enum):
    """A ``str`` enum that prints as its value (``idle``, not ``RankState.IDLE``)."""

    def __str__(self) -> str:
        return str(self.value)


class RankState(_TextEnum):
    """Life cycle of one rank, as the controller sees it.

    ``STARTING -> IDLE <-> BUSY``; any live state ``-> DEAD`` (it died unasked) or
    ``-> STOPPED`` (stopped on purpose); ``DEAD/STOPPED -> STARTING`` on restart.
    ``BUSY`` means: requests (calls, cells) were sent to it and not all answered yet.
    A ``str`` enum, so ``state == "idle"`` reads naturally in user code and tests.
    """

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"
    STOPPED = "stopped"


#: States of a rank that no longer runs.
GONE = frozenset({RankState.DEAD, RankState.STOPPED})


class MeshPhase(_TextEnum):
    """Life cycle of a whole mesh: ``STARTING -> RUNNING -> STOPPING -> STOPPED``."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in (MeshPhase.STOPPING, MeshPhase.STOPPED)


@dataclass(frozen=True)
class DeathInfo:
    """How a rank ended: pushed by its host agent, or decided by supervision."""

    rank: int
    host: str  #: hostname (or ``host N`` before the host said its name)
    pid: int | None
    code: int | None = None  #: exit code, if it exited
    signal: int | None = None  #: the signal that killed it, if one did
    reason: str | None = None  #: why, when it was not an exit (e.g. its host was lost)
    tail: tuple[str, ...] = ()  #: its last output lines
    time: float = 0.0  #: ``time.time()`` when the controller learnt of it

    @property
    def how(self) -> str:
        """``exit code 7``, ``killed by SIGKILL``, or the reason supervision gave."""
        if self.reason:
            return self.reason
        if self.code is None and not self.signal:
            return "exited"
        return describe_exit(self.code, self.signal)


@dataclass
class RankInfo:
    """What the controller knows about one rank."""

    rank: int
    host: int
    local_rank: int
    coords: tuple[int, ...]
    state: RankState = RankState.STARTING
    pid: int | None = None
    hostname: str = ""
    device: str = ""
    restarts: int = 0
    death: DeathInfo | None = None
    #: Its last whole output lines (stdout and stderr), and the unfinished line per stream.
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    partial: dict[str, str] = field(default_factory=dict)
    #: Requests (not control messages) sent to it and not answered yet.
    outstanding: int = 0
    #: ``time.monotonic()`` of its last ready or stats message.
    last_seen: float = 0.0
    #: Latest once-a-second report from the rank.
    stats: RankStats = field(default_factory=lambda: RankStats())
    #: Control-plane bytes the controller sent to / received from this rank.
    bytes_out: int = 0
    bytes_in: int = 0

    @property
    def alive(self) -> bool:
        return self.state not in GONE


@dataclass
class HostInfo:
    """What the controller knows about one host agent."""

    index: int
    handle: HostHandle | None = None
    pid: int | None = None
    hostname: str = ""
    addr: str = "127.0.0.1"  #: where its ranks' process group can rendezvous
    port: int = 0
    ready: bool = False
    lost: str | None = None  #: why it was declared lost (None while it is fine)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ActorSpec:
    """How an actor mesh was spawned, to spawn it again on restarted ranks."""

    name: str
    payload: bytes
    buffers: tuple[memoryview | bytes, ...]
    ranks: frozenset[int]
