"""Flow control of one mesh's send socket: what busy peers have not taken yet.

Every message is sent without blocking. When a peer's queue is full (a busy rank has not
read its inbox: ZeroMQ holds about ``SNDHWM`` + ``RCVHWM`` messages), the message goes to
that peer's *backlog* here instead, and every later message for that peer queues behind
it (FIFO). The I/O thread retries the backlogs (:meth:`Backlog.flush`) every
:data:`FLUSH_INTERVAL` until they drain, so heartbeats, deaths and the other ranks and
meshes keep flowing while one rank is busy. The backlogs are bounded
(:data:`MAX_BACKLOG_MESSAGES` calls, :data:`MAX_BACKLOG_BYTES`): past either, a caller
that sends waits (:meth:`Backlog.wait_for_room`, interruptibly: Ctrl-C and stopping the
mesh release it), or gets :class:`BackpressureError` if it asked not to wait.

Invariant: the backlogs and their counts change only under the transport's send lock
(every method here but :meth:`wait_for_room` is called with it held); the counts are
the calls waiting (a ``batch`` message counts as the calls it carries).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import zmq

from monarch_kernel.calls.errors import MeshStoppedError, MonarchError
from monarch_kernel.wire.codec import NOBLOCK, ZERO_COPY_THRESHOLD, Buffer
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.handoff import owned

log = logging.getLogger("monarch_kernel.controller")

#: How often the I/O thread retries sending to peers whose queues were full.
FLUSH_INTERVAL = 0.002
#: Bounds on what the controller keeps queued for peers with full queues; past either,
#: senders wait for room.
MAX_BACKLOG_MESSAGES = 100_000
MAX_BACKLOG_BYTES = 256 * 1024 * 1024


class BackpressureError(MonarchError):
    """The controller's queues for busy ranks are full and the caller asked not to wait."""


class Backlog:
    """Per-peer queues of messages a busy peer has not taken yet (see the module
    docstring). ``wake``: tells the I/O thread there is something to retry."""

    def __init__(self, name: str, sock: zmq.Socket[bytes], wake: Callable[[], None]):
        self._name = name
        self._sock = sock
        self._wake = wake
        #: Per peer: (frames, bytes, calls) not taken yet.
        self._queues: dict[bytes, deque[tuple[list[Buffer], int, int]]] = {}
        self.messages = 0  #: calls waiting, all peers
        self.nbytes = 0  #: bytes waiting, all peers
        self._room = threading.Condition()
        self._closed = False

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __contains__(self, ident: bytes) -> bool:
        """Whether messages for ``ident`` wait here."""
        return ident in self._queues

    def deliver(self, ident: bytes, frames: list[Buffer], size: int, calls: int = 1) -> bool:
        """Send now, or queue behind what ``ident`` has not taken yet; ``calls``: how
        many calls the message carries (a batch: several). False: dropped, ``ident`` is
        not connected (the caller takes back the sequence number it gave it)."""
        queue = self._queues.get(ident)
        if queue is None:
            try:
                wire_send(self._sock, frames, [ident], NOBLOCK)
                return True
            except zmq.Again:  # its queue is full: keep it here, retried by the I/O thread
                queue = self._queues[ident] = deque()
                self._wake()
            except zmq.ZMQError as exc:
                # Not connected (any more): a dead rank's death report, pushed by its host
                # agent, fails whatever waits on it.
                log.debug("mesh %s: send to %r failed: %s", self._name, ident, exc)
                return False
        # Kept back: it may wait long, so it holds copies, not the sender's memory
        # (wire.handoff).
        queue.append((owned(frames, ZERO_COPY_THRESHOLD), size, calls))
        self.messages += calls
        self.nbytes += size
        return True

    def flush(self) -> bool:
        """Send what the backlogged peers can take now; True while some is still queued."""
        sent = False
        for ident, queue in list(self._queues.items()):
            while queue:
                frames, size, calls = queue[0]
                try:
                    wire_send(self._sock, frames, [ident], NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    log.debug("mesh %s: %r is gone: %s", self._name, ident, exc)
                    self.drop(ident)
                    break
                queue.popleft()
                self.messages -= calls
                self.nbytes -= size
                sent = True
            if not queue:
                self._queues.pop(ident, None)
        if sent:
            with self._room:
                self._room.notify_all()
        return bool(self._queues)

    def drop(self, ident: bytes) -> None:
        """Forget what waits for ``ident`` (a peer gone, or restarted)."""
        queue = self._queues.pop(ident, None)
        if queue:
            self.messages -= sum(calls for _, _, calls in queue)
            self.nbytes -= sum(size for _, size, _ in queue)

    def full(self) -> bool:
        return self.messages >= MAX_BACKLOG_MESSAGES or self.nbytes >= MAX_BACKLOG_BYTES

    def wait_for_room(self, wait: bool = True) -> None:
        """Return when the backlogs are under their bounds (at once, almost always).

        Interruptible: the wait is in short slices, so Ctrl-C raises in the main thread,
        and closing (stopping the mesh) raises ``MeshStoppedError``. Not under the send
        lock (the I/O thread takes it to drain the backlogs).
        """
        if not self.full():
            return
        if not wait:
            raise BackpressureError(
                f"mesh {self._name!r}: {self.messages} messages "
                f"({self.nbytes / 2**20:.0f} MiB) wait for busy ranks to read them; "
                "wait for results (.get()) before sending more, or send with waiting allowed"
            )
        with self._room:
            while self.full() and not self._closed:
                self._room.wait(0.1)
        if self._closed:
            raise MeshStoppedError(f"mesh {self._name!r} was stopped while this call waited")

    def close(self) -> None:
        """Release every waiting caller: they raise (any thread, no lock held)."""
        with self._room:
            self._closed = True
            self._room.notify_all()

    def clear(self) -> None:
        """Forget what waits (the sockets are closing)."""
        self._queues.clear()
        self.messages = self.nbytes = 0
