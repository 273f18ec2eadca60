"""What ranks show, report and ask the notebook, turned into the mesh's events.

The handlers of the message kinds that carry a rank's output and telemetry (``stream``
lines, with each rank's tail of whole lines kept for its death report and the dashboard;
``display`` bundles; ``metric`` values; ``stats``, also as a host agent's ``host_stats``)
and its prompts (``input`` for ``input()`` and pdb, ``resumed``). :class:`~.inbound.Inbound`
dispatches to them after its checks of who sent what; a request's output reaches its cell
through the :class:`~monarch_kernel.controller.state.events.StreamOutput` events
(``streams.StreamRouter``).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Protocol

from monarch_kernel.controller.state.events import (
    DebuggerPaused,
    DebuggerResumed,
    DisplayOutput,
    EventBus,
    InputRequested,
    MetricReported,
    StatsReported,
    StreamOutput,
)
from monarch_kernel.controller.state.records import MeshRecipe, RankInfo
from monarch_kernel.wire import Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.reports import RankStats
from monarch_kernel.wire.terminal import strip_controls

__all__ = ["NO_DEBUGGER", "NO_READER", "PromptAnswerer", "RankOutput"]

log = logging.getLogger("monarch_kernel.controller")

#: Longest unfinished output line kept per rank and stream.
PARTIAL_MAX = 4096

#: Why a rank's ``input()`` gets no line when nobody waits to answer it.
NO_READER = (
    "nothing can answer input() here: only a foreground cell's job reads input for its "
    "ranks (not background jobs or actor endpoints); pass the value as an argument or "
    "push it to the ranks"
)

#: Why a rank's ``breakpoint()`` runs on when nothing can attach to it.
NO_DEBUGGER = (
    "nothing can attach to it here (a notebook attaches through the monarch kernel: "
    "%%remote cells, %debug_remote)"
)


class PromptAnswerer(Protocol):
    """The mesh a prompt came from (``MeshRuntime``): it answers one nobody can."""

    @property
    def name(self) -> str: ...
    def answer_input(
        self, rank: int, serial: int, line: str | None = None, error: str | None = None
    ) -> None: ...


class RankOutput:
    """The handlers of what ranks show, report and ask (see the module's docstring)."""

    def __init__(
        self,
        mesh: PromptAnswerer,
        *,
        ranks: list[RankInfo],
        events: EventBus,
        recipe: MeshRecipe,
        own_rank: Callable[[object, int], int | None],
    ):
        """``own_rank(slot, host)``: the rank of ``slot`` if host ``host`` may speak for
        it (:meth:`~.inbound.Inbound._own_rank`)."""
        self._mesh = mesh
        self._name = mesh.name
        self._ranks = ranks
        self._events = events
        self._recipe = recipe
        self._own_rank = own_rank

    def on_stream(self, h: H.Stream, msg: Message) -> None:
        """STREAM: a rank's output text (see :meth:`stream`)."""
        self.stream(h.rank, h.request, h.name, bytes(msg.payload).decode("utf-8", "replace"))

    def stream(self, rank: int, request: str | None, name: str, text: str) -> None:
        """Output ``text`` of ``rank`` on stream ``name`` while serving ``request``."""
        info = self._ranks[rank]
        # Keep whole lines for the death report and the dashboard (a bar's line: its
        # last frame, without escape sequences).
        buf = info.partial.get(name, "") + text
        *lines, rest = buf.split("\n")
        if "\r" in buf or "\x1b" in buf:
            lines = [strip_controls(line) for line in lines]
            rest = strip_controls(rest)
        info.tail.extend(lines)
        info.partial[name] = rest[-PARTIAL_MAX:]
        events = self._events
        if events.wants(StreamOutput):
            events.emit(StreamOutput(self._name, rank, request, name, text))

    def on_display(self, h: H.Display, msg: Message) -> None:
        """DISPLAY: a rank's display (a MIME bundle), for the cell or job showing it."""
        events = self._events
        if not events.wants(DisplayOutput):
            return
        payload = bytes(msg.payload)
        body = pickle.loads(payload) if payload else {}
        data, metadata = body.get("data") or {}, body.get("metadata") or {}
        if not isinstance(data, dict) or not isinstance(metadata, dict):
            log.warning("rank %s: a display that is not a MIME bundle, dropped", h.rank)
            return
        events.emit(
            DisplayOutput(
                self._name, h.rank, h.request, h.op, data, metadata, h.display_id, payload
            )
        )

    def on_metric(self, h: H.Metric, msg: Message) -> None:
        """METRIC: the values a rank reported (``report()``), for the dashboard."""
        events = self._events
        if events.wants(MetricReported):
            values: dict[str, float] = pickle.loads(msg.payload)
            events.emit(MetricReported(self._name, h.rank, h.request, values, time.time()))

    def on_stats(self, h: H.RankNotice, msg: Message) -> None:
        """STATS: a rank's own once-a-second stats (memory, data plane, process group)."""
        self._stats(h.rank, pickle.loads(msg.payload))

    def on_host_stats(self, h: H.HostStats, msg: Message) -> None:
        """A host agent's ranks' latest stats, sent on together once a second, with the
        stats of the GPU each is on when the agent samples its GPUs (``h.gpu``)."""
        try:
            payload = pickle.loads(msg.payload)
            by_rank, gpu = payload if h.gpu else (payload, {})
            items: list[tuple[int, RankStats]] = []
            for r, p in by_rank.items():
                stats: RankStats = pickle.loads(p)
                if r in gpu:
                    stats.update(gpu[r])
                items.append((r, stats))
        except Exception as exc:  # signed by our agent: another version?
            log.warning("mesh %s dropped host %s's stats: %s", self._name, h.host, exc)
            return
        for slot, stats in items:  # keyed by the ranks' slots (their names on the wire)
            rank = self._own_rank(slot, h.host)
            if rank is not None:
                self._stats(rank, stats)

    def _stats(self, rank: int, stats: RankStats) -> None:
        info = self._ranks[rank]
        info.stats = stats
        info.last_seen = time.monotonic()
        if "pg" in stats:
            self._recipe.pg_backend = stats["pg"]
        events = self._events
        if events.wants(StatsReported):
            events.emit(StatsReported(self._name, rank, stats, time.time()))

    def on_input(self, h: H.Input, msg: Message) -> None:
        """INPUT: a rank waits in ``input()`` or at a pdb prompt; answered at once with
        an error when nothing in the notebook listens for prompts."""
        events = self._events
        debug = h.debugger
        event = InputRequested(
            self._name,
            h.rank,
            h.request,
            h.serial,
            h.prompt,
            h.password,
            debug,
            bytes(msg.payload).decode("utf-8", "replace") if debug else "",
            (h.where or "") if debug else "",
            bool(h.post_mortem),
        )
        if debug and events.wants(DebuggerPaused):
            events.emit(DebuggerPaused(self._name, event.rank, event.request, event.where))
        if events.wants(InputRequested):
            events.emit(event)
        else:  # nobody can answer: the rank's input() raises EOFError at once
            why = NO_DEBUGGER if debug else NO_READER
            self._mesh.answer_input(event.rank, event.serial, error=why)

    def on_resumed(self, h: H.Resumed, msg: Message) -> None:
        """RESUMED: a rank's debugger ran on (its prompt is gone)."""
        if self._events.wants(DebuggerResumed):
            resumed = DebuggerResumed(self._name, h.rank, h.request, h.serial, h.why)
            self._events.emit(resumed)
