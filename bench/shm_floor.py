"""A floor below ZeroMQ's: the gathered call over shared memory and eventfd wake-ups.

Row 2's floor is raw ZeroMQ. On one machine every ZeroMQ message passes through two
libzmq I/O threads: the sender's hands it to its I/O thread, which writes the socket,
and the receiver's I/O thread reads it and wakes the receiving thread. That is four
thread wake-ups per round trip on top of the two ends' own work.
``bench/results/call-floor.md`` found those wake-ups, not CPU, to be most of a gathered
call's time on a small machine. This module measures what a same-machine channel
without them costs. The client and each server share one memory-mapped file with a
request slot and a reply slot per server. Each server blocks on an eventfd of its own,
and all of them add to one eventfd the client blocks on. A message is written into its
slot, then the reader is woken: one system call each way, no I/O thread.

Two modes, each a gathered no-op call to N server processes:

* ``raw``: one byte out, one byte back (what :mod:`bench.raw_zmq` does over ZeroMQ);
* ``codec``: our :class:`~monarch_kernel.wire.codec.Codec`'s signed messages with a
  pickled call and result, decoded and checked at both ends (``bench.wire_floor``'s
  ``codec`` mode, over this channel instead of ZeroMQ).

The servers are ``python -m bench.shm_floor MODE PATH INDEX REQUEST_FD REPLY_FD``
processes that inherit the two eventfds. Each slot is a 4-byte length and the message.
A server that dies fails the measurement after :data:`TIMEOUT_S`, it does not hang it.
Every process started is ended and the file removed (:meth:`ShmServers.close`).
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import subprocess
import sys
import tempfile
from typing import Any

from bench.server_procs import end, spawn
from monarch_kernel.wire.codec import Codec

#: The modes, in the order of the module's docstring.
MODES = ("raw", "codec")
#: Bytes per slot: a 4-byte length, then the message (a no-op call's is ~120 bytes).
SLOT = 4096
#: The key both ends sign with (a benchmark, not a secret).
_KEY = b"shm-floor-benchmark-key-32-bytes"
_CALL = pickle.dumps(("ping", ()), 5)
_QUIT = b"q"
#: Seconds the client waits for the replies, and for each server to quit.
TIMEOUT_S = 10.0


def _put(buf: mmap.mmap, slot: int, data: bytes) -> None:
    if len(data) > SLOT - 4:
        raise ValueError(f"a message of {len(data)} bytes does not fit a {SLOT}-byte slot")
    at = slot * SLOT
    buf[at : at + 4] = len(data).to_bytes(4, "little")
    buf[at + 4 : at + 4 + len(data)] = data


def _take(buf: mmap.mmap, slot: int) -> bytes:
    at = slot * SLOT
    size = int.from_bytes(buf[at : at + 4], "little")
    return buf[at + 4 : at + 4 + size]


def serve(mode: str, path: str, index: int, request_fd: int, reply_fd: int) -> None:
    """Answer calls written to request slot ``index`` until told to quit."""
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 0)
    codec = Codec(_KEY)
    reply_slot = 2 * index + 1
    print("ready", flush=True)
    while True:
        os.eventfd_read(request_fd)
        data = _take(buf, 2 * index)
        if data == _QUIT:
            return
        if mode == "raw":
            _put(buf, reply_slot, data)
        else:
            m = codec.decode([data])
            name, args = pickle.loads(m.payload)
            result = {"ping": lambda: None}[name](*args)
            header = {"k": "r", "i": m.header["i"]}
            (frame,) = codec.encode(header, pickle.dumps(result, 5))
            _put(buf, reply_slot, frame)
        os.eventfd_write(reply_fd, 1)


class ShmServers:
    """``n`` server processes answering in ``mode``; :meth:`call` is one gathered call."""

    def __init__(self, n: int, mode: str, timeout: float = TIMEOUT_S) -> None:
        """``timeout``: seconds :meth:`call` waits for the replies, and :meth:`close`
        for each server to quit (then it is killed)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.n = n
        self.timeout = timeout
        self.codec = Codec(_KEY)
        self.procs: list[subprocess.Popen[str]] = []
        self._requests: list[int] = []
        self._id = 0
        self._closed = False
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self._path = tempfile.mkstemp(prefix="bench-shm-floor-", dir=where)
        try:
            os.ftruncate(fd, 2 * n * SLOT)
            self._buf = mmap.mmap(fd, 0)
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self._replies = os.eventfd(0, os.EFD_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self._replies, select.POLLIN)
        try:
            for i in range(n):
                request = os.eventfd(0)
                self._requests.append(request)
                args = [mode, self._path, str(i), str(request), str(self._replies)]
                self.procs.append(spawn("bench.shm_floor", args, (request, self._replies)))
            for p in self.procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"bench.shm_floor server {p.pid} did not start")
        except BaseException:
            self.close(tell=False)
            raise

    def call(self) -> list[Any]:
        """A no-op call on every server, all replies gathered (and checked)."""
        self._id += 1
        buf, n, raw = self._buf, self.n, self.mode == "raw"
        for i, request in enumerate(self._requests):
            # (encoded once per server, as our transport encodes a call once per rank)
            frame = b"p" if raw else self.codec.encode({"k": "c", "i": self._id}, _CALL)[0]
            _put(buf, 2 * i, frame)
            os.eventfd_write(request, 1)
        answered = 0
        while answered < n:
            if not self._poll.poll(self.timeout * 1000):
                raise RuntimeError(
                    f"{n - answered} of {n} shm-floor servers did not answer in {self.timeout:g}s"
                )
            try:
                answered += os.eventfd_read(self._replies)
            except BlockingIOError:  # (woken, then read by nobody else: not expected)
                continue
        if raw:
            return [_take(buf, 2 * i + 1) for i in range(n)]
        out = []
        for i in range(n):
            m = self.codec.decode([_take(buf, 2 * i + 1)])
            if m.header.get("i") != self._id:
                raise RuntimeError(f"reply to call {m.header.get('i')}, expected {self._id}")
            out.append(pickle.loads(m.payload))
        return out

    def close(self, tell: bool = True) -> None:
        """Tell every server to quit and wait for it (killed after the timeout); the
        eventfds are closed and the shared file removed (once)."""
        if self._closed:
            return
        self._closed = True
        for i, request in enumerate(self._requests):
            if tell:
                _put(self._buf, 2 * i, _QUIT)
                os.eventfd_write(request, 1)
        end(self.procs, self.timeout if tell else 0)
        for fd in (*self._requests, self._replies):
            os.close(fd)
        self._requests = []
        self._buf.close()
        os.unlink(self._path)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
