"""When did a rank's control thread handle what was sent to it? A ping behind it.

The failure policy releases the survivors of a failed request in steps (abort the
process group, interrupt, kill), each given a short time to work. On a loaded machine
the step's message can reach a rank late, or its control thread can be slow to handle
it (the abort joins the group's teardown for up to a second), so a timer started when
the message was *sent* may run out before the rank had any chance: a healthy survivor
would be interrupted, or killed, for the machine's slowness.

:class:`ControlProbe` is the fix's measuring stick: a ping sent on the same control
path right after the step's message. A rank's control thread serves its messages in
order, so its answer to the ping says that the step's message was handled, and when.
The policy's timer for that rank starts there.

Invariant: the probe never holds anything up. A rank that cannot answer (dead, or its
host lost) counts as answered when that is known, and a ping that could not be sent
counts as answered at once (the step then times from its send, as before).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from monarch_kernel.calls.reply import Reply


class ControlProbe:
    """Observer of one ping to some ranks' control threads: when each answered.

    Its ``on_reply``/``on_lost`` run on the receiving thread (see
    :class:`~monarch_kernel.calls.reply.RequestObserver`); :meth:`answered_at` may be
    read from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[int, float] = {}

    def on_reply(self, reply: Reply) -> None:
        """``reply.rank``'s control thread answered (an error answer counts too)."""
        self._mark(reply.rank)

    def on_lost(self, rank: int, error: BaseException) -> None:
        """``rank`` will never answer (it died, or the mesh stopped)."""
        self._mark(rank)

    def answer_all(self, ranks: Iterable[int]) -> None:
        """Count ``ranks`` as answered now (the ping could not be sent to them)."""
        for rank in ranks:
            self._mark(rank)

    def answered_at(self, rank: int) -> float | None:
        """When ``rank`` answered (``time.monotonic``), None while it has not."""
        with self._lock:
            return self._at.get(rank)

    def _mark(self, rank: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._at.setdefault(rank, now)


def step_due(
    probe: ControlProbe, ranks: Iterable[int], sent: float, step: float, ack_wait: float
) -> float:
    """When a release step whose message went to ``ranks`` at ``sent`` has had its time:
    ``step`` seconds after the last of their answers to ``probe``, and never before
    ``step`` after ``sent``; a rank that has not answered ``ack_wait`` after ``sent``
    (its control thread is stuck too: a rank holding the GIL in native code) is waited
    for no longer."""
    due = sent + step
    for rank in ranks:
        at = probe.answered_at(rank)
        due = max(due, sent + ack_wait if at is None else min(at + step, sent + ack_wait + step))
    return due
