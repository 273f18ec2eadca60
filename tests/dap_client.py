"""Speaking the Jupyter debug protocol to a real kernel as JupyterLab's Debugger panel does:
``debug_request`` on the control channel, ``debug_event`` read from IOPub (the other IOPub
messages are kept for :meth:`Kernel.collect`)."""

from __future__ import annotations

import queue
import time
from typing import Any

from kernel_client import Kernel


class DapClient:
    def __init__(self, kernel: Kernel) -> None:
        self.k = kernel
        self.seq = 0
        self.events: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}

    def request(self, command: str, timeout: float = 30, **arguments: Any) -> dict[str, Any]:
        """Send one DAP request; its reply's content (``success``, ``body``...)."""
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command, "arguments": arguments}
        msg = self.k.kc.session.msg("debug_request", content)
        self.k.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.k.kc.control_channel.get_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return dict(reply["content"])

    def ok(self, command: str, **arguments: Any) -> dict[str, Any]:
        """The body of a request that must succeed."""
        reply = self.request(command, **arguments)
        assert reply.get("success"), f"{command} failed: {reply}"
        return dict(reply.get("body", {}))

    def _pump(self, timeout: float) -> None:
        # (events that came while Kernel.collect read a cell's messages are kept there)
        kept = [m for m in self.k.other if m["msg_type"] == "debug_event"]
        if kept:
            self.k.other[:] = [m for m in self.k.other if m["msg_type"] != "debug_event"]
            self.events.extend(m["content"] for m in kept)
            return
        try:
            m = self.k.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return
        if m["msg_type"] == "debug_event":
            self.events.append(m["content"])
        else:
            self.k._ahead.append(m)

    def drop_events(self) -> None:
        """Forget the events seen so far (those of earlier cells)."""
        self._pump(0.05)
        self.k.other[:] = [m for m in self.k.other if m["msg_type"] != "debug_event"]
        self.events.clear()

    def wait_events(self, name: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Wait until ``count`` events ``name`` were seen (not taken before); take them."""
        deadline = time.monotonic() + timeout
        while True:
            got = [e for e in self.events if e.get("event") == name]
            if len(got) >= count:
                for e in got[:count]:
                    self.events.remove(e)
                return got[:count]
            left = deadline - time.monotonic()
            assert left > 0, f"{count} {name!r} events awaited, saw {self.events}"
            self._pump(min(left, 0.2))

    def start(self) -> dict[str, Any]:
        """initialize, attach, debugInfo as JupyterLab sends them; debugInfo's body."""
        self.ok(
            "initialize",
            clientID="jupyterlab",
            clientName="JupyterLab",
            adapterID="python",
            pathFormat="path",
            linesStartAt1=True,
            columnsStartAt1=True,
            supportsVariableType=True,
            supportsVariablePaging=True,
            supportsRunInTerminalRequest=True,
            locale="en",
        )
        self.ok("attach")
        return self.ok("debugInfo")
