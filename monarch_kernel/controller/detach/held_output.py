"""Output of a running job between an attach and the moment its handle is back.

A kernel that attaches to a detachable mesh binds its sockets first; the ranks
reconnect and their live output flows at once, while the notebook still builds the
dashboard and the job's output block. :class:`HeldOutput` is the sink of such a job
until then: it keeps the lines (bounded: the oldest go first, and are counted) and,
once :meth:`HeldOutput.forward_to` names the job's sink, replays them there in order
and passes every later line straight on. So the notebook shows every line printed
after the attach (the ones before are in the ranks' logs: ``printed while no kernel
was attached``).
"""

from __future__ import annotations

import threading
from collections import deque

from monarch_kernel.controller.messaging.streams import Sink

#: Lines a job's output keeps before its handle is back (the oldest go first).
MAX_HELD_LINES = 10_000


class HeldOutput:
    """A :data:`~monarch_kernel.controller.messaging.streams.Sink` that keeps what it gets until it
    has a target."""

    def __init__(self, limit: int = MAX_HELD_LINES):
        self._lock = threading.Lock()
        self._held: deque[tuple[int, str, str]] = deque(maxlen=limit)
        self._target: Sink | None = None
        self.dropped = 0  #: lines that did not fit (the oldest)

    def __call__(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            target = self._target
            if target is None:
                if len(self._held) == self._held.maxlen:
                    self.dropped += 1
                self._held.append((rank, stream, text))
                return
        target(rank, stream, text)

    def forward_to(self, sink: Sink) -> None:
        """Replay the kept lines to ``sink``, then send it every later one."""
        with self._lock:  # a line arriving now waits: the order stays
            if self.dropped:
                sink(0, "stderr", f"[{self.dropped} earlier lines not shown: see the logs]\n")
            while self._held:
                sink(*self._held.popleft())
            self._target = sink
