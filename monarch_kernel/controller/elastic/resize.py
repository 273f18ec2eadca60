"""Growing and shrinking a live mesh (``%mesh grow``/``shrink``, ``procs.grow()``).

Survivors keep their processes and their namespace. What changes:

* the mesh's records: ranks appended after the last one (host agents too, for
  ``--hosts``), or removed (their processes stopped, their host agents too): from the
  end (``--ranks N``/``--hosts K``: survivors keep their flat rank), or the ranks or
  hosts named (``--drop-ranks``/``--drop-hosts``, and the failure policy ``shrink`` for
  a dead rank or host anywhere): the survivors are renumbered in their old order
  (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` change; the rules of a renumbering are in
  :mod:`.renumber`); the shape, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` of every
  rank;
* the torch process group, re-formed at the new size at a fresh rendezvous (the same
  group object on survivors: DDP's reducer is reset and divides by the new size);
* new ranks get the actors spawned on the whole mesh and the ``--setup`` cells, then the
  training state:

  - while a ``--bg`` cell runs a ``TrainingState`` loop, every rank parks at its next
    step boundary (:class:`~.training_loop.ResizeRound`, the machinery of a recovery
    from peers), new ranks take the state of a live replica over the data plane and
    run the same cell from that step on;
  - between cells, the replica check copies the most advanced rank's models and
    optimizers to the new ranks over the process group (``replica_check``).

A cell that runs and is not a training loop (no ``TrainingState``) cannot take new
ranks: the resize is refused with a message that says what to do.

``--hosts +K`` has the launcher start the new host agents (``start_hosts``): on the
``join`` backend that shows the command to run on each new machine and waits for it
until ``timeout`` (the loop trains on meanwhile: it parks only once the new ranks are
ready); engines reserve machines none of the mesh's hosts is on (Ray, Slurm), or new
ones (Lightning). A grow whose hosts or ranks do not come stops what it started, forgets
it (the tokens are void) and fails in one line; the mesh is as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.elastic.members import ElasticMesh, Membership
from monarch_kernel.controller.elastic.plan import (
    MeshSize,
    ResizeError,
    ResizeInterrupted,
    ResizePlan,
    ResizeReport,
    interrupted_text,
    plan_drop,
    plan_grow,
    plan_shrink,
    size_of,
)
from monarch_kernel.controller.elastic.training_loop import STEP_WAIT, UNDO_WAIT, ResizeRound
from monarch_kernel.controller.lifecycle.replica_check import make_replicas_consistent
from monarch_kernel.controller.state.events import RequestKind
from monarch_kernel.controller.state.records import (
    FailurePolicy,
    MeshPhase,
)
from monarch_kernel.wire import fd_limit
from monarch_kernel.wire.codec import Buffer

log = logging.getLogger("monarch_kernel.controller")


class Resizer:
    """Grows and shrinks one mesh (see the module); one resize at a time."""

    def __init__(self, mesh: ElasticMesh, others_running: Callable[[], int]):
        """``others_running()``: ranks of this controller's other meshes on the same
        launcher (a grow must fit beside them)."""
        self._mesh = mesh
        self.members = Membership(mesh)
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
        self,
        ranks: str | None = None,
        hosts: str | None = None,
        timeout: float = 120.0,
        drop_ranks: str | None = None,
        drop_hosts: str | None = None,
    ) -> ResizeReport:
        """Keep ``ranks`` ranks (``"3"``: ranks 0-2) or ``hosts`` hosts; or drop the
        ranks ``drop_ranks`` (``"1,3"``) or hosts ``drop_hosts`` (``"1"``), anywhere: the
        survivors are renumbered in their old order."""
        m = self._mesh
        minimum = max(1, m.shrink_min)
        if drop_ranks is None and drop_hosts is None:
            plan = plan_shrink(m.name, self.size(), ranks, hosts, minimum)
        elif ranks is not None or hosts is not None:
            raise ResizeError(
                f"shrink {m.name}: give what to keep (--ranks N, --hosts K) or what to drop "
                "(--drop-ranks R,R, --drop-hosts H), not both"
            )
        else:
            plan = plan_drop(m.name, self.size(), drop_ranks, drop_hosts, minimum)
        return self._resize(plan, timeout)

    # -- the failure policy ``shrink`` ------------------------------------------------------
    def plan_without(self, dead: set[int]) -> ResizePlan | None:
        """A shrink that leaves out the ``dead`` ranks, wherever they are (a multi-host
        mesh loses their whole hosts), if it keeps at least ``shrink_min`` ranks; else
        None (the policy restarts them instead). Dead ranks at the end are removed from
        the end; others are dropped and the survivors renumbered."""
        m = self._mesh
        try:
            size = self.size()
        except ResizeError:
            return None
        if size.hosts > 1:
            hosts = sorted({m.ranks[r].host for r in dead})
            if set(range(hosts[0], size.hosts)) <= set(hosts):
                plan = ResizePlan(m.name, size, MeshSize(hosts[0], size.per_host, size.dim))
            else:
                drop = ",".join(map(str, hosts))
                try:
                    plan = plan_drop(m.name, size, None, drop, 1)
                except ResizeError:
                    return None
        else:
            keep = min(dead)
            if set(range(keep, size.world)) <= dead:
                plan = ResizePlan(m.name, size, MeshSize(1, keep, size.dim))
            else:
                try:
                    plan = plan_drop(m.name, size, ",".join(map(str, sorted(dead))), None, 1)
                except ResizeError:
                    return None
        if plan.after.world < max(1, m.shrink_min):
            return None
        return plan

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
        return ResizeRound(
            rid, payload, buffers, plan, self.members, self._mesh.peer_mesh, on_done, dead
        )

    def shrink_dead(self) -> bool:
        """Under ``on_failure='shrink'``, between cells: go on without the dead ranks.
        False when that cannot be done (the minimum size, a cell runs): the policy
        restarts them instead."""
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

    # -- checks ------------------------------------------------------------------------
    def _check_capacity(self, plan: ResizePlan) -> None:
        m = self._mesh
        check = getattr(m.launcher, "check_capacity", None)
        try:
            if check is not None:
                check(plan.after.world, self._others())
            fd_limit.ensure(plan.after.world + self._others())
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
        if plan.moved:
            stuck = m.requests.unmovable(plan.renumbering)
            if stuck:
                raise ResizeError(
                    f"mesh {m.name!r} has {stuck[0]} outstanding on ranks that a drop would "
                    "renumber: wait for it to end (or stop it), then shrink"
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
            try:
                if rid is not None:
                    report = self._resize_training(plan, rid, deadline)
                else:
                    report = self._resize_idle(plan, deadline)
            except BaseException as exc:
                if m.world == plan.after.world != plan.before.world:
                    # it failed after the records changed: the handles still follow them
                    said = f"mesh {m.name!r} is of {m.world} rank(s) now, but: {exc}"
                    self.members.resized(plan.report(None, 0.0), said)
                raise
        finally:
            self._busy.release()
        if rid is None:  # a training round tells it itself (also when the policy shrinks)
            self.members.resized(report)
        return report

    def _resize_training(self, plan: ResizePlan, rid: str, deadline: float) -> ResizeReport:
        m = self._mesh
        cell = m.peers.cell(rid)
        if cell is None:
            raise ResizeError(f"the training cell of mesh {m.name!r} is not known any more")
        done = threading.Event()
        runner = ResizeRound(
            rid, cell[0], cell[1], plan, self.members, m.peer_mesh, lambda _r: None
        )
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
        if runner.cell_ended:
            # The loop ended before it could be paused: the new ranks are ready, nothing
            # else changed; the rest is a resize between cells.
            report = self._finish_idle(plan, deadline, time.monotonic(), prepared=True)
            said = "the training cell had ended before the loop could be paused"
            report = replace(report, note="; ".join(filter(None, (said, report.note))))
            self.members.resized(report)
            return report
        if runner.report is None:
            raise ResizeError(f"mesh {m.name!r} could not be resized: {runner.error}")
        return runner.report

    def _resize_idle(self, plan: ResizePlan, deadline: float) -> ResizeReport:
        """Between cells: start or stop ranks, re-form the process group, give new ranks
        the actors, the set-up cells and rank 0's models (the replica check)."""
        m = self._mesh
        t0 = time.monotonic()
        m.restarter._learn_process_group([i.rank for i in m.ranks if i.alive])
        self.members.remove(plan, deadline)
        try:
            self.members.add(plan, deadline)
        except BaseException as exc:  # nothing else changed yet: take the new ranks away
            self.members.undo_add(plan)
            if isinstance(exc, KeyboardInterrupt):
                raise ResizeInterrupted(f"mesh {m.name!r}: {interrupted_text(plan)}") from None
            raise
        return self._finish_idle(plan, deadline, t0, prepared=False)

    def _finish_idle(
        self, plan: ResizePlan, deadline: float, t0: float, prepared: bool
    ) -> ResizeReport:
        """The rest of a resize between cells, once the new ranks run: the new world on
        every rank, the process group at its new size, then (unless ``prepared``: a
        training round gave them already) the actors and set-up cells on the new ranks,
        and last the most advanced rank's models everywhere (the replica check)."""
        m = self._mesh
        if prepared:  # (a training round adds before it pauses, and removes after)
            m.restarter._learn_process_group([i.rank for i in m.ranks if i.alive])
            self.members.remove(plan, deadline)
        problems: list[str] = []
        survivors = [r for r in range(plan.after.world) if r not in plan.added]
        self.members.set_world(survivors, plan, deadline, problems)
        pg = m.recipe.pg_backend is not None
        if pg and not problems:
            m.restarter._reform_process_group(deadline, problems, subgroups=False)
        if not prepared:
            self.members.spawn_actors(plan, deadline, problems)
        note = ""
        if plan.added and not problems:
            if not prepared:
                self.members.run_setup(plan.added, deadline, problems)
            if pg and not problems:
                live = list(range(plan.after.world))
                note = make_replicas_consistent(m.restarter.run_values, live, deadline, problems)
                note = note or "no training state: the new ranks ran the setup cells only"
            elif not pg:
                note = "no process group: the new ranks ran the setup cells only"
        if problems:
            raise ResizeError(f"mesh {m.name!r} was resized, but: {'; '.join(problems)}")
        return plan.report(None, time.monotonic() - t0, note=note)

    # -- the parts (also used by ResizeRound) --------------------------------------------
