"""The running-jobs list: ``%%remote`` cells and actor calls still running on a mesh.

Fed by :class:`~monarch_kernel.widgets.state.MeshState`'s event handlers (on the
dashboard's updater thread); :meth:`RunningJobs.view` gives the rows the dashboard shows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.state.events import RequestKind, RequestStarted
from monarch_kernel.controller.state.records import RankInfo, RankState
from monarch_kernel.widgets.fmt import duration
from monarch_kernel.widgets.views import JobView

#: Requests listed as running jobs: ``%%remote`` cells and actor calls (not spawns,
#: actor stops or control messages, which are over in moments or not work at all).
JOB_KINDS = frozenset({RequestKind.CELL, RequestKind.CALL})
#: Running jobs shown (the newest); older ones are counted, not listed.
MAX_JOBS = 5
#: Running requests tracked at most (a flood of outstanding calls drops the oldest).
MAX_TRACKED_JOBS = 4096
#: Actor calls are listed once they have run this long (cells at once): a training loop
#: of short calls would otherwise make the list flicker at every update.
CALL_MIN_AGE = 0.5


@dataclass
class Job:
    """A request running on the mesh that a person would call a job: a ``%%remote``
    cell or an actor call. ``running``: the ranks that have not answered it yet and
    were not lost (it leaves the list when that is empty)."""

    request: str
    kind: RequestKind
    what: str
    ranks: tuple[int, ...]
    running: set[int]
    started: float  #: ``time.monotonic()`` when it was sent


class RunningJobs:
    """The running jobs of one mesh, by request id, oldest first."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        #: Request ids a Cancel was sent for (written by the dashboard's action thread).
        self.cancelling: set[str] = set()
        self.more = 0  #: running jobs the last :meth:`view` left out

    def start(self, ev: RequestStarted, now: float) -> None:
        """A request was sent: a job if it is a cell or a call (on some ranks)."""
        if ev.kind in JOB_KINDS and ev.ranks:
            jobs = self.jobs
            jobs[ev.request] = Job(ev.request, ev.kind, ev.what, ev.ranks, set(ev.ranks), now)
            if len(jobs) > MAX_TRACKED_JOBS:
                self.end(next(iter(jobs)))

    def end(self, rid: str) -> None:
        """Request ``rid`` is over (everywhere): it leaves the list."""
        self.jobs.pop(rid, None)
        self.cancelling.discard(rid)

    def done_on(self, rid: str, rank: int) -> None:
        """Rank ``rank`` answered request ``rid`` (or failed it)."""
        job = self.jobs.get(rid)
        if job is not None:
            job.running.discard(rank)
            if not job.running:
                self.end(rid)

    def rank_ended(self, rank: int) -> None:
        """Rank ``rank``'s process ended: every job is over on it."""
        for rid, job in list(self.jobs.items()):
            if rank in job.running:
                self.done_on(rid, rank)

    def prune(self, ranks: Sequence[RankInfo]) -> None:
        """Take out of the jobs the ranks the controller says run nothing now (idle,
        dead or stopped). The events say when a rank is done with a job; this catches
        what they cannot: a rank given up on (its late answer is no event), a stop.
        Sound because a rank is BUSY before its :class:`RequestStarted` is emitted, and
        stays BUSY until every request sent to it was answered or lost."""
        busy = (RankState.BUSY, RankState.STARTING)
        n = len(ranks)  # a rank past the end left in a shrink
        for rid, job in list(self.jobs.items()):
            job.running = {r for r in job.running if 0 <= r < n and ranks[r].state in busy}
            if not job.running:
                self.end(rid)

    def view(self, now: float | None = None, limit: int = MAX_JOBS) -> list[JobView]:
        """The newest ``limit`` running jobs, oldest first (cells at once, actor calls
        once they ran :data:`CALL_MIN_AGE` seconds); :attr:`more` counts the others that
        would be listed."""
        now = time.monotonic() if now is None else now
        listed: list[Job] = []
        more = 0
        for job in reversed(list(self.jobs.values())):
            if job.kind is RequestKind.CALL and now - job.started < CALL_MIN_AGE:
                continue
            if len(listed) < limit:
                listed.append(job)
            else:
                more += 1
        self.more = more
        return [self._row(job, now) for job in reversed(listed)]

    def _row(self, job: Job, now: float) -> JobView:
        running = sorted(job.running)
        ranks = f"{'ranks' if len(running) > 1 else 'rank'} {format_ranks(running)}"
        done = len(job.ranks) - len(running)
        if done:
            ranks += f" ({done} of {len(job.ranks)} done)"
        return JobView(
            request=job.request,
            what=job.what or job.kind.value,
            kind=job.kind.value,
            ranks=ranks,
            elapsed=duration(now - job.started),
            cancelling=job.request in self.cancelling,
        )
