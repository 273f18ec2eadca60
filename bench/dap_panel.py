"""Rows 12: how fast JupyterLab's Debugger panel fills for paused ranks (issue 26).

A real kernel (jupyter_client) and a client speaking the Jupyter debug protocol as
JupyterLab's Debugger panel does: a gutter breakpoint on a line inside a loop stops the
code; for each ``stopped`` event the client sends what JupyterLab sends to fill the
Callstack and Variables panels (``stackTrace``, ``scopes`` of the top frame, then
``variables`` of every scope) and times it, from sending the first request to the last
reply (the kernel's work plus local round trips on the control channel); then
``continue``. The peer is plain ipykernel's own debugger (debugpy) on a local cell; ours
is a ``%%remote`` cell on 4 and on 64 ranks (every rank stops: each ``stopped`` event
is timed). ``threads`` and ``stackTrace`` alone with 64 ranks paused (the issue's
50 ms bound). Medians.

    python -m bench.dap_panel [RANKS ...]      # default: 4 64, and plain ipykernel
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import time
from typing import Any

from bench.common import Recorder, Settings

#: Loop iterations of the local cell (one stop each) and of the 4-rank cell.
STOPS = 20
#: Seconds to wait for a kernel, a mesh or a stop.
WAIT = 300.0


def _cell(magic: str, stops: int) -> tuple[str, int]:
    """The debugged cell and its breakpoint line (inside the loop)."""
    head = [magic] if magic else []
    lines = [
        *head,
        "import torch",
        "t = torch.zeros(2, 3)",
        f"for i in range({stops}):",
        "    x = i * 10",
        "x",
    ]
    return "\n".join(lines), len(head) + 4


class DapKernel:
    """A kernel driven as JupyterLab's Debugger panel drives it."""

    def __init__(self, kernel_name: str, env: dict[str, str] | None = None) -> None:
        from jupyter_client.manager import start_new_kernel

        kw: dict[str, Any] = {"env": {**os.environ, **env}} if env else {}
        self.km, self.kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=WAIT, **kw)
        self.seq = 0
        self.events: list[dict[str, Any]] = []

    def request(self, command: str, **arguments: Any) -> dict[str, Any]:
        """One DAP request; the body of its (successful) reply."""
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command, "arguments": arguments}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        while True:
            reply = self.kc.control_channel.get_msg(timeout=WAIT)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                break
        if not reply["content"].get("success"):
            raise RuntimeError(f"{command} failed: {reply['content'].get('message')}")
        return dict(reply["content"].get("body", {}))

    def stopped(self, count: int) -> list[dict[str, Any]]:
        """The next ``count`` ``stopped`` events' bodies (other IOPub messages dropped)."""
        deadline = time.monotonic() + WAIT
        while sum(e["event"] == "stopped" for e in self.events) < count:
            try:
                m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{count} stopped events awaited") from None
            if m["msg_type"] == "debug_event":
                self.events.append(m["content"])
        got = [e for e in self.events if e["event"] == "stopped"][:count]
        self.events = [e for e in self.events if e not in got]
        return [e["body"] for e in got]

    def start_debugging(self, code: str, line: int) -> None:
        """initialize, attach, debugInfo, dumpCell, setBreakpoints, configurationDone."""
        self.request("initialize", clientID="jupyterlab", adapterID="python", pathFormat="path")
        self.request("attach")
        self.request("debugInfo")
        path = self.request("dumpCell", code=code)["sourcePath"]
        self.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}])
        self.request("configurationDone")

    def fill_panel(self, thread: int) -> float:
        """Seconds to fill the Callstack and Variables panels for ``thread``."""
        t0 = time.perf_counter()
        top = self.request("stackTrace", threadId=thread)["stackFrames"][0]
        for scope in self.request("scopes", frameId=top["id"])["scopes"]:
            self.request("variables", variablesReference=scope["variablesReference"])
        return time.perf_counter() - t0

    def run(self, code: str) -> None:
        """Run ``code`` to its end (no debugging)."""
        msg_id = self.kc.execute(code)
        self.finish(msg_id)

    def finish(self, msg_id: str) -> None:
        while True:
            reply = self.kc.get_shell_msg(timeout=WAIT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content'].get('evalue')}")

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def plain_ipykernel(stops: int = STOPS) -> list[float]:
    """Panel fills for a local cell in plain ipykernel (debugpy), one per stop."""
    k = DapKernel("python3")
    try:
        code, line = _cell("", stops)
        k.start_debugging(code, line)
        msg_id = k.kc.execute(code)
        fills = []
        for _ in range(stops):
            thread = k.stopped(1)[0]["threadId"]
            fills.append(k.fill_panel(thread))
            k.request("continue", threadId=thread)
        k.finish(msg_id)
        return fills
    finally:
        k.stop()


def remote(ranks: int, stops: int) -> dict[str, list[float]]:
    """Panel fills (every rank's stop), and ``threads``/``stackTrace`` while all are paused."""
    from monarch_kernel.launchers.local import MAX_RANKS_ENV

    k = DapKernel("monarch", {MAX_RANKS_ENV: str(ranks)})
    try:
        k.run(f"%mesh m --gpus {ranks}")
        code, line = _cell("%%remote m", stops)
        k.start_debugging(code, line)
        msg_id = k.kc.execute(code)
        times: dict[str, list[float]] = {"panel": [], "threads": [], "stackTrace": []}
        for _ in range(stops):
            for event in k.stopped(ranks):
                times["panel"].append(k.fill_panel(event["threadId"]))
                t0 = time.perf_counter()
                assert len(k.request("threads")["threads"]) >= ranks
                times["threads"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                k.request("stackTrace", threadId=event["threadId"])
                times["stackTrace"].append(time.perf_counter() - t0)
            k.request("continue", threadId=1)  # as JupyterLab's button: every rank
        k.finish(msg_id)
        return times
    finally:
        k.stop()


def ours(s: Settings, rec: Recorder) -> None:
    """The rows of ``bench.report`` (``dap_*``)."""
    from monarch_kernel.kernel.install import install

    install(prefix=sys.prefix)
    stops = STOPS // 2 if s.quick else STOPS
    with rec.guard("dap_panel_ipykernel"):
        rec.value("dap_panel_ipykernel", statistics.median(plain_ipykernel(stops)))
    with rec.guard("dap_panel_4"):
        rec.value("dap_panel_4", statistics.median(remote(4, stops)["panel"]))
    rec.ratio("dap_panel_ratio", "dap_panel_4", "dap_panel_ipykernel")
    with rec.guard("dap_panel_64", "dap_threads_64", "dap_stack_64"):
        t = remote(64, 1)
        rec.value("dap_panel_64", statistics.median(t["panel"]), max=max(t["panel"]))
        rec.value("dap_threads_64", statistics.median(t["threads"]), max=max(t["threads"]))
        rec.value("dap_stack_64", statistics.median(t["stackTrace"]), max=max(t["stackTrace"]))


def _ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:.1f} ms, max {max(samples) * 1e3:.1f} ms"


def main(argv: list[str]) -> None:
    from monarch_kernel.kernel.install import install

    install(prefix=sys.prefix)
    plain = plain_ipykernel()
    print(f"| stopped → panel filled, plain ipykernel (local cell) | {_ms(plain)} |")
    for ranks in [int(a) for a in argv] or [4, 64]:
        t = remote(ranks, STOPS if ranks <= 8 else 1)
        ratio = statistics.median(t["panel"]) / statistics.median(plain)
        print(f"| stopped → panel filled, {ranks} ranks | {_ms(t['panel'])} ({ratio:.2f}×) |")
        print(f"| threads, {ranks} paused ranks | {_ms(t['threads'])} |")
        print(f"| stackTrace, {ranks} paused ranks | {_ms(t['stackTrace'])} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
