"""Where rank output goes: to the sink of the request that printed it, else a default.

A :class:`StreamRouter` listens to a mesh's :class:`StreamOutput` and
:class:`FaultReported` events. Whoever starts a request and wants its output (the
kernel's ``%%remote``, for the cell that ran it) routes the request id to a sink
*before* sending it (ids come from ``new_request_id``), and unroutes it when done.
Output of unrouted requests (actor calls, fire-and-forget work, threads a cell left
running) goes to the default sink, which prints ``[rank N] line`` on this process's
stdout/stderr (in a kernel: under the cell that is running).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from monarch_kernel.controller.events import EventBus, FaultReported, MeshEvent, StreamOutput

#: ``sink(rank, stream name, text)``: ``text`` is what the rank wrote (may hold several
#: lines, or part of one).
Sink = Callable[[int, str, str], None]


def print_sink(rank: int, name: str, text: str) -> None:
    """Default output sink: ``[rank N] line`` on our stdout/stderr."""
    stream = sys.stderr if name == "stderr" else sys.stdout
    lines = text.splitlines(keepends=True)
    stream.write("".join(f"[rank {rank}] {line}" for line in lines))
    stream.flush()


class StreamRouter:
    """Routes a mesh's rank output by request id."""

    def __init__(self, events: EventBus, default: Sink = print_sink):
        self.default: Sink = default
        self._routes: dict[str, Sink] = {}
        self._lock = threading.Lock()
        events.subscribe(self._on_event, StreamOutput, FaultReported)

    def route(self, request: str, sink: Sink) -> None:
        """Send output tagged with ``request`` to ``sink`` from now on."""
        with self._lock:
            self._routes[request] = sink

    def unroute(self, request: str) -> None:
        """Stop routing ``request``'s output (later lines go to the default sink)."""
        with self._lock:
            self._routes.pop(request, None)

    def _on_event(self, event: MeshEvent) -> None:
        if isinstance(event, StreamOutput):
            sink = self._routes.get(event.request) if event.request else None
            (sink or self.default)(event.rank, event.stream, event.text)
        elif isinstance(event, FaultReported):
            r = event.report
            self.default(
                event.rank,
                "stderr",
                f"unhandled {r.get('type')} in {r.get('where')} (fire-and-forget): "
                f"{r.get('message')}\n",
            )
