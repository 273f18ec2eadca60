"""The end of an attach: what a controller that took a detachable mesh over does once
it holds it (:class:`Attached`).

In this order: the caller *follows* the requests the earlier holder left running
(:meth:`Attached.follow`: a ``--bg`` cell's job handle comes back; the ranks answer to
whoever holds the mesh), then :meth:`Attached.finish`: the requests of ranks whose
host agent restarted them meanwhile are lost (their earlier incarnation ran them); the
ranks that lived through are *welcomed* (``attached``): each replies with its metric
history (re-emitted as :class:`~monarch_kernel.controller.state.events.MetricReported` with its own
times, so a
dashboard shows the whole run) and sends the results it kept while nobody held the mesh
(so a job that ended meanwhile completes now); ranks that ended go to supervision (the
failure policy applies: ``restart`` restarts them), and the restarted ones are re-formed
(process group, actors, setup cells) by a restart in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import DeathInfo, RankDiedError
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import CallOptions
from monarch_kernel.controller.attach_file import AttachFile, JobRecord
from monarch_kernel.controller.detach import release as detach
from monarch_kernel.controller.detach.adopt import Adopted
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.controller.messaging.streams import Sink
from monarch_kernel.controller.state.events import MetricReported, RequestKind
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.desk import ControllerId, RankStatus, describe_duration
from monarch_kernel.wire.osutil import describe_exit, printed_since_detached

log = logging.getLogger("monarch_kernel.controller")

#: Seconds the ranks get to answer ``attached`` (a rank busy in C code answers late:
#: its history is then missing, nothing else).
WELCOME_TIMEOUT = 10.0
#: Lines per rank shown of what it printed while no controller held the mesh.
DETACHED_LINES = 10


@dataclass
class Welcome:
    """What the ranks told the controller that took them over."""

    points: int = 0  #: metric reports re-emitted (the whole history)
    dropped: int = 0  #: messages the ranks dropped while detached (output, stats)
    silent: list[int] = field(default_factory=list)  #: ranks that did not answer
    #: rank -> the last lines it printed while no controller held the mesh
    printed: dict[int, list[str]] = field(default_factory=dict)


class _Answers:
    """Gathers the ranks' answers to ``attached`` (a RequestObserver, told on the
    receiving thread). Each rank's history is re-emitted as its answer comes, before
    anything that rank sent after it (its live metrics): a rank that answers first
    goes on reporting while the others have not answered yet, and its chart must
    start with its history, not with those. An answer after the wait still charts."""

    def __init__(self, rt: MeshRuntime, ranks: Sequence[int], welcome: Welcome):
        self._rt = rt
        self._welcome = welcome
        self.answered: set[int] = set()  #: ranks whose answer came (under the lock)
        self._left = set(ranks)
        self._lock = threading.Lock()
        self.done = threading.Event()
        if not self._left:
            self.done.set()

    def on_reply(self, reply: Reply) -> None:
        if reply.ok:
            value = reply.value("attached")
            if isinstance(value, dict):
                self._take(reply.rank, value)
        self._answered(reply.rank)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self._answered(rank)

    def _take(self, rank: int, value: dict[str, object]) -> None:
        welcome, rt = self._welcome, self._rt
        history, dropped = value.get("history"), value.get("dropped")
        with self._lock:
            self.answered.add(rank)
            welcome.dropped += dropped if isinstance(dropped, int) else 0
        if not isinstance(history, list) or not rt.events.wants(MetricReported):
            return
        for t, request, metrics in history:
            rt.events.emit(MetricReported(rt.name, rank, request, metrics, t))
        with self._lock:
            welcome.points += len(history)

    def answered_ranks(self) -> set[int]:
        with self._lock:
            return set(self.answered)

    def _answered(self, rank: int) -> None:
        with self._lock:
            self._left.discard(rank)
            if not self._left:
                self.done.set()


@dataclass
class Attached:
    """A mesh this controller took over, and what happened while nobody held it."""

    adopted: Adopted
    file: AttachFile
    detached_for: float | None  #: seconds it ran without a controller (None: it had one)
    taken_from: ControllerId | None  #: the controller it was taken from (``force``)
    refused: dict[str, int]  #: attach requests its agents refused so far, by why
    welcome: Welcome | None = None  #: set by :meth:`finish`

    @property
    def runtime(self) -> MeshRuntime:
        return self.adopted.runtime

    @property
    def jobs(self) -> list[JobRecord]:
        """The ``%%remote`` cells the earlier holder left running."""
        return [j for j in self.file.jobs if j.kind == RequestKind.CELL.value]

    @property
    def ended(self) -> list[int]:
        return [rank for rank, _ in self.adopted.ended]

    @property
    def restarted(self) -> dict[int, RankStatus]:
        return self.adopted.restarted

    def follow(self, job: JobRecord, observer: RequestObserver, output: Sink | None = None) -> None:
        """Follow ``job`` (the ranks' answers go to ``observer``, its output to
        ``output``, from the first line printed after the attach); before :meth:`finish`."""
        rt = self.runtime
        held = self.adopted.held.get(job.request)
        if output is not None and held is not None:
            held.forward_to(output)
        elif output is not None:
            rt.output.route(job.request, output)
        kind = RequestKind(job.kind)
        rt.follow_request(job.ranks, job.request, observer, kind, job.what)
        detacher = detach.detacher_of(rt)
        if detacher is not None:
            detacher.follow(job)

    def finish(self) -> Welcome:
        """Welcome the ranks and apply the failure policy (see the module docstring)."""
        rt = self.runtime
        followed = detach.detacher_of(rt)
        for job in self.file.jobs:  # not followed: its output goes where unrouted output goes
            if followed is None or job.request not in {j.request for j in followed.jobs()}:
                rt.output.unroute(job.request)
        for rank, status in self.restarted.items():
            error = self._lost_incarnation(rank, status)
            rt.receiver.post(_fail_rank, rt, rank, error)
        welcome = self.welcome = _welcome(rt, sorted(set(_live(rt)) - set(self.restarted)))
        for info in rt.ranks:
            lines = printed_since_detached(self.log_of(info.rank), DETACHED_LINES)
            if lines:
                welcome.printed[info.rank] = lines
        for rank, end in self.adopted.ended:  # the failure policy applies to them now
            rt.receiver.post(rt.supervisor.rank_died, rt.ranks[rank], end)
        ended = [rt.ranks[r] for r in self.ended]
        with rt.lifecycle.cv:  # told (so the next request waits for the policy's restart)
            rt.lifecycle.cv.wait_for(lambda: all(not i.alive for i in ended), WELCOME_TIMEOUT)
        if self.restarted:
            # From now the next request waits for the re-forming, even if a restart of
            # the failure policy (ranks that ended meanwhile) runs and ends first.
            rt.lifecycle.hold_recovery()
            threading.Thread(target=self._reform, name="mk-attach-reform", daemon=True).start()
        return welcome

    def _reform(self) -> None:
        ranks = sorted(self.restarted)
        why = "restarted by their host agent while no kernel was attached: re-formed here"
        try:
            self.runtime.recover(ranks, reason=why)
        except Exception:  # the failure is on the mesh (recovery_error), for the notebook
            log.exception("mesh %s: re-forming ranks %s failed", self.runtime.name, ranks)
        finally:
            self.runtime.lifecycle.release_recovery()

    def _lost_incarnation(self, rank: int, status: RankStatus) -> RankDiedError:
        host = self.file.hosts[self.file.ranks[rank].host]
        death = DeathInfo(
            rank=rank,
            host=host.hostname,
            pid=self.file.ranks[rank].pid,
            code=status.code,
            signal=status.signal,
            reason=f"{describe_exit(status.code, status.signal)} while no kernel was attached",
            time=status.ended_at or time.time(),
        )
        text = (
            f"rank {rank} of mesh {self.runtime.name!r} died while no kernel was attached "
            f"({describe_exit(status.code, status.signal)}); its host agent restarted it"
        )
        return RankDiedError(text, death, self.runtime.name)

    def log_of(self, rank: int) -> str:
        """The log rank ``rank`` writes (everything it prints)."""
        return self.file.hosts[self.file.ranks[rank].host].rank_log(rank)

    def describe(self) -> str:
        """A few lines for the notebook."""
        rt = self.runtime
        alive = sum(1 for r in rt.ranks if r.alive)
        text = f"attached mesh {rt.name!r}: {rt.shape.describe()} ({rt.backend}), "
        if self.taken_from is not None:
            text += f"taken over from {self.taken_from.describe()}, "
        elif self.detached_for is not None:
            text += f"after {describe_duration(self.detached_for)} without a kernel, "
        text += f"{alive}/{rt.world} ranks running"
        for rank, status in sorted(self.restarted.items()):
            how = describe_exit(status.code, status.signal)
            text += (
                f"\nrank {rank} died while detached ({how}) and was restarted by its host "
                f"agent {status.restarts} time(s); re-forming it now (process group, actors, "
                "setup cells)"
            )
        for rank, end in self.adopted.ended:
            how = end.reason or describe_exit(end.code, end.signal)
            text += f"\nrank {rank} ended while detached ({how}); the failure policy applies"
        refused = {k: v for k, v in self.refused.items() if v}
        if refused:
            text += "\nattach requests refused so far: " + ", ".join(
                f"{v} {k}" for k, v in sorted(refused.items())
            )
        return text


def _fail_rank(rt: MeshRuntime, rank: int, error: BaseException) -> None:
    """Fail what rank ``rank`` owes (its earlier incarnation ran it; receiving thread)."""
    rt.requests.fail_rank(rank, error)


def _live(rt: MeshRuntime) -> list[int]:
    return [r.rank for r in rt.ranks if r.alive]


def _welcome(rt: MeshRuntime, ranks: list[int]) -> Welcome:
    """Ask ``ranks`` for their history and kept results (each one's history is
    re-emitted as it comes: see :class:`_Answers`)."""
    welcome = Welcome()
    answers = _Answers(rt, ranks, welcome)
    if ranks:
        options = CallOptions(control=True, internal=True)
        rt.request(ranks, {"k": K.ATTACHED}, b"", (), answers, options)
        answers.done.wait(WELCOME_TIMEOUT)
    welcome.silent = sorted(set(ranks) - answers.answered_ranks())
    return welcome
