"""A small driver for real kernels started through jupyter_client."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from helpers import wait_until
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import AsyncKernelManager, KernelManager
from jupyter_client.provisioning import LocalProvisioner


def ensure_kernelspec() -> None:
    """Install the monarch kernelspec into this environment unless the one there is
    already this one. One process at a time: ``make test``'s two pytest-xdist workers
    both get here, and jupyter_client's install (remove, then copy) of one failed on the
    other's copy. A current spec is left alone, as a reinstall's moment without one
    made the other worker's kernel start fail (``NoSuchKernel``): starting a kernel
    reads it without this lock."""
    import fcntl
    import json
    import os
    import sys

    from monarch_kernel.kernel.install import KERNEL_NAME, install, kernel_json

    spec = os.path.join(sys.prefix, "share", "jupyter", "kernels", KERNEL_NAME, "kernel.json")
    with open(os.path.join(sys.prefix, ".mk-kernelspec.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(spec) as f:
                if json.load(f) == kernel_json():
                    return
        except (OSError, ValueError):
            pass
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
    def shown(self) -> str:
        """The text/plain the cell shows as its value: the execute_result, or the last
        display (objects that update themselves, like a ``--bg`` job, are displays)."""
        if self.results:
            return self.text
        shown = [d for d in self.displays if d["type"] == "display_data"]
        return shown[-1]["data"].get("text/plain", "") if shown else ""

    @property
    def error_text(self) -> str:
        return "\n".join("\n".join(e["traceback"]) for e in self.errors)


def kernel_with_mesh(name: str, gpus: int) -> Kernel:
    """A monarch kernel in which ``%mesh NAME --gpus N`` is ready."""
    k = Kernel()
    r = k.run(f"%mesh {name} --gpus {gpus}")
    assert "ready" in r.stdout, r.stderr + r.error_text
    return k


def _on_unix_sockets(km: KernelManager | AsyncKernelManager) -> None:
    """Have ``km``'s kernel talk over unix sockets in a directory of its own
    (jupyter_client's ``ipc`` transport), not TCP. Over TCP jupyter_client picks the
    kernel's five ports by binding and closing sockets, and on a busy machine another
    process (a rank, Ray, Slurm) could take one before the kernel bound it ("Address
    already in use": the kernel exited at start; seen once in CI). Socket files are
    never taken by anyone else. The directory goes with the manager."""
    where = tempfile.mkdtemp(prefix="mk-kernel-")
    km.transport = "ipc"
    km.ip = os.path.join(where, "k")  # the channels are k-1 ... k-5 in it
    km.connection_file = os.path.join(where, "kernel.json")
    weakref.finalize(km, shutil.rmtree, where, ignore_errors=True)


def new_kernel_manager(name: str = "monarch") -> KernelManager:
    """A KernelManager of kernel ``name`` on unix sockets (see :func:`_on_unix_sockets`)."""
    km = KernelManager(kernel_name=name)
    _on_unix_sockets(km)
    return km


class IpcKernelManager(AsyncKernelManager):
    """nbclient's kernel manager, on unix sockets (see :func:`_on_unix_sockets`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _on_unix_sockets(self)


def start_kernel(name: str, env: dict[str, str]) -> tuple[KernelManager, BlockingKernelClient]:
    """A started kernel (on :func:`new_kernel_manager`'s unix sockets) and its ready
    client; the kernel is shut down if it does not get ready."""
    km = new_kernel_manager(name)
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
    except BaseException:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc


def notebook_client(nb: Any, **options: Any) -> Any:
    """nbclient's NotebookClient for ``nb`` (``options``: its own) whose kernel talks
    over unix sockets (:class:`IpcKernelManager`); nbclient shuts it down at the end."""
    from nbclient import NotebookClient

    return NotebookClient(nb, kernel_manager_class=IpcKernelManager, **options)


class Kernel:
    """A live monarch kernel; ``run(code)`` returns what that cell produced."""

    def __init__(self, name: str = "monarch", env: dict[str, str] | None = None):
        ensure_kernelspec()
        self.km, self.kc = start_kernel(name, {**os.environ, **(env or {})})
        self.other: list[dict[str, Any]] = []  # iopub messages for other cells
        # iopub messages read ahead by wait_for_output, not yet seen by collect()
        self._ahead: list[dict[str, Any]] = []

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 60) -> Result:
        res = Result(msg_id)
        deadline = time.monotonic() + timeout
        while True:
            if self._ahead:
                m = self._ahead.pop(0)
            else:
                m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if m["parent_header"].get("msg_id") != msg_id or m["msg_type"] == "debug_event":
                self.other.append(m)  # (a debugger's events: for tests/dap_client.py)
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

    def output_so_far(self, msg_id: str) -> list[str]:
        """What cell ``msg_id`` has shown in the iopub messages read but not yet collected
        for it: its streams joined into one text, then the text of each display it sent
        (``--bg`` cells show their rank output in a display that keeps being updated)."""
        streams, displays = [], []
        for m in [*self.other, *self._ahead]:
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = m["msg_type"], m["content"]
            if t == "stream":
                streams.append(c["text"])
            elif t in ("display_data", "update_display_data", "execute_result"):
                displays.append(c["data"].get("text/plain", ""))
        return ["".join(streams), *displays]

    def wait_for_output(self, msg_id: str, *texts: str, timeout: float = 30) -> None:
        """Wait until cell ``msg_id`` has shown every one of ``texts`` (each within one
        stream text or one display), e.g. a line its ranks print once they have started.
        The messages read meanwhile are kept: ``collect(msg_id)`` still sees them."""

        def shown() -> bool:
            with contextlib.suppress(queue.Empty):
                self._ahead.append(self.kc.get_iopub_msg(timeout=0.05))
            seen = self.output_so_far(msg_id)
            return all(any(t in s for s in seen) for t in texts)

        wait_until(
            shown,
            timeout=timeout,
            interval=0,
            what=f"cell {msg_id} to show {list(texts)}",
            detail=lambda: f"it showed {self.output_so_far(msg_id)}",
        )

    def pids(self) -> list[int]:
        """Process ids of the kernel and everything it started."""
        import psutil

        provisioner = self.km.provisioner
        assert isinstance(provisioner, LocalProvisioner) and provisioner.process, provisioner
        root = psutil.Process(provisioner.process.pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)

    def shutdown_and_check(self, timeout: float = 10.0) -> None:
        """Shut down; fail if the kernel or anything it started is still alive after."""
        from conftest import pid_alive

        pids = self.pids()
        self.shutdown()
        wait_until(
            lambda: not any(pid_alive(p) for p in pids),
            timeout=timeout,
            what="the kernel and everything it started to exit",
            detail=lambda: (
                f"kernel shutdown left processes behind: {[p for p in pids if pid_alive(p)]}"
            ),
        )
