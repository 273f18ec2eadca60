"""Who reads a mesh's receive socket: the receive token (leader/follower) and the I/O thread.

One thread at a time reads the ``recv`` socket: the holder of the *receive token*.

* A caller blocked in ``Future.get()`` takes the token if it is free and receives its
  own reply (and handles whatever else arrives meanwhile), so a call costs no wake-up
  of a second thread.
* If the token is taken, a caller *follows* its holder: the holder completes the
  caller's future. When the holder is the I/O thread, it hands the token over as soon
  as its followers are served, so the next call finds it free.
* The I/O thread takes the token whenever no caller has held it for
  :data:`READER_GRACE` (streams of background work, deaths, futures that are awaited
  or polled), and runs the periodic ``tick`` (heartbeats) every
  :data:`HEARTBEAT_INTERVAL`. Whoever holds the token, it also retries the transport's
  backlogs (messages for busy ranks) every ``FLUSH_INTERVAL`` until they drain.

Invariants: only the token's holder calls ``handle`` (so message handling, and work
posted with :meth:`Receiver.post`, never runs on two threads at once); ``_reader`` names
the holder (None when free) and changes only with ``_recv_lock`` held or released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from monarch_kernel.controller.messaging.lanes import Lanes
from monarch_kernel.controller.messaging.sigint import DeferSigint
from monarch_kernel.controller.messaging.transport import (
    FLUSH_INTERVAL,
    SIGINT_ID,
    WAKE_ID,
    Transport,
)
from monarch_kernel.wire.codec import readable
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.spin import SpinWait

log = logging.getLogger("monarch_kernel.controller")

HEARTBEAT_INTERVAL = 0.5
#: After a caller stopped receiving (and no reply is owed to anyone), the I/O thread
#: waits this long before it takes the receive token back, so that a loop of calls
#: never has to wake it. Only unsolicited messages (streams of fire-and-forget work,
#: heartbeats) can wait this long.
READER_GRACE = 0.02


class Awaitable(Protocol):
    """What a caller waits for (a :class:`~monarch_kernel.calls.future.Future`)."""

    def done(self) -> bool: ...


def _not_started(_: object) -> None:
    raise RuntimeError("the receiver was not started")


class Receiver:
    """The receive token and the I/O thread of one mesh."""

    def __init__(
        self,
        name: str,
        transport: Transport,
        owed: Callable[[], bool],
        spin: float = 0.0,
        spin_below: int | None = None,
    ):
        """``owed()`` tells whether replies are still owed to anybody (then the I/O
        thread receives when a caller leaves). ``spin``: seconds a caller spins before it
        blocks for a message (:mod:`monarch_kernel.wire.spin`); ``spin_below``: only
        after a message to fewer ranks than that (this machine's CPUs, where the ranks
        run on it: a caller that spins while as many ranks work takes a CPU one of them
        needs; measured: a gathered call to 8 local ranks on 2 CPUs took 0.8 ms longer
        with the spin). Nothing is received before :meth:`start`; work posted before it
        runs once it started."""
        self.name = name
        self._transport = transport
        self._sock = transport.recv_sock
        #: Same-machine lanes (``transport.lanes``): read beside the socket; a poller
        #: over both, made when a lane is first in use.
        self._lanes = transport.lanes
        self._both: zmq.Poller | None = None
        self._socket_turn = False  # the socket's turn before the lanes'
        self._handle: Callable[[list[zmq.Frame]], None] = _not_started
        self._tick: Callable[[float], None] = _not_started
        self._owed = owed
        self._recv_lock = threading.Lock()
        self._reader: int | None = None  # ident of the thread holding the token
        self._io_cv = threading.Condition()
        self._io_followers: list[Awaitable] = []  # futures whose waiters the I/O thread serves
        self._posted: deque[tuple[Callable[..., None], tuple[object, ...]]] = deque()
        self._io_needed = False  # the last caller left replies owed: I/O thread, take over
        self._last_release = 0.0
        self._running = True
        self._rcvtimeo = -1
        self._spin = SpinWait(spin)
        self._spin_below = spin_below
        self._io = threading.Thread(target=self._io_loop, name=f"mesh-{name}-io", daemon=True)

    def start(
        self, handle: Callable[[list[zmq.Frame]], None], tick: Callable[[float], None]
    ) -> None:
        """Start the I/O thread: ``handle(frames)`` handles one message; ``tick(now)``
        runs about twice a second on the I/O thread. Called once, when the parts that
        handle messages exist (they post work here, so they are made after this)."""
        self._handle, self._tick = handle, tick
        self._io.start()

    @property
    def on_receiving_thread(self) -> bool:  # used by MeshRuntime's flow control
        """Whether the calling thread holds the receive token now."""
        return self._reader == threading.get_ident()

    # -- callers (leader/follower) -------------------------------------------------------
    def wait_for(self, fut: Awaitable, timeout: float | None) -> None:
        """Receive in this thread until ``fut`` is done or ``timeout`` passes.

        Used by ``Future.get``: if the receive token is free, the caller takes it and
        handles whatever arrives, its own replies included. Otherwise this returns at
        once and the future is waited on: the token's holder completes it.
        ``timeout=0`` only makes sure that some thread receives.
        """
        if timeout == 0:
            self.ensure_reader()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reader == threading.get_ident():  # a handler on the receiving thread
            self._receive_until(fut, deadline, None)
            return
        if not self._take_token(fut):
            return
        try:
            with DeferSigint(self._transport.wake_from_sigint) as sigint:
                self._receive_until(fut, deadline, sigint)
        finally:
            self._give_token()

    def ensure_reader(self) -> None:
        """Make sure some thread receives now (for futures that nobody blocks on)."""
        if self._reader is None:
            with self._io_cv:
                self._io_needed = True
                self._io_cv.notify()

    def post(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the thread that holds the receive token, so that what
        fails requests never races with the handling of their replies."""
        self._posted.append((fn, args))
        self._transport.wake()
        self.ensure_reader()

    def kick(self) -> None:
        """Make the transport's waiting batch of calls go now: the I/O thread flushes
        it at the top of its loop, or (while it receives) after the wake-up message."""
        self._transport.wake()
        with self._io_cv:
            self._io_cv.notify()

    def _take_token(self, fut: Awaitable) -> bool:
        """Take the receive token if it is free; else follow its holder.

        The holder receives our reply too. Taking the token from the I/O thread would
        cost more wake-ups than it saves on this call, so the I/O thread serves it and
        hands the token over afterwards (see ``_serve``): the next call finds it free.
        """
        while self._running:  # once stopped, nobody receives (the future is failed)
            if self._recv_lock.acquire(blocking=False):
                self._reader = threading.get_ident()
                return True
            with self._io_cv:  # atomic with the I/O thread's hand-over (_hand_over)
                if self._reader == self._io.ident:
                    self._io_followers.append(fut)
                    return False
                if self._reader is not None:
                    return False  # a caller receives: it (or the I/O thread after it) serves us
            # Released in between, or taken and not yet named: let its holder run, retry.
            time.sleep(0)
        return False

    def _give_token(self) -> None:
        with self._io_cv:
            self._reader = None
            self._last_release = time.monotonic()
            self._recv_lock.release()
            if self._owed():
                # Replies are still owed to others (followers, awaited futures, --bg
                # cells): the I/O thread receives them from now on.
                self._io_needed = True
                self._io_cv.notify()

    def _receive_until(
        self, fut: Awaitable, deadline: float | None, sigint: DeferSigint | None
    ) -> None:
        while not fut.done() and self._running:
            if sigint is not None and sigint.pending:
                return
            if not self._receive_one(deadline, spin=True):
                return

    def _receive_one(self, deadline: float | None, spin: bool = False) -> bool:
        """Block for one message (token held) and handle it; False once past ``deadline``.
        ``spin``: a caller waiting for its reply spins first (``wire.spin``); the I/O
        thread, which waits for whatever comes, never does.

        Wake-up messages (see ``Transport.wake``) return at once, so the caller looks at
        its conditions again.
        """
        sock = self._sock
        if deadline is None:
            ms = -1
        else:
            ms = int((deadline - time.monotonic()) * 1000) + 1
            if ms <= 0:
                return False
        if spin and self._spin_below is not None:
            spin = self._transport.last_width < self._spin_below
        lanes = self._lanes
        if lanes is not None and lanes.active:
            got = self._from_lanes_or_socket(lanes, ms, spin)
            if got is None:
                return deadline is None or time.monotonic() < deadline
            frames = got
        else:
            if ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, ms)
                self._rcvtimeo = ms
            if spin:
                self._spin.until_readable(sock)
            try:
                frames = wire_recv(sock)
            except zmq.Again:
                return False
        # A wake-up is [its routing id, b""]: a peer's message is [routing id, envelope,
        # ...] too, but an envelope is never empty.
        if len(frames) == 2 and not len(frames[1]) and frames[0].bytes in (WAKE_ID, SIGINT_ID):
            self._run_posted()
            return True
        try:
            self._handle(frames)
        except Exception:  # never let one bad message stop the receiving
            log.exception("mesh %s: error handling a message", self.name)
        return True

    def _from_lanes_or_socket(self, lanes: Lanes, ms: int, spin: bool) -> list[Any] | None:
        """The next message from a lane or the socket, taking turns while both have
        some (a rank that floods its lane with replies must not starve its host agent's
        heartbeats on the socket; a rank's death is handled after what its lane still
        held: ``Inbound``); None when ``ms`` passed, or a wake-up had nothing behind it."""
        sock = self._sock
        frames = self._take_turn(lanes)
        if frames is not None:
            return frames
        if not (spin and self._spin.until(lambda: lanes.pending() or readable(sock))):
            both = self._both
            if both is None:
                both = self._both = zmq.Poller()
                both.register(sock, zmq.POLLIN)
                lanes.register(both)
            both.poll(ms if ms >= 0 else None)
        return self._take_turn(lanes)

    def _take_turn(self, lanes: Lanes) -> list[Any] | None:
        """A message there now, from the socket when it is its turn, else from a lane,
        else from the socket; None when neither has one."""
        sock = self._sock
        if self._socket_turn and readable(sock):
            self._socket_turn = False
            return wire_recv(sock, zmq.NOBLOCK)
        frames = lanes.take()
        if frames is not None:
            self._socket_turn = True
            return frames
        if readable(sock):
            return wire_recv(sock, zmq.NOBLOCK)
        return None

    def _run_posted(self) -> None:
        while self._posted:
            fn, args = self._posted.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("mesh %s: error in %s", self.name, getattr(fn, "__name__", fn))

    # -- the I/O thread ------------------------------------------------------------------
    def _io_loop(self) -> None:
        me = threading.get_ident()
        last_tick = time.monotonic()
        flush = self._transport.flush
        while self._running:
            backlog = flush()
            now = time.monotonic()
            if now - last_tick >= HEARTBEAT_INTERVAL:
                last_tick = now
                try:
                    self._tick(now)
                except Exception:
                    log.exception("mesh %s: error in the periodic tick", self.name)
            until_tick = last_tick + HEARTBEAT_INTERVAL - now
            idle = 0.0 if self._io_needed else self._callers_idle_wait(now)
            if idle <= 0 and self._recv_lock.acquire(blocking=False):
                self._reader = me
                self._io_needed = False
                handed_over = False
                try:
                    handed_over = self._serve(until_tick)
                finally:
                    if not handed_over:
                        self._reader = None
                        self._recv_lock.release()
                continue
            with self._io_cv:
                # A caller holds the token: it notifies us when it leaves replies owed.
                busy = self._recv_lock.locked()
                if busy:
                    wait = READER_GRACE
                elif idle > 0 and not self._io_needed:
                    wait = idle  # callers may come back for the token
                else:
                    continue  # take the token now
                if backlog:
                    wait = min(wait, FLUSH_INTERVAL)
                if self._running:
                    self._io_cv.wait(min(until_tick, wait))

    def _callers_idle_wait(self, now: float) -> float:
        """How long to leave the token to callers before the I/O thread takes it."""
        if self._reader is not None:
            return READER_GRACE
        if self._io_followers:
            return 0.0  # callers wait for this thread to receive their replies
        return self._last_release + READER_GRACE - now

    def _serve(self, timeout: float) -> bool:
        """Receive (token held) until ``timeout`` passes (False), or until the callers
        that follow this thread have their replies (True: the token was handed over)."""
        deadline = time.monotonic() + timeout
        flush = self._transport.flush
        while self._running:
            if flush():  # peers with full queues: look again soon
                until = min(deadline, time.monotonic() + FLUSH_INTERVAL)
                if not self._receive_one(until):
                    if time.monotonic() >= deadline:
                        return False
                    continue
            elif not self._receive_one(deadline):
                return False
            if self._io_followers and self._hand_over():
                return True
        return False

    def _hand_over(self) -> bool:
        """Release the token if every follower has its reply, so the next call finds
        it free; atomic with followers registering (see ``_take_token``)."""
        with self._io_cv:
            if not all(f.done() for f in self._io_followers):
                return False
            self._io_followers.clear()
            self._reader = None
            self._last_release = time.monotonic()
            self._recv_lock.release()
            return True

    # -- stopping ------------------------------------------------------------------------
    def stop(self) -> None:
        """End the I/O thread and wait for a receiving caller to leave (its future was
        failed before this is called); the socket may be closed afterwards."""
        me = threading.get_ident()
        self._running = False
        self._transport.wake()
        with self._io_cv:
            self._io_cv.notify_all()
        if self._io.ident not in (None, me):  # None: never started
            self._io.join(5)
        # A caller receiving in another thread returns now.
        if self._reader != me and not self._recv_lock.acquire(timeout=5):
            log.warning("mesh %s: a thread still receives; closing anyway", self.name)
