"""Restart in place: bring dead ranks back and re-form the mesh as it was created.

:meth:`Restarter.recover` runs the steps in order: restart the ranks (their host agents
too, if lost); re-create the torch process group on every rank with a new rendezvous if
the ranks had one; re-create actors and re-run ``--setup`` cells on the restarted ranks
(what a :class:`~monarch_kernel.controller.state.records.MeshRecipe` remembers). With no rank to
restart (an
in-place recovery after a failure or an interrupt in a collective loop), the process
group is re-formed only if a rank's is broken, and then the data-parallel replicas are
compared and made the same again (:func:`.replica_check.make_replicas_consistent`). Each
step is a request of the controller's own (``internal``: no failure policy applies to
it), waited for with a deadline and cancelled if it runs past it.

Invariants: one restart runs at a time (``_lock``); while one runs the mesh is
RECOVERING and new requests wait for it (:meth:`Restarter.wait_recovered`), except
those of the restarting thread itself and of the receiving thread (whose replies it
waits for); a rank is never left STARTING: one that does not come up in time is
declared DEAD.

Size: over the ~450-line habit: a restart in place is one ordered sequence (new port,
re-form the process group, re-create actors, re-run set-up cells, check the replicas)
whose steps share the deadline and the ranks being restarted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from monarch_kernel.calls.errors import MeshStartError, format_ranks, ranks_word
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import PLAIN, CallOptions
from monarch_kernel.controller.lifecycle.replica_check import make_replicas_consistent
from monarch_kernel.controller.lifecycle.startup import Starter
from monarch_kernel.controller.messaging.receiver import Receiver
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, MeshRecovered
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import (
    HostInfo,
    MeshRecipe,
    RankEnd,
    RankInfo,
    RankState,
    RecoveryReport,
)
from monarch_kernel.controller.state.requests import RequestTable, new_request_id
from monarch_kernel.wire import dumps
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.headers import SpawnActor

#: The controller's own questions to ranks' control threads while it re-forms a mesh.
_INTERNAL_CONTROL = CallOptions(control=True, internal=True)


#: A cell that makes ``torch.distributed``'s collectives complete locally on a rank
#: (``on=True``) or restores them: for set-up cells run again on restarted ranks alone.
LOCAL_COLLECTIVES = (
    "from monarch_kernel.rank.training.reform import local_collectives as _mk_local\n"
    "_mk_local({on})\n"
    "del _mk_local\n"
)


class MeshRequests(Protocol):
    """The mesh operations a restart uses (``MeshRuntime`` provides them)."""

    def request(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver,
        options: CallOptions = PLAIN,
        request_id: str | None = None,
    ) -> str: ...
    def cancel_request(self, request_id: str) -> list[int]: ...
    def kill_ranks(self, ranks: Sequence[int]) -> None: ...
    def check_alive(self, ranks: Sequence[int]) -> None: ...
    def death_text(self, info: RankInfo) -> str: ...


class Restarter:
    """Restarts ranks of one mesh in place and re-forms the mesh (see the module)."""

    def __init__(
        self,
        name: str,
        mesh: MeshRequests,
        *,
        ranks: list[RankInfo],
        hosts: list[HostInfo],
        recipe: MeshRecipe,
        starter: Starter,
        lifecycle: MeshLifecycle,
        transport: Transport,
        receiver: Receiver,
        requests: RequestTable,
        events: EventBus,
        rank_died: Callable[[RankInfo, RankEnd], None],
    ):
        self._name = name
        self._mesh = mesh
        self._ranks = ranks
        self._hosts = hosts
        self._world = len(ranks)
        self.recipe = recipe
        self._starter = starter
        self._lifecycle = lifecycle
        self._transport = transport
        self._receiver = receiver
        self._requests = requests
        self._events = events
        self._rank_died = rank_died
        self.last_recovery: RecoveryReport | None = None
        #: Why the last restart in place failed (None if it did not).
        self.recovery_error: str | None = None
        self._lock = threading.Lock()
        self._thread: int | None = None  # ident of the thread restarting now
        self._ports: dict[str, int] = {}  # request id -> port a host agent found free

    # -- waiting for a restart -----------------------------------------------------------
    def wait_recovered(self, timeout: float | None = None) -> None:
        """Block (interruptibly) while the mesh restarts ranks after a failure.

        The thread doing the restart, and the receiving thread (whose replies it
        waits for), never wait here.
        """
        if threading.get_ident() == self._thread or self._receiver.on_receiving_thread:
            return
        self._lifecycle.wait_while_recovering(timeout)

    # -- the whole restart ---------------------------------------------------------------
    def dead(self, among: Iterable[int]) -> list[int]:
        """The ranks ``among`` these that a restart brings back: dead, or on a lost host
        (its ranks are dead, even in the instant between the host being marked lost and
        its ranks, on the receiving thread)."""
        info, hosts = self._ranks, self._hosts
        return [r for r in among if not info[r].alive or hosts[info[r].host].lost]

    def recover(
        self,
        ranks: Sequence[int] | None = None,
        timeout: float = 120.0,
        reason: str = "",
        skip: frozenset[int] = frozenset(),
    ) -> RecoveryReport:
        """Restart in place: bring ``ranks`` (default: the dead ones but ``skip``) back
        and re-form the mesh as it was created.

        New requests wait meanwhile; one restart runs at a time (a second caller waits
        for the first, then restarts what is still dead). Returns what was done;
        problems while re-forming (a setup cell that raised) are in the report, a rank
        that cannot start raises :class:`MeshStartError` (and is left DEAD, never
        STARTING).
        """
        in_place_check = ranks is not None and not ranks  # []: nothing to restart
        with self._lock:
            self._mesh.check_alive([])
            t0 = time.monotonic()
            if ranks is None:
                ranks = [r for r in self.dead(range(len(self._ranks))) if r not in skip]
            targets = sorted(set(ranks))
            self._lifecycle.begin_recovery()
            self._thread = threading.get_ident()
            self.recovery_error = None
            problems: list[str] = []
            try:
                backend, actors, setups, replicas = self._reform(targets, t0 + timeout, problems)
            except BaseException as exc:
                self.recovery_error = str(exc).splitlines()[0] if str(exc) else repr(exc)
                raise
            finally:
                self._thread = None
                self._lifecycle.end_recovery()
            report = RecoveryReport(
                tuple(targets),
                backend,
                actors,
                setups,
                time.monotonic() - t0,
                tuple(problems),
                reason,
                replicas,
            )
            self.last_recovery = report
        if self._events.wants(MeshRecovered) and (report.changed or not in_place_check):
            self._events.emit(MeshRecovered(self._name, report))
        return report

    def _reform(
        self, targets: list[int], deadline: float, problems: list[str]
    ) -> tuple[str | None, tuple[str, ...], tuple[str, ...], str]:
        """The steps of :meth:`recover`: (process group backend, actors, setup cells,
        what the replica check did)."""
        backend = None
        broken = self._learn_process_group([r.rank for r in self._ranks if r.alive])
        if targets:
            self.restart_ranks(targets, max(1.0, deadline - time.monotonic()))
        if self.recipe.pg_backend is not None and (targets or broken):
            backend = self._reform_process_group(deadline, problems, subgroups=not targets)
        actors = self._respawn_actors(targets, deadline, problems)
        # Some ranks restarted, the others keep their state: the set-up cells run again
        # on the restarted ones alone, so their collectives (DDP's broadcast, a barrier)
        # must complete locally; the replica check then gives them the others' state.
        alone = self.recipe.pg_backend is not None and 0 < len(targets) < self._world
        setups = self._rerun_setup(targets, deadline, problems, alone) if targets else ()
        replicas = ""
        live = [r.rank for r in self._ranks if r.alive]
        checkable = (
            (not targets or (alone and bool(setups))) and not problems and len(live) == self._world
        )
        if self.recipe.pg_backend is not None and checkable:
            replicas = make_replicas_consistent(self.run_values, live, deadline, problems)
        return backend, actors, setups, replicas

    # -- restarting ranks ----------------------------------------------------------------
    def restart_ranks(self, ranks: list[int], timeout: float = 60.0) -> None:
        """Kill (if alive) and start again the given ranks on their hosts; hosts that
        were lost get a new host agent first.

        Never leaves a rank STARTING: a rank that does not come up in time is marked
        DEAD (with why) and a :class:`MeshStartError` says which.
        """
        self._mesh.check_alive([])
        deadline = time.monotonic() + timeout
        starter, info = self._starter, self._ranks
        involved = [self._hosts[h] for h in sorted({info[r].host for r in ranks})]
        lost = [h for h in involved if h.lost]
        for lost_host in lost:  # all at once: each takes a moment to start
            starter.relaunch_host(lost_host)
        starter.wait(
            lambda: all(h.ready for h in lost), deadline, "host agents (started again)", lost
        )
        self._mesh.kill_ranks([r for r in ranks if info[r].alive])
        gone = lambda: all(not info[r].alive for r in ranks)
        starter.wait(gone, deadline, "rank exits", involved)
        infos = [info[r] for r in ranks]
        for i in infos:
            self._transport.reset_seq(i.rank)
            i.restarts += 1
            i.tail.clear()
            i.kill_reason = None
        for index in {i.host for i in infos}:
            starter.spawn_ranks([i for i in infos if i.host == index])
        try:
            starter.wait(
                lambda: all(info[r].state is not RankState.STARTING for r in ranks),
                deadline,
                "restarted ranks",
                involved,
            )
        except BaseException as exc:
            self._declare_late_dead(ranks, exc)
            raise
        dead = [info[r] for r in ranks if not info[r].alive]
        if dead:
            raise MeshStartError(
                "ranks died while restarting:\n" + "\n".join(self._mesh.death_text(r) for r in dead)
            )

    def _declare_late_dead(self, ranks: list[int], exc: BaseException) -> None:
        """Ranks that never left STARTING are declared dead now (and killed, so that
        they do not come up unsupervised later)."""
        late = [r for r in ranks if self._ranks[r].state is RankState.STARTING]
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._mesh.kill_ranks(late)
        for r in late:
            end = RankEnd(reason=f"did not start: {why}")
            self._receiver.post(self._rank_died, self._ranks[r], end)
        self._receiver.ensure_reader()

    # -- the process group ---------------------------------------------------------------
    def new_port(self, host: int = 0, timeout: float = 10.0) -> int:
        """A free port on ``host`` (for a new torch.distributed rendezvous)."""
        rid = new_request_id()
        self._transport.send_host(host, {"k": K.NEW_PORT, "i": rid})
        self._receiver.ensure_reader()
        self._starter.wait(
            lambda: rid in self._ports,
            time.monotonic() + timeout,
            f"a free port from host {host}",
            [self._hosts[host]],
            "its host agent did not answer",
        )
        return self._ports.pop(rid)

    def port_received(self, rid: str, port: int) -> None:
        """A host agent answered :meth:`new_port` (receiving thread)."""
        self._ports[rid] = port
        self._lifecycle.notify()

    def _learn_process_group(self, ranks: list[int]) -> bool:
        """Ask live ranks about their process group; True if one of them had one that
        is gone now (aborted, or broken by a dead peer): it must be re-formed."""
        if not ranks:
            return False
        collect = _Collect(ranks)
        rid = self._mesh.request(ranks, {"k": K.PING}, b"", (), collect, _INTERNAL_CONTROL)
        self._finish(collect, rid, time.monotonic() + 2.0)  # a rank stuck holding the GIL
        broken = False
        for reply in list(collect.replies):
            if reply.ok:
                info = reply.value("ping")
                if isinstance(info, dict) and info.get("pg"):
                    self.recipe.pg_backend = str(info["pg"])
                    broken = broken or not info.get("pg_live")
        return broken

    def _reform_process_group(
        self, deadline: float, problems: list[str], subgroups: bool = True
    ) -> str | None:
        """Re-form the process group on every rank (``subgroups``: its ``new_group``
        groups too; a restarted rank has none, so they cannot be)."""
        live = [r.rank for r in self._ranks if r.alive]
        if len(live) != self._world:
            dead = [r.rank for r in self._ranks if not r.alive]
            problems.append(f"process group not re-formed: rank(s) {format_ranks(dead)} are dead")
            return None
        port = self.new_port(0)
        addr = self._hosts[0].addr
        backend = self.recipe.pg_backend
        if self._starter.common is not None:  # ranks restarted later use it too
            self._starter.common["master_port"] = port
        code = (
            "from monarch_kernel.rank.pg.distributed import reform_process_group as _mk_reform\n"
            f"_mk_reform({addr!r}, {port}, {backend!r}, subgroups={subgroups})\n"
            "del _mk_reform\n"
        )
        failed = self.run_cell(live, code, "restart: process group", (), deadline)
        if failed:
            problems.append(f"re-forming the process group failed: {failed}")
            return None
        return backend

    # -- actors and setup cells ----------------------------------------------------------
    def _respawn_actors(
        self, targets: list[int], deadline: float, problems: list[str]
    ) -> tuple[str, ...]:
        done = []
        for spec in list(self.recipe.actors.values()):
            on = [r for r in targets if r in spec.ranks and self._ranks[r].alive]
            if not on:
                continue
            collect = _Collect(on)
            header = SpawnActor(actor=spec.name, owner=spec.owner).encode()
            rid = self._mesh.request(
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
        self, targets: list[int], deadline: float, problems: list[str], alone: bool = False
    ) -> tuple[str, ...]:
        """Run the ``--setup`` cells again on ``targets`` (``alone``: the other ranks
        take no part: ``torch.distributed``'s collectives complete locally meanwhile,
        see ``rank.training.reform.local_collectives``); the labels of those that ran."""
        done: list[str] = []
        on = [r for r in targets if self._ranks[r].alive]
        cells = list(self.recipe.setup_cells)
        if not cells or not on:
            return ()
        if alone:
            failed = self.run_cell(
                on, LOCAL_COLLECTIVES.format(on=True), "restart: local collectives", (), deadline
            )
            if failed:
                problems.append(f"making collectives local failed: {failed}")
                return ()
        try:
            for cell in cells:
                failed = self.run_cell(on, cell.code, cell.label, cell.header, deadline)
                if failed:
                    problems.append(f"setup cell {cell.label} failed: {failed}")
                    break  # later setup cells likely need this one
                done.append(cell.label)
        finally:
            if alone:  # always: a rank left with local collectives skips its part
                back = [r for r in on if self._ranks[r].alive]
                failed = self.run_cell(
                    back,
                    LOCAL_COLLECTIVES.format(on=False),
                    "restart: collectives",
                    (),
                    max(deadline, time.monotonic() + 10.0),
                )
                if failed:
                    problems.append(f"restoring collectives failed: {failed}")
        return tuple(done)

    def run_cell(
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
        rid = self._mesh.request(ranks, {"k": K.EXEC}, payload, buffers, collect, options)
        return self._finish(collect, rid, deadline)

    def run_values(
        self, ranks: list[int], code: str, label: str, deadline: float
    ) -> tuple[dict[int, object], str]:
        """Run ``code`` as a cell on ``ranks``: (rank -> the value of its last
        expression, '' or what went wrong)."""
        payload, buffers = dumps({"code": code, "cell": label, "header": []}, "cell")
        collect = _Collect(ranks)
        options = CallOptions(what=f"cell {label}", internal=True)
        rid = self._mesh.request(ranks, {"k": K.EXEC}, payload, buffers, collect, options)
        failed = self._finish(collect, rid, deadline)
        values: dict[int, object] = {}
        if not failed:
            for reply in collect.replies:
                values[reply.rank] = reply.value(label)
        return values, failed

    def _finish(self, collect: _Collect, rid: str, deadline: float) -> str:
        """Wait for one of the controller's own requests; on timeout, cancel it and give
        up on it, so that it neither runs later nor keeps its ranks BUSY."""
        failed = collect.wait(deadline)
        if collect.future.done():
            return failed
        self._mesh.cancel_request(rid)
        error = MeshStartError(f"mesh {self._name!r}: no answer in time while re-forming it")
        requests = self._requests
        self._receiver.post(requests.abandon, rid, set(requests.waiting(rid)), error)
        return failed


class _Collect:
    """Observer of the controller's own requests (re-forming a mesh): all replies."""

    def __init__(self, ranks: list[int]):
        #: The ranks not heard from yet (neither a reply nor lost).
        self._waiting = set(ranks)
        self._lock = threading.Lock()
        self.replies: list[Reply] = []
        self.lost: list[str] = []
        self.future: Future[None] = Future()

    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            self.replies.append(reply)
            self._waiting.discard(reply.rank)
            done = not self._waiting
        if done:
            self.future.set_result(None)

    def on_lost(self, rank: int, error: BaseException) -> None:
        with self._lock:
            self.lost.append(f"rank {rank}: {str(error).splitlines()[0]}")
            self._waiting.discard(rank)
            done = not self._waiting
        if done:
            self.future.set_result(None)

    def wait(self, deadline: float) -> str:
        """'' when every rank succeeded, else a one-line summary of what failed."""
        try:
            self.future.get(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            with self._lock:
                silent = sorted(self._waiting)
            # (which ones: %mesh stacks then says where they are)
            return f"no answer in time from {ranks_word(silent)}" if silent else "no answer in time"
        problems = list(self.lost)
        for reply in self.replies:
            if not reply.ok and reply.report is not None:
                rep = reply.report
                problems.append(f"rank {reply.rank}: {rep.get('type')}: {rep.get('message')}")
        return "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
