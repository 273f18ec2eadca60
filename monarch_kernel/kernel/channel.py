"""Sending output to one particular cell from any thread.

ipykernel ties output to the request being served *now*; rank output may arrive from the
controller's I/O thread while another cell runs, or after its own cell finished
(``--bg``). A :class:`CellChannel` remembers the parent request of the cell that started
the work and publishes on IOPub with it (ipykernel's IOPub socket is thread-safe).
"""

from __future__ import annotations

import base64
import html
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any

from monarch_kernel.controller.state.events import DisplayOutput
from monarch_kernel.wire.jsontypes import JsonObject, MimeBundle
from monarch_kernel.wire.terminal import strip_controls


def current_kernel() -> Any:
    """The running ipykernel kernel, or None (plain Python / terminal IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return None
    shell = get_ipython()
    return getattr(shell, "kernel", None)


class CellChannel:
    """Publishes streams and displays under the cell that created this channel."""

    def __init__(self, kernel: Any = None):
        self.kernel = kernel if kernel is not None else current_kernel()
        self.parent = self.kernel.get_parent("shell") if self.kernel is not None else None

    def _send(self, msg_type: str, content: JsonObject) -> None:
        k = self.kernel
        k.session.send(
            k.iopub_socket, msg_type, content, parent=self.parent, ident=k._topic(msg_type)
        )

    def stream(self, name: str, text: str) -> None:
        if self.kernel is None:
            (sys.stderr if name == "stderr" else sys.stdout).write(text)
            return
        self._send("stream", {"name": name, "text": text})

    def display(
        self,
        data: MimeBundle,
        display_id: str | None = None,
        update: bool = False,
        metadata: JsonObject | None = None,
    ) -> None:
        """A display_data (``update``: an update_display_data of ``display_id``); binary
        data (a rank's PNG) is sent base64-encoded, as Jupyter's protocol wants."""
        if self.kernel is None:
            if not update:
                print(data.get("text/plain", ""))
            return
        if any(isinstance(v, (bytes, bytearray, memoryview)) for v in data.values()):
            data = {
                k: base64.b64encode(v).decode("ascii")
                if isinstance(v, (bytes, bytearray, memoryview))
                else v
                for k, v in data.items()
            }
        content: JsonObject = {"data": data, "metadata": metadata or {}}
        if display_id:
            content["transient"] = {"display_id": display_id}
        self._send("update_display_data" if update else "display_data", content)

    def show(
        self, data: MimeBundle, metadata: JsonObject, display_id: str | None, update: bool
    ) -> None:
        """:meth:`display` in the argument order of a ``CellOutput``'s display sink."""
        self.display(data, display_id, update, metadata)


class _Bars:
    """A bar block inside a :class:`LiveText` (its text changes in place)."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text = ""

    def __str__(self) -> str:
        return self.text


class _Shown:
    """A rank's display inside a :class:`LiveText` (updated in place by its id)."""

    __slots__ = ("data", "metadata")

    def __init__(self) -> None:
        self.data: MimeBundle = {}
        self.metadata: JsonObject = {}

    def __str__(self) -> str:
        return str(self.data.get("text/plain", ""))

    def html(self) -> str:
        """The display as HTML: its own HTML, an image inline, else its text."""
        data = self.data
        if "text/html" in data:
            return f"<div>{data['text/html']}</div>"
        for mime in ("image/png", "image/jpeg", "image/gif"):
            if mime in data:
                value = data[mime]
                if isinstance(value, (bytes, bytearray, memoryview)):
                    value = base64.b64encode(value).decode("ascii")
                size = self.metadata.get(mime)
                attrs = ""
                if isinstance(size, dict):
                    for key in ("width", "height"):
                        if isinstance(size.get(key), (int, float)):
                            attrs += f' {key}="{size[key]}"'
                return f'<img src="data:{mime};base64,{value}"{attrs}>'
        if "image/svg+xml" in data:
            return f"<div>{data['image/svg+xml']}</div>"
        text = str(self)
        return _pre(text) if text else ""


def _pre(text: str) -> str:
    """Text as HTML (colours and other controls dropped)."""
    return f"<pre>{html.escape(strip_controls(text))}</pre>"


class LiveText:
    """A block of text under a cell that keeps growing after the cell has finished.

    Used for ``--bg`` output: frontends drop plain stream messages for a finished cell,
    but apply display updates by display id at any time. An update replaces the whole
    block, so the block keeps only its last :attr:`MAX_LINES` lines (with a line saying
    how many earlier ones are in the logs) and is re-sent at most every
    :attr:`MIN_INTERVAL` seconds: a flood costs a few small updates a second.

    Rich displays of the job's ranks (HTML, images, figures) are part of the block too,
    in line with the text (a new ``display_data`` for a finished cell would be dropped
    like its streams): once it holds one, the block is also sent as ``text/html``, the
    text in ``<pre>`` and each display as its HTML or an inline image; only the last
    :attr:`MAX_DISPLAYS` keep their images (older ones become their text).
    """

    MAX_LINES = 200
    MIN_INTERVAL = 0.25
    MAX_DISPLAYS = 16

    def __init__(self, channel: CellChannel, title: str = "", logs: str = ""):
        self.channel = channel
        self.display_id = f"mk-{uuid.uuid4().hex[:12]}"
        self.title = title
        self.logs = logs
        self.lines: deque[str | _Bars | _Shown] = deque(maxlen=self.MAX_LINES)
        self._bars: dict[str, _Bars] = {}  # bar blocks by display id
        self._shown: dict[str, _Shown] = {}  # displays by display id
        self._rich: deque[_Shown] = deque()  # displays that keep their images, oldest first
        self.dropped = 0  # lines no longer shown (all are in the logs)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # held from making a block until it is sent
        self._sent = 0.0
        self._timer: threading.Timer | None = None
        self.channel.display(self._data(), self.display_id)

    def _data(self) -> MimeBundle:
        head = [self.title] if self.title else []
        if self.dropped:
            where = f" (all output: {self.logs})" if self.logs else ""
            head.append(f"[... {self.dropped:,} earlier lines not shown{where}]")
        body = [str(line) for line in self.lines]
        data: MimeBundle = {"text/plain": "\n".join([*head, *(line for line in body if line)])}
        if self._rich:
            data["text/html"] = self._html(head)
        return data

    def _html(self, head: list[str]) -> str:
        parts: list[str] = []
        text: list[str] = list(head)
        for line in self.lines:
            if isinstance(line, _Shown):
                if text:
                    parts.append(_pre("\n".join(text)))
                    text = []
                parts.append(line.html())
            elif str(line):
                text.append(str(line))
        if text:
            parts.append(_pre("\n".join(text)))
        return "".join(parts)

    def show(
        self, data: MimeBundle, metadata: JsonObject, display_id: str | None, update: bool
    ) -> None:
        """A ``CellOutput``'s display sink: bar blocks and the ranks' displays become
        part of this block (kept up to date in place, like the rest of it)."""
        marks = metadata.get("monarch_kernel")
        with self._lock:
            if isinstance(marks, dict) and marks.get("bars") and display_id:
                bars = self._bars.get(display_id)
                if bars is None:
                    bars = self._bars[display_id] = _Bars()
                    self.lines.append(bars)
                bars.text = str(data.get("text/plain", ""))
            else:
                shown = self._shown.get(display_id) if display_id else None
                if shown is None:
                    shown = _Shown()
                    self.lines.append(shown)
                    if display_id:
                        self._shown[display_id] = shown
                shown.data, shown.metadata = dict(data), dict(metadata)
                if shown not in self._rich:
                    self._rich.append(shown)
                while len(self._rich) > self.MAX_DISPLAYS:
                    old = self._rich.popleft()  # keeps its text only
                    old.data = {"text/plain": str(old)}
        self._update()

    def emit(self, name: str, text: str) -> None:
        new = text.rstrip("\n").split("\n")
        with self._lock:
            overflow = len(self.lines) + len(new) - self.MAX_LINES
            if overflow > 0:
                self.dropped += overflow
            self.lines.extend(new)
        self._update()

    def set_title(self, title: str) -> None:
        self.title = title
        self._update(now=True)

    def _update(self, now: bool = False) -> None:
        """Send the block, or schedule it if one was sent less than MIN_INTERVAL ago."""
        # Blocks leave in the order they were made: the timer's send and another one
        # (the job's last title) must not cross, or the notebook keeps the older block.
        with self._send_lock:
            with self._lock:
                wait = self._sent + self.MIN_INTERVAL - time.monotonic()
                if not now and wait > 0:
                    if self._timer is None:
                        self._timer = threading.Timer(wait, self._update, kwargs={"now": True})
                        self._timer.daemon = True
                        self._timer.start()
                    return
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                self._sent = time.monotonic()
                data = self._data()
            self.channel.display(data, self.display_id, update=True)


def show_unrouted(event: DisplayOutput) -> None:
    """Show a display no cell routes (an actor endpoint's, a thread's) under the cell
    running when it comes, labelled ``[rank N]:`` like the lines of the default stream
    sink: the kernel's :func:`~monarch_kernel.controller.messaging.streams.set_unrouted_display`
    hook, for every mesh (``%mesh``, ``spawn_procs`` in a cell, ...)."""
    if event.op not in ("display", "update"):
        return  # clear_output outside a cell: nothing of its own to clear
    channel = CellChannel()
    did = f"{event.display_id}-r{event.rank}" if event.display_id else None
    update = event.op == "update"
    if not update:
        channel.stream("stdout", f"[rank {event.rank}]:\n")
    meta = {**event.metadata, "monarch_kernel": {"ranks": [event.rank]}}
    channel.display(event.data, did, update, meta)
