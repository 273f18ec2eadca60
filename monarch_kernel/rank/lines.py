"""Which thread runs each actor message of a rank, and the actors' lines (a part of the
:class:`~monarch_kernel.rank.inbox.Inbox`; the threads are
:mod:`monarch_kernel.rank.runners`).

Every actor handles its messages one at a time, in order (Monarch): a message to an
actor that is busy waits in that actor's line (:attr:`Lines.waiting`) and the thread
that ends the actor's current message starts the next one (:meth:`Lines.leave`). A
message to a free actor runs (:meth:`Lines.place`):

* on the thread that read it, when that is the main thread, free (not inside a wait
  of user code): the fast path, nothing handed over;
* an ``async def`` one as a task of the rank's event loop, on the thread that runs
  that loop: the main thread while it is free or awaiting, else a worker that runs the
  loop while the main thread is held (:meth:`Lines.to_loop`);
* a sync one (endpoint, constructor, ``__supervise__``, ``__cleanup__``) read while
  the main thread waits or is held: on a worker of its own, which then serves that
  actor's line;
* a call from another rank to an actor whose sync endpoint waits (``.get()``) on some
  thread runs inside that wait, on that thread (re-entrant: a cycle of calls between
  meshes completes); if that endpoint is not waiting, it waits in the line.

All of this state is shared by those threads and guarded by :attr:`Lines.lock` (never
held while user code runs).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import select
import selectors
import threading
from collections.abc import Callable
from typing import Any

import zmq

from monarch_kernel.rank.runners import Relief, Runners, Wake
from monarch_kernel.wire import Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K


class RunKind(enum.IntEnum):
    """How an actor message runs (``ActorHost.kind_of``). Int-valued: compared on
    every message of the rank's hot path."""

    #: returns at once on any thread (a ``@concurrent_endpoint`` call, a stop without
    #: ``__cleanup__``, an error)
    QUICK = 0
    #: runs user code on one thread until it returns
    SYNC = 1
    #: runs as a task of the rank's event loop
    ASYNC = 2


class Placement(enum.IntEnum):
    """Where :meth:`Lines.place` runs a message."""

    #: on this thread, now
    HERE = 0
    #: on a worker thread
    WORKER = 1
    #: as a task of the rank's event loop
    LOOP = 2
    #: not now: in a line or a waiting thread's mailbox
    KEPT = 3
    #: here, by the main thread's fast path of :meth:`Lines.route` (counted in)
    FAST = 4


# The members by name, as the modules of the rank's message path compare them.
QUICK, SYNC, ASYNC = RunKind.QUICK, RunKind.SYNC, RunKind.ASYNC
HERE, WORKER, LOOP, KEPT, FAST = (
    Placement.HERE,
    Placement.WORKER,
    Placement.LOOP,
    Placement.KEPT,
    Placement.FAST,
)
#: A holder not started yet (a worker was asked to run the actor's message).
_STARTING = -1
#: Messages the inbox keeps in the actors' lines (or for the main thread) at most while
#: a handler runs: beyond, it reads no more, so that the senders feel the back-pressure
#: of a rank that does not keep up (the controller's bounded backlog waits for room).
MAX_KEPT = 10_000

#: Controller messages that go to one actor (named by :func:`actor_of`): they keep that
#: actor's order (a busy actor's wait in its line); other actors' do not wait for them.
#: Every other kind (cells, ``push`` ...) runs on the main thread.
ACTOR_KINDS = frozenset({K.CALL, K.SPAWN_ACTOR, K.STOP_ACTOR, K.SUPERVISE})

Line = collections.deque[tuple[Message, H.Ordered]]


def actor_of(hdr: H.Ordered) -> str:
    """The actor an :data:`ACTOR_KINDS` message goes to."""
    if type(hdr) is H.Call:
        return hdr.actor
    if isinstance(hdr, H.Supervise):
        return hdr.owner_name
    return str(getattr(hdr, "actor", ""))


def _always_sync(hdr: H.Ordered) -> RunKind:
    return SYNC


class Lines:
    """The scheduling part of the inbox (see the module docstring)."""

    # provided by the Inbox
    sock: zmq.Socket[bytes]
    rank: int
    loop: asyncio.AbstractEventLoop | None
    pump: Callable[[], None]
    inbox_fds: Callable[[], list[int]]
    run_saved: Callable[[Message, H.Ordered], None]

    def init_lines(self, local_rank: int) -> None:
        """Set up (on the main thread)."""
        self.main_ident = threading.get_ident()
        #: Guards what follows (and ``deferred``) across the threads that run actors.
        self.lock = threading.Lock()
        #: actor -> how many of its messages run now (on a thread, or tasks of the
        #: event loop); absent when it is free. The rank's ``ActorHost.busy``.
        self.busy: dict[str, int] = {}
        #: Messages to an actor that was busy when they came, in order, per actor
        #: (absent when empty); the rank's ``ActorHost.waiting``.
        self.waiting: dict[str, Line] = {}
        #: How many messages wait in those lines (see :data:`MAX_KEPT`).
        self.kept = 0
        self._draining: set[str] = set()
        #: actor -> the thread that runs a sync message of it now (``_STARTING``: a
        #: worker that has not started yet)
        self.holders: dict[str, int] = {}
        #: thread -> (messages for the actor it holds, its wake-up) while its endpoint
        #: waits in ``.get()`` and another thread reads the inbox (re-entrant calls)
        self.mailboxes: dict[int, tuple[Line, Wake]] = {}
        #: How an actor message runs (``ActorHost.kind_of``: QUICK, SYNC, ASYNC).
        self.kind_of: Callable[[H.Ordered], int] = _always_sync  # a RunKind
        #: The thread that reads the socket: the main thread, or the relief thread
        #: while the main thread is held.
        self.reader = self.main_ident
        #: Whether the main thread reads the inbox itself now (idle, or waiting in
        #: ``.get()`` or the event loop's ``select``), for the relief thread.
        self.responsive = True
        #: Counts the main thread's entries into user code (the relief thread compares).
        self.serial = 0
        #: The main thread wants the socket back from the relief thread.
        self.want_back = False
        self._handed_back = threading.Event()
        #: How deep the main thread is in waits that read the inbox (``serve_until``,
        #: the event loop): a sync message it reads there runs on a worker.
        self.wait_depth = 0
        #: The main thread runs a message that is not an actor's (a cell): the relief
        #: thread starts none of the controller's messages meanwhile.
        self.exclusive = False
        #: The thread that runs the event loop now (None: nobody), how deep the main
        #: thread is in it, and how to stop a worker that runs it.
        self.loop_owner: int | None = None
        self._loop_depth = 0
        self._runner_stop: asyncio.Future[None] | None = None
        self._runner_pending = False
        self.want_loop = False
        self._loop_free = threading.Event()
        self._loop_free.set()
        self._reader_on = False
        self._main_wake: Wake | None = None
        self.local_rank = local_rank
        #: The relief thread naps (it found the main thread responsive at its last
        #: looks): the main thread wakes it when it is held again (``main_held``).
        self.relief_napping = False
        #: The actor the main thread's fast path counted in for the handler it runs
        #: next (``route``; taken by that handler's ``enter``, else released after it).
        self._entered: str | None = None
        self.runners: Runners | None = None
        self.relief: Relief | None = None

    # -- threads --------------------------------------------------------------------
    def start_threads(self) -> None:
        """Start the workers' pool and the relief thread (with the rank's first actor)."""
        with self.lock:
            if self.relief is not None:
                return
            self.runners = Runners(self._device_index)
            self.relief = Relief(self)
        self.relief.start()

    def _device_index(self) -> int | None:
        import sys

        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return None
        return int(self.local_rank % torch.cuda.device_count())

    def full(self, deferred: int) -> bool:
        """Whether the inbox keeps as much as it may (:data:`MAX_KEPT`): read no more."""
        return self.kept >= MAX_KEPT or deferred >= MAX_KEPT

    def main_held(self) -> None:
        """The main thread goes back to user code (held until it waits or returns)."""
        self.responsive = False
        self.serial += 1
        if self.relief_napping:
            self.wake_relief()

    def wake_relief(self) -> None:
        """Wake the relief thread from its nap (the main thread is held again)."""
        relief = self.relief
        self.relief_napping = False
        if relief is not None:
            relief.nap.set()

    def take_over(self, serial: int) -> bool:
        """The relief thread takes the socket if the main thread is still held by the
        user code it entered at ``serial``."""
        with self.lock:
            if self.responsive or self.serial != serial or self.reader != self.main_ident:
                return False
            if self.want_back:
                return False
            self.reader = threading.get_ident()
            return True

    def hand_back(self) -> None:
        """The relief thread gives the socket back to the main thread and wakes it."""
        with self.lock:
            self.reader = self.main_ident
        self._handed_back.set()
        wake = self._main_wake
        if wake is not None:
            wake()
        loop = self.loop
        if loop is not None and self.loop_owner == self.main_ident:
            loop.call_soon_threadsafe(self.pump)

    def reclaim(self) -> None:
        """The main thread takes the socket back from the relief thread."""
        relief = self.relief
        while self.reader != self.main_ident and relief is not None:
            self.want_back = True
            relief.wake()
            self._handed_back.wait(0.05)
            self._handed_back.clear()
        self.want_back = False

    # -- where a message runs ---------------------------------------------------------
    def route(self, msg: Message, hdr: H.Ordered, ordered: bool) -> Placement:
        """Where actor message ``msg`` runs (:meth:`place`): HERE or FAST (the caller
        runs it now; FAST: counted in already), or it was handed on (a worker, the
        event loop) or kept (a line, a mailbox). ``ordered``: it keeps its actor's
        order (from the controller, or a batch); else it is another rank's call (see
        the module docstring)."""
        if self.relief is None:
            self.start_threads()
        name = hdr.actor if type(hdr) is H.Call else actor_of(hdr)  # type: ignore[attr-defined,unused-ignore]
        me = threading.get_ident()
        if me == self.main_ident and not self.wait_depth and self.loop_owner is None:
            # The fast path: the main thread is free (and so is the event loop): a free
            # actor's message runs here, whatever its kind, counted in now (the
            # handler's own ``enter`` is this one: ``_entered``)
            lock = self.lock
            lock.acquire()  # (not ``with``: half its cost, on every call)
            try:
                busy = self.busy
                if name not in busy and name not in self.waiting:
                    busy[name] = 1
                    self.holders[name] = me
                    self._entered = name
                    return FAST
            finally:
                lock.release()
        kind = self.kind_of(hdr)
        with self.lock:
            busy = self.busy
            if name in busy or name in self.waiting:
                if ordered:
                    self.waiting.setdefault(name, collections.deque()).append((msg, hdr))
                    self.kept += 1
                    return KEPT
                holder = self.holders.get(name)
                if holder == me:
                    return HERE  # re-entrant: inside its own endpoint's wait
                if holder is not None:
                    box = self.mailboxes.get(holder)
                    if box is not None:  # its endpoint waits on that thread: there
                        box[0].append((msg, hdr))
                        box[1]()
                        return KEPT
                    self.waiting.setdefault(name, collections.deque()).append((msg, hdr))
                    self.kept += 1
                    return KEPT
                # busy with tasks of the event loop: a call starts at once (they
                # interleave at ``await``, as before)
            where = self.place(kind, me)
            if kind == SYNC:
                self.holders[name] = me if where == HERE else _STARTING
            else:
                self.holders.pop(name, None)
            if where != HERE:
                busy[name] = busy.get(name, 0) + 1  # reserved for the thread that runs it
        if where == WORKER:
            self._to_worker(name, msg, hdr)
        elif where == LOOP:
            self.to_loop(name, msg, hdr)
        return where

    def place(self, kind: int, me: int) -> Placement:
        """Where a message of ``kind`` to a free actor runs, read on thread ``me``."""
        if kind == QUICK:
            return HERE
        running = asyncio._get_running_loop()
        if kind == ASYNC:
            if running is not None and running is self.loop:
                return HERE  # a task of the loop this thread runs
            if me == self.main_ident and self.loop_owner in (None, me):
                return HERE  # the main thread runs the loop for it
            return LOOP
        if me == self.main_ident:
            return HERE if self.wait_depth == 0 else WORKER
        runners = self.runners
        if running is None and runners is not None and runners.current() is not None:
            return HERE  # a worker serving its actor's line
        return WORKER

    def enter(self, name: str) -> None:
        """A message of actor ``name`` starts (any thread; counted in already when the
        main thread's fast path routed it here: ``_entered``)."""
        if self._entered == name:
            self._entered = None
            return
        with self.lock:
            busy = self.busy
            busy[name] = busy.get(name, 0) + 1

    def leave(self, name: str) -> None:
        """A message of actor ``name`` ended (any thread): when it is free, this thread
        starts the messages that waited in its line, in order."""
        lock = self.lock
        lock.acquire()  # (not ``with``: half its cost, on every call)
        try:
            busy = self.busy
            left = busy.get(name, 1) - 1
            if left > 0:
                busy[name] = left
                return
            busy.pop(name, None)
            self.holders.pop(name, None)
            if name not in self.waiting or name in self._draining:
                return  # nothing waits, or a drain of it runs (on this thread or another)
            self._draining.add(name)
        finally:
            lock.release()
        self._drain(name)

    def _drain(self, name: str) -> None:
        me = threading.get_ident()
        try:
            while True:
                with self.lock:
                    line = self.waiting.get(name)
                    if not line or name in self.busy:
                        self._draining.discard(name)
                        return
                    msg, hdr = line.popleft()
                    self.kept -= 1
                    if not line:
                        del self.waiting[name]
                    kind = self.kind_of(hdr)
                    where = self.place(kind, me)
                    if kind == SYNC:
                        self.holders[name] = me if where == HERE else _STARTING
                    else:
                        self.holders.pop(name, None)
                    self.busy[name] = 1  # reserved: whatever runs it releases it
                if where == HERE:
                    try:
                        self.run_saved(msg, hdr)
                    finally:
                        self.leave(name)
                elif where == WORKER:
                    self._to_worker(name, msg, hdr)
                else:
                    self.to_loop(name, msg, hdr)
        except BaseException:
            with self.lock:
                self._draining.discard(name)
            raise

    def claim(self, name: str) -> bool:
        """Count a message of actor ``name`` in if this thread may run it now: the actor
        is free, or this thread holds it (a call from its own endpoint)."""
        me = threading.get_ident()
        with self.lock:
            busy = self.busy
            if name in busy or name in self.waiting:
                if self.holders.get(name) != me:
                    return False
            else:
                self.holders[name] = me
            busy[name] = busy.get(name, 0) + 1
            return True

    # -- workers ----------------------------------------------------------------------
    def _to_worker(self, name: str, msg: Message, hdr: H.Ordered) -> None:
        runners = self.runners
        assert runners is not None
        runners.start(functools.partial(self._session, name, msg, hdr))

    def _session(self, name: str, msg: Message, hdr: H.Ordered) -> None:
        """On a worker: run actor ``name``'s message (reserved for it), then its line."""
        me = threading.get_ident()
        threading.current_thread().name = f"actor {name}"
        with self.lock:
            if self.holders.get(name) == _STARTING:
                self.holders[name] = me
        try:
            self.run_saved(msg, hdr)
        finally:
            self.leave(name)

    def quiesce(self) -> None:
        """Before a message only the main thread runs (a cell): wait until the workers
        are done and the event loop is back (as before threads, a cell runs alone);
        the stop button meanwhile interrupts the workers."""
        runners = self.runners
        if runners is None:
            return
        self.main_held()  # the relief thread serves other ranks' calls meanwhile
        try:
            while True:
                try:
                    if self.loop_owner not in (None, self.main_ident):
                        self.take_loop()
                        self.give_loop()
                    if runners.running == 0:
                        return
                    runners.wait_quiet(0.05)
                except KeyboardInterrupt:
                    runners.interrupt()
        finally:
            self.responsive = True

    # -- the event loop ---------------------------------------------------------------
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The rank's event loop (made on first use): its ``select`` tells whether the
        main thread waits in it (:class:`WatchedSelector`)."""
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.SelectorEventLoop(WatchedSelector(self))
            for fd in self.inbox_fds():
                loop.add_reader(fd, self.pump)
            self._reader_on = True
        return loop

    def to_loop(self, name: str, msg: Message, hdr: H.Ordered) -> None:
        """Start actor ``name``'s message (reserved for it) as a task of the event loop,
        on whichever thread runs it (a worker, if none does)."""
        loop = self.event_loop()
        loop.call_soon_threadsafe(self._start_on_loop, name, msg, hdr)
        self._ensure_loop_runs()

    def on_actor_loop(self) -> bool:
        """Whether this thread runs the rank's event loop now."""
        loop = self.loop
        return loop is not None and asyncio._get_running_loop() is loop

    def call_on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the rank's event loop (a worker runs it if nobody does)."""
        loop = self.event_loop()
        loop.call_soon_threadsafe(fn)
        self._ensure_loop_runs()

    def keep_loop_running(self) -> None:
        """The main thread is held by an actor's message (the relief thread took the
        inbox over): the event loop's pending tasks (an actor's ``@concurrent_endpoint``
        calls, tasks its async endpoints started) go on, on a worker, instead of waiting
        for it. Not while it runs a cell: a cell runs alone (:meth:`quiesce`)."""
        loop = self.loop
        if loop is None or self.exclusive or self.loop_owner is not None:
            return
        if _work_left(loop):
            self._ensure_loop_runs()

    def _start_on_loop(self, name: str, msg: Message, hdr: H.Ordered) -> None:
        try:
            self.run_saved(msg, hdr)
        finally:
            self.leave(name)

    def _ensure_loop_runs(self) -> None:
        with self.lock:
            if self.loop_owner is not None or self._runner_pending:
                return
            self._runner_pending = True
        runners = self.runners
        if runners is None:
            self.start_threads()
            runners = self.runners
            assert runners is not None
        runners.start(self._run_loop)

    def _run_loop(self) -> None:
        """On a worker: run the event loop while it has work and the main thread does
        not want it (the main thread is held meanwhile)."""
        loop = self.event_loop()
        me = threading.get_ident()
        with self.lock:
            self._runner_pending = False
            if self.loop_owner is not None:
                return
            self.loop_owner = me
            self._loop_free.clear()
        threading.current_thread().name = "actor event loop"
        stop: asyncio.Future[None] = loop.create_future()
        self._runner_stop = stop

        def check() -> None:
            if stop.done():
                return
            if self.want_loop or not _work_left(loop):
                stop.set_result(None)
            else:
                loop.call_later(0.05, check)

        try:
            if self._reader_on:  # the inbox is the main thread's (or the relief's) to read
                for fd in self.inbox_fds():
                    loop.remove_reader(fd)
                self._reader_on = False
            loop.call_soon(check)
            loop.run_until_complete(stop)
        finally:
            with self.lock:
                self.loop_owner = None
                self._runner_stop = None
                self._loop_free.set()
            if not self.want_loop and _work_left(loop):
                self._ensure_loop_runs()  # work came after the last look

    def take_loop(self, wait: bool = True) -> bool:
        """The main thread is about to run the event loop: a worker that runs it stops
        first (at its next turn). ``wait=False``: not if a worker runs it (False)."""
        me = self.main_ident
        loop = self.event_loop()
        while True:
            with self.lock:
                owner = self.loop_owner
                if owner is None or owner == me:
                    self.loop_owner = me
                    self._loop_depth += 1
                    self.want_loop = False
                    break
                if not wait:
                    return False
                self.want_loop = True
                stop = self._runner_stop
            if stop is not None:
                loop.call_soon_threadsafe(_finish, stop)
            self._loop_free.wait(0.05)
        if not self._reader_on:
            for fd in self.inbox_fds():
                loop.add_reader(fd, self.pump)
            self._reader_on = True
        return True

    def give_loop(self) -> None:
        """The main thread stopped running the event loop."""
        with self.lock:
            self._loop_depth -= 1
            if self._loop_depth <= 0:
                self._loop_depth = 0
                self.loop_owner = None

    # -- waits --------------------------------------------------------------------------
    def open_mailbox(self, me: int, wake: Wake) -> Line:
        box: Line = collections.deque()
        with self.lock:
            self.mailboxes[me] = (box, wake)
        return box

    def close_mailbox(self, me: int, box: Line) -> None:
        with self.lock:
            self.mailboxes.pop(me, None)
        self.run_mailbox(box)  # what came at the last moment

    def run_mailbox(self, box: Line) -> None:
        while box:
            msg, hdr = box.popleft()
            self.run_saved(msg, hdr)

    def wait_elsewhere(self, fut: Any, timeout: float | None) -> None:
        """A worker's endpoint waits for ``fut`` (``.get()``): calls from other ranks to
        its actor run here meanwhile (re-entrant, as on the main thread)."""
        runners = self.runners
        worker = runners.current() if runners is not None else None
        if worker is None:
            return  # not an actor's thread: it just blocks
        import time

        wake = worker.wake
        fut.add_done_callback(wake)
        me = threading.get_ident()
        box = self.open_mailbox(me, wake)
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(wake.r, select.POLLIN)
        try:
            while not fut.done():
                left = 100 if deadline is None else int((deadline - time.monotonic()) * 1000)
                if left <= 0:
                    return
                # a bounded wait: the stop button's interrupt lands between two
                poller.poll(min(left, 100))
                wake.clear()
                self.run_mailbox(box)
        finally:
            self.close_mailbox(me, box)


class WatchedSelector(selectors.DefaultSelector):
    """The event loop's selector: while the main thread waits in it, the inbox's
    relief thread need not read for it."""

    def __init__(self, lines: Lines):
        super().__init__()
        self._lines = lines

    def select(self, timeout: float | None = None) -> Any:
        lines = self._lines
        if threading.get_ident() != lines.main_ident:
            return super().select(timeout)
        lines.responsive = True
        try:
            return super().select(timeout)
        finally:
            lines.main_held()


def _finish(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _work_left(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the event loop has something left to run: a pending task, or a callback
    already queued. The second matters: a task that ended in the
    very last step of ``run_until_complete`` (a second call served while the first
    awaited) is no longer in ``all_tasks``, but its done callback, which sends its
    reply, is still queued; without another turn of the loop that caller would wait
    forever."""
    return bool(asyncio.all_tasks(loop)) or bool(getattr(loop, "_ready", None))
