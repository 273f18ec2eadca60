"""What a resize does to a mesh's membership: ranks and host agents started or stopped,
the records rewritten, the new shape told to every rank, actors and ``--setup`` cells
given to new ranks (:class:`Membership`); the orchestration of a resize, and the
training round, are in :mod:`.resize` and :mod:`.training_loop`.

A shrink that drops ranks other than the last ones renumbers the survivors: the rules
of that are in :mod:`.renumber`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from monarch_kernel.calls.errors import MeshStartError, format_ranks
from monarch_kernel.controller.elastic.plan import (
    MeshSize,
    ResizeError,
    ResizeInterrupted,
    ResizePlan,
    ResizeReport,
    interrupted_text,
)
from monarch_kernel.controller.elastic.renumber import forget_and_renumber
from monarch_kernel.controller.lifecycle.failures import FailureHandler
from monarch_kernel.controller.lifecycle.restart import LOCAL_COLLECTIVES, Restarter
from monarch_kernel.controller.lifecycle.startup import Starter
from monarch_kernel.controller.messaging.inbound import Inbound
from monarch_kernel.controller.messaging.receiver import Receiver
from monarch_kernel.controller.messaging.streams import RankLogs
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, MeshResized, StreamOutput
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import (
    HostInfo,
    MeshRecipe,
    RankInfo,
    RankState,
    Slots,
    slots_by_host,
)
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.controller.training.recovery import PeerRecovery
from monarch_kernel.controller.training.round_mesh import PeerMesh
from monarch_kernel.launchers.base import Launcher, RemoteHostHandle
from monarch_kernel.shape import Shape
from monarch_kernel.wire import kinds as K

log = logging.getLogger("monarch_kernel.controller")


class ElasticMesh(Protocol):
    """The mesh a :class:`Resizer` changes (``MeshRuntime``): its records, which it
    rewrites, and the parts it uses."""

    name: str
    shape: Shape
    n_hosts: int
    per_host: int
    world: int
    ranks: list[RankInfo]
    hosts: list[HostInfo]
    launcher: Launcher
    lifecycle: MeshLifecycle
    events: EventBus
    recipe: MeshRecipe
    requests: RequestTable
    transport: Transport
    receiver: Receiver
    inbound: Inbound
    starter: Starter
    restarter: Restarter
    peers: PeerRecovery
    peer_mesh: PeerMesh
    failures: FailureHandler
    shrink_min: int
    slots: Slots
    logs: RankLogs
    generation: int

    def kill_ranks(self, ranks: list[int]) -> None: ...
    def death_text(self, info: RankInfo) -> str: ...
    def publish_reference(self) -> None: ...


_WORLD = (
    "from monarch_kernel.rank.world import set_world as _mk_world\n"
    "_mk_world({labels!r}, {sizes!r}, {ranks!r})\n"
    "del _mk_world\n"
)


class Membership:
    """The membership changes of one mesh's resizes (the operations a
    :class:`~.training_loop.ResizeRound` uses, and the between-cells resize)."""

    def __init__(self, mesh: ElasticMesh):
        self._mesh = mesh

    def resized(self, report: ResizeReport, text: str = "") -> None:
        """Tell the mesh's listeners (handles, dashboard) that it has a new shape, and
        every live rank of the controller its new reference (mesh handles they hold);
        ``text``: what to say instead of the report's words (a resize that failed part
        way, after the records changed)."""
        m = self._mesh
        m.generation += 1
        moved = report.moved if report.dropped else ()
        removed = report.removed if report.dropped else ()
        event = MeshResized(
            m.name, report.before, report.after, text or report.describe(), removed, moved
        )
        m.events.emit(event)
        try:
            m.publish_reference()
        except Exception as exc:  # the resize is done: handles in ranks stay as they were
            log.warning("mesh %s: telling the ranks its new shape failed: %s", m.name, exc)

    def world_moves(self, plan: ResizePlan) -> dict[int, int]:
        """slot -> new rank of each survivor that ``plan`` renumbered (once it did)."""
        m = self._mesh
        return {m.ranks[new].slot: new for _, new in plan.moved if new < len(m.ranks)}

    def leave_request(self, rid: str, ranks: list[int]) -> None:
        """Removed ``ranks`` are no part of request ``rid`` any more (no answer owed)."""
        m = self._mesh
        pending = m.requests.get(rid)
        if pending is None:
            return
        shape = m.shape if len(pending.ranks) == m.world else None
        for r in ranks:
            pending.waiting.discard(r)
            drop = getattr(pending.observer, "drop_rank", None)
            if drop is not None:
                drop(r, _without(shape, ranks))
            elif r in pending.ranks:
                pending.ranks.remove(r)
            m.ranks[r].outstanding = 0

    def join_request(self, rid: str, ranks: list[int]) -> None:
        """New ``ranks`` answer request ``rid`` too (the cell is sent to them later)."""
        m = self._mesh
        pending = m.requests.get(rid)
        if pending is None:
            return
        whole = len(pending.ranks) + len(ranks) == m.world
        for r in ranks:
            add = getattr(pending.observer, "add_rank", None)
            if add is not None:
                add(r, m.shape if whole else None)
            elif r not in pending.ranks:
                pending.ranks.append(r)

    def tell_cell(self, rid: str, text: str) -> None:
        """Say ``text`` under the cell of request ``rid`` (and in rank 0's log)."""
        m = self._mesh
        m.events.emit(StreamOutput(m.name, 0, rid, "stderr", text))

    def remove(self, plan: ResizePlan, deadline: float) -> None:
        """Stop the removed ranks (and host agents) and forget them."""
        m = self._mesh
        gone = [r for r in plan.removed if r < len(m.ranks)]  # (a grow undone: maybe none)
        if not plan.removed:
            return
        m.kill_ranks([r for r in gone if m.ranks[r].alive])
        m.receiver.ensure_reader()
        m.starter.wait(lambda: all(not m.ranks[r].alive for r in gone), deadline, "ranks to stop")
        for host in [m.hosts[h] for h in plan.removed_hosts if h < len(m.hosts)]:
            m.transport.send_host(host.index, {"k": K.STOP, "grace": 0.0})
            if host.handle is not None:
                host.handle.wait_or_kill(max(0.5, deadline - time.monotonic()))
                host.handle.cleanup()
        self._forget(plan)

    def forget(self, plan: ResizePlan) -> Callable[[], None]:
        """Take the removed ranks out of the mesh while they still run (parked at a step
        boundary: nothing waits for them); returns what stops them, to call once the
        others resumed (messages they send meanwhile are dropped: ``Inbound``). Ranks of
        removed hosts are stopped before (their agents go with them)."""
        m = self._mesh
        if plan.removed_hosts:
            self.remove(plan, time.monotonic() + 60.0)
            return lambda: None
        # by slots: once forgotten, nothing else names them
        groups = {
            m.hosts[h].slot: slots for h, slots in slots_by_host(m.ranks, plan.removed).items()
        }
        self._forget(plan)

        def stop() -> None:
            for host, slots in groups.items():
                m.transport.send_host_slot(host, {"k": K.KILL_RANKS, "d": slots})

        return stop

    def _forget(self, plan: ResizePlan) -> None:
        """Take the removed ranks and hosts out of the records; the survivors are
        renumbered in their old order (:mod:`.renumber`)."""
        forget_and_renumber(self._mesh, plan, self._apply_shape)

    def add(self, plan: ResizePlan, deadline: float, cancel: threading.Event | None = None) -> None:
        """Start the new host agents and ranks; return when they are ready (ResizeError
        ``interrupted`` once ``cancel`` is set: the caller takes them back).

        Long on purpose: one join is one ordered sequence (hosts, then ranks) under one deadline and
        one cancel event, each step undoing the records it changed when it fails.
        """
        m = self._mesh
        cancelled = cancel.is_set if cancel is not None else (lambda: False)
        if not plan.added:
            return
        new_hosts = [HostInfo(h, slot=m.slots.new_host()) for h in plan.added_hosts]
        if new_hosts:
            configs = [m.starter.host_config(h) for h in new_hosts]
            with m.transport.send_lock:  # known before they can say they are ready
                m.hosts.extend(new_hosts)
                m.slots.rebuild()
            try:
                handles = m.launcher.start_hosts(configs)
            except ValueError as exc:  # the engine cannot (too few free nodes ...)
                with m.transport.send_lock:
                    del m.hosts[plan.before.hosts :]
                    m.slots.rebuild()
                raise ResizeError(_first_line(exc)) from None
            except BaseException:
                with m.transport.send_lock:
                    del m.hosts[plan.before.hosts :]
                    m.slots.rebuild()
                raise
            for host, handle in zip(new_hosts, handles):
                host.handle = handle
                m.starter.adopt(host)
            t0 = time.monotonic()
            if m.launcher.name == "join":  # someone runs the command shown on each machine
                which = ", ".join(str(h.index) for h in new_hosts)
                say = getattr(m.launcher, "on_progress", None) or print
                say(
                    f"mesh {m.name!r}: waiting up to {deadline - t0:.0f}s for host(s) {which} "
                    "to join (--timeout SECONDS waits longer); the mesh runs on meanwhile"
                )
            try:
                m.starter.wait(
                    lambda: cancelled() or all(h.ready for h in new_hosts),
                    deadline,
                    "new host agents",
                    new_hosts,
                )
            except MeshStartError as exc:
                raise ResizeError(self._not_joined(new_hosts, exc, time.monotonic() - t0)) from None
            if cancelled():
                raise ResizeInterrupted(interrupted_text(plan))
        self._apply_shape(plan.after)
        per = plan.after.per_host
        coords = plan.after.shape._coords()
        infos = [
            RankInfo(r, r // per, r % per, coords[r], slot=m.slots.new_rank()) for r in plan.added
        ]
        with m.transport.send_lock:
            m.ranks.extend(infos)
            m.slots.rebuild()
        for index in sorted({i.host for i in infos}):
            m.starter.spawn_ranks([i for i in infos if i.host == index])
        try:
            m.starter.wait(
                lambda: cancelled() or all(i.state is not RankState.STARTING for i in infos),
                deadline,
                "new ranks",
            )
            if cancelled():
                raise ResizeInterrupted(interrupted_text(plan))
        except BaseException as exc:
            m.restarter._declare_late_dead(plan.added, exc)
            raise
        dead = [i for i in infos if not i.alive]
        if dead:
            raise ResizeError(
                "new ranks died while starting:\n" + "\n".join(m.death_text(i) for i in dead)
            )

    def _not_joined(self, hosts: list[HostInfo], exc: MeshStartError, waited: float) -> str:
        """One line: which new host agents did not come, and what to do."""
        missing = [h.index for h in hosts if not h.ready]
        if not missing or "not ready in time" not in str(exc):
            return _first_line(exc)
        which = f"host {missing[0]}" if len(missing) == 1 else f"hosts {format_ranks(missing)}"
        if self._mesh.launcher.name == "join":
            return (
                f"{which} did not join within {waited:.0f}s (nobody ran the command shown on "
                "the new machine; its token is void now): grow again and run the new command "
                "there, or give more time (--timeout SECONDS)"
            )
        # what the engine last said (a Slurm job still pending ...): why it did not come
        handle = next((h.handle for h in hosts if h.index == missing[0]), None)
        said = handle.status() if isinstance(handle, RemoteHostHandle) else ""
        said = said.splitlines()[0] if said else self._mesh.launcher.name
        return (
            f"{which} did not start within {waited:.0f}s ({said}); what was asked for it is "
            "given back: give more time (--timeout SECONDS) or free a machine first"
        )

    def undo_add(self, plan: ResizePlan) -> None:
        """A grow failed before the new ranks took part in anything: stop what it started
        (new ranks, new host agents, their tokens) and forget them."""
        m = self._mesh
        p = plan
        try:
            self.remove(ResizePlan(p.name, p.after, p.before), time.monotonic() + 30.0)
        except Exception as exc:
            log.warning("mesh %s: undoing the grow: %s", m.name, exc)
        for host in list(m.hosts[p.before.hosts :]):
            if host.handle is not None:
                host.handle.wait_or_kill(0.5)
                host.handle.cleanup()
        with m.transport.send_lock:
            m.transport.forget_ranks(list(range(p.before.world, len(m.ranks))))
            del m.ranks[p.before.world :]
            del m.hosts[p.before.hosts :]
            m.slots.rebuild()
        self._apply_shape(p.before)

    def _apply_shape(self, size: MeshSize) -> None:
        """The mesh's records take on ``size`` (the ranks already there keep theirs)."""
        m = self._mesh
        m.shape = size.shape
        m.n_hosts, m.per_host, m.world = size.hosts, size.per_host, size.world
        m.restarter._world = size.world
        coords = size.shape._coords()
        for info in m.ranks[: size.world]:
            info.coords = tuple(coords[info.rank])
            info.local_rank = info.rank % size.per_host
        common = m.starter.common
        if common is not None:
            common["labels"] = list(size.shape.labels)
            common["sizes"] = list(size.shape.sizes)
            common["world_size"] = size.world
            common["local_world_size"] = size.per_host
            if m.hosts and m.hosts[0].ready:  # host 0 was dropped: rank 0's host now
                common["master_addr"] = m.hosts[0].addr
                common["master_port"] = m.hosts[0].port

    def set_world(
        self, ranks: list[int], plan: ResizePlan, deadline: float, problems: list[str]
    ) -> None:
        """Tell ``ranks`` (idle survivors) the mesh's new shape, and their new ranks
        where ``plan`` renumbered them (by slot: each finds its own)."""
        if not ranks:
            return
        shape = plan.after.shape
        code = _WORLD.format(
            labels=tuple(shape.labels), sizes=tuple(shape.sizes), ranks=self.world_moves(plan)
        )
        failed = self._mesh.restarter.run_cell(ranks, code, "resize: world", (), deadline)
        if failed:
            problems.append(f"telling the ranks the new world size failed: {failed}")

    def spawn_actors(self, plan: ResizePlan, deadline: float, problems: list[str]) -> None:
        """Actors spawned on the whole mesh are spawned on the new ranks too."""
        m = self._mesh
        if not plan.added:
            return
        whole = set(range(plan.before.world))
        for spec in list(m.recipe.actors.values()):
            if spec.ranks == whole:
                m.recipe.remember_actor(replace(spec, ranks=frozenset(range(plan.after.world))))
        m.restarter._respawn_actors(plan.added, deadline, problems)

    def run_setup(self, ranks: list[int], deadline: float, problems: list[str]) -> None:
        """The ``--setup`` cells on new ranks, their collectives completing locally (the
        other ranks take part in none; the state is copied after)."""
        restarter = self._mesh.restarter
        cells = list(self._mesh.recipe.setup_cells)
        if not cells:
            return
        steps = [(LOCAL_COLLECTIVES.format(on=True), "resize: local collectives")]
        steps += [(c.code, c.label) for c in cells]
        steps += [(LOCAL_COLLECTIVES.format(on=False), "resize: collectives")]
        for code, label in steps:
            failed = restarter.run_cell(ranks, code, label, (), deadline)
            if failed:
                problems.append(f"setup cell {label} failed on a new rank: {failed}")
                return


def _first_line(exc: BaseException) -> str:
    """``exc`` in one line: its first line, and its last when there are more (an agent's
    exit: the last line of its log says why)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"


def _without(shape: Shape | None, ranks: list[int]) -> Shape | None:
    """The whole mesh's new shape once ``ranks`` left (None: the result stays flat)."""
    if shape is None:
        return None
    n = len(shape) - len(ranks)
    return Shape((shape.labels[-1],), (n,)) if n > 0 and len(shape.labels) == 1 else None
