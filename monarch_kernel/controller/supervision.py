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
from typing import TYPE_CHECKING

from monarch_kernel.calls.errors import MeshStoppedError, RankDiedError
from monarch_kernel.controller.events import HostLost, RankDied
from monarch_kernel.controller.records import (
    GONE,
    DeathInfo,
    FailurePolicy,
    HostInfo,
    RankInfo,
    RankState,
)
from monarch_kernel.wire.codec import Header

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

#: A gap between ticks longer than this (seconds) means the controller itself stalled.
STALL = 1.5
#: Output lines of a dead rank shown in its error.
DEATH_TAIL = 20


class Supervisor:
    """Turns exits, silence and lost hosts into dead ranks and failed requests."""

    def __init__(self, mesh: MeshRuntime):
        self._mesh = mesh
        self._last_tick = time.monotonic()

    def tick(self, now: float) -> None:
        """Twice a second (I/O thread): heartbeat every host, notice lost ones."""
        mesh = self._mesh
        if mesh.state.ended:
            return
        stalled = now - self._last_tick > STALL
        self._last_tick = now
        for host in mesh.hosts:
            if stalled:
                # This process did not run for a while (a long computation holding the
                # GIL, a swapped-out kernel): the silence was ours, not the hosts'.
                host.last_seen = max(host.last_seen, now)
            if host.lost:
                continue
            mesh.transport.heartbeat(host.index)
            code = host.handle.exit_code() if host.handle is not None else None
            if code is not None:
                mesh.receiver.post(
                    self.host_lost, host, f"host agent process exited with code {code}"
                )
            elif host.ready and now - host.last_seen > mesh.hb_timeout:
                mesh.receiver.post(
                    self.host_lost, host, f"no heartbeat for {now - host.last_seen:.1f}s"
                )

    def host_lost(self, host: HostInfo, why: str) -> None:
        """``host`` is gone: its live ranks die with that cause."""
        if host.lost:
            return
        mesh = self._mesh
        where = [w for w in (host.hostname, host.addr) if w and w != "127.0.0.1"]
        if where:  # name the machine: "node3 at 10.0.0.13"
            why = f"{why} ({' at '.join(dict.fromkeys(where))})"
        host.lost = why
        if host.handle is not None:
            # A frozen (or partitioned) agent may still run its ranks: end it, so that
            # they die with it rather than run on unsupervised.
            threading.Thread(target=host.handle.wait_or_kill, args=(0.1,), daemon=True).start()
        if mesh.events.wants(HostLost):
            mesh.events.emit(HostLost(mesh.name, host.index, why))
        for info in mesh.ranks:
            if info.host == host.index and info.alive:
                self.rank_died(info, {"reason": f"host agent {host.index} lost: {why}"})
        mesh.notify()

    def rank_died(self, info: RankInfo, report: Header) -> None:
        """``info``'s rank ended (``report``: a ``rank_exit`` header or a reason)."""
        mesh = self._mesh
        if info.state in GONE:
            return  # told already (a stop and its exit report, say)
        expected = bool(report.get("expected"))
        if info.kill_reason and not mesh.state.ended:  # killed by the failure policy
            report = dict(report, reason=info.kill_reason)
            expected = False
            info.kill_reason = None
        state = RankState.STOPPED if expected or mesh.state.ended else RankState.DEAD
        mesh.requests.set_state(info, state, announce=False)
        host = mesh.hosts[info.host]
        # The host agent's tail holds what the rank printed in the request it died in
        # (from its log, crash dumps included); without one (a lost host), the last
        # lines the controller saw.
        host_tail = report.get("tail")
        tail = tuple(host_tail) if host_tail is not None else tuple(info.tail)[-DEATH_TAIL:]
        info.death = DeathInfo(
            rank=info.rank,
            host=host.hostname or f"host {info.host}",
            pid=report.get("pid", info.pid),
            code=report.get("code"),
            signal=report.get("sig"),
            reason=report.get("reason"),
            tail=tail,
            time=time.time(),
        )
        if mesh.state.ended:
            error: BaseException = MeshStoppedError(
                f"mesh {mesh.name!r} was stopped while this call was running"
            )
        else:
            error = RankDiedError(self.death_text(info), info.death, mesh.name)
        taken = mesh.requests.take_rank(info.rank)
        # Listeners hear of the death before the callers whose requests it fails.
        if mesh.events.wants(RankDied):
            failed = tuple(p.id for p in taken)
            mesh.events.emit(RankDied(mesh.name, info.rank, state, info.death, failed))
        mesh.requests.lose(info.rank, taken, error)
        mesh.notify()

    def death_text(self, info: RankInfo) -> str:
        """``rank 2 of mesh 'm' (host h, pid 123) died: killed by SIGKILL`` + last lines."""
        mesh = self._mesh
        d = info.death
        tail: tuple[str, ...]
        if d is None:
            how, host, pid, tail = "is not running", info.hostname, info.pid, ()
        else:
            host, pid, tail = d.host, d.pid, d.tail
            stopped = info.state is RankState.STOPPED and not d.reason
            how = "was stopped" if stopped else d.how
        text = f"rank {info.rank} of mesh {mesh.name!r} (host {host}, pid {pid}) died: {how}"
        if tail:
            text += "\nlast output lines:\n  " + "\n  ".join(tail[-DEATH_TAIL:])
        elif d is not None and not d.reason:
            text += "\n(no output in what it was running)"
        if info.state is RankState.DEAD:
            policy = mesh.failures.policy
            if policy is FailurePolicy.RESTART and not mesh.failures.gave_up_on(info.rank):
                text += "\nThe failure policy (restart) restarts it now; requests wait for it."
            elif policy is FailurePolicy.STOP:
                text += "\nThe failure policy (stop) stops the mesh."
            else:
                if policy is FailurePolicy.RESTART:
                    text += "\nIt kept dying when restarted, so it was left dead."
                text += f"\nRestart it with ProcMesh.restart(ranks=[{info.rank}])."
        return text
