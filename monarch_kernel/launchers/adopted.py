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
import time

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
