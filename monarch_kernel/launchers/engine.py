"""What the cluster engines (Ray, Slurm, Lightning) share: they only start the join command.

An :class:`EngineLauncher` owns a :class:`~.join.JoinLauncher` (the join endpoint, its
tokens and addresses) and asks its engine to run ``python -m monarch_kernel.host --join
URL`` on each machine, with the token in ``$MONARCH_KERNEL_JOIN_TOKEN`` (never on a
command line). Everything after a host joins is the one code path of every backend.

A subclass implements :meth:`EngineLauncher.allocate`: reserve the machines and start the
command on each; it returns an :class:`Allocation` that can say how each machine is doing
(for the dashboard, until it joins) and release everything it holds. An allocation is
released when the last of its hosts is cleaned up (``%mesh stop``, a host relaunched), and
every live one on :meth:`EngineLauncher.shutdown` (kernel shutdown) and at interpreter
exit, except a detachable mesh's (``--detachable``): it outlives the kernel, releases
itself once the mesh's agents end, and says what it holds (:meth:`Allocation.reservation`,
recorded in the mesh's attach file) so that another kernel can release it on stop.
A host cleaned up while others of its allocation live on (a shrink) frees what its
machine alone holds, where the engine reserves machine by machine
(:meth:`Allocation.release_machine`: Ray's per-host placement groups; Slurm's
per-host steps, and the node of a job we allocated).

Invariant: a host handle holds its allocation until :meth:`EngineHost.cleanup`; nothing
the engine started outlives the release of the allocation.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.launchers.base import HostConfig, HostHandle
from monarch_kernel.launchers.join import TOKEN_ENV, JoinHost, JoinLauncher
from monarch_kernel.launchers.reservation import Reservation

log = logging.getLogger("monarch_kernel.launchers")


@dataclass(frozen=True)
class JoinCommand:
    """What an engine runs on every machine of one allocation."""

    argv: list[str]  #: the command, without the token
    #: Environment to add: the token(s) in ``$MONARCH_KERNEL_JOIN_TOKEN``. ``tokens`` has
    #: one per host when the engine starts hosts one by one, else one group token.
    tokens: list[str]
    mesh: str
    hosts: list[int]  #: host indices of the mesh this allocation serves
    #: A detachable mesh's ``--keep`` (seconds; 0: not detachable): the reservation
    #: must then outlive the kernel and release itself once the agents end.
    keep: float = 0.0

    def env(self, i: int = 0) -> dict[str, str]:
        """The environment for machine ``i`` of the allocation."""
        return {TOKEN_ENV: self.tokens[min(i, len(self.tokens) - 1)]}

    @property
    def line(self) -> str:
        return " ".join(self.argv)


class Allocation(ABC):
    """Machines an engine reserved for some hosts of a mesh, running the join command."""

    @abstractmethod
    def status(self, i: int) -> str:
        """How machine ``i`` of the allocation is doing, in a few words (must not block:
        engines update it from their own threads)."""

    def notice(self) -> str | None:
        """A warning the dashboard shows while the mesh lives (e.g. that an idle Studio
        going to sleep ends it), else None."""
        return None

    def failure(self) -> str | None:
        """Why the allocation can no longer produce its hosts (the engine refused, the
        job ended), else None. Must not block."""
        return None

    def reservation(self, i: int = 0) -> Reservation | None:
        """What machine ``i`` of a detachable mesh's allocation holds, by name, for its
        attach file (None: nothing outlives the kernel). Engines that reserve all the
        machines as one return the same record for every ``i``."""
        return None

    def release_machine(self, i: int) -> None:
        """Free what machine ``i`` alone holds: its host was cleaned up while others of
        the allocation live on (a shrink). Default: nothing (the machines share one
        reservation, freed with the last of them by :meth:`release`)."""
        return

    @abstractmethod
    def release(self) -> None:
        """Stop every process and free every reservation (idempotent)."""


class EngineHost:
    """A host started by an engine (a :class:`~.base.HostHandle`): the join slot's view
    plus the engine's."""

    def __init__(self, join: JoinHost, alloc: Allocation, index: int, owner: EngineLauncher):
        self._join = join
        self._alloc = alloc
        self._index = index
        self._owner = owner
        self.command = join.command
        self.tell_exit: Callable[[], object] | None = None

    @property
    def pid(self) -> int | None:
        return None

    @property
    def joined(self) -> bool:
        return self._join.joined

    def status(self) -> str:
        if self._join.joined:
            return self._join.status()
        return self._alloc.status(self._index)

    def notice(self) -> str | None:
        return self._alloc.notice()

    @property
    def reservation(self) -> dict[str, Any] | None:
        """The allocation's reservation record (a detachable mesh's), else None."""
        kept = self._alloc.reservation(self._index)
        return kept.to_json() if kept is not None else None

    def exit_code(self) -> int | None:
        """1 once the engine says this host cannot come (it then fails the start)."""
        return 1 if not self._join.joined and self._alloc.failure() else None

    def log_tail(self, n: int = 20) -> str:
        why = self._alloc.failure()
        if why and not self._join.joined:
            return why
        return f"({self._owner.name}: {self.status()})"

    def wait_or_kill(self, timeout: float) -> None:
        self._join.tell_exit = self.tell_exit
        self._join.wait_or_kill(timeout)

    def cleanup(self) -> None:
        self._join.cleanup()
        self._owner._release_host(self._alloc, self)


# eq=False: a launcher is an identity (it owns allocations), not a value; two with the
# same options are still two launchers.
@dataclass(eq=False)
class EngineLauncher(ABC):
    """A :class:`~.base.Launcher` that has an engine run the join command per machine.

    ``bind``/``advertise``: as for the join backend (``advertise`` must be an address
    the engine's machines reach)."""

    bind: str = "0.0.0.0"
    advertise: str | None = None
    allow_loopback: bool = False
    name: str = "engine"
    #: Whether the engine starts hosts one by one (a token each) or runs one command on
    #: all (a group token).
    per_host_tokens: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Live allocations and the handles that still hold each.
    _holders: dict[Allocation, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.join = JoinLauncher(
            bind=self.bind,
            advertise=self.advertise,
            allow_loopback=self.allow_loopback,
            on_progress=self._progress,
            python=self.python(),
            name=self.name,
        )
        self.advertise = self.join.advertise
        _live[id(self)] = weakref.ref(self)

    def python(self) -> str:
        """The interpreter the machines run the agent with (default: this one, for
        engines whose machines share this file system)."""
        import sys

        return sys.executable

    @property
    def same_machine(self) -> bool:
        return False

    def check_capacity(self, ranks: int, running: int = 0) -> None:
        """The engine checks what it can hold when it allocates."""
        return

    def _progress(self, line: str) -> None:
        log.info("%s", line)

    @abstractmethod
    def allocate(self, command: JoinCommand, configs: list[HostConfig]) -> Allocation:
        """Reserve ``len(configs)`` machines and run ``command`` on each; return at once
        or after the reservation is granted. Raise ValueError with a clear message when
        the engine cannot (no cluster, no credentials, too many GPUs per machine)."""

    def start_hosts(self, configs: list[HostConfig]) -> list[HostHandle]:
        if not configs:
            return []
        joins, line, tokens = self.join.start_for_engine(configs, group=not self.per_host_tokens)
        command = JoinCommand(
            line.split(),
            tokens,
            configs[0].mesh,
            [c.host for c in configs],
            configs[0].detach_keep,
        )
        try:
            alloc = self.allocate(command, configs)
        except BaseException:
            for j in joins:
                j.cleanup()  # the tokens can no longer be used
            raise
        handles = [EngineHost(j, alloc, i, self) for i, j in enumerate(joins)]
        with self._lock:
            self._holders[alloc] = {id(h) for h in handles}
        return list(handles)

    def describe_missing(self, mesh: str, hosts: list[int]) -> str:
        return self.join.describe_missing(mesh, hosts)

    def _release_host(self, alloc: Allocation, handle: EngineHost) -> None:
        with self._lock:
            holders = self._holders.get(alloc)
            if holders is None or id(handle) not in holders:
                return
            holders.discard(id(handle))
            last = not holders
            if last:
                del self._holders[alloc]
        if last:
            _release(alloc)
            return
        try:  # a shrink: the others of the allocation live on
            alloc.release_machine(handle._index)
        except Exception:
            log.exception("releasing machine %d of %r failed", handle._index, alloc)

    def shutdown(self) -> None:
        """Release every allocation (but a detachable mesh's: it outlives the kernel)
        and close the join endpoint."""
        with self._lock:
            allocs = [a for a in self._holders if a.reservation() is None]
            for alloc in allocs:
                del self._holders[alloc]
        for alloc in allocs:
            _release(alloc)
        self.join.shutdown()


def _release(alloc: Allocation) -> None:
    try:
        alloc.release()
    except Exception:  # log and go on: the other allocations still go
        log.exception("releasing %r failed", alloc)


#: Every engine launcher made in this process, by id (dataclasses are unhashable).
_live: dict[int, weakref.ref[EngineLauncher]] = {}


@atexit.register
def _release_all() -> None:
    """Kernel exit: nothing an engine started for us stays reserved."""
    for ref in list(_live.values()):
        launcher = ref()
        if launcher is not None:
            launcher.shutdown()
