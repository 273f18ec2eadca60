"""A host agent this controller did not start: one of a detachable mesh it attached to.

It is not our child, so there is no exit code to reap: the handle follows the agent by
its pid (and start time, so that a recycled pid is not taken for it) and reads its log
from its private directory. Stopping it is asked by message (the mesh's ``stop``); only
an agent that does not exit in time is signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.launchers import reservation as reservations
from monarch_kernel.wire.desk import process_started
from monarch_kernel.wire.osutil import tail_lines

#: What :meth:`AdoptedHost.exit_code` says of an agent that ended (not ours to reap:
#: its real status is unknown).
UNKNOWN_EXIT = -1


class AdoptedHost:
    """Handle on a host agent started by another controller (a :class:`~.base.HostHandle`)."""

    def __init__(self, pid: int, log_path: str, private_dir: str):
        self._pid = pid
        self._started = process_started(pid)
        self.log_path = log_path
        self.private_dir = private_dir

    @property
    def pid(self) -> int | None:
        return self._pid

    def running(self) -> bool:
        """Whether the agent still runs."""
        now = process_started(self._pid)
        if now is None or self._started is None:
            return False
        return not self._started or abs(now - self._started) < 1.0

    def exit_code(self) -> int | None:
        return None if self.running() else UNKNOWN_EXIT

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(tail_lines(self.log_path, n)) or "(no output)"

    def wait_or_kill(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the agent to exit (it was told to), then SIGTERM
        it, then SIGKILL it."""
        for sig, wait in ((None, timeout), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            if sig is not None and self.running():
                try:
                    os.kill(self._pid, sig)
                except ProcessLookupError:
                    return
            deadline = time.monotonic() + wait
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
            if not self.running():
                return

    def cleanup(self) -> None:
        if not self.running():  # never under a live agent
            shutil.rmtree(self.private_dir, ignore_errors=True)


def desk_listens(desk: str, timeout: float = 0.5) -> bool:
    """Whether the desk (``tcp://ADDR:PORT`` or ``ipc://PATH``) takes connections: its
    agent runs. The operating system accepts a connection on a listening socket however
    busy (or stopped) the agent is, and refuses one on the socket file a killed agent
    left behind, so this does not depend on the agent answering in time."""
    if desk.startswith("ipc://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(desk.removeprefix("ipc://"))
            except TimeoutError:  # its listen backlog is full: it is there
                return True
            except OSError:  # no such file, or nothing listens on it
                return False
            return True
    addr, _, port = desk.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((addr.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class SharedReservation:
    """An engine reservation (ray, slurm) some adopted hosts run in: released once the
    last of them is cleaned up (a stop; a shrink that drops some hosts keeps it)."""

    def __init__(self, record: dict[str, Any], holders: int):
        self.record = record
        self._left = holders
        self._lock = threading.Lock()

    def let_go(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            reservations.release(self.record)


class RemoteAdoptedHost:
    """Handle on a host agent of a detachable mesh on another machine (a tcp mesh: the
    join backend and the engines on it): no pid to follow, so its desk's port tells
    whether it still runs, and stopping it is asked over the control plane
    (:attr:`tell_exit`). ``kept``: the engine reservation it runs in (released with the
    last host of it)."""

    def __init__(self, desk: str, hostname: str, kept: SharedReservation | None = None):
        self.desk = desk
        self.hostname = hostname
        self._kept = kept
        self._cleaned = False
        #: Set by the mesh: tells the agent to exit (a ``stop`` over the control plane).
        self.tell_exit: Callable[[], object] | None = None

    @property
    def reservation(self) -> dict[str, Any] | None:
        """The reservation's record (for the attach file the new holder writes)."""
        return self._kept.record if self._kept is not None else None

    @property
    def pid(self) -> int | None:
        return None

    def exit_code(self) -> int | None:
        return None if desk_listens(self.desk) else UNKNOWN_EXIT

    def log_tail(self, n: int = 20) -> str:
        return f"(the agent runs on {self.hostname}; its log is on that machine)"

    def wait_or_kill(self, timeout: float) -> None:
        """Tell the agent to exit, then wait up to ``timeout`` for its desk to close."""
        if self.tell_exit is not None:
            try:
                self.tell_exit()
            except Exception:  # the mesh's sockets are closed: it is stopping anyway
                pass
        deadline = time.monotonic() + timeout
        while desk_listens(self.desk) and time.monotonic() < deadline:
            time.sleep(0.05)

    def cleanup(self) -> None:
        """Nothing of it is on this machine; its engine reservation goes with the last
        host of it."""
        if self._kept is not None and not self._cleaned:
            self._cleaned = True
            self._kept.let_go()
