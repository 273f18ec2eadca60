"""The host agent's share of step telemetry: its ranks' ``steps`` batches, combined.

Each rank sends its finished steps every 0.1 s (``rank.telemetry.sender``) to the
agent's fan-in socket; the agent keeps them and sends all its ranks' batches on as one
``host_steps`` message every :data:`STEPS_EVERY` seconds, so the messages the
controller verifies and decodes for telemetry grow with hosts, not ranks (the batches
stay signed by nothing but the agent's own message: the agent is trusted as it is for
``host_stats``). A dead rank's batches still go: they tell what its last steps did.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Header

#: Seconds between two ``host_steps`` messages while ranks send steps.
STEPS_EVERY = 0.1


class StepFanIn:
    """Batches of the agent's ranks waiting to go on, and when they go."""

    def __init__(self, host: int, send: Callable[[Header, bytes], None]):
        self.host = host
        self._send = send
        self._batches: dict[int, list[bytes]] = {}
        self.due: float | None = None
        #: ``host_steps`` messages sent, and rank batches they carried.
        self.sent = 0
        self.carried = 0

    def add(self, rank: int, payload: bytes) -> None:
        """A rank's ``steps`` batch (its payload, ``wire.steps``)."""
        if self.due is None:
            self.due = time.monotonic() + STEPS_EVERY
        self._batches.setdefault(rank, []).append(payload)

    def send_due(self, now: float) -> None:
        """Send what waits if its time came."""
        if self.due is None or now < self.due:
            return
        batches, self._batches, self.due = self._batches, {}, None
        if batches:
            header: Header = {"k": K.HOST_STEPS, "h": self.host}
            self._send(header, pickle.dumps(batches, protocol=5))
            self.sent += 1
            self.carried += sum(len(v) for v in batches.values())
