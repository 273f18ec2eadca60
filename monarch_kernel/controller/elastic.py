"""Growing and shrinking a live mesh (``%mesh grow``/``shrink``, ``procs.grow()``).

Survivors keep their processes, their namespace and their flat rank. What changes:

* the mesh's records: ranks appended after the last one (host agents too, for
  ``--hosts``), or removed from the end (their processes stopped, their host agents
  too); the shape, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` of every rank;
* the torch process group, re-formed at the new size at a fresh rendezvous (the same
  group object on survivors: DDP's reducer is reset and divides by the new size);
* new ranks get the actors spawned on the whole mesh and the ``--setup`` cells, then the
  training state:

  - while a ``--bg`` cell runs a ``TrainingState`` loop, every rank parks at its next
    step boundary (:class:`~.elastic_round.ResizeRound`, the machinery of a recovery
    from peers), new ranks take the state of a live replica over the data plane and
    run the same cell from that step on;
  - between cells, the replica check copies the most advanced rank's models and
    optimizers to the new ranks over the process group (``replica_check``).

A cell that runs and is not a training loop (no ``TrainingState``) cannot take new
ranks: the resize is refused with a message that says what to do.

``--hosts +K`` has the launcher start the new host agents (``start_hosts``): on the
``join`` backend that shows the command to run on each new machine and waits for it
until ``timeout`` (the loop trains on meanwhile: it parks only once the new ranks are
ready); engines (Ray) reserve machines none of the mesh's hosts is on. A grow whose
hosts or ranks do not come stops what it started, forgets it (the tokens are void) and
fails in one line; the mesh is as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from monarch_kernel.calls.errors import MeshStartError, format_ranks
from monarch_kernel.controller.elastic_plan import (
    MeshSize,
    ResizeError,
    ResizeInterrupted,
    ResizePlan,
    ResizeReport,
    interrupted_text,
    plan_grow,
    plan_shrink,
    size_of,
)
from monarch_kernel.controller.elastic_round import STEP_WAIT, UNDO_WAIT, ResizeRound
from monarch_kernel.controller.events import EventBus, MeshResized, RequestKind, StreamOutput
from monarch_kernel.controller.failures import FailureHandler
from monarch_kernel.controller.inbound import Inbound
from monarch_kernel.controller.peer_mesh import PeerMesh
from monarch_kernel.controller.peer_recovery import PeerRecovery
from monarch_kernel.controller.phase import MeshLifecycle
from monarch_kernel.controller.receiver import Receiver
from monarch_kernel.controller.records import (
    FailurePolicy,
    HostInfo,
    MeshPhase,
    MeshRecipe,
    RankInfo,
    RankState,
    by_host,
)
from monarch_kernel.controller.replica_check import make_replicas_consistent
from monarch_kernel.controller.requests import RequestTable
from monarch_kernel.controller.restart import Restarter
from monarch_kernel.controller.startup import Starter
from monarch_kernel.controller.transport import Transport
from monarch_kernel.launchers.base import Launcher
from monarch_kernel.shape import Shape
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer

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

    def kill_ranks(self, ranks: list[int]) -> None: ...
    def death_text(self, info: RankInfo) -> str: ...


_WORLD = (
    "from monarch_kernel.rank.world import set_world as _mk_world\n"
    "_mk_world({labels!r}, {sizes!r})\n"
    "del _mk_world\n"
)
_LOCAL = "__import__('monarch_kernel.rank.train_pg', fromlist=['_']).local_collectives({on})\n"


class Resizer:
    """Grows and shrinks one mesh (see the module); one resize at a time."""

    def __init__(self, mesh: ElasticMesh, others_running: Callable[[], int]):
        """``others_running()``: ranks of this controller's other meshes on the same
        launcher (a grow must fit beside them)."""
        self._mesh = mesh
        self._others = others_running
        self._busy = threading.Lock()

    def size(self) -> MeshSize:
        """The mesh's size as a resize sees it (raises if it cannot be resized)."""
        m = self._mesh
        return size_of(m.name, m.shape.extent, m.n_hosts)

    def grow(
        self, ranks: str | None = None, hosts: str | None = None, timeout: float = 120.0
    ) -> ResizeReport:
        """Add ``ranks`` (``"+2"``) to a one-host mesh, or ``hosts`` (``"+1"``)."""
        plan = plan_grow(self._mesh.name, self.size(), ranks, hosts)
        self._check_capacity(plan)
        return self._resize(plan, timeout)

    def shrink(
        self, ranks: str | None = None, hosts: str | None = None, timeout: float = 120.0
    ) -> ResizeReport:
        """Keep ``ranks`` ranks (``"3"``: ranks 0-2) or ``hosts`` hosts."""
        return self._resize(plan_shrink(self._mesh.name, self.size(), ranks, hosts), timeout)

    # -- the failure policy ``shrink`` ------------------------------------------------------
    def plan_without(self, dead: set[int]) -> ResizePlan | None:
        """A shrink that leaves out the ``dead`` ranks (the last ones, or the last hosts:
        a multi-host mesh loses whole hosts), if there is one that keeps at least
        ``shrink_min`` ranks; else None (the policy restarts them instead)."""
        m = self._mesh
        try:
            size = self.size()
        except ResizeError:
            return None
        if size.hosts > 1:
            hosts = {m.ranks[r].host for r in dead}
            keep = min(hosts)
            if not set(range(keep, size.hosts)) <= hosts:
                return None
            after = MeshSize(keep, size.per_host, size.dim)
        else:
            keep = min(dead)
            if not set(range(keep, size.world)) <= dead:
                return None
            after = MeshSize(1, keep, size.dim)
        if after.world < max(1, m.shrink_min):
            return None
        return ResizePlan(m.name, size, after)

    def runner_for_death(
        self,
        rid: str,
        payload: bytes,
        buffers: tuple[Buffer, ...] | Sequence[Buffer],
        dead: int,
        on_done: Callable[[str], None],
    ) -> ResizeRound | None:
        """Under ``on_failure='shrink'``: the round that goes on without the rank
        ``dead`` that died in training request ``rid`` (None: restart it instead)."""
        if self._mesh.failures.policy is not FailurePolicy.SHRINK:
            return None
        plan = self.plan_without({dead})
        if plan is None:
            return None
        return ResizeRound(rid, payload, buffers, plan, self, self._mesh.peer_mesh, on_done, dead)

    def shrink_dead(self) -> bool:
        """Under ``on_failure='shrink'``, between cells: go on without the dead ranks.
        False when that cannot be done (they are not the last ones, the minimum size, a
        cell runs): the policy restarts them instead."""
        m = self._mesh
        dead = {i.rank for i in m.ranks if not i.alive}
        if not dead:
            return True
        plan = self.plan_without(dead)
        if plan is None:
            return False
        try:
            report = self._resize(plan, 120.0)
        except ResizeError as exc:
            log.warning("mesh %s: shrinking without the dead failed: %s", m.name, exc)
            return False
        log.info("mesh %s: on_failure=shrink: %s", m.name, report.describe())
        return True

    def resized(self, report: ResizeReport) -> None:
        """Tell the mesh's listeners (handles, dashboard) that it has a new shape."""
        m = self._mesh
        m.events.emit(MeshResized(m.name, report.before, report.after, report.describe()))

    # -- checks ------------------------------------------------------------------------
    def _check_capacity(self, plan: ResizePlan) -> None:
        m = self._mesh
        check = getattr(m.launcher, "check_capacity", None)
        if check is None:
            return
        try:
            check(plan.after.world, self._others())
        except Exception as exc:
            raise ResizeError(
                f"grow {m.name}: {str(exc).splitlines()[0]}; grow by fewer ranks, or stop "
                "another mesh first"
            ) from None

    def _check_mesh(self, plan: ResizePlan) -> str | None:
        """The training request to resize at a step boundary (None: between cells);
        raises a :class:`ResizeError` saying what to do when it cannot be resized now."""
        m = self._mesh
        dead = [i.rank for i in m.ranks if not i.alive and i.rank not in plan.removed]
        if m.lifecycle.phase is not MeshPhase.RUNNING:
            raise ResizeError(
                f"mesh {m.name!r} is {m.lifecycle.phase}: it can grow or shrink only while "
                "it runs (wait for a restart to end, or start it again)"
            )
        if dead:
            raise ResizeError(
                f"rank(s) {format_ranks(dead)} of mesh {m.name!r} are not running: restart "
                f"them first (%mesh restart {m.name}) or shrink the mesh to leave them out"
            )
        training = m.peers.training_requests()
        cells = self._running_cells()
        untrained = {rid: ranks for rid, ranks in cells.items() if rid not in training}
        if untrained:
            rid, ranks = next(iter(untrained.items()))
            what = "removes ranks that run" if set(ranks) & set(plan.removed) else "runs"
            raise ResizeError(
                f"mesh {m.name!r} {what} a cell on rank(s) {format_ranks(ranks)} that is not a "
                "TrainingState loop: new ranks cannot join it. Wait for it to end or interrupt "
                "it, then resize (a --bg loop written with TrainingState is resized at a step "
                "boundary)"
            )
        running = [rid for rid in training if rid in cells]
        if len(running) > 1:
            raise ResizeError(
                f"mesh {m.name!r} runs {len(running)} training cells at once: stop all but one"
            )
        return running[0] if running else None

    def _running_cells(self) -> dict[str, list[int]]:
        """Cell requests of the user's now running: request id -> its ranks."""
        m = self._mesh
        out: dict[str, list[int]] = {}
        ranks = {i.rank for i in m.ranks}
        for rid in list(m.requests._pending):
            pending = m.requests.get(rid)
            if pending is None or pending.internal or pending.kind is not RequestKind.CELL:
                continue
            if pending.waiting & ranks:
                out[rid] = sorted(pending.waiting)
        return out

    # -- the resize ----------------------------------------------------------------------
    def _resize(self, plan: ResizePlan, timeout: float) -> ResizeReport:
        m = self._mesh
        if not self._busy.acquire(blocking=False):
            raise ResizeError(f"mesh {m.name!r} is being resized already; wait for it to end")
        try:
            rid = self._check_mesh(plan)
            deadline = time.monotonic() + timeout
            if rid is not None:
                report = self._resize_training(plan, rid, deadline)
            else:
                report = self._resize_idle(plan, deadline)
        finally:
            self._busy.release()
        if rid is None:  # a training round tells it itself (also when the policy shrinks)
            self.resized(report)
        return report

    def _resize_training(self, plan: ResizePlan, rid: str, deadline: float) -> ResizeReport:
        m = self._mesh
        cell = m.peers.cell(rid)
        if cell is None:
            raise ResizeError(f"the training cell of mesh {m.name!r} is not known any more")
        done = threading.Event()
        runner = ResizeRound(rid, cell[0], cell[1], plan, self, m.peer_mesh, lambda _r: None)
        runner.finished = done
        runner.add_deadline = deadline
        why = m.peers.begin(rid, runner)
        if why:
            raise ResizeError(f"mesh {m.name!r}: {why}")
        try:
            try:
                # the deadline is for the new ranks to be ready; the round after has its own
                if not done.wait(max(1.0, deadline - time.monotonic()) + STEP_WAIT):
                    raise ResizeError(f"mesh {m.name!r}: the resize did not end in time")
            except KeyboardInterrupt:
                # Before the loop is paused the new ranks are taken back and the training
                # goes on as it was; once paused, the round ends by itself in seconds.
                cancelled = runner.interrupt()
                done.wait(UNDO_WAIT if cancelled else STEP_WAIT)
                if cancelled:
                    raise ResizeInterrupted(f"mesh {m.name!r}: {runner.error}") from None
        finally:
            m.peers.finished(rid)
        if runner.report is None:
            raise ResizeError(f"mesh {m.name!r} could not be resized: {runner.error}")
        return runner.report

    def _resize_idle(self, plan: ResizePlan, deadline: float) -> ResizeReport:
        """Between cells: start or stop ranks, re-form the process group, give new ranks
        the actors, the set-up cells and rank 0's models (the replica check)."""
        m = self._mesh
        t0 = time.monotonic()
        m.restarter._learn_process_group([i.rank for i in m.ranks])
        self.remove(plan, deadline)
        try:
            self.add(plan, deadline)
        except BaseException as exc:  # nothing else changed yet: take the new ranks away
            self.undo_add(plan)
            if isinstance(exc, KeyboardInterrupt):
                raise ResizeInterrupted(f"mesh {m.name!r}: {interrupted_text(plan)}") from None
            raise
        problems: list[str] = []
        survivors = [r for r in range(plan.after.world) if r not in plan.added]
        self.set_world(survivors, plan, deadline, problems)
        pg = m.recipe.pg_backend is not None
        if pg and not problems:
            m.restarter._reform_process_group(deadline, problems, subgroups=False)
        self.spawn_actors(plan, deadline, problems)
        note = ""
        if plan.added and not problems:
            self.run_setup(plan.added, deadline, problems)
            if pg and not problems:
                live = list(range(plan.after.world))
                note = make_replicas_consistent(m.restarter.run_values, live, deadline, problems)
                note = note or "no training state: the new ranks ran the setup cells only"
            elif not pg:
                note = "no process group: the new ranks ran the setup cells only"
        if problems:
            raise ResizeError(f"mesh {m.name!r} was resized, but: {'; '.join(problems)}")
        seconds = time.monotonic() - t0
        return ResizeReport(
            m.name,
            plan.before.world,
            plan.after.world,
            tuple(plan.added),
            tuple(plan.removed),
            None,
            0,
            0.0,
            seconds,
            note,
        )

    # -- the parts (also used by ResizeRound) --------------------------------------------
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
        groups = by_host(m.ranks, plan.removed)
        self._forget(plan)

        def stop() -> None:
            for host, ranks in groups.items():
                m.transport.send_host(host, {"k": K.KILL_RANKS, "d": ranks})

        return stop

    def _forget(self, plan: ResizePlan) -> None:
        m = self._mesh
        gone = plan.removed
        for spec in list(m.recipe.actors.values()):
            if spec.ranks & set(gone):
                m.recipe.forget_actor(spec.name, gone)
        m.inbound._world = plan.after.world  # first: their late messages are dropped
        with m.transport.send_lock:
            del m.ranks[plan.after.world :]
            del m.transport.next_seq[plan.after.world :]
            del m.hosts[plan.after.hosts :]
        self._apply_shape(plan.after)

    def add(self, plan: ResizePlan, deadline: float, cancel: threading.Event | None = None) -> None:
        """Start the new host agents and ranks; return when they are ready (ResizeError
        ``interrupted`` once ``cancel`` is set: the caller takes them back)."""
        m = self._mesh
        cancelled = cancel.is_set if cancel is not None else (lambda: False)
        if not plan.added:
            return
        new_hosts = [HostInfo(h) for h in plan.added_hosts]
        if new_hosts:
            configs = [m.starter.host_config(h.index) for h in new_hosts]
            try:
                handles = m.launcher.start_hosts(configs)
            except ValueError as exc:  # the engine cannot (too few free nodes ...)
                raise ResizeError(_first_line(exc)) from None
            with m.transport.send_lock:
                m.hosts.extend(new_hosts)
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
        infos = [RankInfo(r, r // per, r % per, coords[r]) for r in plan.added]
        with m.transport.send_lock:
            m.transport.next_seq.extend(m.transport.seq_base for _ in infos)
            m.ranks.extend(infos)
        m.inbound._world = len(m.ranks)
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
        return (
            f"{which} did not start within {waited:.0f}s ({self._mesh.launcher.name}); "
            "give more time (--timeout SECONDS)"
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
            del m.ranks[p.before.world :]
            del m.transport.next_seq[p.before.world :]
            del m.hosts[p.before.hosts :]
        self._apply_shape(p.before)

    def _apply_shape(self, size: MeshSize) -> None:
        """The mesh's records take on ``size`` (the ranks already there keep theirs)."""
        m = self._mesh
        m.shape = size.shape
        m.n_hosts, m.per_host, m.world = size.hosts, size.per_host, size.world
        m.inbound._world = min(size.world, len(m.ranks))
        m.restarter._world = size.world
        coords = size.shape._coords()
        for info in m.ranks[: size.world]:
            info.coords = tuple(coords[info.rank])
        common = m.starter.common
        if common is not None:
            common["labels"] = list(size.shape.labels)
            common["sizes"] = list(size.shape.sizes)
            common["world_size"] = size.world
            common["local_world_size"] = size.per_host

    def set_world(
        self, ranks: list[int], plan: ResizePlan, deadline: float, problems: list[str]
    ) -> None:
        """Tell ``ranks`` (idle survivors) the mesh's new shape."""
        if not ranks:
            return
        shape = plan.after.shape
        code = _WORLD.format(labels=tuple(shape.labels), sizes=tuple(shape.sizes))
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
        steps = [(_LOCAL.format(on=True), "resize: local collectives")]
        steps += [(c.code, c.label) for c in cells]
        steps += [(_LOCAL.format(on=False), "resize: collectives")]
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
