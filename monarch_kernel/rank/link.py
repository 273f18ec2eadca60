"""A rank of a ``--detachable`` mesh outlives its controller: :class:`ControllerLink`
knows whether one is connected, and takes what the rank would send while none is.

The rank's ``out`` socket (to the controller) is watched with a ZeroMQ socket monitor,
read by the control thread: a dropped connection (the kernel exited or was killed)
means no controller, a completed handshake (a controller attached at the same address)
means one again. Meanwhile nothing is queued for the controller (a queue would fill
after a thousand messages and then block the training loop's prints): output and
stats are dropped (the output is in the rank's log, which the next controller reads),
metrics, results and failures are kept, bounded, for the next controller.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.utils.monitor

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header

log = logging.getLogger("monarch_kernel.rank")

#: Connection events the link follows on the ``out`` socket.
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
#: Messages of each kind kept while no controller is connected (the oldest go first).
KEEP_MESSAGES = 100_000
#: Bytes of payload kept while no controller is connected (past it, the oldest go).
KEEP_BYTES = 64 << 20
#: Kinds kept while detached; every other kind (output, stats) is dropped.
KEPT_KINDS = frozenset({K.RESULT, K.FAULT, K.METRIC})


@dataclass(frozen=True)
class Kept:
    """A message the rank could not send (no controller): its header and bytes."""

    header: Header
    payload: bytes
    buffers: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return len(self.payload) + sum(len(b) for b in self.buffers)


class ControllerLink:
    """Whether the controller is connected, and what was kept while it was not."""

    def __init__(self, out: zmq.Socket[bytes]):
        #: read by the control thread only (``watch``)
        self.monitor = out.get_monitor_socket(EVENTS)
        self.connected = True
        self.dropped = 0  #: messages dropped while no controller was connected
        self.kept: deque[Kept] = deque(maxlen=KEEP_MESSAGES)
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def watch(self) -> None:
        """Read the monitor's events (the control thread, when it polls readable)."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closing
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                log.debug("rank: the controller went away; running on without it")
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                self.connected = True
                log.debug("rank: a controller is connected again")

    def divert(self, header: Header, payload: bytes, buffers: Sequence[Buffer]) -> None:
        """Keep (or drop) a message that cannot go to the controller now."""
        if header.get("k") not in KEPT_KINDS:
            self.dropped += 1
            return
        kept = Kept(dict(header), bytes(payload), tuple(bytes(memoryview(b)) for b in buffers))
        with self._lock:
            if len(self.kept) == self.kept.maxlen:
                self._kept_bytes -= self.kept[0].size
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
