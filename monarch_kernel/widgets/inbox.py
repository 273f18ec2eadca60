"""Where controller threads hand lifecycle events to the dashboard: O(1), never blocking.

:meth:`EventInbox.put` is a mesh event listener (``runtime.events.subscribe``). It runs
on whichever controller thread emitted the event and only appends to a deque: metric
reports (the bulk: 64 ranks x 100 reports/s) go straight into a per-rank deque of their
values, so that the dashboard's updater folds them per rank, not per event; every other
event goes into one deque, in order. Nothing here touches a widget or takes a lock
(``deque.append`` is atomic), and nothing needs a mesh: the listener's cost can be
measured alone (``bench/dashboard_overhead.py``).
"""

from __future__ import annotations

from collections import deque

from monarch_kernel.controller.state.events import MeshEvent, MetricReported

#: Events kept between two drains; far more than 64 ranks x 100 reports/s x 0.25 s.
MAX_QUEUED = 200_000
MAX_QUEUED_RANK = 20_000  # metric reports of one rank kept between two drains


class EventInbox:
    """Events queued since the last drain; full queues drop their oldest (counted)."""

    __slots__ = ("events", "metrics", "dropped")

    def __init__(self) -> None:
        self.events: deque[MeshEvent] = deque(maxlen=MAX_QUEUED)
        #: rank -> the values of its metric reports, in arrival order
        self.metrics: dict[int, deque[dict[str, float]]] = {}
        self.dropped = 0  # events lost to full queues (approximate: not locked)

    def put(self, event: MeshEvent) -> None:
        """The listener: queue ``event`` for the next drain."""
        if type(event) is MetricReported:
            queue = self.metrics.get(event.rank)
            if queue is None:
                queue = self.metrics.setdefault(event.rank, deque(maxlen=MAX_QUEUED_RANK))
            if len(queue) == MAX_QUEUED_RANK:
                self.dropped += 1
            queue.append(event.values)
            return
        events = self.events
        if len(events) == MAX_QUEUED:
            self.dropped += 1
        events.append(event)
