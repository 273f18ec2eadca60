"""Where rank output goes: to the sink of the request that printed it, else a default;
and, all of it, to a log file per rank.

A :class:`StreamRouter` listens to a mesh's :class:`StreamOutput` and
:class:`FaultReported` events. Whoever starts a request and wants its output (the
kernel's ``%%remote``, for the cell that ran it) routes the request id to a sink
*before* sending it (ids come from ``new_request_id``), and unroutes it when done.
Output of unrouted requests (actor calls, fire-and-forget work, threads a cell left
running) goes to the default sink, which prints ``[rank N] line`` on this process's
stdout/stderr (in a kernel: under the cell that is running).

Rich displays (:class:`DisplayOutput`) are routed the same way, to the display sink
given with the request's route (the cell's), else to :attr:`StreamRouter.default_display`
if a mesh set one, else to the process's :func:`set_unrouted_display` hook (which the
kernel sets: under the cell running when they come, for every mesh however it was made),
else their text is printed like a line.

A :class:`RankLogs` keeps every line a rank printed in ``<log dir>/<mesh>-<id>/rankN.log``
(``$MONARCH_KERNEL_LOG_DIR``, by default ``monarch_kernel-logs`` in the temp directory),
so output the notebook elides is never lost; the files stay after the mesh stops. A
progress bar's line is logged in its final state (each ``\r`` frame replaces the last,
escape sequences dropped: :class:`~monarch_kernel.wire.terminal.Terminal`, used once a
stream redraws a line), not as thousands of frames; a rank's display is logged as its
MIME types and text.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TextIO

from monarch_kernel.controller.state.events import (
    DisplayOutput,
    EventBus,
    FaultReported,
    MeshEvent,
    StreamOutput,
)
from monarch_kernel.wire.terminal import Terminal

#: ``sink(rank, stream name, text)``: ``text`` is what the rank wrote (may hold several
#: lines, or part of one).
Sink = Callable[[int, str, str], None]
#: ``display_sink(event)``: a rank's rich display (see :class:`DisplayOutput`).
DisplaySink = Callable[[DisplayOutput], None]


#: Where displays no request routes go, in every mesh of this process (see the module's
#: doc); the kernel layer sets it (a hook: this layer never imports the kernel).
_unrouted_display: DisplaySink | None = None


def set_unrouted_display(sink: DisplaySink | None) -> None:
    """Show the displays of unrouted requests (endpoints, threads) of every mesh with
    ``sink`` (None: as their text, printed like a line)."""
    global _unrouted_display
    _unrouted_display = sink


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
        #: where displays of unrouted requests go (None: the process's hook, see
        #: :func:`set_unrouted_display`)
        self.default_display: DisplaySink | None = None
        # Single dict operations (atomic under the GIL): no lock on the receiving path.
        self._routes: dict[str, Sink] = {}
        self._display_routes: dict[str, DisplaySink] = {}
        events.subscribe(self._on_event, StreamOutput, FaultReported, DisplayOutput)

    def route(self, request: str, sink: Sink, display: DisplaySink | None = None) -> None:
        """Send output tagged with ``request`` to ``sink`` (and its displays to
        ``display``, if given) from now on."""
        self._routes[request] = sink
        if display is not None:
            self._display_routes[request] = display

    def unroute(self, request: str) -> None:
        """Stop routing ``request``'s output (later lines go to the default sink)."""
        self._routes.pop(request, None)
        self._display_routes.pop(request, None)

    def _print_display(self, event: DisplayOutput) -> None:
        """A display nobody shows: its text, as a line of the default sink."""
        if event.op in ("display", "update"):
            text = str(event.data.get("text/plain", ""))
            if text:
                self.sink_for(event.request)(event.rank, "stdout", text + "\n")

    def sink_for(self, request: str | None) -> Sink:
        """Where output of ``request`` goes now (for notices about it)."""
        sink = self._routes.get(request) if request else None
        return sink or self.default

    def _on_event(self, event: MeshEvent) -> None:
        if isinstance(event, StreamOutput):
            sink = self._routes.get(event.request) if event.request else None
            (sink or self.default)(event.rank, event.stream, event.text)
        elif isinstance(event, DisplayOutput):
            show = self._display_routes.get(event.request) if event.request else None
            if show is None and event.request in self._routes:
                show = self._print_display  # routed without a display sink
            (show or self.default_display or _unrouted_display or self._print_display)(event)
        elif isinstance(event, FaultReported):
            r = event.report
            self.default(
                event.rank,
                "stderr",
                f"unhandled {r.get('type')} in {r.get('where')} (fire-and-forget): "
                f"{r.get('message')}\n",
            )


def log_root() -> str:
    """Where rank logs go: ``$MONARCH_KERNEL_LOG_DIR`` or the temp directory."""
    return os.environ.get("MONARCH_KERNEL_LOG_DIR") or os.path.join(
        tempfile.gettempdir(), "monarch_kernel-logs"
    )


class RankLogs:
    """Appends each rank's output (both streams, each line in its final state) to its
    own log file."""

    def __init__(self, events: EventBus, mesh: str, run_id: str):
        self.directory = os.path.join(log_root(), f"{mesh}-{run_id}")
        self._files: dict[int, TextIO] = {}
        self._terms: dict[tuple[int, str], Terminal] = {}
        self._lock = threading.Lock()
        self._closed = False
        events.subscribe(self._on_event, StreamOutput, DisplayOutput)

    def path(self, rank: int) -> str:
        """The log file of ``rank`` (it exists once the rank printed something)."""
        return os.path.join(self.directory, f"rank{rank}.log")

    def _on_event(self, event: MeshEvent) -> None:
        if isinstance(event, DisplayOutput):
            if event.op != "display":
                return
            mimes = ", ".join(sorted(event.data))
            text = str(event.data.get("text/plain", "")).replace("\n", " ")[:200]
            event = StreamOutput(event.mesh, event.rank, event.request, "stdout", "")
            line = f"[display: {mimes}] {text}\n"
        elif isinstance(event, StreamOutput):
            line = ""
        else:
            return
        with self._lock:
            if self._closed:
                return
            f = self._files.get(event.rank)
            if f is None:
                try:
                    os.makedirs(self.directory, mode=0o700, exist_ok=True)
                    # kept open until the mesh stops (close()), one file per rank
                    f = open(self.path(event.rank), "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                except OSError:
                    return  # no log (disk full, read-only): the notebook output still flows
                self._files[event.rank] = f
            if event.text:
                key = (event.rank, event.stream)
                term = self._terms.get(key)
                if term is None and "\r" not in event.text and "\x1b" not in event.text:
                    text = event.text  # as it came, until the stream redraws a line
                else:
                    if term is None:
                        term = self._terms[key] = Terminal()
                    lines = term.feed(event.text)
                    text = "\n".join(lines) + "\n" if lines else ""
            else:
                text = line
            try:
                if text:
                    f.write(text)
            except OSError:
                pass

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (old -> new): each log is closed with a line
        that says so; a rank's output goes to the log of its new number from now on
        (``rank1.log`` holds what rank 1 printed, whichever process it was)."""
        with self._lock:
            if self._closed:
                return
            for rank, f in self._files.items():
                new = mapping.get(rank)
                what = f"rank {new} now" if new is not None else "removed from the mesh"
                try:
                    f.write(f"[mesh shrunk: the process that was rank {rank} is {what}]\n")
                    f.close()
                except OSError:
                    pass
            self._files.clear()
            self._terms.clear()

    def close(self) -> None:
        """Close the files (they stay on disk), with the lines still open (a bar's last
        frame, a line without its newline) written out."""
        with self._lock:
            self._closed = True
            files, self._files = self._files, {}
            terms, self._terms = self._terms, {}
        for (rank, _), term in sorted(terms.items()):
            rest = term.close()
            f = files.get(rank)
            if rest and f is not None:
                try:
                    f.write("\n".join(rest) + "\n")
                except OSError:
                    pass
        for f in files.values():
            f.close()
