"""The controller's per-process-mesh state of the tensor engine: :class:`Client`.

One client per process mesh (its requester) hands out refs and sequence numbers, buffers
the records of the ops issued on the mesh's ranks and sends them as one ``tensor_ops``
message per batch (fire and forget: never a round trip per op), queues the refs of mesh
tensors the notebook dropped, keeps where each op was issued (for errors), and makes the
fetches.

Invariants:

* Records for a set of ranks leave in issue order; the buffer holds records for one set of
  ranks at a time (an op on another set sends the buffer first), so each rank sees its ops
  in order.
* A drop is sent after every op that used the ref: the drop is queued when the notebook
  let go of the tensor, after it issued those ops, and goes at the end of a batch (or
  alone, before a batch for other ranks starts).
* A fetch goes to every rank of its mesh after everything issued before it.
* An op that fails on a rank is shown once when nothing fetched it: when a notebook
  cell ends, :meth:`Client.report` asks the ranks that ran ops since the last report for
  their new root errors (after all sent before), waits up to :data:`REPORT_WAIT` for
  them (what comes later is shown at a later cell's end) and leaves out those a fetch
  already raised. Ranks answer reports in order and forget what they answered, so each
  error comes once. Outside a notebook (a script) the same errors are raised by
  :meth:`Client.shutdown` (Monarch's ``device_mesh.client.shutdown()``) and written to
  stderr at the interpreter's exit (:func:`report_at_exit`), each once.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch.utils._python_dispatch import _disable_current_modes

from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import Gather
from monarch_kernel.calls.reply import Reply
from monarch_kernel.calls.requester import CallOptions, Requester
from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import CellReport, Frame, RemoteException, Unfetched
from monarch_kernel.wire.codec import Header
from monarch_kernel.wire.headers import TensorOps, TensorStop
from monarch_kernel.wire.tensor_ops import (
    ALL_SHARDS,
    Drop,
    Fetch,
    FetchReply,
    JoinWorld,
    RankError,
    Record,
    Report,
    ReportReply,
    Resume,
)

#: Records buffered before a batch is sent without waiting for a fetch.
FLUSH_OPS = 256
#: Dropped refs that make the next op send its batch (with the drops).
FLUSH_DROPS = 1024
#: How many ops' controller frames are kept for error messages (oldest forgotten first).
MAX_FRAMES = 50_000
#: Frames kept per op (innermost user frames).
FRAMES_PER_OP = 6

#: Seconds a cell's end waits for its ops to finish on the ranks, to show their errors
#: under it; errors of ops still running then are shown at a later cell's end.
REPORT_WAIT = 30.0
#: Seconds a process mesh's ``stop()`` waits for its ranks to run the ops issued, to
#: show the errors nothing fetched before the ranks are gone.
STOP_REPORT_WAIT = 3.0
#: Seqs of errors already raised or shown that are remembered (oldest forgotten first).
MAX_SHOWN = 10_000
#: Seconds :meth:`Client.shutdown` waits for the ranks to run what was issued (Monarch's
#: shutdown waits 60 s too).
SHUTDOWN_WAIT = 60.0

#: Records that are not ops (not counted as issued, nor as run by the ranks).
_NOT_OPS = (Drop, Resume)

_FETCH_OPTIONS = CallOptions(what="fetch_shard", waited=True)
_REPORT_OPTIONS = CallOptions(what="tensor-engine errors at cell end")

#: Filenames of frames that are not the user's (torch, this package).
_SKIP_PREFIXES: tuple[str, ...] = ()


def _skip_prefixes() -> tuple[str, ...]:
    global _SKIP_PREFIXES
    if not _SKIP_PREFIXES:
        import os

        import torch

        here = os.path.dirname(os.path.abspath(__file__))
        _SKIP_PREFIXES = (os.path.dirname(torch.__file__), here, "<frozen ")
    return _SKIP_PREFIXES


def user_frames() -> tuple[Frame, ...]:
    """The innermost frames of the caller outside torch and the tensor engine,
    outermost first (cheap: no source lines read)."""
    skip = _skip_prefixes()
    frame = sys._getframe(1)
    found: list[Frame] = []
    while frame is not None and len(found) < FRAMES_PER_OP:
        code = frame.f_code
        if not code.co_filename.startswith(skip):
            found.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back  # type: ignore[assignment]
    found.reverse()
    attributed = state.this_thread.frames
    if attributed is not None:  # a grad_generator's backward thread: its caller's line
        own = tuple(f for f in found if f[0] != threading.__file__)
        return (attributed + own)[-FRAMES_PER_OP:]
    return tuple(found)


@dataclass(frozen=True, slots=True)
class Fetched:
    """What a fetch brought back: the shard's values (one per fetched ref); for a fetch
    of every shard, ``every`` holds each rank's (in the mesh's rank order)."""

    values: list[Any]
    every: list[list[Any]] | None = None


@runtime_checkable
class Interruptible(Protocol):
    """What a mesh's requester offers the stop button (the notebook's meshes do; a
    rank's reference to a mesh does not)."""

    def signal_ranks(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (through their host agents)."""
        ...

    def send_control(self, rank: int, header: Header, payload: bytes = b"") -> None:
        """Send to ``rank``'s control thread (served while its main thread is busy)."""
        ...


class Client:
    """The tensor engine's state for one process mesh (see the module docstring)."""

    def __init__(self, requester: Requester):
        self.requester = requester
        self._lock = threading.RLock()
        self._next_ref = 0
        self.seq = 0
        self._pending: list[Record] = []
        self._pending_ranks: tuple[int, ...] = ()
        #: (ranks, ref) of mesh tensors the notebook dropped; appended from ``__del__``
        #: (any thread, any time: a deque's append is atomic), taken by :meth:`flush`.
        self._dropped: collections.deque[tuple[tuple[int, ...], int]] = collections.deque()
        #: a drop of a tensor on other ranks than the batch's waits (see :meth:`issue`)
        self._foreign_drops = False
        #: ``Drop`` records among ``_pending`` (not ops: :meth:`issued_to` skips them)
        self._buffered_drops = 0
        self._frames: dict[int, tuple[Frame, ...]] = {}
        self.ops_issued = 0
        self.messages_sent = 0
        #: ops sent to each rank (the dashboard's count; :meth:`issued_to` adds those
        #: still buffered)
        self.sent_to: collections.Counter[int] = collections.Counter()
        #: ranks sent ops (not only drops) since the last report
        self._unreported_ranks: set[int] = set()
        #: ranks sent ops since the last :meth:`interrupt` check (a notebook cell's end)
        self._cell_ranks: set[int] = set()
        #: report requests not all answered yet, oldest first
        self._reports: list[_Report] = []
        #: the report sent since the last :meth:`report`, if any (then it waits)
        self._fresh: _Report | None = None
        #: seqs of failed ops a fetch raised or a report showed (insertion-ordered)
        self._shown: dict[int, None] = {}
        #: each storage's tensors and what they may do (borrows), by the fakes' storage
        self.aliases: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        #: whether every rank was told to join the default process group
        self._world_joined = False
        #: :meth:`shutdown` was called (Monarch's ``has_shutdown``)
        self.has_shutdown = False

    # -- naming ----------------------------------------------------------------------
    def new_ref(self) -> int:
        """A fresh mesh tensor ref."""
        ref = self._next_ref
        self._next_ref = ref + 1
        return ref

    def new_seq(self) -> int:
        """A fresh op sequence number; remembers where in the notebook it was issued."""
        seq = self.seq
        self.seq = seq + 1
        frames = self._frames
        frames[seq] = user_frames()
        if len(frames) > MAX_FRAMES:
            for old in list(frames)[: MAX_FRAMES // 2]:
                del frames[old]
        return seq

    def frames(self, seq: int) -> tuple[Frame, ...]:
        """Where op ``seq`` was issued (empty once forgotten)."""
        return self._frames.get(seq, ())

    # -- sending ---------------------------------------------------------------------
    def issue(self, ranks: tuple[int, ...], record: Record) -> None:
        """Queue ``record`` for ``ranks`` (sent in order, batched)."""
        with self._lock:
            if (
                (self._pending or self._dropped) and ranks != self._pending_ranks
            ) or self._foreign_drops:
                # A batch for other ranks, or drops of tensors on other ranks: what is
                # buffered goes first, drops included (a drop may always wait; sent
                # before the ops issued after it, the ranks' memory follows the notebook).
                self._flush_locked()
            elif self._dropped:
                self._drops_first(ranks)
            self._pending_ranks = ranks
            self._pending.append(record)
            self.ops_issued += 1
            ops = len(self._pending) - self._buffered_drops
            if ops >= FLUSH_OPS or len(self._dropped) >= FLUSH_DROPS:
                self._flush_locked()

    def _drops_first(self, ranks: tuple[int, ...]) -> None:
        """The refs dropped since the last op, on ``ranks`` (those of the batch), go in
        the batch before the next op (Monarch sends its drops before the next message):
        what a rank frees with a tensor (an ``OpaqueRef``'s object, weakly keyed by its
        local tensor) is gone when the ops issued after the drop run. A few bytes a
        record (the pickle names the class once); ``FLUSH_OPS`` counts ops only."""
        mine: list[int] = []
        other = []
        dropped = self._dropped
        while dropped:  # (``__del__`` may append meanwhile, from any thread)
            entry = dropped.popleft()
            if entry[0] == ranks:
                mine.append(entry[1])
            else:
                other.append(entry)  # a foreign drop: the next issue sends the batch
        dropped.extend(other)
        if mine:
            self._pending.append(Drop(tuple(mine)))
            self._buffered_drops += 1

    def join_world(self) -> None:
        """Before the first collective or transfer: every rank of the process mesh joins
        its default process group (once; the ranks skip it when they have one)."""
        if not self._world_joined:
            self._world_joined = True
            self.issue(tuple(self.requester.shape.ranks()), JoinWorld())

    def drop(self, ranks: tuple[int, ...], ref: int) -> None:
        """The notebook let go of mesh tensor ``ref`` (safe from ``__del__``)."""
        self._dropped.append((ranks, ref))
        if ranks != self._pending_ranks:
            self._foreign_drops = True

    def flush(self) -> None:
        """Send what is buffered (ops, then drops)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        with held_sigint():  # a Ctrl-C mid-send would lose the batch, or send it twice
            self._flush_held()

    def _flush_held(self) -> None:
        self._foreign_drops = False
        drops: dict[tuple[int, ...], list[int]] = {}
        dropped = self._dropped
        while dropped:
            ranks, ref = dropped.popleft()
            drops.setdefault(ranks, []).append(ref)
        pending, ranks = self._pending, self._pending_ranks
        if pending or ranks in drops:
            mine = drops.pop(ranks, None)
            if mine:
                pending.append(Drop(tuple(mine)))
            self._pending = []
            self._buffered_drops = 0
            self._send(ranks, pending)
        for other, refs in drops.items():  # no ops pending there: order is kept
            self._send(other, [Drop(tuple(refs))])

    def _send(self, ranks: Sequence[int], records: list[Record]) -> None:
        with _disable_current_modes():  # constants pickle as plain tensors
            payload = pickle.dumps(records, protocol=5)
        header = TensorOps(count=len(records)).encode()
        self.requester.send(list(ranks), header, payload, ())
        self.messages_sent += 1
        ops = sum(1 for r in records if type(r) not in _NOT_OPS)
        if ops:
            sent = self.sent_to
            for rank in ranks:
                sent[rank] += ops
        if len(records) > 1 or type(records[0]) is not Drop:
            self._unreported_ranks.update(ranks)
            self._cell_ranks.update(ranks)

    def issued_to(self, rank: int) -> int:
        """How many ops were issued to global rank ``rank``: sent, or buffered here
        (what the ranks count as run, ``TensorWorker.ops_done``, counts the same)."""
        buffered = len(self._pending) - self._buffered_drops if rank in self._pending_ranks else 0
        return self.sent_to.get(rank, 0) + buffered

    # -- the stop button ---------------------------------------------------------------
    def cell_ended(self, interrupted: bool) -> None:
        """A notebook cell ended; ``interrupted``: by the stop button. Then the ranks
        that were sent ops in it, or still run those of an earlier cell (a report sent
        after them is not answered yet), are interrupted (SIGINT, through the mesh's
        ``signal_ranks``: a rank running no ops ignores it) and told to resume after
        what was sent: the ops still queued there do not run (their outputs hold the
        interruption, which a fetch raises) and the mesh stays usable."""
        with self._lock:
            cell, self._cell_ranks = self._cell_ranks, set()
            if not interrupted:
                return
            running = {r for report in self._reports for r in report.waiting()}
            ranks = sorted(cell | running)
            if ranks:
                self._interrupt_locked(ranks)

    def interrupt(self, ranks: Sequence[int]) -> None:
        """Interrupt ``ranks`` (``ProcMesh.interrupt()``): what they run stops (the
        tensor-engine ops sent so far among it: their outputs hold the interruption),
        and they run the ops sent after this again."""
        with self._lock:
            self._interrupt_locked(sorted(ranks))

    def _interrupt_locked(self, ranks: list[int]) -> None:
        """Stop ``ranks``' ops sent so far: ``tensor_stop`` to their control threads (the
        ops not run yet do not run, wherever they wait) and SIGINT (through the mesh's
        ``signal_ranks``: stops the op running; a rank running no ops ignores it), then
        :class:`Resume` after what was sent (lock held)."""
        self._flush_locked()
        through = self.seq - 1  # the last op issued (all sent now)
        requester = self.requester
        if isinstance(requester, Interruptible):
            if through >= 0:
                stop = TensorStop(through=through).encode()
                for rank in ranks:
                    requester.send_control(rank, stop)
            requester.signal_ranks(ranks, signal.SIGINT)
        self._pending_ranks = tuple(ranks)
        self._pending.append(Resume(through))
        self._flush_locked()

    # -- values back -----------------------------------------------------------------
    def fetch(self, ranks: tuple[int, ...], refs: tuple[int, ...], shard: int) -> Future[Fetched]:
        """Fetch ``refs`` from rank ``shard``; every rank of ``ranks`` answers (after all
        it was sent before), and an error any of them holds for a ref fails the fetch."""
        with self._lock, held_sigint():
            self._flush_held()
            gather = Gather(list(ranks), None, self.requester.waiter)
            out: Future[Fetched] = Future(
                lambda _: self._finish(gather, ranks, shard), self.requester.waiter
            )
            gather.future.add_done_callback(lambda _: _complete(out))
            payload = pickle.dumps([Fetch(refs, shard)], protocol=5)
            header = TensorOps(count=1).encode()
            self.requester.request(list(ranks), header, payload, (), gather, _FETCH_OPTIONS)
            self.messages_sent += 1
        return out

    def _finish(self, gather: Gather, ranks: tuple[int, ...], shard: int) -> Fetched:
        # unpickled as plain local tensors, even while a mesh is active
        with _disable_current_modes():
            return self._finish_plain(gather, ranks, shard)

    def _finish_plain(self, gather: Gather, ranks: tuple[int, ...], shard: int) -> Fetched:
        replies: list[FetchReply] = gather.future.get().values()  # type: ignore[assignment]
        errors: list[RankError] = [err for reply in replies for _, err in reply.errors]
        if errors:
            # the root cause: the earliest op that failed (a missing ref has seq -1)
            root = min(errors, key=lambda e: (e.seq < 0, e.seq, e.rank))
            self._mark_shown(root.seq)
            raise RemoteException(root, self.frames(root.seq))
        if shard == ALL_SHARDS:
            every = [r.values or [] for r in replies]
            return Fetched(every[0], every)
        values = replies[ranks.index(shard)].values
        assert values is not None
        return Fetched(values)

    # -- errors nothing fetched ------------------------------------------------------
    def _mark_shown(self, seq: int) -> None:
        shown = self._shown
        shown[seq] = None
        if len(shown) > MAX_SHOWN:
            for old in list(shown)[: MAX_SHOWN // 2]:
                del shown[old]

    def start_report(self) -> None:
        """Send what is buffered and ask the ranks that ran ops since the last report
        for the errors of those that failed (see :meth:`report`)."""
        with self._lock:
            self._flush_locked()
            ranks = sorted(self._unreported_ranks)
            if not ranks:
                return
            self._unreported_ranks = set()
            report = _Report(ranks, self.requester.waiter)
            payload = pickle.dumps([Report()], protocol=5)
            header = TensorOps(count=1).encode()
            self.requester.request(ranks, header, payload, (), report, _REPORT_OPTIONS)
            self.messages_sent += 1
            self._reports.append(report)
            self._fresh = report

    def report(self, deadline: float) -> CellReport:
        """The errors of failed ops that the answered reports bring and no fetch raised
        (each shown once). When :meth:`start_report` sent one since the previous call,
        waits for the pending reports until ``deadline`` (``time.monotonic``); else only
        takes those answered (a rank busy for long delays the ends of the cells that
        issue ops, not of every cell). Reports not answered yet are read by a later
        call. One entry per failed op: the lowest rank's error, with every rank it
        failed on."""
        fresh, self._fresh = self._fresh, None
        if fresh is not None:
            for pending in self._reports:
                try:
                    pending.future.get(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    break
        errors: list[RankError] = []
        more = 0
        kept = []
        for report in self._reports:
            if not report.future.done():
                kept.append(report)
                continue
            failed, extra = report.failed()
            errors.extend(failed)
            more += extra
        self._reports = kept
        by_seq: dict[int, list[RankError]] = {}
        for err in errors:
            if err.seq not in self._shown:
                by_seq.setdefault(err.seq, []).append(err)
        unfetched = []
        for seq in sorted(by_seq):
            found = sorted(by_seq[seq], key=lambda e: e.rank)
            self._mark_shown(seq)
            unfetched.append(
                Unfetched(RemoteException(found[0], self.frames(seq)), tuple(e.rank for e in found))
            )
        return CellReport(unfetched, more)

    def unfinished(self) -> bool:
        """Whether a report asked of the ranks is not answered yet (they still run ops
        issued before it): errors of those ops are not known yet."""
        return any(not r.future.done() for r in self._reports)

    def shutdown(self, wait: float = SHUTDOWN_WAIT) -> None:
        """Monarch's ``device_mesh.client.shutdown()``: send what is buffered, wait (up
        to ``wait`` seconds) until the ranks ran every op issued, and raise the
        :class:`RemoteException` of the first failed op that nothing fetched (where it
        was issued, and the rank's traceback; the others, if any, in its notes). Each
        is raised or shown once: the interpreter's exit does not show them again. The
        mesh keeps running (its process mesh's ``stop()`` stops the ranks); ops issued
        later are reported at a later ``shutdown()``, a notebook cell's end or exit."""
        self.has_shutdown = True
        deadline = time.monotonic() + wait
        self.start_report()
        for pending in list(self._reports):  # (those of earlier cells' ends too)
            try:
                pending.future.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        got = self.report(deadline)
        if got.unfetched:
            first = got.unfetched[0]
            error = first.error
            for other in got.unfetched[1:]:
                error.add_note(f"and another op nothing fetched failed:\n{other.error}")
            if got.more:
                error.add_note(f"and {got.more} more op failures the ranks did not keep")
            raise error
        if self.unfinished():
            raise TimeoutError(
                f"shutdown: the ranks of mesh {self.requester.name!r} did not run the ops "
                f"issued within {wait:g}s; their errors, if any, are not known yet (fetch "
                "a value, or call shutdown() again to wait longer)"
            )


class _Report:
    """The observer of a report request: each rank's answer, done once every rank
    answered or was lost (a lost rank's errors are gone with it)."""

    def __init__(self, ranks: list[int], waiter: Any):
        self._lock = threading.Lock()
        self._waiting = set(ranks)
        self._replies: list[Reply] = []
        self.future: Future[None] = Future(None, waiter)

    def on_reply(self, reply: Reply) -> None:
        self._answered(reply.rank, reply)

    def waiting(self) -> list[int]:
        """The ranks that have not answered: they still run the ops sent before it."""
        with self._lock:
            return list(self._waiting)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self._answered(rank, None)

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (elastic meshes)."""
        with self._lock:
            self._waiting = {mapping.get(r, -1 - r) for r in self._waiting}

    def _answered(self, rank: int, reply: Reply | None) -> None:
        with self._lock:
            if reply is not None:
                self._replies.append(reply)
            self._waiting.discard(rank)
            done = not self._waiting
        if done:
            self.future.set_result(None)

    def failed(self) -> tuple[list[RankError], int]:
        """The root errors the ranks answered, and how many more they left out."""
        errors: list[RankError] = []
        more = 0
        for reply in self._replies:
            if not reply.ok:
                continue
            try:
                value = reply.value("the tensor-engine errors at cell end")
            except Exception:
                continue
            if isinstance(value, ReportReply):
                errors.extend(value.failed)
                more += value.more
        return errors, more


def _complete(fut: Future[Any]) -> None:
    fut.set_result(None)


@contextlib.contextmanager
def held_sigint() -> Iterator[None]:
    """Hold Ctrl-C (the stop button) back on the main thread until the block ends, then
    raise it: what is sent to the ranks is sent whole, once, and recorded as sent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_DFL / SIG_IGN raise nothing in Python
        yield
        return
    got: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got:
            previous(*got[0])


#: requester id -> its client (the requester is held by the client)
_clients: dict[int, Client] = {}
_clients_lock = threading.Lock()


def client_for(requester: Requester) -> Client:
    """The one :class:`Client` of ``requester``'s process mesh."""
    with _clients_lock:
        client = _clients.get(id(requester))
        if client is None or client.requester is not requester:
            client = _clients[id(requester)] = Client(requester)
        return client


def existing_client(requester: object) -> Client | None:
    """The :class:`Client` of ``requester``'s process mesh if the tensor engine was
    used on it (made none: the dashboard asks for every mesh)."""
    client = _clients.get(id(requester))
    return client if client is not None and client.requester is requester else None


def cells_ended(interrupted: bool) -> None:
    """A notebook cell ended (see :meth:`Client.cell_ended`), for every client."""
    for client in list(_clients.values()):
        try:
            client.cell_ended(interrupted)
        except Exception:  # a stopped mesh: nothing runs there
            pass


def report_all(wait: float | None = None) -> CellReport:
    """A cell ended: send every client's buffered ops, and the errors of failed ops that
    nothing fetched (waiting up to ``wait`` seconds, :data:`REPORT_WAIT` by default, in
    all for the ranks to run them). ``KeyboardInterrupt`` while waiting leaves the rest
    to a later call."""
    clients = list(_clients.values())
    for client in clients:
        try:
            client.start_report()
        except Exception:  # a stopped mesh: its ops have nowhere to go
            client._reports.clear()
    deadline = time.monotonic() + (REPORT_WAIT if wait is None else wait)
    out = CellReport([], 0)
    for client in clients:
        try:
            got = client.report(deadline)
        except Exception:  # a mesh stopped meanwhile
            client._reports.clear()
            continue
        out.unfetched.extend(got.unfetched)
        out.more += got.more
    return out


def report_before_stop(requester: object) -> None:
    """``requester``'s process mesh is about to stop: write to stderr (under the cell,
    in a notebook) the errors of its failed ops that nothing fetched, raised or showed,
    waiting up to :data:`STOP_REPORT_WAIT` for its ranks to run the ops issued (a mesh
    is often stopped because it is stuck); once the ranks are gone nobody could tell
    them any more. Nothing if the tensor engine was not used on it; the stop button
    while it waits skips the report, not the stop."""
    client = existing_client(requester)
    if client is None:
        return
    try:
        client.start_report()
        got = client.report(time.monotonic() + STOP_REPORT_WAIT)
        unfinished = client.unfinished()
    except KeyboardInterrupt:
        return
    except Exception:  # the mesh is gone already: nothing to ask
        return
    text = got.text()
    if unfinished:
        text += (
            f"Warning: the ranks of mesh {client.requester.name!r} were still running "
            f"tensor-engine ops when it was stopped (after {STOP_REPORT_WAIT:g}s): errors "
            "of those ops, if any, are not shown.\n"
        )
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()


#: Seconds the interpreter's exit waits for the ranks to run the ops issued (a script),
#: to show the errors of those that failed and nothing fetched.
EXIT_WAIT = REPORT_WAIT
_exit_hook: list[bool] = []


def report_at_exit() -> None:
    """Outside a notebook: at the interpreter's exit, write to stderr the errors of
    failed ops that nothing fetched, raised or showed (Monarch raises them when its
    client shuts down at exit). Registered once, with ``atexit``, by the first device
    mesh of a script (:func:`watch_exit`); before the meshes' own exit handlers, which
    stop the ranks (``atexit`` runs the last registered first)."""
    try:
        got = report_all(EXIT_WAIT)
    except KeyboardInterrupt:  # Ctrl-C at exit: do not wait for the ranks
        return
    except Exception:  # the meshes are gone: nothing to ask
        return
    text = got.text()
    left = [c.requester.name for c in list(_clients.values()) if c.unfinished()]
    if left:
        text += (
            f"Warning: the ranks of mesh(es) {', '.join(map(repr, left))} were still "
            f"running tensor-engine ops at exit (after {EXIT_WAIT:g}s): errors of those "
            "ops, if any, are not shown.\n"
        )
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()


def watch_exit() -> None:
    """Register :func:`report_at_exit` (once per process)."""
    if not _exit_hook:
        import atexit

        _exit_hook.append(True)
        atexit.register(report_at_exit)
