"""Starting process-group workers: a small fork server ("zygote"), and the rank's handle
on one worker.

The zygote is forked from the rank the first time a worker is needed (with ``--dist``
that is the first cell, when the rank holds little memory), then forks every worker
itself: it is single-threaded, so forking it is safe and takes milliseconds, and the
workers do not share the pages the rank writes later (no copy-on-write cost for the
model the rank trains). The zygote ends when the rank does (its socket closes); so does
each worker.

A process forked after torch touched CUDA cannot use CUDA (torch poisons every fork
after its first CUDA call, ``is_available()`` included, which a rank on a GPU machine
makes at start), and an NCCL worker must. So on a machine with a GPU the zygote is a
fresh interpreter instead (``python -c``, its socket passed as a descriptor): it imports torch
but never initialises CUDA, so every worker it forks can. That costs the interpreter's
start once per rank (about a second), not once per worker.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from monarch_kernel.rank.pg.protocol import MAX_FDS, MAX_MESSAGE
from monarch_kernel.rank.pg.worker import run_child, serve
from monarch_kernel.wire.osutil import die_with_parent

#: Set to ``1`` to start the zygote as a fresh interpreter even without CUDA (tests).
EXEC_ZYGOTE = "MONARCH_KERNEL_PG_EXEC_ZYGOTE"
#: Set to ``cell`` to have the workers' own output (fd 1 and 2) shown in the cell, as a
#: rank's is; by default it goes to the rank's log file only (``rank<N>.log``), unless
#: ``NCCL_DEBUG`` is set (then the person asked to see NCCL's words where they work).
WORKER_OUTPUT = "MONARCH_KERNEL_PG_WORKER_OUTPUT"


def _worker_output_fd() -> int | None:
    """Where the workers' fd 1 and 2 go: the rank's log (see :data:`WORKER_OUTPUT`), or
    None (the rank's own fd 1 and 2, shown in the cell).

    Why the log: a worker is disposable and runs only our collectives; when a peer dies
    the worker's NCCL watchdog prints an error with a C++ stack trace as the group is
    aborted and re-formed, which in the cell reads as a failure of a step that was in
    fact recovered (the recovery's own line says what happened)."""
    if os.environ.get(WORKER_OUTPUT) == "cell" or os.environ.get("NCCL_DEBUG"):
        return None
    from monarch_kernel.rank.stdio.capture import rank_log_fd

    return rank_log_fd()


class WorkerHandle:
    """The rank's end of one worker: its socket, and a race-free way to kill it."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid = pid
        self.sock = sock
        self._send_lock = threading.Lock()
        #: Slot ids whose descriptors this worker already has.
        self.known: set[int] = set()
        try:  # a pidfd never signals a recycled pid
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = None
        self.closed = False

    def send(self, msg: object, fds: list[int] | None = None) -> None:
        """Send one message (``fds`` ride along); OSError if the worker is gone."""
        data = pickle.dumps(msg, protocol=5)
        with self._send_lock:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)

    def recv(self, timeout: float | None = None) -> object | None:
        """The next message; None when the worker is gone. TimeoutError after
        ``timeout`` seconds (the wait is interruptible: Ctrl-C lands)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("no answer from the process-group worker")
            try:
                ready, _, _ = select.select([self.sock], [], [], left)
            except (OSError, ValueError):
                return None
            if ready:
                break
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except OSError:
            return None
        return pickle.loads(data) if data else None

    def alive(self) -> bool:
        """Whether the worker process still runs."""
        if self.closed:
            return False
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], 0)
        return not ready

    def kill(self, wait: float = 1.0) -> None:
        """End the worker now (SIGKILL), wait up to ``wait`` seconds until it is gone (it
        may be writing into user tensors it uses in place), close our end (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                select.select([self._pidfd], [], [], wait)
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Spawner:
    """Forks workers through the zygote (started on first use, again if it died)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._owner = 0  # pid of the process that started the zygote
        self._process: subprocess.Popen[bytes] | None = None  # an exec'd zygote

    def spawn(self) -> WorkerHandle:
        """A new worker, waiting for its Configure."""
        with self._lock:
            for _ in range(2):
                if self._sock is None or self._owner != os.getpid():
                    self._start()
                assert self._sock is not None
                try:
                    self._sock.send(b"w")
                    data, fds, _, _ = socket.recv_fds(self._sock, 64, MAX_FDS)
                except OSError:
                    data, fds = b"", []
                if data and fds:
                    return WorkerHandle(int(data), socket.socket(fileno=fds[0]))
                for fd in fds:
                    os.close(fd)
                self._sock.close()
                self._sock = None  # the zygote died: start another
            raise RuntimeError("could not start a process-group worker (its fork server died)")

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if self._process is not None:
            self._process.poll()  # reap the one that died
            self._process = None
        output = _worker_output_fd()
        if _fork_poisoned_for_cuda() or os.environ.get(EXEC_ZYGOTE) == "1":
            self._process = _exec_zygote(theirs, output)
            theirs.close()
            self._sock, self._owner = ours, os.getpid()
            return
        pid = os.fork()
        if pid == 0:
            # (No parent-death signal here: it would follow the forking *thread*, which
            # may be a short-lived one; the zygote leaves when the rank's end closes.)
            ours.close()
            if output is not None:
                os.dup2(output, 1)
                os.dup2(output, 2)
            # Python's own writes (a traceback) to fd 1 and 2 too: the rank's streams
            # send through the rank's sockets, which are not this process's to use
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            run_child(_zygote, theirs)
        theirs.close()
        self._sock, self._owner = ours, os.getpid()


def _fork_poisoned_for_cuda() -> bool:
    """Whether a child forked now could not use CUDA: torch marks every fork after its
    first CUDA call, ``torch.cuda.is_available()`` and ``device_count()`` included (they
    initialise the driver), and a rank on a GPU machine asks those at start
    (``rank.device.bind_gpu``). So: any torch built with CUDA, on a machine with a GPU."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.version, "cuda", None) is None:
        return False
    return bool(torch.cuda.is_available())


def _exec_zygote(theirs: socket.socket, output: int | None) -> subprocess.Popen[bytes]:
    """A zygote in a fresh interpreter, serving ``theirs`` (passed as a descriptor); its
    fd 1 and 2 are ``output`` where given (see :func:`_worker_output_fd`)."""
    fd = theirs.fileno()
    env = dict(os.environ)
    # the rank's own import path (a template may have extended it), then the inherited one
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    code = f"from monarch_kernel.rank.pg.spawn import zygote_main; zygote_main({fd})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        pass_fds=[fd],
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        env=env,
    )


def zygote_main(fd: int) -> None:
    """The body of an exec'd zygote (see the module docstring); never returns."""
    sock = socket.socket(fileno=fd)
    import torch.distributed  # noqa: F401  (its workers fork with torch imported: fast)

    run_child(_zygote, sock)


def _zygote(sock: socket.socket) -> None:
    """Fork a worker per request until the rank's end of ``sock`` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank's interrupts are its own
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    while True:
        try:
            request = sock.recv(64)
        except OSError:
            return
        if not request:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            # A worker blocked inside a gloo collective would otherwise live on until
            # gloo's own timeout once its rank (and so its zygote) is gone.
            die_with_parent(signal.SIGKILL, expected_parent=zygote)
            sock.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            run_child(serve, theirs)
        theirs.close()
        try:
            socket.send_fds(sock, [str(pid).encode()], [ours.fileno()])
        except OSError:
            return
        finally:
            ours.close()
