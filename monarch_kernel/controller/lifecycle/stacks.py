"""Collect every selected rank's Python stacks now: the data behind ``%mesh stacks``.

First each rank's control thread is asked (``stacks``); it answers in milliseconds
unless C code holds the rank's GIL. After :data:`FALLBACK_AFTER` the host agents of the
ranks still silent are asked to make them dump their stacks with ``faulthandler``
(``dump_stacks``, same request id: the agent answers on the rank's behalf, and the
request table keeps whichever answer comes first). At ``timeout`` a rank still silent
gets an error instead of stacks; a dead rank gets the reason of its death. Never raises
for one rank and never waits longer than ``timeout``.
"""

from __future__ import annotations

import linecache
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from monarch_kernel.calls.errors import MeshStoppedError, RankDiedError
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import PLAIN, CallOptions
from monarch_kernel.controller.messaging.receiver import Receiver
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.records import GONE, MeshPhase, RankInfo, slots_by_host
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.stacks import Frame, RankStacks, ThreadStack

__all__ = ["FALLBACK_AFTER", "StacksMesh", "collect_stacks"]

#: Seconds to wait for the ranks' control threads before the faulthandler fallback.
FALLBACK_AFTER = 0.3
#: ... and for a pause in their answers: on a big mesh on few cores answers still come
#: in after FALLBACK_AFTER, and making ranks that are merely late dump their stacks
#: through their agents only adds work (measured at 256 ranks on 2 cores: answers over
#: 0.3-0.8 s). The fallback starts once no answer came for this long, or at the latest
#: at FALLBACK_LATEST of the timeout.
FALLBACK_QUIET = 0.1
FALLBACK_LATEST = 0.6
#: A diagnosis never waits for a restart; silent ranks are reported as such.
_STACKS = CallOptions(what="stacks", control=True, during_restart=True)


class StacksMesh(Protocol):
    """What collecting stacks uses of a mesh (a ``MeshRuntime``): it sends one control
    request, asks host agents directly for the silent ranks, and forgets the request
    on the receiving thread when it gives up on it."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> MeshPhase: ...
    @property
    def ranks(self) -> list[RankInfo]: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def receiver(self) -> Receiver: ...
    @property
    def requests(self) -> RequestTable: ...
    def death_text(self, info: RankInfo) -> str: ...
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


class _Collector:
    """The request's observer: keeps each rank's first answer (runs on the receiving
    thread, so it only stores and wakes the caller, which reads the answers while it
    waits for the others: unpickling 256 ranks' stacks after the last one came in
    added a fifth to ``%mesh stacks``' time)."""

    def __init__(self, ranks: Sequence[int]):
        self.waiting = set(ranks)
        self.fresh: list[Reply] = []  # answers not read yet
        self.replied: set[int] = set()
        self.lost: dict[int, BaseException] = {}
        self.cv = threading.Condition()
        self.last_answer = time.monotonic()  # when the last rank answered (or gave up)

    def on_reply(self, reply: Reply) -> None:
        with self.cv:
            if reply.rank in self.waiting:
                self.waiting.discard(reply.rank)
                self.replied.add(reply.rank)
                self.fresh.append(reply)
                self.last_answer = time.monotonic()
                self.cv.notify_all()

    def on_lost(self, rank: int, error: BaseException) -> None:
        with self.cv:
            if rank in self.waiting:
                self.waiting.discard(rank)
                self.lost[rank] = error
                self.last_answer = time.monotonic()
                self.cv.notify_all()

    def wait(self, end: Callable[[float], float], read: Callable[[Reply], None]) -> set[int]:
        """Wait until every rank answered or the time ``end(last_answer)`` (monotonic),
        handing each answer to ``read`` (on this thread, outside the lock) as it comes;
        returns the ranks left."""
        while True:
            with self.cv:
                while not self.fresh and self.waiting:
                    left = end(self.last_answer) - time.monotonic()
                    if left <= 0:
                        break
                    self.cv.wait(left)
                fresh, self.fresh = self.fresh, []
                left_ranks = set(self.waiting)
                over = not left_ranks or end(self.last_answer) <= time.monotonic()
            for reply in fresh:
                read(reply)
            if over and not fresh:
                return left_ranks

    def close(self) -> None:
        """Ignore what comes from now on."""
        with self.cv:
            self.waiting.clear()


def collect_stacks(
    mesh: StacksMesh, ranks: Sequence[int], timeout: float = 1.0
) -> list[RankStacks]:
    """Every thread's stack of each of ``ranks`` now, in the order of ``ranks``."""
    t0 = time.monotonic()
    ranks = list(dict.fromkeys(ranks))
    done: dict[int, RankStacks] = {}
    if mesh.state.ended:
        for r in ranks:
            done[r] = _failed(mesh, r, f"mesh {mesh.name!r} is stopped")
        return [done[r] for r in ranks]
    for r in ranks:
        if mesh.ranks[r].state in GONE:
            done[r] = _failed(mesh, r, mesh.death_text(mesh.ranks[r]))
    live = [r for r in ranks if r not in done]
    collector = _Collector(live)
    rid = None
    if live:
        try:
            rid = mesh.request(live, {"k": K.STACKS}, b"", (), collector, _STACKS)
        except (RankDiedError, MeshStoppedError) as exc:  # it died or stopped just now
            for r in live:
                info = mesh.ranks[r]
                why = mesh.death_text(info) if info.state in GONE else str(exc)
                done[r] = _failed(mesh, r, why)
            live = []

    def read(reply: Reply) -> None:
        done[reply.rank] = _answered(mesh, reply)

    asked_agent: set[int] = set()
    if live:
        after = t0 + min(FALLBACK_AFTER, timeout)
        latest = max(after, t0 + FALLBACK_LATEST * timeout)
        silent = collector.wait(lambda last: min(max(after, last + FALLBACK_QUIET), latest), read)
        if silent and rid is not None:
            asked_agent = silent
            for host, group in slots_by_host(mesh.ranks, sorted(silent)).items():
                mesh.transport.send_host(host, {"k": K.DUMP_STACKS, "d": group, "i": rid})
            collector.wait(lambda _last: t0 + timeout, read)
    collector.close()
    with collector.cv:
        late, collector.fresh = collector.fresh, []
        answered, lost = len(collector.replied), dict(collector.lost)
    for reply in late:  # came in between the last wait and close()
        read(reply)
    if rid is not None and answered + len(lost) < len(live):
        # Forget the request (on the receiving thread): late answers are dropped.
        mesh.receiver.post(mesh.requests.fail_request, rid, TimeoutError("stacks: too late"))
    for r in live:
        if r not in done:
            done[r] = _unanswered(mesh, r, lost, r in asked_agent, timeout)
    return [done[r] for r in ranks]


def _unanswered(
    mesh: StacksMesh,
    r: int,
    lost: dict[int, BaseException],
    asked_agent: bool,
    timeout: float,
) -> RankStacks:
    """Rank ``r`` gave no stacks: why it was lost, or that it stayed silent."""
    if r in lost:
        info = mesh.ranks[r]
        return _failed(mesh, r, mesh.death_text(info) if info.state in GONE else str(lost[r]))
    how = (
        "its control thread did not answer, and its host agent got no faulthandler dump from it"
        if asked_agent
        else "its control thread did not answer"
    )
    return _failed(mesh, r, f"no answer in {timeout:g}s ({how})")


def _failed(mesh: StacksMesh, rank: int, error: str) -> RankStacks:
    info = mesh.ranks[rank]
    return RankStacks(rank, info.hostname, info.pid, (), "none", error)


def _answered(mesh: StacksMesh, reply: Reply) -> RankStacks:
    r = reply.rank
    info = mesh.ranks[r]
    if not reply.ok:
        report = reply.report or {}
        error = f"{report.get('type', 'Error')}: {report.get('message', '')}"
        return RankStacks(r, info.hostname, info.pid, (), "none", error)
    try:
        threads = reply.value(f"stacks of rank {r}")
    except Exception as exc:  # an answer we cannot read is one bad rank, not a failure
        return RankStacks(r, info.hostname, info.pid, (), "none", str(exc))
    if not isinstance(threads, tuple) or not all(isinstance(t, ThreadStack) for t in threads):
        return RankStacks(r, info.hostname, info.pid, (), "none", "unreadable stacks")
    # The host agent answers for the ranks it made dump with faulthandler (header "h").
    if reply.message.header.get("h") is not None:
        return RankStacks(r, info.hostname, info.pid, _with_lines(threads), "faulthandler")
    return RankStacks(r, info.hostname, info.pid, threads, "python")


def _with_lines(threads: tuple[ThreadStack, ...]) -> tuple[ThreadStack, ...]:
    """faulthandler gives no source lines: read them here where the files exist (the
    same environment on every host, as a rule)."""

    def line(f: Frame) -> Frame:
        if f.line or f.filename.startswith("<") or f.lineno <= 0:
            return f
        text = linecache.getline(f.filename, f.lineno).strip()
        return Frame(f.filename, f.lineno, f.function, text) if text else f

    return tuple(
        ThreadStack(t.name, t.ident, t.main, tuple(line(f) for f in t.frames)) for t in threads
    )
