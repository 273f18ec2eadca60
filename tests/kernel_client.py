"""A small driver for real kernels started through jupyter_client."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import start_new_kernel


def ensure_kernelspec() -> None:
    """Install the monarch kernelspec into this environment (idempotent)."""
    import sys

    from monarch_kernel.kernel.install import install

    install(prefix=sys.prefix)


@dataclass
class Result:
    msg_id: str
    streams: list[tuple[str, str]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        return "".join(t for n, t in self.streams if n == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(t for n, t in self.streams if n == "stderr")

    @property
    def text(self) -> str:
        """The text/plain of the execute_result (empty if none)."""
        return self.results[-1]["data"].get("text/plain", "") if self.results else ""

    @property
    def error_text(self) -> str:
        return "\n".join("\n".join(e["traceback"]) for e in self.errors)


class Kernel:
    """A live monarch kernel; ``run(code)`` returns what that cell produced."""

    def __init__(self, name: str = "monarch", env: dict[str, str] | None = None):
        ensure_kernelspec()
        kw = {"env": {**os.environ, **(env or {})}}
        self.km, self.kc = start_new_kernel(kernel_name=name, **kw)
        self.other: list[dict[str, Any]] = []  # iopub messages for other cells

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 60) -> Result:
        res = Result(msg_id)
        deadline = time.monotonic() + timeout
        while True:
            m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if m["parent_header"].get("msg_id") != msg_id:
                self.other.append(m)
                continue
            t, c = m["msg_type"], m["content"]
            if t == "status" and c["execution_state"] == "idle":
                break
            if t == "stream":
                res.streams.append((c["name"], c["text"]))
            elif t == "execute_result":
                res.results.append(c)
            elif t in ("display_data", "update_display_data"):
                res.displays.append({"type": t, **c})
            elif t == "error":
                res.errors.append(c)
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                res.reply = reply["content"]
                return res

    def run(self, code: str, timeout: float = 60) -> Result:
        return self.collect(self.submit(code), timeout)

    def pids(self) -> list[int]:
        """Process ids of the kernel and everything it started."""
        import psutil

        root = psutil.Process(self.km.provisioner.process.pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)

    def shutdown_and_check(self, timeout: float = 10.0) -> None:
        """Shut down; fail if the kernel or anything it started is still alive after."""
        from conftest import pid_alive

        pids = self.pids()
        self.shutdown()
        deadline = time.monotonic() + timeout
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in pids if pid_alive(p)]
        assert not left, f"kernel shutdown left processes behind: {left}"
