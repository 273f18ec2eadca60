"""A rank of a ``--detachable`` mesh outlives its controller: :class:`ControllerLink`
knows whether one is connected, and takes what the rank would send while none is.

The rank's ``out`` socket (to the controller) is watched with a ZeroMQ socket monitor,
read by the control thread: a dropped connection (the kernel exited or was killed)
means no controller, a completed handshake (a controller attached at the same address)
means one again; each change is marked in the rank's log (``osutil.DETACHED_MARK``), so
the next controller can show what the rank printed meanwhile. While no controller is
connected nothing is queued for it (a queue would fill after a thousand messages and
then block the training loop's prints): output and stats are dropped (the output is in
the log), results and failures are kept, bounded. Every ``report()`` is kept too
(:data:`HISTORY`, attached or not): a controller that attaches gets the whole history
for its dashboard (``attached``, answered by :func:`serve_attached`), then the kept
results, as if they had just been sent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.utils.monitor

from monarch_kernel.wire import Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.osutil import ATTACHED_MARK, DETACHED_MARK

log = logging.getLogger("monarch_kernel.rank")

#: Connection events the link follows on the ``out`` socket.
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
#: Messages kept while no controller is connected (the oldest go first) ...
KEEP_MESSAGES = 10_000
#: ... and their bytes of payload at most.
KEEP_BYTES = 64 << 20
#: Kinds kept while detached; every other kind (output, stats, metrics: those are in
#: the history) is dropped.
KEPT_KINDS = frozenset({K.RESULT, K.FAULT})
#: ``report()`` calls kept per rank for the next controller's dashboard: past this many,
#: every other one is dropped and only every other new one kept from then on (as the
#: dashboard's own series thin), so the history spans the whole run in bounded memory.
HISTORY = 20_000

#: Seconds the answer to ``attached`` waits for room in the controller's queue (the
#: controller stops waiting for it after ``takeover.WELCOME_TIMEOUT``).
WELCOME_SEND_TIMEOUT = 15.0

#: One ``report()``: when (time.time()), during which request, the values.
Report = tuple[float, "str | None", dict[str, float]]


@dataclass(frozen=True)
class Kept:
    """A message the rank could not send (no controller): its header and bytes."""

    header: Header
    payload: bytes
    buffers: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return len(self.payload) + sum(len(b) for b in self.buffers)


class Sender(Protocol):
    """The rank's outbox, as far as the link uses it."""

    def send(
        self, header: H.WireHeader, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> None: ...
    def welcome(self, link: ControllerLink, request: str, timeout: float) -> bool: ...


class ControllerLink:
    """Whether the controller is connected; what was kept while it was not."""

    def __init__(self, out: zmq.Socket[bytes], log_fd: int, connected: bool = True):
        #: read by the control thread only (``watch``)
        self.monitor = out.get_monitor_socket(EVENTS)
        self.log_fd = log_fd
        self.connected = connected
        #: The connected controller asked for the history (``attached``); until then
        #: metrics go to the history only, so that it charts them in order.
        self.welcomed = connected
        self.dropped = 0  #: messages dropped while no controller was connected
        self.kept: deque[Kept] = deque(maxlen=KEEP_MESSAGES)
        self.history: list[Report] = []
        self._stride = 1  # keep every stride-th report (1 until the history was thinned)
        self._reports = 0
        self._kept_bytes = 0
        self._lock = threading.Lock()
        #: The thread that reads the monitor (the control thread, set as it starts). No
        #: other thread may: a ZeroMQ socket is used by one thread at a time.
        self.watcher: int | None = None
        if not connected:
            self._mark(DETACHED_MARK)

    def watch(self) -> None:
        """Read the monitor's events (the control thread, when it polls readable)."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing more (Again), or closing
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = self.welcomed = False
                self._mark(DETACHED_MARK)
                log.debug("rank: the controller went away; running on without it")
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reconnected()

    def watch_while_waiting(self) -> None:
        """A sender waiting for room in the controller's queue calls this: where it is
        the control thread, it reads the monitor meanwhile. That thread is the only one
        that hears the connection drop, and it sends too (``stats`` once a second): waiting
        for room in the queue of a controller that was killed, it would otherwise never
        hear that it is gone, and every sender would wait for it forever."""
        if threading.get_ident() == self.watcher:
            self.watch()

    def reconnected(self) -> None:
        """A controller is connected (again)."""
        if not self.connected:
            self.connected = True
            self._mark(ATTACHED_MARK)

    def _mark(self, marker: str) -> None:
        try:
            os.write(self.log_fd, f"{marker}\n".encode())
        except OSError:
            pass

    def record(self, metrics: Mapping[str, float], request: str | None) -> None:
        """Keep a ``report()`` for the history."""
        with self._lock:
            self._reports += 1
            if self._reports % self._stride:
                return
            history = self.history
            history.append((time.time(), request, dict(metrics)))
            if len(history) >= HISTORY:
                del history[1:-1:2]  # the first and the latest stay
                self._stride *= 2

    def welcome(self) -> list[Report]:
        """The history, as the controller that asked for it gets it; metrics go live
        from now on (one reported meanwhile may reach it twice, never not at all). The
        outbox calls it under its send lock (``Outbox.welcome``)."""
        with self._lock:
            self.welcomed = True
            return list(self.history)

    def holds(self, header: Header) -> bool:
        """Whether ``header``'s message must not go to the controller now."""
        return not self.connected or (not self.welcomed and header.get("k") == K.METRIC)

    def divert(self, header: Header, payload: bytes, buffers: Sequence[Buffer]) -> None:
        """Keep (or drop) a message that cannot go to the controller now."""
        if header.get("k") not in KEPT_KINDS:
            self.dropped += 1
            return
        kept = Kept(dict(header), bytes(payload), tuple(bytes(memoryview(b)) for b in buffers))
        with self._lock:
            if len(self.kept) == self.kept.maxlen:
                self._kept_bytes -= self.kept[0].size
                self.dropped += 1
            self.kept.append(kept)
            self._kept_bytes += kept.size
            while self._kept_bytes > KEEP_BYTES and len(self.kept) > 1:
                self._kept_bytes -= self.kept.popleft().size
                self.dropped += 1

    def take_kept(self) -> list[Kept]:
        """What was kept, oldest first (and forget it)."""
        with self._lock:
            kept = list(self.kept)
            self.kept.clear()
            self._kept_bytes = 0
        return kept

    def close(self) -> None:
        self.monitor.close(0)


def serve_attached(link: ControllerLink, outbox: Sender, msg: Message) -> None:
    """ATTACHED (control thread): a controller took the mesh over. Reply with the
    metric history (before any live metric: ``Outbox.welcome``), then send the results
    and failures kept meanwhile."""
    request = H.ControlRequest.decode(msg.header).request
    link.watch()  # its connection event may still wait behind this message
    link.reconnected()  # a message from the controller proves it is there
    if request is None:
        link.welcome()
    elif not outbox.welcome(link, request, WELCOME_SEND_TIMEOUT):
        log.warning("rank: the controller that attached took no answer (gone again?)")
    for kept in link.take_kept():
        outbox.send(kept.header, kept.payload, kept.buffers)
