"""The threads besides the main one that run a rank's actor messages (Monarch: each actor
runs on its own, so one actor's long endpoint never holds another's).

A rank runs an actor message on its **main thread** whenever that thread is free: the
fast path (no hand-over between threads), and where the stop button's SIGINT, CUDA's
current device and output under the calling cell are simplest. When the main thread is
*held* (an endpoint blocks in ``time.sleep``, waits on a ``threading.Event``, computes)
for :data:`RELIEF_TICK` seconds, the :class:`Relief` thread takes over reading the inbox
(the socket is only ever read by one thread at a time: ``Inbox.reader``) and hands the
messages it reads on: a sync endpoint (constructor, ``__supervise__``, ``__cleanup__``) of
a free actor to a :class:`Worker` of its own, an ``async def`` one to the rank's event
loop (run by a worker while the main thread is held), anything else (a cell, ``push``)
to the main thread, for when it is free again. The main thread takes the inbox back as
soon as it waits again (``.get()``, ``await``) or returns.

An actor still handles one message at a time, in order: its messages wait in its line
while one of them runs, on whichever thread (``Inbox.route``), and the thread that ran
one starts the next (``Inbox.leave``). A worker that runs an actor's message keeps
serving that actor's line, then returns to the pool; idle workers end after
:data:`WORKER_IDLE_EXIT` seconds.

The stop button reaches a worker's endpoint as a ``KeyboardInterrupt`` raised in that
thread (``PyThreadState_SetAsyncExc``), only while it runs user code: Python code stops
at once, a blocking C call (``time.sleep``, a lock wait) when it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from monarch_kernel.rank import context
from monarch_kernel.rank.torch_modes import restore_after_interrupt, torch_modes

log = logging.getLogger("monarch_kernel.rank")

#: Seconds the main thread may be held by user code before the relief thread reads the
#: inbox in its place (checked at this interval: relief comes after one to two ticks).
RELIEF_TICK = 0.02
#: Looks in a row that find the main thread responsive after which the relief thread
#: naps until the main thread is held again.
RELIEF_NAP_AFTER = 5
#: Seconds an idle worker thread waits for more work before it ends.
WORKER_IDLE_EXIT = 30.0

_SetAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)
_ClearAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
#: Raise an exception (class) in a thread at its next bytecode; clear a pending one (NULL).
_set_async_exc = _SetAsyncExc(("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_clear_async_exc = _ClearAsyncExc(("PyThreadState_SetAsyncExc", ctypes.pythonapi))


class Wake:
    """A pipe a thread polls while it waits: written to wake it (any thread)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def __call__(self, *_: Any) -> None:
        try:
            os.write(self.w, b".")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway
            pass

    def clear(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass


class Worker:
    """A thread that runs actor messages (jobs) handed to it by :class:`Runners`."""

    _ids = itertools.count(1)

    def __init__(self, pool: Runners):
        self.pool = pool
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: guards :attr:`in_user` against an interrupt landing outside user code
        #: (re-entrant: the main thread's SIGINT handler takes it, and may nest)
        self.lock = threading.RLock()
        #: this thread runs user code now (an interrupt may be raised in it)
        self.in_user = False
        self.ident = 0
        #: wakes this thread while its endpoint waits in ``.get()`` (``Lines.wait_elsewhere``)
        self.wake = Wake()
        self.thread = threading.Thread(
            target=self._run, name=f"mk-actor-{next(self._ids)}", daemon=True
        )

    def _run(self) -> None:
        self.ident = threading.get_ident()
        self.pool.by_ident[self.ident] = self
        name = self.thread.name
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=WORKER_IDLE_EXIT)
                except queue.Empty:
                    with self.pool.lock:
                        if self in self.pool.idle:  # no job was given meanwhile
                            self.pool.idle.remove(self)
                            return
                    job = self.jobs.get()
                try:
                    _bind_device(self.pool.device_index)
                    job()
                except KeyboardInterrupt:  # the stop button, after the user code it was for
                    pass
                except Exception:  # a job answers its own failures: a bug of ours
                    log.exception("rank worker %s: a job failed", name)
                finally:
                    self.thread.name = name
                    serving = context.serving()
                    serving.request = serving.actor = serving.slice = None
                    self.clear_interrupt()
                    with self.pool.lock:
                        self.pool.running -= 1
                        self.pool.idle.append(self)
                        self.pool.quiet.notify_all()
        finally:
            self.pool.by_ident.pop(self.ident, None)
            context.forget_thread()

    @contextlib.contextmanager
    def user(self) -> Iterator[None]:
        """Around user code: an interrupt may be raised in this thread meanwhile (and
        puts back torch's modes it left switched: ``rank.torch_modes``)."""
        modes = torch_modes()  # before ``in_user``: no interrupt lands in the reading
        with self.lock:
            outer = self.in_user
            self.in_user = True
        try:
            yield
        except KeyboardInterrupt:
            with self.lock:  # a second press does not cut the restore short
                self.in_user = outer
            restore_after_interrupt(modes)
            raise
        finally:
            with self.lock:
                self.in_user = outer
                if not outer:
                    self.clear_interrupt()

    def clear_interrupt(self) -> None:
        """Drop an interrupt raised too late to land in user code."""
        if self.ident:
            _clear_async_exc(self.ident, None)

    def interrupt(self) -> bool:
        """Raise KeyboardInterrupt in this thread if it runs user code now."""
        with self.lock:
            if not self.in_user or not self.ident:
                return False
            _set_async_exc(self.ident, KeyboardInterrupt)
        self.wake()  # out of a bounded wait in ``.get()`` at once
        return True


class Runners:
    """The rank's worker threads (see the module docstring)."""

    def __init__(self, device_index: Callable[[], int | None]):
        self.lock = threading.Lock()
        #: Told (under :attr:`lock`) when a job ends.
        self.quiet = threading.Condition(self.lock)
        self.idle: list[Worker] = []
        #: jobs running now
        self.running = 0
        self.by_ident: dict[int, Worker] = {}
        self.device_index = device_index

    def start(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle worker, or a new one."""
        with self.lock:
            self.running += 1
            worker = self.idle.pop() if self.idle else None
        if worker is None:
            worker = Worker(self)
            worker.jobs.put(job)
            worker.thread.start()
        else:
            worker.jobs.put(job)

    def current(self) -> Worker | None:
        """The worker this code runs on, if it runs on one."""
        return self.by_ident.get(threading.get_ident())

    def wait_quiet(self, timeout: float) -> bool:
        """Wait until no job runs (True), at most ``timeout`` seconds."""
        with self.lock:
            return self.quiet.wait_for(lambda: self.running == 0, timeout)

    def interrupt(self, requests: set[str] | None = None) -> int:
        """Interrupt the workers that run user code now (of ``requests`` only, if given);
        how many were."""
        n = 0
        for worker in list(self.by_ident.values()):
            if requests is not None:
                serving = context.serving(worker.ident)
                if serving.request is None or serving.request not in requests:
                    continue
            n += worker.interrupt()
        return n


def _bind_device(index: Callable[[], int | None]) -> None:
    """A worker uses the rank's GPU, as its main thread does (CUDA's current device is
    per thread): set once CUDA is initialised (bind_gpu's lazy choice takes effect in
    the thread that first uses CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if not torch.cuda.is_initialized():
            return
        i = index()
        if i is not None and torch.cuda.current_device() != i:
            torch.cuda.set_device(i)
    except Exception:  # no CUDA build, a broken driver: nothing to bind
        return


class Relief(threading.Thread):
    """Reads the inbox while the main thread is held (see the module docstring). It
    looks every :data:`RELIEF_TICK` seconds; a main thread held by the same user code
    since the last look is relieved."""

    def __init__(self, inbox: Any):
        super().__init__(name="mk-relief", daemon=True)
        self.inbox = inbox
        #: written by the main thread when it wants the inbox back
        self.wake = Wake()
        #: set by the main thread when it is held while this thread naps
        self.nap = threading.Event()

    def run(self) -> None:
        inbox = self.inbox
        main = inbox.main_ident
        last = -1
        idle = 0  # looks in a row that found the main thread responsive
        while True:
            if idle >= RELIEF_NAP_AFTER:
                # nap until the main thread is held again (it wakes us then): an idle
                # or quick rank costs no wake-ups
                self.nap.clear()
                inbox.relief_napping = True
                if inbox.responsive:
                    self.nap.wait()
                inbox.relief_napping = False
                idle = 0
            time.sleep(RELIEF_TICK)
            if inbox.responsive or inbox.reader != main:
                last = -1
                idle += 1
                continue
            idle = 0
            serial = inbox.serial
            if serial != last:
                last = serial
                continue
            if not inbox.take_over(serial):
                continue
            last = -1
            inbox.keep_loop_running()  # its tasks go on while the main thread is held
            try:
                self.serve()
            except Exception:  # never leave the inbox unread
                log.exception("rank %s: the relief thread failed", inbox.rank)
            finally:
                inbox.hand_back()

    def serve(self) -> None:
        """Read the inbox until the main thread is responsive again or wants it back."""
        inbox = self.inbox
        r = self.wake.r
        poller = select.poll()
        poller.register(r, select.POLLIN)
        fds = inbox.inbox_fds()  # the socket's, and the lane's wake-up pipe's
        for fd in fds:
            poller.register(fd, select.POLLIN)
        watching = True
        while not inbox.want_back and not inbox.responsive:
            inbox.pump()  # what is there now (ZMQ_FD is edge-triggered: read it all)
            if inbox.want_back or inbox.responsive:
                return
            full = inbox.full(len(inbox.deferred))
            if full == watching:  # while it keeps all it may, the socket is not watched
                for fd in fds:
                    if full:
                        poller.unregister(fd)
                    else:
                        poller.register(fd, select.POLLIN)
                watching = not full
            for got, _ in poller.poll(RELIEF_TICK * 1000):
                if got == r:
                    self.wake.clear()
