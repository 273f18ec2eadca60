"""A private place for kernels whose meshes outlive them (``--detachable``): their own
temporary directory and Jupyter runtime directory, so that what they leave behind
(processes, temp dirs, attach files) is theirs alone and can be checked."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import tempfile
from typing import Any

import psutil
from conftest import pid_alive
from helpers import wait_until
from kernel_client import Kernel, Result


class Place:
    """Kernels started here get ``TMPDIR`` and ``JUPYTER_RUNTIME_DIR`` of their own
    (short paths: unix socket paths must stay under ~100 bytes)."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="mkd-", dir="/tmp")
        self.runtime = os.path.join(self.tmp, "rt")
        os.mkdir(self.runtime, 0o700)
        self.kernels: list[Kernel] = []

    @property
    def env(self) -> dict[str, str]:
        return {"TMPDIR": self.tmp, "JUPYTER_RUNTIME_DIR": self.runtime}

    def kernel(self) -> Kernel:
        return self.kernel_with(self.env)

    def kernel_with(self, env: dict[str, str]) -> Kernel:
        """A kernel with ``env`` (this place's, plus what a test adds)."""
        k = Kernel(env=dict(env, **self.env))
        self.kernels.append(k)
        return k

    def kernel_pid(self, k: Kernel) -> int:
        process = k.km.provisioner.process  # type: ignore[union-attr]
        assert process is not None
        return int(process.pid)

    def kill(self, k: Kernel) -> None:
        """SIGKILL the kernel's process (as the OOM killer would) and wait for it."""
        pid = self.kernel_pid(k)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), timeout=10, what="the killed kernel to end")
        self.forget(k)

    def restart(self, k: Kernel) -> None:
        """``Restart Kernel``, as JupyterLab does it: through the kernel manager (a
        shutdown request, then a new kernel process on the same connection)."""
        old = self.kernel_pid(k)
        k.km.restart_kernel(now=False)
        wait_until(lambda: not pid_alive(old), timeout=30, what="the old kernel to exit")
        with contextlib.suppress(queue.Empty):  # what it sent last (for k.other)
            while True:
                k.other.append(k.kc.get_iopub_msg(timeout=1))
        k.kc.stop_channels()
        k.kc = k.km.client()
        k.kc.start_channels()
        k.kc.wait_for_ready(timeout=60)

    def forget(self, k: Kernel) -> None:
        """Stop talking to a kernel that is gone (its manager cleans up after it)."""
        if k in self.kernels:
            self.kernels.remove(k)
        with contextlib.suppress(Exception):
            k.kc.stop_channels()
        with contextlib.suppress(Exception):
            k.km.shutdown_kernel(now=True)

    def attach_path(self, name: str) -> str:
        return os.path.join(self.runtime, f"monarch-mesh-{name}.json")

    def attach_file(self, name: str) -> dict[str, Any]:
        with open(self.attach_path(name)) as f:
            data: dict[str, Any] = json.load(f)
        return data

    def mesh_pids(self, name: str) -> list[int]:
        """The ranks' and host agents' pids the attach file lists."""
        f = self.attach_file(name)
        return [r["pid"] for r in f["ranks"]] + [h["pid"] for h in f["hosts"]]

    def rank_log(self, name: str, rank: int) -> str:
        """The log rank ``rank`` writes itself (everything it prints)."""
        f = self.attach_file(name)
        host = f["hosts"][f["ranks"][rank]["host"]]
        folder = host.get("dir") or os.path.dirname(host["desk"].removeprefix("ipc://"))
        return os.path.join(folder, f"rank{rank}.log")

    def processes(self) -> list[psutil.Process]:
        """Processes of this user that run with this place's TMPDIR (every process its
        kernels started, wherever they were re-parented to)."""
        out = []
        mine = f"TMPDIR={self.tmp}"
        for p in psutil.process_iter(["uids"]):
            try:
                if p.info["uids"].real != os.getuid() or p.pid == os.getpid():
                    continue
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    environ = f.read().decode(errors="replace")
                if mine in environ.split("\0") and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, OSError):
                continue
        return out

    def temp_dirs(self) -> list[str]:
        """Our temporary directories left in this place (``mk-*``)."""
        return sorted(n for n in os.listdir(self.tmp) if n.startswith("mk-"))

    def describe_temp_dirs(self) -> str:
        """What the left directories hold (their owners, the agents' logs' ends)."""
        out = []
        for name in self.temp_dirs():
            for root, _, files in os.walk(os.path.join(self.tmp, name)):
                for f in files:
                    path = os.path.join(root, f)
                    out.append(path)
                    if f.endswith(".log") or f == ".mk-owners":
                        with open(path, errors="replace") as fh:
                            out.append("    " + fh.read()[-1500:].replace("\n", "\n    "))
        return "\n".join(out)

    def close(self) -> tuple[list[str], list[str]]:
        """Shut the kernels down and stop the meshes they left detached; what was left
        (processes, temp dirs), cleaned up."""
        from monarch_kernel.controller.detach.attach import stop_detached

        for k in list(self.kernels):
            with contextlib.suppress(Exception):
                k.shutdown()
        self.kernels.clear()
        for name in os.listdir(self.runtime):
            if name.startswith("monarch-mesh-"):
                with contextlib.suppress(Exception):
                    stop_detached(None, path=os.path.join(self.runtime, name), force=True)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not self.processes(), timeout=15, what="our processes to end")
        left = self.processes()
        described = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in left]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not self.temp_dirs(), timeout=10, what="temp dirs to go")
        dirs = self.temp_dirs()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return described, dirs


def ok(k: Kernel, code: str, timeout: float = 120) -> Result:
    """Run ``code``; fail the test with the cell's error if it raised."""
    r = k.run(code, timeout=timeout)
    assert not r.errors, r.error_text
    return r


def log_has(log: str, text: str) -> bool:
    """Whether a rank's log holds ``text``."""
    with open(log, errors="replace") as f:
        return text in f.read()


def steps(log: str) -> int:
    """The last ``step N`` a rank printed to its log (0 if none yet)."""
    try:
        with open(log, errors="replace") as f:
            found = re.findall(r"step (\d+)", f.read())
    except OSError:
        return 0
    return int(found[-1]) if found else 0
