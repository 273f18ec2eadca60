"""One request's recovery from peers, on a thread of its own (see :mod:`.recovery`).

A recovery runs in *rounds*; a death during a round (a claimed one: the new rank, the
replica sending its state, any other rank of the request) starts the next round, which
picks up where the ranks are: parked ranks stay parked, restarted ranks that have
their set-up keep it. Each round: wait for every running rank to park; restart the
dead; re-form the process group on all; run the set-up cells again on new ranks; take
an offer from the replica at the latest step; load it where it is missing; send new
ranks the cell again; resume. :class:`RoundMesh` is what it needs of the mesh.

Size: over the ~450-line habit: one recovery is one state machine (park, restart, re-
form, set-up, offer, load, the cell again, resume) whose rounds restart on a death at
any step; its mesh-facing half is ``round_mesh``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from monarch_kernel.calls.errors import RankDiedError, format_ranks
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.reply import Reply
from monarch_kernel.controller.lifecycle.restart import LOCAL_COLLECTIVES
from monarch_kernel.controller.state.records import RankInfo, SetupCell
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.train_msgs import Notice, Offered, Order

log = logging.getLogger("monarch_kernel.controller")

#: Seconds the running ranks get to park by themselves before their process group is
#: aborted, and in all before the recovery gives up on them.
PARK_NUDGE = 0.5
PARK_WAIT = 15.0
#: Deadline of each later step (restart, re-form, set-up, transfer) in seconds.
STEP_WAIT = 120.0
#: How long a round waits for the claim of a death it ran into before the receiving
#: thread made it (that thread marks the rank dead, then claims it at once).
DEATH_CLAIM_WAIT = 2.0
#: Seconds at least for giving a restarted rank its real collectives back after its
#: set-up ended early (the set-up's own deadline may have passed).
LOCAL_OFF_WAIT = 10.0
#: Rounds (deaths during the recovery) before it gives up.
MAX_ROUNDS = 4

_REFORM = (
    "from monarch_kernel.rank.training.reform import reform as _mk_reform\n"
    "_mk_reform({addr!r}, {port}, {backend!r}, {defer!r})\n"
    "del _mk_reform\n"
)
_SUBGROUPS = (
    "from monarch_kernel.rank.training.reform import reform_subgroups as _mk_subgroups\n"
    "_mk_subgroups({addr!r}, {port})\n"
    "del _mk_subgroups\n"
)


class RoundMesh(Protocol):
    """The mesh operations a recovery uses (``MeshRuntime`` provides them)."""

    name: str
    ranks: list[RankInfo]

    def ask_ranks(self, ranks: Sequence[int], order: Order) -> Future[list[Reply]]: ...
    def run_internal(self, ranks: list[int], code: str, label: str, deadline: float) -> str: ...
    def restart_ranks(self, ranks: list[int], timeout: float = ...) -> None: ...
    def rendezvous(self) -> tuple[str, int]: ...
    def setup_cells_now(self) -> list[SetupCell]: ...
    def abort_groups(self, ranks: Sequence[int]) -> None: ...
    def resend_cell(
        self, rid: str, rank: int, payload: bytes, buffers: Sequence[Buffer]
    ) -> None: ...
    def lose_part(self, rid: str, rank: int, error: BaseException) -> None: ...
    def request_ranks(self, rid: str) -> list[int] | None: ...
    def request_waiting(self, rid: str) -> list[int]: ...
    def recovered(
        self, rid: str, text: str, restarted: tuple[int, ...], seconds: float
    ) -> None: ...
    def restart_dead(self, reason: str) -> None: ...
    def has_process_group(self) -> bool: ...
    def pg_backend(self) -> str | None: ...


T = TypeVar("T")


def size_text(nbytes: int) -> str:
    """``41.2 MB``, ``8.1 KB``, ``1.20 GB``."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.1f} KB"


class _Broken(Exception):
    """A rank died during the round: start the next one."""


class _GiveUp(Exception):
    """No recovery possible: the message says why."""


class Recovery:
    """The recovery of request ``rid`` (see the module)."""

    def __init__(
        self,
        rid: str,
        payload: bytes,
        buffers: Sequence[Buffer],
        first_dead: int,
        mesh: RoundMesh,
        on_done: Callable[[str], None],
    ):
        self.rid = rid
        self._payload = payload
        self._buffers = tuple(buffers)
        self._mesh = mesh
        self._on_done = on_done
        self._cond = threading.Condition()
        self._epoch = 0
        self.dead: set[int] = {first_dead}
        #: restarted ranks -> ``setup`` (needs its set-up), ``ready``, ``sent`` (runs the cell)
        self.fresh: dict[int, str] = {}
        self.parked: dict[int, Notice] = {}
        #: Ranks told to resume that have not all answered (a death broke the round,
        #: or one refused): they may still be parked, so a give-up raises them too.
        self.resuming: set[int] = set()
        self.loaded: dict[int, Notice] = {}
        self.restarted: list[int] = []
        self.deaths: list[int] = [first_dead]
        #: rank -> how it died (``killed by SIGKILL``), read when its death is claimed
        self.causes: dict[int, str] = {}
        self._cause(first_dead)
        self._t0 = time.monotonic()
        #: Why the recovery cannot go on (a rank raised), once known.
        self._failure = ""
        #: seconds spent in each phase (all rounds together)
        self.phases: dict[str, float] = {}
        #: rank that needs state -> the parked replica it takes it from (this round)
        self._from: dict[int, int] = {}

    # -- told by the receiving thread (quick) -----------------------------------------
    def involves(self, rank: int) -> bool:
        with self._cond:
            return rank in self.dead or rank in self.fresh or rank in self.parked

    def _cause(self, rank: int) -> None:
        death = self._mesh.ranks[rank].death
        if death is not None:
            self.causes[rank] = death.how

    def add_dead(self, rank: int) -> None:
        self._cause(rank)
        with self._cond:
            self.dead.add(rank)
            self.deaths.append(rank)
            self.fresh.pop(rank, None)
            self.parked.pop(rank, None)
            self.resuming.discard(rank)
            self.loaded.pop(rank, None)
            self._epoch += 1
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """A rank of the request raised instead of parking: no recovery is possible."""
        with self._cond:
            self._failure = why
            self._cond.notify_all()

    def notice(self, rank: int, notice: object) -> None:
        if not isinstance(notice, Notice):
            return
        with self._cond:
            if rank in self.dead:
                return
            if notice.event == "parked":
                self.parked[rank] = notice
            elif notice.event == "loaded":
                self.loaded[rank] = notice
            self._cond.notify_all()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"mk-peer-{self.rid}", daemon=True).start()

    # -- the recovery thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            for _ in range(MAX_ROUNDS):
                try:
                    self._round()
                    return
                except _Broken:
                    continue
            self._give_up("ranks kept dying while it was recovered")
        except _GiveUp as exc:
            self._give_up(str(exc))
        except Exception as exc:
            log.exception("mesh %s: recovery of %s from peers failed", self._mesh.name, self.rid)
            self._give_up(f"the recovery failed: {type(exc).__name__}: {exc}")
        finally:
            self._on_done(self.rid)

    def _round(self) -> None:
        epoch = self._epoch
        ranks = self._mesh.request_ranks(self.rid)
        if ranks is None:
            raise _GiveUp("the cell ended meanwhile")
        self._timed("park", self._wait_parked, ranks, epoch)
        self._timed("restart", self._restart, epoch)
        deferred = self._timed("reform", self._reform, epoch)
        # The replicas share their state (moving it into shared memory takes a while
        # for a big model) while the new rank runs its set-up cells: they overlap.
        offering = self._start_offer(epoch)
        self._timed("setup", self._setup, epoch)
        if deferred:
            self._timed("subgroups", self._subgroups, epoch)
        offered = self._timed("offer", self._offer, offering, epoch)
        self._timed("load", self._load_behind, offered, epoch)
        transfer = self._timed("cell", self._send_cell, offered, epoch)
        self._timed("resume", self._resume, epoch)
        self._report(offered, transfer)

    def _timed(self, phase: str, fn: Callable[..., T], *args: object) -> T:
        """Run one phase of the round; its seconds go to ``phases`` (the bench's)."""
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.monotonic() - t0

    def _watch(self, fut: Future[list[Reply]]) -> Future[list[Reply]]:
        """``fut``, which wakes :meth:`_wait` when it completes."""

        def wake(_: object) -> None:
            with self._cond:
                self._cond.notify_all()

        fut.add_done_callback(wake)
        return fut

    def _check(self, epoch: int) -> None:
        if self._failure:
            raise _GiveUp(self._failure)
        if self._epoch != epoch:
            raise _Broken()

    def _wait(self, done: Callable[[], bool], epoch: int, until: float) -> bool:
        """Wait for ``done()`` (True), the deadline (False) or a new death (raises)."""
        with self._cond:
            while not done():
                self._check(epoch)
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            self._check(epoch)
            return True

    def _await_death(self, epoch: int, seconds: float) -> None:
        """Give a death that is being reported ``seconds`` to break this round (raises
        :class:`_Broken`: the next round); returns when none came."""
        self._wait(lambda: False, epoch, time.monotonic() + seconds)

    def _running(self, ranks: list[int]) -> list[int]:
        """Ranks of the request that must park: neither dead nor new and idle, nor done
        with their part of it (a loop that ended before the others' step failed, or
        before a resize's ``hold`` reached it, parks no more)."""
        waiting = set(self._mesh.request_waiting(self.rid))
        return [
            r
            for r in ranks
            if r not in self.dead
            and self.fresh.get(r, "sent") == "sent"
            and r not in self.parked
            and r in waiting
        ]

    def _wait_parked(self, ranks: list[int], epoch: int) -> None:
        t0 = time.monotonic()
        if self._wait(lambda: not self._running(ranks), epoch, t0 + PARK_NUDGE):
            return
        self._mesh.abort_groups(self._running(ranks))  # release them from a stuck collective
        if not self._wait(lambda: not self._running(ranks), epoch, t0 + PARK_WAIT):
            stuck = format_ranks(self._running(ranks))
            raise _GiveUp(f"rank(s) {stuck} did not stop at a step boundary")

    def _restart(self, epoch: int) -> None:
        with self._cond:
            dead = sorted(self.dead)
        if not dead:
            return
        try:
            self._mesh.restart_ranks(dead, STEP_WAIT)
        except Exception as exc:
            self._check(epoch)
            raise _GiveUp(f"rank(s) {format_ranks(dead)} could not be restarted: {exc}") from None
        with self._cond:
            for r in dead:
                self.dead.discard(r)
                self.fresh[r] = "setup"
                self.restarted.append(r)
        self._check(epoch)

    def _ask(self, ranks: Sequence[int], order: Order, epoch: int, what: str) -> list[Reply]:
        """An order to parked ranks; their replies (a failed one gives up, unless a rank
        died meanwhile: then the next round)."""
        return self._replies(self._order(ranks, order, epoch), epoch, what)

    def _order(self, ranks: Sequence[int], order: Order, epoch: int) -> Future[list[Reply]]:
        """Send ``order`` to ``ranks``, watched (see :meth:`_watch`). A rank found dead as
        it is sent (its death is being reported on the receiving thread, which claims it
        for this recovery a moment later) ends the round: the next one restarts it."""
        try:
            return self._watch(self._mesh.ask_ranks(ranks, order))
        except RankDiedError as exc:
            self._await_death(epoch, DEATH_CLAIM_WAIT)
            raise _GiveUp(f"{order.op}: {_first_line(exc)}") from None

    def _cell(self, ranks: list[int], code: str, label: str, deadline: float, epoch: int) -> str:
        """Run ``code`` as an internal cell on ``ranks``: '' or what went wrong. A rank
        found dead as it is sent ends the round, as in :meth:`_order`."""
        try:
            return self._mesh.run_internal(ranks, code, label, deadline)
        except RankDiedError as exc:
            self._await_death(epoch, DEATH_CLAIM_WAIT)
            return _first_line(exc)

    def _replies(self, fut: Future[list[Reply]], epoch: int, what: str) -> list[Reply]:
        """The replies of an order (see :meth:`_ask`)."""
        if not self._wait(fut.done, epoch, time.monotonic() + STEP_WAIT):
            raise _GiveUp(f"no answer to {what} in {STEP_WAIT:.0f}s")
        replies = fut.get()
        bad = [r for r in replies if not r.ok]
        if bad:
            # a death that caused it is reported a moment later: then the next round
            self._await_death(epoch, 0.5)
            rep = bad[0].report or {}
            raise _GiveUp(f"{what} failed on rank {bad[0].rank}: {rep.get('message', '?')}")
        return replies

    def _reform(self, epoch: int) -> int:
        """Every rank of the mesh joins the process group's new rendezvous: parked ranks
        by an order, the others (new ranks, ranks not in the request) as a cell. The
        parked ranks' subgroups (``new_group``, ``device_mesh()``) wait until the new
        ranks made theirs in their set-up cells (:meth:`_subgroups`); how many wait."""
        if not self._mesh.has_process_group():
            return 0
        addr, port = self._mesh.rendezvous()
        with self._cond:  # new ranks that run the cell already are parked: an order
            parked = sorted(self.parked)
            fresh = sorted(r for r, s in self.fresh.items() if s != "sent")
        # (a rank whose part of the request ended is idle: it joins as a cell too)
        ranks = self._mesh.request_waiting(self.rid)
        idle = [i.rank for i in self._mesh.ranks if i.alive and i.rank not in ranks]
        fresh = sorted(set(fresh) | set(idle))
        defer = bool(self.fresh)  # no restarted rank: every subgroup re-forms at once
        fut = self._order(parked, Order("reform", self.rid, addr, port, defer=defer), epoch)
        failed = self._cell(
            fresh,
            _REFORM.format(addr=addr, port=port, backend=self._mesh.pg_backend(), defer=defer),
            "recovery: process group",
            time.monotonic() + STEP_WAIT,
            epoch,
        )
        self._check(epoch)
        if failed:
            raise _GiveUp(f"re-forming the process group failed: {failed}")
        if not self._wait(fut.done, epoch, time.monotonic() + STEP_WAIT):
            raise _GiveUp("the parked ranks did not re-form the process group")
        replies = fut.get()
        bad = [r for r in replies if not r.ok]
        if bad:
            self._check(epoch)
            raise _GiveUp(f"re-forming the process group failed on rank {bad[0].rank}")
        return sum(int(v) for v in (r.value("reform") for r in replies) if isinstance(v, int))

    def _subgroups(self, epoch: int) -> None:
        """Every rank forms its subgroups at a new rendezvous, the restarted ones with
        what their set-up cells made (matched by members; see ``pg.backend``)."""
        addr, port = self._mesh.rendezvous()
        with self._cond:
            parked = sorted(self.parked)
        # the restarted ranks and any rank not in the request: a cell
        others = sorted(i.rank for i in self._mesh.ranks if i.alive and i.rank not in parked)
        fut = self._order(parked, Order("subgroups", self.rid, addr, port), epoch)
        failed = self._cell(
            others,
            _SUBGROUPS.format(addr=addr, port=port),
            "recovery: process subgroups",
            time.monotonic() + STEP_WAIT,
            epoch,
        )
        self._check(epoch)
        if failed:
            raise _GiveUp(f"re-forming the subgroups failed: {failed}")
        if not self._wait(fut.done, epoch, time.monotonic() + STEP_WAIT):
            raise _GiveUp("the parked ranks did not re-form their subgroups")
        bad = [r for r in fut.get() if not r.ok]
        if bad:
            self._check(epoch)
            why = (bad[0].report or {}).get("message", "?")
            raise _GiveUp(f"re-forming the subgroups failed on rank {bad[0].rank}: {why}")

    def _setup(self, epoch: int) -> None:
        with self._cond:
            todo = sorted(r for r, s in self.fresh.items() if s == "setup")
        if not todo:
            return
        deadline = time.monotonic() + STEP_WAIT
        steps = [(LOCAL_COLLECTIVES.format(on=True), "recovery: local collectives")]
        steps += [(c.code, c.label) for c in self._mesh.setup_cells_now()]
        try:
            for code, label in steps:
                t0 = time.monotonic()
                failed = self._cell(todo, code, label, deadline, epoch)
                self.phases[f"setup {label}"] = time.monotonic() - t0
                self._check(epoch)
                if failed:
                    raise _GiveUp(f"setup cell {label} failed on the restarted rank: {failed}")
        finally:
            # Whatever ended the set-up (a death: the next round; a failed cell: giving
            # up), the restarted ranks get real collectives back: one left with local
            # ones would skip its part of every later collective (the replica check's
            # broadcast, the next round's), and its peers would wait for it in vain.
            alive = [r for r in todo if self._mesh.ranks[r].alive]
            # (not :meth:`_cell`: a death noticed now must not skip the rest of this)
            try:
                failed = self._mesh.run_internal(
                    alive,
                    LOCAL_COLLECTIVES.format(on=False),
                    "recovery: collectives",
                    max(deadline, time.monotonic() + LOCAL_OFF_WAIT),
                )
            except RankDiedError as exc:
                failed = _first_line(exc)
        if failed:
            self._check(epoch)
            raise _GiveUp(f"restoring collectives failed on the restarted rank: {failed}")
        with self._cond:
            for r in todo:
                if r in self.fresh:
                    self.fresh[r] = "ready"

    def _start_offer(self, epoch: int) -> dict[int, Future[list[Reply]]]:
        """Choose where each rank that needs state takes it from (:meth:`_sources`) and
        ask those replicas to share theirs; their answers come later (:meth:`_offer`)."""
        sources = self._sources()
        with self._cond:
            self._from = sources
        return {
            src: self._order([src], Order("offer", self.rid), epoch)
            for src in sorted(set(sources.values()))
        }

    def _sources(self) -> dict[int, int]:
        """Restarted ranks and parked ranks behind the latest step -> the parked rank
        at that step whose state they take: the lowest that holds the same state (any,
        for a whole model; one across the replicate dim for an HSDP model's shards)."""
        with self._cond:
            parked = dict(self.parked)
            fresh = sorted(r for r, st in self.fresh.items() if st != "sent")
        why = [n.error for n in parked.values() if n.error.startswith("sharded:")]
        if why:
            raise _GiveUp(why[0].removeprefix("sharded: "))
        held = {r: n for r, n in parked.items() if n.has_state}
        if not held:
            raise _GiveUp("no live replica holds the training state")
        step = max(n.step for n in held.values())
        behind = [r for r, n in parked.items() if not n.has_state or n.step != step]
        sources: dict[int, int] = {}
        for r in fresh + sorted(behind):
            same = [s for s, n in held.items() if not n.replicas or r in n.replicas]
            latest = [s for s in same if held[s].step == step]
            if latest:
                sources[r] = min(latest)
                continue
            if same:
                raise _GiveUp(
                    f"the replicas of rank {r}'s shards (rank(s) {format_ranks(same)}) are at "
                    f"step {held[same[0]].step}, others at step {step}"
                )
            raise _GiveUp(
                f"no live rank holds a replica of rank {r}'s shards (HSDP: its replicas "
                "across the replicate dim died too)"
            )
        if not sources:  # nobody needs state (a death claimed late): the latest replica
            sources[-1] = min(r for r, n in held.items() if n.step == step)
        return sources

    def _offer(self, offering: dict[int, Future[list[Reply]]], epoch: int) -> dict[int, Offered]:
        offers = {}
        for src, fut in offering.items():
            reply = self._replies(fut, epoch, "sharing the state")[0]
            offered = reply.value("offer")
            assert isinstance(offered, Offered)
            offers[src] = offered
        return offers

    def _load_behind(self, offers: dict[int, Offered], epoch: int) -> None:
        with self._cond:
            behind = {r: src for r, src in self._from.items() if r in self.parked}
        for src, offered in offers.items():
            ranks = sorted(r for r, s in behind.items() if s == src)
            if not ranks:
                continue
            order = Order("load", self.rid, offer=offered.blob)
            self._ask(ranks, order, epoch, "loading the replica's state")
            with self._cond:
                for r in ranks:
                    self.parked[r] = Notice("parked", self.rid, offered.step)

    def _send_cell(self, offers: dict[int, Offered], epoch: int) -> Notice | None:
        """Send the new ranks the cell again (with the offer to load first); wait until
        they loaded it. The last ``loaded`` notice (for the report)."""
        with self._cond:
            ready = sorted(r for r, s in self.fresh.items() if s == "ready")
            sources = dict(self._from)
        if not ready:
            return None
        for r in ready:
            if r not in sources:  # restarted after the sources were chosen: next round
                raise _Broken()
            offer = offers[sources[r]].blob
            self._ask([r], Order("expect", self.rid, offer=offer), epoch, "the offer")
        for r in ready:
            with self._cond:
                self.fresh[r] = "sent"
                self.loaded.pop(r, None)
            self._mesh.resend_cell(self.rid, r, self._payload, self._buffers)
        if not self._wait(
            lambda: all(r in self.loaded or r in self.parked for r in ready),
            epoch,
            time.monotonic() + STEP_WAIT,
        ):
            raise _GiveUp(f"rank(s) {format_ranks(ready)} did not reach their first step")
        if any(r not in self.loaded for r in ready):  # its load failed: the source died?
            self._await_death(epoch, 2.0)  # its death, if so
            raise _GiveUp("the restarted rank could not load the replica's state")
        return self.loaded[ready[-1]]

    def _resume(self, epoch: int) -> None:
        with self._cond:
            # Once told to resume a rank is parked no more, also when a death breaks
            # this round before every rank answered: the next round must wait for it to
            # park again (its step fails on the dead rank), not send it orders now. A
            # rank drops the orders it finds queued when it parks (stale: their round
            # gave up on them), so an order sent while it still ran its step was lost,
            # and the next round waited STEP_WAIT for a rendezvous it would never join.
            parked = sorted(self.parked)
            self.parked.clear()
            self.resuming.update(parked)
        self._ask(parked, Order("resume", self.rid), epoch, "resuming")
        with self._cond:
            self.resuming.clear()

    # -- the outcome ----------------------------------------------------------------------
    def _report(self, offers: dict[int, Offered], transfer: Notice | None) -> None:
        seconds = time.monotonic() - self._t0
        step = max(o.step for o in offers.values())
        deaths = []
        for r in dict.fromkeys(self.deaths):
            how = f" ({self.causes[r]})" if r in self.causes else ""
            deaths.append(f"rank {r} died{how}")
        text = f"{'; '.join(deaths)} at step {step:,}; restarted"
        if transfer is not None:
            loaded = [self.loaded[r] for r in self.restarted if r in self.loaded] or [transfer]
            nbytes = sum(n.nbytes for n in loaded)
            sources = format_ranks(sorted({n.source for n in loaded}))
            text += (
                f"; state of {size_text(nbytes)} copied from rank {sources} in "
                f"{max(n.seconds for n in loaded):.2f} s"
            )
        text += f"; resumed at step {step:,} (recovery took {seconds:.2f} s)"
        log.info("mesh %s: %s; phases %s", self._mesh.name, text, self.phases)
        self._mesh.recovered(self.rid, text, tuple(dict.fromkeys(self.restarted)), seconds)

    def _give_up(self, why: str) -> None:
        with self._cond:  # (a rank a shrink removed meanwhile is no part of it)
            parked = sorted(
                r
                for r in (set(self.parked) | self.resuming) - self.dead
                if r < len(self._mesh.ranks)
            )
            gone = sorted(set(self.dead) | {r for r, s in self.fresh.items() if s != "sent"})
        text = (
            f"training state could not be recovered from peers: {why}. Lost: the step in "
            f"flight on every rank, and the state of rank(s) {format_ranks(gone or self.deaths)}"
        )
        log.warning("mesh %s: %s", self._mesh.name, text)
        for r in gone:
            self._mesh.lose_part(self.rid, r, RankDiedError(text, None, self._mesh.name))
        if parked:
            try:
                fut = self._mesh.ask_ranks(parked, Order("raise", self.rid, why=text))
                fut.get(5.0)
            except Exception:
                pass
        with self._cond:
            dead = sorted(self.dead)
        if dead:  # the failure policy left them to this recovery: restart them now
            self._mesh.restart_dead(f"rank(s) {format_ranks(dead)} died; {why}")


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
