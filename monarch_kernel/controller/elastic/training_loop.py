"""A resize while a ``TrainingState`` loop runs: one round of a recovery from peers
(:class:`~monarch_kernel.controller.training.rounds.Recovery`) whose "restart" is the resize.

1. every rank of the training cell is told ``hold``: it parks at its next step
   boundary (a rank already inside that step's collective is released by the abort of
   its peers' process groups, and parks at the same boundary);
2. removed ranks leave the cell's request and are stopped; new ranks are started, get
   the whole mesh's actors, join the request; a shrink that dropped ranks other than
   the last ones renumbers the survivors there (``elastic.renumber``), and the round's
   own records follow;
3. survivors take the new shape and their new ranks (``world``), every rank re-forms
   the process group at the new size, new ranks run the ``--setup`` cells (local
   collectives);
4. a replica offers its state, new ranks get the cell again under its request id and
   load that state at their first step; the survivors resume.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.elastic.plan import (
    ResizeInterrupted,
    ResizePlan,
    ResizeReport,
    interrupted_text,
)
from monarch_kernel.controller.training.rounds import Recovery, RoundMesh, _Broken, _GiveUp
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.train_msgs import Notice, Offered, Order


class ResizeOps(Protocol):
    """What a resize does to the mesh (``elastic.Resizer``)."""

    def leave_request(self, rid: str, ranks: list[int]) -> None: ...
    def join_request(self, rid: str, ranks: list[int]) -> None: ...
    def remove(self, plan: ResizePlan, deadline: float) -> None: ...
    def forget(self, plan: ResizePlan) -> Callable[[], None]: ...
    def add(
        self, plan: ResizePlan, deadline: float, cancel: threading.Event | None = None
    ) -> None: ...
    def undo_add(self, plan: ResizePlan) -> None: ...
    def set_world(
        self, ranks: list[int], plan: ResizePlan, deadline: float, problems: list[str]
    ) -> None: ...
    def spawn_actors(self, plan: ResizePlan, deadline: float, problems: list[str]) -> None: ...
    def tell_cell(self, rid: str, text: str) -> None: ...
    def resized(self, report: ResizeReport) -> None: ...
    def world_moves(self, plan: ResizePlan) -> dict[int, int]: ...


log = logging.getLogger("monarch_kernel.controller")

#: Seconds the ranks get to reach a step boundary by themselves before the process
#: groups of those still in a step are aborted (the step is then redone), and in all.
HOLD_NUDGE = 3.0
HOLD_WAIT = 30.0
_ALONE = (
    "import torch.distributed as _mk_dist\n"
    "if not _mk_dist.is_initialized():\n"
    "    __import__('monarch_kernel.rank.pg.alone', fromlist=['_']).form_alone()\n"
    "del _mk_dist\n"
)
#: Deadline of each later step in seconds.
STEP_WAIT = 120.0
#: Seconds an interrupted grow gets to take its new ranks and host agents back.
UNDO_WAIT = 60.0


class _CellEnded(Exception):
    """The training cell ended on every rank before the loop paused: there is no loop
    to resize, the mesh is resized as between cells (``Resizer``)."""


class ResizeRound(Recovery):
    """The resize of the mesh around training request ``rid`` (see the module)."""

    def __init__(
        self,
        rid: str,
        payload: bytes,
        buffers: Sequence[Buffer],
        plan: ResizePlan,
        resizer: ResizeOps,
        mesh: RoundMesh,
        on_done: Callable[[str], None],
        died: int | None = None,
    ):
        """``died``: a rank that died in the request (``on_failure='shrink'``): the
        plan leaves it out."""
        super().__init__(rid, payload, buffers, 0, mesh, on_done)
        self.dead.clear()
        self.deaths.clear()
        self.causes.clear()
        if died is not None:
            self.deaths.append(died)
            self._cause(died)
        self.plan = plan
        self._resizer = resizer
        #: What it did (None until it succeeded) or why it failed.
        self.report: ResizeReport | None = None
        self.error = ""
        #: Set when it ended either way.
        self.finished: threading.Event | None = None
        #: Seconds the training loop was paused (from ``hold`` to ``resume``).
        self.paused = 0.0
        #: When the new host agents and ranks must be ready (the user's ``--timeout``;
        #: on the join backend someone starts the agent by hand meanwhile), else None.
        self.add_deadline: float | None = None
        #: Set by :meth:`interrupt` while the new ranks are prepared: they are taken back.
        self.cancel = threading.Event()
        self._pausing = False  # under _cond: the loop is being paused (too late to cancel)
        #: Under _cond: the ranks were renumbered (ranks named from then on are new ones).
        self._renumbered = False
        #: Set when it ended because the training cell had ended before the pause: the
        #: new ranks are ready (started, actors, set-up cells) and nothing else changed;
        #: the caller finishes the resize as between cells.
        self.cell_ended = False
        self._for_death = died is not None

    def interrupt(self) -> bool:
        """The user interrupted the grow. True: it is cancelled (it was still preparing
        the new ranks; they are taken back and the training goes on as it was); False:
        the loop is being paused already, and the round ends by itself in seconds."""
        with self._cond:
            if self._pausing:
                return False
            self.cancel.set()
            self._cond.notify_all()
            return True

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise ResizeInterrupted(interrupted_text(self.plan))

    def notice(self, rank: int, notice: object) -> None:
        """A rank's training notice; a removed rank's is ignored (one that parks by itself
        when its peers stop, until its numbering is gone: ``elastic.renumber``)."""
        with self._cond:
            removed = rank in self.plan.removed and not self._renumbered
        if not removed:
            super().notice(rank, notice)

    def add_dead(self, rank: int) -> None:
        """A rank died: one the plan leaves out anyway is only noted; any other ends
        the resize (the recovery's give-up restarts it)."""
        if rank in self.plan.removed and not self._renumbered:
            self._cause(rank)
            with self._cond:
                self.deaths.append(rank)
                self.parked.pop(rank, None)
            return
        super().add_dead(rank)

    def _run(self) -> None:
        try:
            try:
                self._prepare(self._epoch)
                with self._cond:  # from here on the loop is paused: no cancelling
                    self._check_cancel()
                    self._pausing = True
            except Exception as exc:  # the training was not touched: take the new ranks away
                self._undo(exc)
                return
            self._round()
        except _CellEnded:
            if self._for_death:  # (no user is waiting to finish it)
                self._give_up("the training cell ended meanwhile")
            else:
                self.cell_ended = True
        except _Broken:
            self._give_up("a rank died while the mesh was resized")
        except _GiveUp as exc:
            self._give_up(str(exc))
        except Exception as exc:
            log.exception("mesh %s: resize failed", self._mesh.name)
            self._give_up(f"{type(exc).__name__}: {exc}")
        finally:
            self._on_done(self.rid)
            if self.finished is not None:
                self.finished.set()

    def _prepare(self, epoch: int) -> None:
        """Before the pause, while the loop trains on: start the new ranks, spawn the
        actors, form their process group alone and run the set-up cells on them."""
        if not self.plan.added:
            return
        self._timed("add", self._add, epoch)
        self._check_cancel()
        self._timed("actors", self._actors, epoch)
        self._check_cancel()
        if self._mesh.has_process_group():
            failed = self._cell(
                self.plan.added, _ALONE, "resize: process group", self._deadline(), epoch
            )
            self._check(epoch)
            if failed:
                raise _GiveUp(f"the new ranks could not form a process group: {failed}")
            self._check_cancel()
        self._timed("setup", self._setup, epoch)

    def _undo(self, exc: BaseException) -> None:
        why = str(exc) or type(exc).__name__
        if isinstance(exc, ResizeInterrupted):  # the user's own doing: said in the cell
            self.error = f"{why}; the training goes on as before"
        else:
            self.error = (
                f"the new ranks could not be prepared ({why}); the training goes on as before"
            )
            log.warning("mesh %s: %s", self._mesh.name, self.error)
        try:
            self._resizer.undo_add(self.plan)
        except Exception as again:
            self.error += f"; stopping them failed too: {again}"

    def _round(self) -> None:
        epoch = self._epoch
        left_out = set(self.plan.removed) | set(self.fresh)
        ranks = [r for r in self._mesh.request_waiting(self.rid) if r not in left_out]
        if not ranks:
            raise _CellEnded()
        t0 = time.monotonic()
        self._timed("hold", self._ask, ranks, Order("hold", self.rid), epoch, "hold")
        self._timed("park", self._wait_boundary, ranks, epoch)
        with self._cond:
            parked = set(self.parked)
        if not parked:  # the loop ended on every rank before the hold reached it
            raise _CellEnded()
        # a rank whose loop ended meanwhile is idle: it takes the new world as a cell
        waiting = set(self._mesh.request_waiting(self.rid))
        ranks = [r for r in ranks if r in parked or r in waiting]
        step = max((n.step for n in self.parked.values()), default=0)
        stop = self._timed("remove", self._remove, epoch)
        mapping = self.plan.renumbering
        ranks = [mapping[r] for r in ranks if r in mapping]
        if self.fresh:
            self._resizer.join_request(self.rid, self.plan.added)
        self._timed("world", self._world, ranks, epoch)
        self._timed("reform", self._reform, epoch)
        offered: Offered | None = None
        transfer: Notice | None = None
        behind = self._behind()
        if self.fresh or behind:
            offering = self._start_offer(epoch)
            offers = self._timed("offer", self._offer, offering, epoch)
            self._timed("load", self._load_behind, offers, epoch)
            if self.fresh:
                transfer = self._timed("cell", self._send_cell, offers, epoch)
            offered = offers[min(offers)]
        self._timed("resume", self._resume, epoch)
        self.paused = time.monotonic() - t0
        stop()
        self._done(offered.step if offered else step, transfer, behind, offered)

    def _behind(self) -> list[int]:
        """Survivors parked at an earlier step than another one.

        A rank that dies inside a collective can leave it completed on some ranks and
        failed on others: those go on to the next step, these redo the step. Resumed
        as they are, the replicas would train a step apart (each collective pairing one
        rank's step with another's next: silently different models), and the loop's
        last step would wait forever for a partner. So they take the state of one at
        the latest step first (:meth:`_load_behind`), as a recovery from peers does."""
        with self._cond:
            steps = {r: n.step for r, n in self.parked.items()}
        latest = max(steps.values(), default=0)
        return sorted(r for r, s in steps.items() if s != latest)

    def _wait_boundary(self, ranks: list[int], epoch: int) -> None:
        t0 = time.monotonic()
        if self._wait(lambda: not self._running(ranks), epoch, t0 + HOLD_NUDGE):
            return
        self._mesh.abort_groups(self._running(ranks))  # a step that waits on a parked peer
        if not self._wait(lambda: not self._running(ranks), epoch, t0 + HOLD_WAIT):
            stuck = format_ranks(self._running(ranks))
            raise _GiveUp(f"rank(s) {stuck} did not reach a step boundary")

    def _deadline(self) -> float:
        return time.monotonic() + STEP_WAIT

    def _remove(self, epoch: int) -> Callable[[], None]:
        """Removed ranks leave the request and the mesh's records; what stops them."""
        gone = self.plan.removed
        if not gone:
            return lambda: None
        self._resizer.leave_request(self.rid, gone)
        with self._cond:
            for r in gone:
                self.parked.pop(r, None)
                self.loaded.pop(r, None)
        stop = self._resizer.forget(self.plan)
        if self.plan.moved:  # the survivors were renumbered: so are the round's records
            mapping = self.plan.renumbering
            with self._cond:
                self._renumbered = True
                self.parked = {mapping[r]: n for r, n in self.parked.items() if r in mapping}
                self.loaded = {mapping[r]: n for r, n in self.loaded.items() if r in mapping}
                self.fresh = {mapping[r]: f for r, f in self.fresh.items() if r in mapping}
                self.dead = {mapping[r] for r in self.dead if r in mapping}
        self._check(epoch)
        return stop

    def _add(self, epoch: int) -> None:
        new = self.plan.added
        self._resizer.add(self.plan, self.add_deadline or self._deadline(), self.cancel)
        with self._cond:
            for r in new:
                self.fresh[r] = "setup"
                self.restarted.append(r)
        self._check(epoch)

    def _world(self, ranks: list[int], epoch: int) -> None:
        shape = self.plan.after.shape
        with self._cond:
            parked = sorted(self.parked)
        moves = tuple(sorted(self._resizer.world_moves(self.plan).items()))
        order = Order(
            "world", self.rid, labels=tuple(shape.labels), sizes=tuple(shape.sizes), ranks=moves
        )
        self._ask(parked, order, epoch, "the new world size")
        others = [
            r
            for r in range(self.plan.after.world)
            if r not in parked and r not in self.plan.added and r not in ranks
        ]
        problems: list[str] = []
        self._resizer.set_world(others, self.plan, self._deadline(), problems)
        if problems:
            raise _GiveUp(problems[0])

    def _actors(self, epoch: int) -> None:
        problems: list[str] = []
        self._resizer.spawn_actors(self.plan, self._deadline(), problems)
        self._check(epoch)
        if problems:
            raise _GiveUp(problems[0])

    def _done(
        self,
        step: int,
        transfer: Notice | None,
        behind: Sequence[int] = (),
        offered: Offered | None = None,
    ) -> None:
        note = ""
        if behind and offered is not None:
            note = (
                f"rank{'s' if len(behind) > 1 else ''} {format_ranks(list(behind))} had not "
                f"finished step {offered.step - 1:,}; "
                f"rank {offered.source}'s state at step {offered.step:,} copied to "
                f"{'them' if len(behind) > 1 else 'it'}"
            )
        self.report = self.plan.report(
            step,
            self.paused,
            transfer.nbytes if transfer else 0,
            transfer.seconds if transfer else 0.0,
            note,
        )
        log.info("%s; phases %s", self.report.describe(), self.phases)
        died = ""
        for r in dict.fromkeys(self.deaths):
            how = f" ({self.causes[r]})" if r in self.causes else ""
            died += f"rank {r} died{how}; "
        self._resizer.tell_cell(self.rid, f"[resized] {died}{self.report.describe()}\n")
        self._resizer.resized(self.report)

    def _give_up(self, why: str) -> None:
        self.error = why
        super()._give_up(f"the mesh could not be resized ({why})")
