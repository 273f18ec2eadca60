"""Supervision of one mesh: heartbeats, rank deaths and lost hosts.

Deaths are pushed: a host agent reaps its ranks and reports each exit at once
(``rank_exit``); a host agent that exits or stops answering heartbeats is *lost* and its
ranks die with that cause. Everything here runs on the thread holding the receive token
(deaths arrive as messages; the heartbeat tick posts what it finds through
``Receiver.post``), so failing a request never races with handling its replies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from monarch_kernel.calls.errors import MeshStoppedError, RankDiedError
from monarch_kernel.controller.lifecycle.busy_agents import BusyAgents
from monarch_kernel.controller.lifecycle.silence import SilenceBound
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, HostLost, RankDied, RequestKind
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import (
    GONE,
    DeathInfo,
    FailurePolicy,
    HostInfo,
    RankEnd,
    RankInfo,
    RankState,
)
from monarch_kernel.controller.state.requests import RequestTable

#: A gap between ticks longer than this (seconds) means the controller itself stalled.
STALL = 1.5
#: Output lines of a dead rank shown in its error.
DEATH_TAIL = 20


#: ``Receiver.post``: run a function on the thread holding the receive token.
Post = Callable[..., None]


class RestartPolicy(Protocol):
    """What a death report says about what happens next (the ``FailureHandler``)."""

    @property
    def policy(self) -> FailurePolicy: ...
    def gave_up_on(self, rank: int) -> bool: ...


class Supervisor:
    """Turns exits, silence and lost hosts into dead ranks and failed requests."""

    def __init__(
        self,
        name: str,
        *,
        ranks: list[RankInfo],
        hosts: list[HostInfo],
        lifecycle: MeshLifecycle,
        transport: Transport,
        requests: RequestTable,
        events: EventBus,
        post: Post,
        restarts: RestartPolicy,
        hb_timeout: float,
        claim: Callable[[int], frozenset[str]] | None = None,
    ):
        """``claim``: ``PeerRecovery.claim`` (requests that keep waiting for a dead rank
        whose training state is recovered from peers)."""
        self._name = name
        self._ranks = ranks
        self._hosts = hosts
        self._lifecycle = lifecycle
        self._transport = transport
        self._requests = requests
        self._events = events
        self._post = post
        self._restarts = restarts
        self._silence = SilenceBound(hb_timeout)
        self._busy = BusyAgents()
        self._claim = claim
        self._last_tick = time.monotonic()

    def tick(self, now: float) -> None:
        """Twice a second (I/O thread): heartbeat every host, notice lost ones."""
        if self._lifecycle.phase.ended:
            return
        stalled = now - self._last_tick > STALL
        self._last_tick = now
        self._transport.trim_arena()
        for host in self._hosts:
            if stalled:
                # This process did not run for a while (a long computation holding the
                # GIL, a swapped-out kernel): the silence was ours, not the hosts'.
                host.last_seen = max(host.last_seen, now)
            if host.lost:
                continue
            self._transport.heartbeat(host.slot)
            code = host.handle.exit_code() if host.handle is not None else None
            if code is not None:
                self._post(self.host_lost, host, f"host agent process exited with code {code}")
                continue
            if not host.ready:
                self._silence.forget(host.slot)  # (re)starting: its old gaps do not count
                self._busy.forget(host.slot)
                continue
            self._silence.seen(host.slot, host.last_seen)
            allowed = self._silence.allowed(host.slot)
            silence = now - host.last_seen
            pid = host.handle.pid if host.handle is not None else None
            self._busy.watch(host.slot, pid, silence, allowed)
            if silence > allowed and not self._busy.working(host.slot, pid, silence):
                self._busy.forget(host.slot)
                why = f"no heartbeat for {silence:.1f}s"
                if allowed > self._silence.floor:
                    gap = self._silence.longest_gap(host.slot)
                    why += f" (allowed {allowed:.1f}s: its messages came up to {gap:.1f}s apart)"
                self._post(self.host_lost, host, why)

    def host_lost(self, host: HostInfo, why: str) -> None:
        """``host`` is gone: its live ranks die with that cause."""
        if host.lost:
            return
        where = [w for w in (host.hostname, host.addr) if w and w != "127.0.0.1"]
        if where:  # name the machine: "node3 at 10.0.0.13"
            why = f"{why} ({' at '.join(dict.fromkeys(where))})"
        host.lost = why
        if host.handle is not None:
            # A frozen (or partitioned) agent may still run its ranks: end it, so that
            # they die with it rather than run on unsupervised.
            threading.Thread(target=host.handle.wait_or_kill, args=(0.1,), daemon=True).start()
        if self._events.wants(HostLost):
            self._events.emit(HostLost(self._name, host.index, why))
        for info in self._ranks:
            if info.host == host.index and info.alive:
                self.rank_died(info, RankEnd(reason=f"host agent {host.index} lost: {why}"))
        self._lifecycle.notify()

    def rank_died(self, info: RankInfo, end: RankEnd) -> None:
        """``info``'s rank ended (``end``: its exit report, or a reason)."""
        if info.state in GONE:
            return  # told already (a stop and its exit report, say)
        ended = self._lifecycle.phase.ended
        expected = end.expected
        if info.kill_reason and not ended:  # killed by the failure policy
            end = replace(end, reason=info.kill_reason)
            expected = False
            info.kill_reason = None
        state = RankState.STOPPED if expected or ended else RankState.DEAD
        self._requests.set_state(info, state, announce=False)
        host = self._hosts[info.host]
        # The host agent's tail holds what the rank printed in the request it died in
        # (from its log, crash dumps included); without one (a lost host), the last
        # lines the controller saw.
        tail = end.tail if end.tail is not None else tuple(info.tail)[-DEATH_TAIL:]
        info.death = DeathInfo(
            rank=info.rank,
            host=host.hostname or f"host {info.host}",
            pid=end.pid if end.pid is not None else info.pid,
            code=end.code,
            signal=end.signal,
            reason=end.reason,
            tail=tail,
            time=time.time(),
        )
        if ended:
            error: BaseException = MeshStoppedError(
                f"mesh {self._name!r} was stopped while this call was running"
            )
        else:
            error = RankDiedError(self.death_text(info), info.death, self._name)
        keep = frozenset[str]()
        if self._claim is not None and state is RankState.DEAD:
            keep = self._claim(info.rank)
        taken = self._requests.take_rank(info.rank, keep)
        # Listeners hear of the death before the callers whose requests it fails.
        if self._events.wants(RankDied):
            failed = tuple(p.id for p in taken)
            in_cell = any(p.kind is RequestKind.CELL and not p.internal for p in taken)
            dead = RankDied(self._name, info.rank, state, info.death, failed, bool(keep), in_cell)
            self._events.emit(dead)
        self._requests.lose(info.rank, taken, error)
        self._lifecycle.notify()

    def death_text(self, info: RankInfo) -> str:
        """``rank 2 of mesh 'm' (host h, pid 123) died: killed by SIGKILL`` + last lines."""
        d = info.death
        tail: tuple[str, ...]
        if d is None:
            how, host, pid, tail = "is not running", info.hostname, info.pid, ()
        else:
            host, pid, tail = d.host, d.pid, d.tail
            stopped = info.state is RankState.STOPPED and not d.reason
            how = "was stopped" if stopped else d.how
        text = f"rank {info.rank} of mesh {self._name!r} (host {host}, pid {pid}) died: {how}"
        if tail:
            text += "\nlast output lines:\n  " + "\n  ".join(tail[-DEATH_TAIL:])
        elif d is not None and not d.reason:
            text += "\n(no output in what it was running)"
        if info.state is RankState.DEAD:
            policy = self._restarts.policy
            if policy is FailurePolicy.RESTART and not self._restarts.gave_up_on(info.rank):
                text += "\nThe failure policy (restart) restarts it now; requests wait for it."
            elif policy is FailurePolicy.STOP:
                text += "\nThe failure policy (stop) stops the mesh."
            elif policy is FailurePolicy.SHRINK:
                text += "\nThe failure policy (shrink) goes on without it if it can."
            else:
                if policy is FailurePolicy.RESTART:
                    text += "\nIt kept dying when restarted, so it was left dead."
                text += f"\nRestart it with ProcMesh.restart(ranks=[{info.rank}])."
        return text
