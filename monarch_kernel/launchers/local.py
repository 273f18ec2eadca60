"""The ``local`` backend: host agents as subprocesses of the controller's process.

Each agent is started in its own session (so the kernel's SIGINT never reaches ranks
that are not running the interrupted cell) and dies with the controller (parent-death
signal plus heartbeats). Agents can be pre-warmed: started before a mesh asks for
them, so the template has already imported torch when ``%mesh`` runs.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.launchers.base import HostConfig, HostHandle
from monarch_kernel.wire.osutil import tail_lines

T = TypeVar("T")


class LocalHost:
    """Handle on one local host agent process (a :class:`~.base.HostHandle`)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: str):
        self.proc = proc
        self.log_path = log_path
        self._pid = proc.pid

    @property
    def pid(self) -> int | None:
        return self._pid

    def configure(self, cfg: HostConfig) -> None:
        """Hand the agent its mesh (through its stdin: the key never shows in argv)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cfg.to_json()) + "\n").encode())
        self.proc.stdin.flush()

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(tail_lines(self.log_path, n)) or "(no output)"

    def wait_or_kill(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


class LocalLauncher:
    """Starts host agents on this machine, optionally from a pool of pre-warmed ones
    (a :class:`~.base.Launcher`)."""

    name = "local"
    same_machine = True
    _shared: LocalLauncher | None = None

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="mk-launch-")
        self._pool: list[LocalHost] = []
        self._pool_lock = threading.Lock()
        # Linux's parent-death signal fires when the *thread* that forked a child exits,
        # so every agent is started from this one long-lived thread.
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._spawner, name="mk-local-launcher", daemon=True).start()

    @classmethod
    def shared(cls) -> LocalLauncher:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def _spawner(self) -> None:
        while True:
            fn, out = self._jobs.get()
            try:
                out.put((fn(), None))
            except BaseException as exc:
                out.put((None, exc))

    def _on_spawner(self, fn: Callable[[], T]) -> T:
        out: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue()
        self._jobs.put((fn, out))
        value, error = out.get()
        if error is not None:
            raise error
        return value

    def _start_agent(self) -> LocalHost:
        if not os.path.isdir(self._dir):  # removed by shutdown(); the launcher lives on
            self._dir = tempfile.mkdtemp(prefix="mk-launch-")
        fd, log_path = tempfile.mkstemp(prefix="host-", suffix=".log", dir=self._dir)
        env = dict(os.environ, MONARCH_KERNEL_PARENT_PID=str(os.getpid()))
        env.pop("MONARCH_KERNEL_HOST_CONFIG", None)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "monarch_kernel.host"],
                stdin=subprocess.PIPE,
                stdout=fd,
                stderr=fd,
                env=env,
                start_new_session=True,
                cwd=os.getcwd(),
            )
        finally:
            os.close(fd)
        return LocalHost(proc, log_path)

    def prewarm(self, count: int = 1) -> None:
        """Start ``count`` host agents now so the next mesh finds torch imported."""
        with self._pool_lock:
            self._pool = [h for h in self._pool if h.exit_code() is None]
            missing = count - len(self._pool)
        for _ in range(missing):
            host = self._on_spawner(self._start_agent)
            with self._pool_lock:
                self._pool.append(host)

    def pooled(self) -> int:
        with self._pool_lock:
            return sum(1 for h in self._pool if h.exit_code() is None)

    def start_hosts(self, configs: list[HostConfig]) -> list[HostHandle]:
        """Hand each config to a pre-warmed agent, or to a new one."""
        hosts: list[HostHandle] = []
        for cfg in configs:
            host = None
            with self._pool_lock:
                while self._pool and host is None:
                    candidate = self._pool.pop(0)
                    if candidate.exit_code() is None:
                        host = candidate
            if host is None:
                host = self._on_spawner(self._start_agent)
            host.configure(cfg)
            hosts.append(host)
        return hosts

    def shutdown(self) -> None:
        """Stop pre-warmed agents that were never used."""
        with self._pool_lock:
            pool, self._pool = self._pool, []
        for host in pool:
            host.cleanup()  # closing stdin makes an unconfigured agent exit
            host.wait_or_kill(5)
        shutil.rmtree(self._dir, ignore_errors=True)
