"""Server processes a floor measurement talks to, one DEALER socket to each.

The raw ZeroMQ floor (:mod:`bench.raw_zmq`) and the wire format's floors
(:mod:`bench.wire_floor`) both start N processes with ``python -m MODULE ...`` that
print their address on their first line (a tcp port, or an ``ipc://`` address) and then
serve until told to quit. Starting them, connecting to them and ending them is here,
once: a server that fails to start fails the measurement with its name, and every
process started is ended (killed if it does not quit) whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import zmq

#: The repository, where ``python -m bench....`` finds the packages.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcs:
    """One process per argument list in ``args`` (``python -m MODULE *args``), each
    with a DEALER connected to the address it printed.

    ``timeout``: seconds to wait for a server's reply before ``zmq.Again`` (None: for
    ever), and for each server to quit on :meth:`close` before it is killed (None: 5).
    """

    def __init__(
        self, module: str, args: Sequence[Sequence[str]], timeout: float | None = None
    ) -> None:
        self.ctx = zmq.Context()
        self.procs: list[subprocess.Popen[str]] = []
        self.socks: list[zmq.Socket[bytes]] = []
        self._timeout = timeout
        try:
            for a in args:
                self.procs.append(spawn(module, a))
            for p in self.procs:
                assert p.stdout is not None
                said = p.stdout.readline().strip()  # "" once the process ended
                if not said:
                    raise RuntimeError(f"{module} server {p.pid} did not start")
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                if timeout is not None:
                    s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
                s.connect(said if said.startswith("ipc://") else f"tcp://127.0.0.1:{said}")
                self.socks.append(s)
        except BaseException:
            self.close([])
            raise

    def close(self, quit_frames: list[bytes]) -> None:
        """Send each server ``quit_frames`` (none: it is killed after the wait), wait
        for it to end, then drop the sockets."""
        if quit_frames:
            for s in self.socks:
                s.send_multipart(quit_frames)
        end(self.procs, (self._timeout or 5.0) if quit_frames else 0)
        self.ctx.destroy(linger=0)


def spawn(module: str, args: Sequence[str], pass_fds: Sequence[int] = ()) -> subprocess.Popen[str]:
    """``python -m MODULE *args`` in the repository, its stdout a pipe (the server's first
    line says it is ready); ``pass_fds``: descriptors it inherits."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        pass_fds=tuple(pass_fds),
    )


def end(procs: Sequence[subprocess.Popen[str]], wait: float) -> None:
    """Wait up to ``wait`` seconds for each of ``procs`` to end (told to quit before),
    kill the ones that did not, and close their pipes."""
    for p in procs:
        try:
            p.wait(wait)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()
