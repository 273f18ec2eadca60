"""Sending output to one particular cell from any thread.

ipykernel ties output to the request being served *now*; rank output may arrive from the
controller's I/O thread while another cell runs, or after its own cell finished
(``--bg``). A :class:`CellChannel` remembers the parent request of the cell that started
the work and publishes on IOPub with it (ipykernel's IOPub socket is thread-safe).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any


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

    def _send(self, msg_type: str, content: dict[str, Any]) -> None:
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
        self, data: dict[str, Any], display_id: str | None = None, update: bool = False
    ) -> None:
        if self.kernel is None:
            if not update:
                print(data.get("text/plain", ""))
            return
        content: dict[str, Any] = {"data": data, "metadata": {}}
        if display_id:
            content["transient"] = {"display_id": display_id}
        self._send("update_display_data" if update else "display_data", content)


class LiveText:
    """A block of text under a cell that keeps growing after the cell has finished.

    Used for ``--bg`` output: frontends drop plain stream messages for a finished cell,
    but apply display updates by display id at any time.
    """

    MAX_LINES = 2000

    def __init__(self, channel: CellChannel, title: str = ""):
        self.channel = channel
        self.display_id = f"mk-{uuid.uuid4().hex[:12]}"
        self.lines: list[str] = [title] if title else []
        self.channel.display(self._data(), self.display_id)

    def _data(self) -> dict[str, Any]:
        return {"text/plain": "\n".join(self.lines)}

    def emit(self, name: str, text: str) -> None:
        self.lines.extend(text.rstrip("\n").split("\n"))
        del self.lines[: -self.MAX_LINES]
        self.channel.display(self._data(), self.display_id, update=True)

    def set_title(self, title: str) -> None:
        if self.lines:
            self.lines[0] = title
        else:
            self.lines.append(title)
        self.channel.display(self._data(), self.display_id, update=True)
