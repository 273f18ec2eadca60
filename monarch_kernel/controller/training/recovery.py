"""Training that survives a dead rank: the controller's side of state from peers.

Ranks that run steps of a ``TrainingState`` (``monarch_kernel.training``) say so once
per request (a ``train_notice``, ``active``). When such a rank dies while the request
runs and the mesh's policy is ``restart``, its death is *claimed* here instead of
failing its part of the request: the request keeps waiting for that rank, the failure
policy leaves the mesh alone (``RankDied.claimed``), and a recovery thread
(:class:`~.rounds.Recovery`) brings the rank back:

1. the other ranks of the request park at their step boundary (their failed
   collective is caught by ``stepping()``); stragglers get their process group aborted;
2. the dead rank is restarted, the process group re-formed on every rank, the mesh's
   ``--setup`` cells run again on the new rank (with local collectives);
3. a live replica at the latest step offers its state (handles on its tensors); the
   new rank gets the cell again under the *same request id* and, at its first step,
   pulls that state straight from the replica over the data plane;
4. the parked ranks resume: the step in flight is redone, the cell completes normally.

A death during any of this starts again from 1 with the new dead rank; when no replica
is left, or the ranks do not park, the recovery gives up and the request fails with an
error that says what was lost.

Threads: :meth:`PeerRecovery.claim` and :meth:`PeerRecovery.on_notice` run on the thread
holding the receive token (quick, never block); each recovery runs on a thread of its own.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from monarch_kernel.controller.state.events import EventBus, RequestFailed, RequestKind
from monarch_kernel.controller.state.records import FailurePolicy, RankInfo
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.train_msgs import Notice

log = logging.getLogger("monarch_kernel.controller")

#: Cell payloads kept (most recent first out) so that a restarted rank can run the cell
#: that was in flight again.
KEPT_CELLS = 64
#: Times one request may be recovered from peers (deaths claimed) before it fails.
MAX_RECOVERIES = 4
#: Seconds ranks parked at a step boundary wait for a death to be claimed (a peer's
#: death is reported by its host agent a moment after the collective failed); without
#: one they are told to raise the step's error (it was not a death: a hung peer ...).
PARK_ALONE = 2.0


class PolicyView(Protocol):
    """The failure policy, as far as claiming a death reads it (``FailureHandler``)."""

    @property
    def policy(self) -> FailurePolicy: ...


class RecoveryRunner(Protocol):
    """Runs one request's recovery (``training.rounds.Recovery``)."""

    def add_dead(self, rank: int) -> None: ...
    def fail(self, why: str) -> None: ...
    def notice(self, rank: int, notice: object) -> None: ...
    def start(self) -> None: ...
    def involves(self, rank: int) -> bool: ...


#: ``(request id, cell payload, buffers, first dead rank) -> a runner``.
RunnerFactory = Callable[[str, bytes, Sequence[Buffer], int], RecoveryRunner]
#: ``(request id, parked ranks, why)``: tell them to leave the boundary and raise.
RaiseParked = Callable[[str, list[int], str], None]


class PeerRecovery:
    """Which requests train, which deaths are claimed, and their recoveries."""

    def __init__(
        self,
        name: str,
        *,
        ranks: list[RankInfo],
        requests: RequestTable,
        policy: PolicyView,
        make_runner: RunnerFactory,
        raise_parked: RaiseParked,
        events: EventBus,
    ):
        self._name = name
        self._ranks = ranks
        self._requests = requests
        self._policy = policy
        self._make_runner = make_runner
        self._raise_parked = raise_parked
        #: request id -> rank -> its ``parked`` notice (kept for a recovery that starts
        #: after it: the notice often comes before the death's report)
        self._parked: dict[str, dict[int, Notice]] = {}
        self._lock = threading.Lock()
        #: request id -> its cell's (payload, buffers), the last KEPT_CELLS cells.
        self._cells: OrderedDict[str, tuple[bytes, tuple[Buffer, ...]]] = OrderedDict()
        #: request id -> ranks that run TrainingState steps in it.
        self._active: dict[str, set[int]] = {}
        #: request id -> its recovery in progress.
        self._running: dict[str, RecoveryRunner] = {}
        self._counts: dict[str, int] = {}
        events.subscribe(self._on_failed, RequestFailed)
        #: The last recovery that ended (its ``phases``: seconds per step, for the bench).
        self.last: RecoveryRunner | None = None

    # -- what the mesh tells it -----------------------------------------------------------
    def remember_cell(self, rid: str, payload: bytes, buffers: Sequence[Buffer]) -> None:
        """A cell request was sent (any thread): keep it to send it again if needed."""
        with self._lock:
            self._cells[rid] = (bytes(payload), tuple(bytes(b) for b in buffers))
            while len(self._cells) > KEPT_CELLS:
                old, _ = self._cells.popitem(last=False)
                self._active.pop(old, None)

    def on_notice(self, rank: int, payload: bytes) -> None:
        """A rank's ``train_notice`` (receiving thread)."""
        notice = pickle.loads(payload)
        if not isinstance(notice, Notice):
            return
        rid = notice.request
        alone = False
        with self._lock:
            if notice.event == "active":
                self._active.setdefault(rid, set()).add(rank)
            elif notice.event == "parked":
                parked = self._parked.setdefault(rid, {})
                alone = not parked and rid not in self._running
                parked[rank] = notice
            runner = self._running.get(rid)
        if runner is not None:
            runner.notice(rank, notice)
        elif alone:
            timer = threading.Timer(PARK_ALONE, self._unclaimed, (rid,))
            timer.daemon = True
            timer.start()

    def _on_failed(self, event: object) -> None:
        """A rank raised in a request (receiving thread): ranks of it parked at a step
        boundary raise too, and a recovery of it gives up (that rank will not park)."""
        if not isinstance(event, RequestFailed) or event.kind is not RequestKind.CELL:
            return
        rid = event.request
        why = f"rank {event.rank} raised {event.report.get('type', 'an error')}"
        with self._lock:
            runner = self._running.get(rid)
            parked = [] if runner is not None else sorted(self._parked.pop(rid, {}))
        if runner is not None:
            runner.fail(why)
        elif parked:
            self._raise_parked(rid, parked, why)

    def _unclaimed(self, rid: str) -> None:
        """Ranks of ``rid`` parked and no death was claimed: they raise (timer thread)."""
        with self._lock:
            if rid in self._running:
                return
            parked = sorted(self._parked.pop(rid, {}))
        if parked:
            self._raise_parked(
                rid, parked, "no rank died: the collective failed for another reason"
            )

    def claim(self, rank: int) -> frozenset[str]:
        """``rank`` died (receiving thread): the requests whose part of it is kept
        waiting for a restarted rank (its death is recovered from peers)."""
        if self._policy.policy not in (FailurePolicy.RESTART, FailurePolicy.SHRINK):
            return frozenset()
        claimed = set()
        with self._lock:
            for rid, ranks in list(self._active.items()):
                runner = self._running.get(rid)
                if rank not in ranks and (runner is None or not runner.involves(rank)):
                    continue
                pending = self._requests.get(rid)
                if (
                    pending is None
                    or rank not in pending.waiting
                    or pending.kind is not RequestKind.CELL
                    or rid not in self._cells
                ):
                    continue
                if runner is None:
                    if self._counts.get(rid, 0) >= MAX_RECOVERIES:
                        continue
                    self._counts[rid] = self._counts.get(rid, 0) + 1
                    payload, buffers = self._cells[rid]
                    runner = self._make_runner(rid, payload, buffers, rank)
                    self._running[rid] = runner
                    for r, notice in self._parked.get(rid, {}).items():
                        runner.notice(r, notice)  # parked before the death was reported
                    runner.start()
                else:
                    runner.add_dead(rank)
                claimed.add(rid)
        return frozenset(claimed)

    def begin(self, rid: str, runner: RecoveryRunner) -> str:
        """Run ``runner`` (a resize of the mesh at a step boundary: ``controller.
        elastic``) for request ``rid``: its ranks' notices go to it. '' if it started,
        else why not (a recovery of that request runs)."""
        with self._lock:
            if rid in self._running:
                return "a recovery from peers is in progress; try again when it is done"
            self._running[rid] = runner
            self._parked.pop(rid, None)
        runner.start()
        return ""

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (old -> new; the others are gone): what is
        kept per rank follows (a running round re-keys its own state)."""
        with self._lock:
            self._parked = {
                rid: {mapping[r]: n for r, n in parked.items() if r in mapping}
                for rid, parked in self._parked.items()
            }
            self._active = {
                rid: {mapping[r] for r in ranks if r in mapping}
                for rid, ranks in self._active.items()
            }

    def training_requests(self) -> list[str]:
        """Requests whose ranks run ``TrainingState`` steps and are still running."""
        with self._lock:
            active = list(self._active)
        return [rid for rid in active if self._requests.get(rid) is not None]

    def trains(self, rid: str) -> frozenset[int]:
        """The ranks that said they run training steps in ``rid``."""
        with self._lock:
            return frozenset(self._active.get(rid, ()))

    def cell(self, rid: str) -> tuple[bytes, tuple[Buffer, ...]] | None:
        """The cell payload of request ``rid`` (to send it to new ranks), if kept."""
        with self._lock:
            return self._cells.get(rid)

    def finished(self, rid: str) -> None:
        """A recovery ended (its thread)."""
        with self._lock:
            self.last = self._running.pop(rid, None) or self.last
            self._parked.pop(rid, None)

    def recovering(self, rid: str) -> bool:
        """Whether request ``rid`` is being recovered from peers now."""
        return rid in self._running
