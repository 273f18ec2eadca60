"""The attach desk: how a controller that did not start a detachable mesh talks to its
host agents (attach to it, ask how it is, stop it).

A host agent of a ``--detachable`` mesh binds one more socket, its *desk* (a ROUTER on a
unix socket in its private 0700 directory), next to its connections to the controller.
A client sends one :class:`DeskRequest` and gets one :class:`DeskReply`, each one
message signed with the mesh's key (the same :class:`~monarch_kernel.wire.codec.Codec`
framing as every control message: one envelope frame, header, signature, payload): the header
is ``{"k": "desk"}`` (``"desk_reply"`` for the answer) and the payload the JSON of the
dataclass. The desk refuses a request that is forged (its signature fails), replayed
(the codec's per-sender counters, and ``sent_at`` older than :data:`MAX_REQUEST_AGE`)
or from a second controller while one holds the mesh (unless ``force``), and counts
each refusal; a forged request is answered with the one unsigned frame
:data:`FORGED_REPLY`, since nothing signed can be trusted by its sender anyway.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

#: Header kind of a request to a desk, and of its answer.
DESK = "desk"
DESK_REPLY = "desk_reply"
#: The unsigned answer to a request whose signature failed.
FORGED_REPLY = b"refused: the request is not signed with this mesh's key"
#: A request older than this (seconds, by its ``sent_at``) is refused as replayed.
MAX_REQUEST_AGE = 60.0


class DeskOp(str, Enum):
    """What a desk request asks."""

    STATUS = "status"  #: how the mesh is (answered to any holder of the key)
    ATTACH = "attach"  #: take the mesh over (refused while held, unless ``force``)
    RELEASE = "release"  #: undo an attach that the other hosts refused
    STOP = "stop"  #: stop the ranks and the agent (refused while held, unless ``force``)


@dataclass(frozen=True)
class ControllerId:
    """Which process holds (or asks for) a mesh: its pid on its machine, and that
    process's start time (so a recycled pid is not taken for it)."""

    pid: int
    hostname: str
    started: float = 0.0  #: the process's start time (``psutil.Process.create_time``)

    @classmethod
    def of_this_process(cls) -> ControllerId:
        """This process."""
        return cls(os.getpid(), socket.gethostname(), process_started(os.getpid()) or 0.0)

    def alive(self) -> bool | None:
        """Whether the process still runs: None when it runs on another machine
        (unknowable from here)."""
        if self.hostname != socket.gethostname():
            return None
        started = process_started(self.pid)
        if started is None:
            return False
        return not self.started or abs(started - self.started) < 1.0

    def describe(self) -> str:
        return f"the kernel (pid {self.pid}) on {self.hostname}"

    @classmethod
    def from_json(cls, raw: Any) -> ControllerId:
        return cls(int(raw["pid"]), str(raw["hostname"]), float(raw.get("started", 0.0)))


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None if there is none."""
    if pid <= 0:
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # not ours to look at: it runs, its start unknown
        return 0.0


@dataclass(frozen=True)
class DeskRequest:
    """One request to a host agent's desk."""

    op: DeskOp
    controller: ControllerId
    force: bool = False  #: take the mesh from (stop it under) a live holder
    grace: float = 3.0  #: ``stop``: seconds ranks get to exit cleanly
    sent_at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["op"] = self.op.value
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DeskRequest:
        """Parse a request (ValueError naming what is wrong)."""
        try:
            raw = json.loads(data)
            return cls(
                DeskOp(raw["op"]),
                ControllerId.from_json(raw["controller"]),
                bool(raw.get("force", False)),
                float(raw.get("grace", 3.0)),
                float(raw["sent_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed desk request: {exc!r}") from None


@dataclass(frozen=True)
class RankStatus:
    """One rank of a host, as its agent knows it."""

    rank: int
    pid: int
    alive: bool
    code: int | None = None  #: exit status once it ended (None: killed by a signal)
    signal: int | None = None
    #: Seconds (since the epoch) it ended, when it ended while no controller held the mesh.
    ended_at: float | None = None
    #: Times its host agent restarted it while no controller held the mesh (the mesh's
    #: failure policy: ``restart``); ``code``/``signal``/``ended_at`` tell its last end.
    restarts: int = 0


@dataclass(frozen=True)
class DeskReply:
    """A desk's answer."""

    ok: bool
    error: str = ""  #: why the request was refused (ok is False)
    holder: ControllerId | None = None  #: who holds the mesh now (None: detached)
    detached_since: float | None = None  #: time.time() the mesh lost its controller
    keep_until: float | None = None  #: time.time() the agent stops if nobody attaches
    epoch: int = 0  #: controllers that held the mesh before (sequence numbers' epoch)
    ranks: tuple[RankStatus, ...] = ()
    #: Refused requests since the agent started: forged, replayed, while held.
    refused: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DeskReply:
        """Parse an answer (ValueError naming what is wrong)."""
        try:
            raw = json.loads(data)
            holder = raw.get("holder")
            return cls(
                bool(raw["ok"]),
                str(raw.get("error", "")),
                ControllerId.from_json(holder) if holder else None,
                raw.get("detached_since"),
                raw.get("keep_until"),
                int(raw.get("epoch", 0)),
                tuple(RankStatus(**r) for r in raw.get("ranks", ())),
                {str(k): int(v) for k, v in dict(raw.get("refused", {})).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed desk reply: {exc!r}") from None


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` -> seconds (ValueError with an example)."""
    raw = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}.get(raw[-1:])
    number = raw[:-1] if scale is not None else raw
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} is not a duration; write e.g. 90s, 30m, 2h or 1d")
    return value


def describe_duration(seconds: float) -> str:
    """``2h``, ``1h30m``, ``45s``: a short form for tables."""
    seconds = max(0, int(seconds))
    if seconds < 90:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 90:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
