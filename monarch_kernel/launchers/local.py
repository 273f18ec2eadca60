"""The ``local`` backend: host agents as subprocesses of the controller's process.

Each agent is started in its own session (so the kernel's SIGINT never reaches ranks
that are not running the interrupted cell) and dies with the controller (parent-death
signal plus heartbeats). Agents can be pre-warmed: started before a mesh asks for
them, so the template has already imported torch when ``%mesh`` runs.

Every rank of every local mesh runs on this machine, so the backend refuses a mesh that
would take more ranks than the machine can hold (:meth:`LocalLauncher.check_capacity`)
before it starts anything: ``--gpus 10000`` is an error, not ten thousand forks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import psutil

from monarch_kernel.launchers.base import HostConfig, HostHandle
from monarch_kernel.wire.osutil import cpu_count, tail_lines
from monarch_kernel.wire.tempdirs import LAUNCH_DIR_ROOM, make_private_dir, mark_owners, sweep

T = TypeVar("T")

#: Environment variable that, when set, replaces the computed limit on the ranks that
#: local meshes may run at once (read at each check: ``%env`` in a notebook works).
MAX_RANKS_ENV = "MONARCH_KERNEL_MAX_LOCAL_RANKS"
#: Ranks per CPU the limit allows (at least :data:`MIN_CPU_RANKS`): ranks mostly wait
#: (for a GPU, a collective, the next cell), so a CPU serves many.
RANKS_PER_CPU = 32
MIN_CPU_RANKS = 64
#: Memory budgeted per rank: an idle rank forked from the warm template (torch imported)
#: costs about 40 MB (PSS); the rest is room for what the user's code keeps.
RANK_MEMORY = 128 << 20
CGROUP = "/sys/fs/cgroup/"


def available_memory() -> int:
    """Bytes of memory this process's processes can still take: what the machine has
    available, or less where a cgroup (container) limit leaves less."""
    available = int(psutil.virtual_memory().available)
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # cgroup v1
    ):
        try:
            with open(CGROUP + limit_file) as f, open(CGROUP + usage_file) as g:
                limit, usage = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # else "max": no limit
            available = min(available, max(0, int(limit) - usage))
    return available


def rank_limit(cpus: int, memory: int) -> int:
    """Ranks a machine with ``cpus`` CPUs and ``memory`` bytes available holds at once:
    ``min(max(64, 32 × cpus), memory ÷ 128 MiB)``, at least 1."""
    return max(1, min(max(MIN_CPU_RANKS, RANKS_PER_CPU * cpus), memory // RANK_MEMORY))


class LocalHost:
    """Handle on one local host agent process (a :class:`~.base.HostHandle`)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: str, private_dir: str = ""):
        self.proc = proc
        self.log_path = log_path
        #: The agent's private (0700) directory, made here so that it is removed even
        #: when the agent is killed outright (its own clean-up never runs then).
        self.private_dir = private_dir
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
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
        if self.private_dir and self.proc.poll() is not None:  # never under a live agent
            shutil.rmtree(self.private_dir, ignore_errors=True)


_shared_lock = threading.Lock()


class LocalLauncher:
    """Starts host agents on this machine, optionally from a pool of pre-warmed ones
    (a :class:`~.base.Launcher`)."""

    name = "local"
    same_machine = True
    _shared: LocalLauncher | None = None

    def __init__(self) -> None:
        self._dir = self._new_dir()
        self._pool: list[LocalHost] = []
        self._pool_lock = threading.Lock()
        # Linux's parent-death signal fires when the *thread* that forked a child exits,
        # so every agent is started from this one long-lived thread.
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._spawner, name="mk-local-launcher", daemon=True).start()
        # At interpreter exit the directory (agents' logs and private dirs) goes too; the
        # agents remove it themselves when this process is killed outright. The one in
        # use then: after shutdown() a later agent makes a new one (_start_agent).
        atexit.register(self._remove_dir)
        # What earlier kernels killed outright left behind (their agents were gone too).
        threading.Thread(target=sweep, name="mk-sweep", daemon=True).start()

    @staticmethod
    def _new_dir() -> str:
        """The agents' directory (logs, private dirs), owned by this process and,
        as they start, by the agents (``wire.tempdirs``)."""
        path = make_private_dir("mk-launch-", room=LAUNCH_DIR_ROOM)
        mark_owners(path, [os.getpid()])
        return path

    def _remove_dir(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    @classmethod
    def shared(cls) -> LocalLauncher:
        # The kernel's pre-warm thread and the first %mesh ask at about the same time: a
        # second launcher would leave a directory no agent of the first removes.
        with _shared_lock:
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
        return cast(T, value)

    def _start_agent(self) -> LocalHost:
        if not os.path.isdir(self._dir):  # removed by shutdown(); the launcher lives on
            self._dir = self._new_dir()
        fd, log_path = tempfile.mkstemp(prefix="host-", suffix=".log", dir=self._dir)
        private_dir = tempfile.mkdtemp(prefix="h-", dir=self._dir)  # mode 0700
        env = dict(
            os.environ,
            MONARCH_KERNEL_PARENT_PID=str(os.getpid()),
            MONARCH_KERNEL_HOST_DIR=private_dir,
        )
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
        mark_owners(self._dir, [proc.pid])
        return LocalHost(proc, log_path, private_dir)

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

    def check_capacity(self, ranks: int, running: int = 0) -> None:
        """Raise ValueError if this machine cannot hold ``ranks`` more ranks besides the
        ``running`` ones of this controller's local meshes.

        The limit is ``min(max(64, 32 × CPUs), available memory ÷ 128 MiB)`` (at least
        1; see :func:`rank_limit`), or the value of ``$MONARCH_KERNEL_MAX_LOCAL_RANKS``
        when that is set. Nothing is started before the check, so a refused mesh costs
        nothing.
        """
        override = os.environ.get(MAX_RANKS_ENV, "").strip()
        if override:
            try:
                limit = int(override)
            except ValueError:
                limit = 0
            if limit < 1:
                raise ValueError(
                    f"{MAX_RANKS_ENV}={override!r} is not a positive whole number of ranks"
                )
            why = f"set by {MAX_RANKS_ENV}"
        else:
            cpus, memory = cpu_count(), available_memory()
            limit = rank_limit(cpus, memory)
            why = f"{cpus} CPUs, {memory / (1 << 30):.1f} GiB of memory available"
        if running + ranks <= limit:
            return
        held = f"; {running} already run in other meshes" if running else ""
        raise ValueError(
            f"{ranks} ranks are more than the local backend allows: local meshes may run "
            f"at most {limit} ranks at once on this machine ({why}){held}. Use fewer ranks, "
            f"or set the environment variable {MAX_RANKS_ENV}=N to change the limit"
        )

    def shutdown(self) -> None:
        """Stop pre-warmed agents that were never used."""
        with self._pool_lock:
            pool, self._pool = self._pool, []
        for host in pool:
            host.cleanup()  # closing stdin makes an unconfigured agent exit
            host.wait_or_kill(5)
        shutil.rmtree(self._dir, ignore_errors=True)
