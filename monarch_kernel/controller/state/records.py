"""What the controller knows about a mesh's ranks and hosts: plain records and states.

These records are read by every layer above (the actor API, the kernel, the dashboard)
and written only by the controller's own modules, on the thread that holds the receive
token (see :mod:`monarch_kernel.controller.messaging.receiver`) or under the mesh's condition.

**Ranks and slots.** A rank's ``rank`` is its logical (flat) rank: its index in the
mesh's ``ranks`` list, what ``RANK`` says and what requests, events and handles use. Its
``slot`` is its process's *wire id*: the number in its routing ids (``r<slot>``,
``c<slot>``), in the ``r`` of every header it sends, in the ``d`` lists its host agent
fans out by, in its host agent's tables and its peer socket's path. A slot is given when
a rank is first made (equal to its rank then) and never changes while the rank exists
(a restart keeps it); a slot is never given twice in a mesh. When ranks other than the
last ones are dropped (``%mesh shrink NAME --drop-ranks``), the survivors are renumbered
and keep their slots: nothing on the wire changes for them, and the controller's
:class:`Slots` maps what arrives to the rank it is now. Hosts likewise: ``HostInfo.index``
is the logical host (``GROUP_RANK``), ``HostInfo.slot`` the agent's wire id (``h<slot>``,
the ``h`` of its headers). See :mod:`monarch_kernel.controller.elastic.renumber`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from monarch_kernel.calls.errors import DeathInfo, format_ranks
from monarch_kernel.calls.replica_plan import IDENTICAL
from monarch_kernel.calls.requester import ActorSpec
from monarch_kernel.launchers.base import HostHandle
from monarch_kernel.wire.headers import Owner, RankExit
from monarch_kernel.wire.peer_address import PeerAddress
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
    """Life cycle of a whole mesh: ``STARTING -> RUNNING -> STOPPING -> STOPPED``, with
    ``RUNNING <-> RECOVERING`` while ranks are restarted and the mesh is re-formed
    (process group, actors, setup cells); new requests wait for ``RUNNING``."""

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in _ENDED  # a module tuple: two enum attribute look-ups per call cost


#: The phases of a mesh that has ended (:attr:`MeshPhase.ended`; read on every request).
_ENDED = (MeshPhase.STOPPING, MeshPhase.STOPPED)


class FailurePolicy(_TextEnum):
    """What a mesh does when a rank dies, or fails a request the other ranks still run.

    In every case the failed request fails with one error after a grace period instead
    of waiting for ranks that may hang in a collective. Then:

    * ``RESTART`` (the default): the survivors still running it are released (their
      process group is aborted, then they are interrupted, then killed); dead ranks are
      restarted and the mesh re-formed as it was (process group, actors, setup cells).
      A notebook keeps its state on every rank that did not die.
    * ``STOP``: survivors are released as above, then the whole mesh stops (torchrun's
      behaviour without restarts).
    * ``CONTINUE``: nothing is done to the other ranks: they run on (inspect them with
      ``%mesh stacks``), dead ranks stay dead until restarted by hand.
    * ``SHRINK`` (``shrink:N``: not below N ranks): the mesh goes on without the dead
      rank (on a mesh of several hosts: without its whole host), wherever it is, at a
      step boundary of a ``TrainingState`` loop or between cells
      (``controller.elastic.resize``); the survivors are renumbered in their old order when it
      was not the last one. Below N ranks it is restarted as under ``RESTART``.
    """

    RESTART = "restart"
    STOP = "stop"
    CONTINUE = "continue"
    SHRINK = "shrink"


def parse_policy(text: str) -> tuple[FailurePolicy, int]:
    """``restart`` -> (RESTART, 1); ``shrink:2`` -> (SHRINK, 2): the policy and the
    smallest world size a shrink may leave. ValueError (saying the choices) if bad."""
    name, _, minimum = str(text).partition(":")
    choices = ", ".join(p.value for p in FailurePolicy)
    try:
        policy = FailurePolicy(name)
    except ValueError:
        raise ValueError(
            f"on_failure must be one of {choices} (shrink:N keeps at least N ranks); got {text!r}"
        ) from None
    if not minimum:
        return policy, 1
    if policy is not FailurePolicy.SHRINK or not minimum.isdigit() or int(minimum) < 1:
        raise ValueError(
            f"on_failure={text!r}: only shrink takes a minimum size, a whole number >= 1 (shrink:2)"
        )
    return policy, int(minimum)


@dataclass(frozen=True)
class RankEnd:
    """Why a rank ended, as supervision is told: its host agent's exit report, or a
    reason the controller decided (a lost host, a stop, a rank that did not start)."""

    reason: str | None = None
    expected: bool = False  #: the end was asked for (a stop): the rank is STOPPED
    pid: int | None = None
    code: int | None = None  #: exit status (None: killed by a signal)
    signal: int | None = None
    tail: tuple[str, ...] | None = None  #: its last output lines, from its host agent's log

    @classmethod
    def of_exit(cls, report: RankExit) -> RankEnd:
        """The end a ``rank_exit`` message reports."""
        return cls(
            expected=report.expected,
            pid=report.pid,
            code=report.code,
            signal=report.signal,
            tail=tuple(report.tail),
        )


@dataclass
class RankInfo:
    """What the controller knows about one rank (``rank``: its logical rank, ``host``
    the logical index of its host; see the module on slots)."""

    rank: int
    host: int
    local_rank: int
    coords: tuple[int, ...]
    state: RankState = RankState.STARTING
    pid: int | None = None
    hostname: str = ""
    device: str = ""
    #: Where other ranks call its actors directly (its inbox's unix socket and, in a
    #: mesh that spans machines, CURVE TCP socket; from its ready message); empty
    #: (false) until it is ready.
    peer: PeerAddress = PeerAddress("")
    #: The CURVE secret key (z85) of its TCP peer socket in a mesh that may span
    #: machines, made once: a restarted rank keeps its key (and asks for its port).
    peer_secret: str = ""
    #: Actors on it that an actor of another rank spawned: name -> the owner (its
    #: inbox ``oa``, mesh key ``ox``, actor name ``on``), told if this rank dies.
    owners: dict[str, Owner] = field(default_factory=dict)
    restarts: int = 0
    death: DeathInfo | None = None
    #: Its last whole output lines (stdout and stderr), and the unfinished line per stream.
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    partial: dict[str, str] = field(default_factory=dict)
    #: Requests (not control messages) sent to it and not answered yet.
    outstanding: int = 0
    #: ``time.monotonic()`` of its last ready or stats message.
    last_seen: float = 0.0
    #: Why the controller is killing it (a failure policy), for its death report.
    kill_reason: str | None = None
    #: Latest once-a-second report from the rank.
    stats: RankStats = field(default_factory=lambda: RankStats())
    #: Control-plane bytes the controller sent to / received from this rank.
    bytes_out: int = 0
    bytes_in: int = 0
    #: Its process's wire id (see the module); -1: the same as ``rank``.
    slot: int = -1

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.rank

    @property
    def alive(self) -> bool:
        return self.state not in GONE


def by_host(ranks: Sequence[RankInfo], which: Iterable[int]) -> dict[int, list[int]]:
    """The ranks ``which`` grouped by the index of their host (in the order given)."""
    groups: dict[int, list[int]] = {}
    for r in which:
        groups.setdefault(ranks[r].host, []).append(r)
    return groups


def slots_by_host(ranks: Sequence[RankInfo], which: Iterable[int]) -> dict[int, list[int]]:
    """The *slots* of the ranks ``which``, grouped by the index of their host: what a
    message to host agents names them by (``d`` of ``kill_ranks`` ...)."""
    groups: dict[int, list[int]] = {}
    for r in which:
        info = ranks[r]
        groups.setdefault(info.host, []).append(info.slot)
    return groups


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
    ready_at: float | None = None  #: when it said ready (time.monotonic)
    lost: str | None = None  #: why it was declared lost (None while it is fine)
    last_seen: float = field(default_factory=time.monotonic)
    desk: str = ""  #: a detachable mesh's agent: its attach desk (``wire.desk``)
    dir: str = ""  #: ... and its private directory (its ranks' logs)
    #: The agent's wire id (``h<slot>``, the ``h`` of its headers); -1: ``index``.
    slot: int = -1

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.index


class Slots:
    """The controller's map from wire ids (slots) to the logical ranks and hosts they
    are now (see the module), and the next free slots. Rebuilt (each map replaced
    whole, so a reader on another thread sees the old one or the new one) whenever
    ranks or hosts are added, removed or renumbered."""

    def __init__(self, ranks: list[RankInfo], hosts: list[HostInfo]):
        self._ranks = ranks
        self._hosts = hosts
        #: rank slot -> logical rank; host slot -> logical host index
        self.rank: dict[int, int] = {}
        self.host: dict[int, int] = {}
        #: rank slot -> the slot of its host
        self.rank_host: dict[int, int] = {}
        self._next_rank = 0
        self._next_host = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Read the records again (after they changed)."""
        hosts = self._hosts
        self.rank = {i.slot: i.rank for i in self._ranks}
        self.host = {h.slot: h.index for h in hosts}
        self.rank_host = {
            i.slot: hosts[i.host].slot if i.host < len(hosts) else -1 for i in self._ranks
        }
        self._next_rank = max(self._next_rank, max(self.rank, default=-1) + 1)
        self._next_host = max(self._next_host, max(self.host, default=-1) + 1)

    def new_rank(self) -> int:
        """A slot for a new rank (never one given before in this mesh)."""
        slot = self._next_rank
        self._next_rank += 1
        return slot

    def new_host(self) -> int:
        """A slot for a new host agent."""
        slot = self._next_host
        self._next_host += 1
        return slot

    def gone(self, rank: object, host: object) -> bool:
        """Whether a header's sender slots (``r``, ``h``) name a rank or host this mesh
        had and removed (a shrink): its late messages are dropped, not suspected."""
        return (
            isinstance(rank, int) and 0 <= rank < self._next_rank and rank not in self.rank
        ) or (isinstance(host, int) and 0 <= host < self._next_host and host not in self.host)


@dataclass(frozen=True)
class SetupCell:
    """A ``%%remote NAME --setup`` cell: re-run on ranks when they restart."""

    code: str
    label: str  #: the cell's label in tracebacks (its prompt number)
    header: tuple[str, ...] = ()  #: the magic line(s) above the code
    key: str | None = None  #: the notebook cell it came from (its id), if known


@dataclass
class MeshRecipe:
    """What a restart in place re-creates on restarted ranks, as it was learnt: actors
    spawned on the mesh, ``--setup`` cells, and the backend of the ranks' process group.

    Written by callers spawning or stopping actors, by the receiving thread (actors that
    ranks spawned on each other, the process group seen in stats) and by the restart;
    each write replaces one entry or the whole list (no read-modify-write across threads
    is relied on).
    """

    #: Actors spawned on this mesh, re-created on restarted ranks.
    actors: dict[str, ActorSpec] = field(default_factory=dict)
    #: Cells re-run on restarted ranks (after the process group is re-formed).
    setup_cells: list[SetupCell] = field(default_factory=list)
    #: Backend of the ranks' torch.distributed process group, once one was seen.
    pg_backend: str | None = None

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

    def renumber(self, mapping: dict[int, int]) -> None:
        """Ranks were renumbered (old -> new for every rank kept): actors follow them;
        ranks not in ``mapping`` (removed) are forgotten."""
        for name, spec in list(self.actors.items()):
            ranks = frozenset(mapping[r] for r in spec.ranks if r in mapping)
            if ranks:
                self.actors[name] = dataclasses.replace(spec, ranks=ranks)
            else:
                del self.actors[name]

    def remember_setup(self, cell: SetupCell) -> None:
        """Re-run ``cell`` on ranks when they restart (after the process group)."""
        self.setup_cells.append(cell)

    def forget_setup(self) -> list[SetupCell]:
        """Re-run no setup cell on restarts any more; returns those forgotten."""
        cells, self.setup_cells = self.setup_cells, []
        return cells


@dataclass(frozen=True)
class RecoveryReport:
    """What one restart in place did (``MeshRuntime.recover``)."""

    restarted: tuple[int, ...]
    #: The re-formed process group's backend (None: there was no process group).
    process_group: str | None
    actors: tuple[str, ...]  #: actors re-created on the restarted ranks
    setup_cells: tuple[str, ...]  #: labels of the setup cells re-run on them
    seconds: float
    #: What went wrong while re-forming (a setup cell raised ...); empty if nothing.
    problems: tuple[str, ...] = ()
    reason: str = ""
    #: What the replica check found and did (``DDP replicas identical (ddp, opt
    #: compared)``; empty: no check).
    replicas: str = ""
    #: A recovery from peers: what died, the state copied, the step resumed (then the
    #: restarted ranks lost nothing declared in their TrainingState).
    peer_state: str = ""

    @property
    def changed(self) -> bool:
        """Whether it did anything worth telling (not just found all well)."""
        # (all well: ``DDP replicas identical (ddp, opt compared)`` and nothing more)
        copied = bool(self.replicas) and not (
            self.replicas.startswith(IDENTICAL) and ";" not in self.replicas
        )
        return bool(self.restarted or self.process_group or self.problems or copied)

    def describe(self, mesh: str, in_place: bool = False) -> str:
        """Which ranks restarted, what was re-run, and what state was lost; ``in_place``
        (no rank was to restart): only what was done, or nothing when all was well."""
        if not self.restarted and self.process_group is None and not self.problems:
            if self.replicas:
                return f"mesh {mesh!r}: {self.replicas}"
            return "" if in_place else f"mesh {mesh!r}: nothing to restart (no dead ranks)"
        parts = []
        if self.restarted:
            parts.append(f"restarted rank(s) {format_ranks(list(self.restarted))}")
        if self.process_group is not None:
            where = "in place" if in_place else "on all ranks"
            parts.append(f"re-formed the process group ({self.process_group}) {where}")
        if self.actors:
            parts.append(f"re-created actor(s) {', '.join(self.actors)}")
        if self.setup_cells:
            parts.append(f"re-ran setup cell(s) {', '.join(self.setup_cells)}")
        parts = parts or ["checked the process group and the replicas"]
        text = f"mesh {mesh!r}: " + "; ".join(parts) + f" in {self.seconds:.2f}s"
        if self.reason:
            text += f" ({self.reason})"
        if self.replicas:
            text += f"; {self.replicas}"
        if self.peer_state:
            text += f"\n{self.peer_state}"
        elif self.restarted:
            text += (
                "\nlost on the restarted rank(s): variables and imports not made by setup "
                "cells, and GPU memory contents"
            )
        for problem in self.problems:
            text += f"\nproblem: {problem}"
        return text
