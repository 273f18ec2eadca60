"""Sends a rank's finished steps in batches, off the training loop's thread.

The loop's thread only appends a record to a deque (and wakes the sender after a quiet
spell); the ``mk-steps`` thread sends what gathered every :data:`FLUSH_EVERY` seconds
as one ``steps`` message (``wire.steps``), and sleeps on an event once steps stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Header
from monarch_kernel.wire.steps import StepBatch, StepRecord, encode_steps

log = logging.getLogger("monarch_kernel.rank")

#: Seconds between two batches while steps come.
FLUSH_EVERY = 0.1
#: Seconds without a step after which the thread sleeps until the next one.
QUIET = 2.0

Send = Callable[[Header, bytes], None]


class StepSender:
    """Batches step records to the controller (through the host agent's fan-in)."""

    def __init__(self, send: Send, slot: int):
        self._send = send
        self._slot = slot
        self._queue: deque[tuple[StepRecord, str | None]] = deque()
        self._wake = threading.Event()
        self._asleep = True
        #: Batches sent (for tests and the benchmark).
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="mk-steps", daemon=True)
        self._thread.start()

    def put(self, record: StepRecord, request: str | None) -> None:
        """A finished step (the loop's thread: an append, a wake-up after quiet)."""
        self._queue.append((record, request))
        if self._asleep:
            self._asleep = False
            self._wake.set()

    def flush(self) -> None:
        """Send what waits now (any thread)."""
        queue = self._queue
        if not queue:
            return
        by_request: dict[str | None, list[StepRecord]] = {}
        while queue:
            record, request = queue.popleft()
            by_request.setdefault(request, []).append(record)
        header: Header = {"k": K.STEPS, "r": self._slot}
        for request, steps in by_request.items():
            try:
                self._send(header, encode_steps(StepBatch(request, steps)))
                self.sent += 1
            except Exception as exc:  # never break the loop for telemetry
                log.debug("steps not sent: %r", exc)

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(FLUSH_EVERY)
            if self._queue:
                last = time.monotonic()
                self.flush()
                self._wake.set()  # keep going while steps come
            elif time.monotonic() - last > QUIET:
                self._asleep = True
                if self._queue:  # one came while going to sleep
                    self._asleep = False
                    self._wake.set()
            else:
                self._wake.set()
