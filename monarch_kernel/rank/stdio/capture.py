"""Capture of a rank's stdout/stderr at Python and file-descriptor level.

Python-level writes go to the controller, tagged with the request the main thread is
serving, batched as ipykernel's ``iostream`` batches: a line (or a ``\r`` frame of a
progress bar) after a quiet spell goes at once, while a flood goes as one message per
:data:`BATCH_INTERVAL` (or per :data:`BATCH_BYTES`), so printing costs the rank a
message per batch, not per line. Text without a newline (``print(..., end="")``) goes a
few :data:`BATCH_INTERVAL` rounds after the writer stopped writing (a flood's batches
end at line ends); a bar's frame (``\r``) goes as a line does.
Writes to fd 1/2 (C extensions, subprocesses) go through a pipe and a reader thread.
Everything is also appended to the rank's log file so the host agent can report the
last lines of a rank that died without warning; once a stream used ``\r`` or escape
sequences, its log gets each line's final state (a bar's last frame), not every frame.
"""

from __future__ import annotations

import builtins
import fcntl
import io
import os
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable

from monarch_kernel.rank import context
from monarch_kernel.wire.terminal import Terminal

Sink = Callable[[str, str, "str | None"], None]  # (stream name, text, request id)

#: While output keeps coming, a stream sends at most one message per interval ...
BATCH_INTERVAL = 0.01
#: ... unless this much is waiting.
BATCH_BYTES = 64 * 1024
#: A line without its newline waits for it until the writer wrote nothing for this many
#: of the flusher's rounds, or at most this many rounds (a writer adding to one line).
IDLE_ROUNDS = 3
HOLD_ROUNDS = 5


class _Flusher:
    """Sends the batches of streams that wait for their interval to pass (one thread,
    asleep while no stream waits)."""

    def __init__(self) -> None:
        self._due = threading.Event()
        self._streams: list[RankStream] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Rounds run (woken by a waiting batch), for tests.
        self.rounds = 0

    def add(self, stream: RankStream) -> None:
        with self._lock:
            self._streams.append(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mk-out-batch", daemon=True)
                self._thread.start()

    def arm(self) -> None:
        self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            time.sleep(BATCH_INTERVAL)
            self._due.clear()  # a write after this arms the next round
            self.rounds += 1
            for stream in list(self._streams):
                stream.flush_batch()


_flusher = _Flusher()


class _LogWriter:
    """Appends one stream's text to the rank's log file: as it comes, until the stream
    redraws lines (``\r``, escape sequences); from then on through a
    :class:`~monarch_kernel.wire.terminal.Terminal`, so a bar's thousands of frames
    are logged as its final line."""

    __slots__ = ("fd", "term")

    def __init__(self, fd: int):
        self.fd = fd
        self.term: Terminal | None = None

    def write(self, data: str) -> None:
        term = self.term
        if term is None:
            if "\r" not in data and "\x1b" not in data:
                self._put(data)
                return
            term = self.term = Terminal()
        lines = term.feed(data)
        if lines:
            self._put("\n".join(lines) + "\n")

    def _put(self, data: str) -> None:
        try:
            os.write(self.fd, data.encode("utf-8", "replace"))
        except OSError:
            pass


class RankStream(io.TextIOBase):
    """A line-buffered text stream that forwards complete lines to ``sink``."""

    def __init__(self, name: str, sink: Sink, log_fd: int):
        self.name = name
        self._sink = sink
        self._log = _LogWriter(log_fd)
        self._buf: list[str] = []
        self._size = 0
        self._last = 0.0  # when a batch last went
        self._armed = False  # a batch waits for the flusher
        self._partial_at = 0.0  # when the line the buffer ends in began (0: none)
        self._writes = 0  # writes so far, and as many as the flusher's last round saw
        self._writes_seen = 0
        self._held = 0  # rounds the line at the buffer's end was kept for its newline
        self._idle = 0  # ... of which the last ones without a write
        self._lock = threading.Lock()
        #: The request the buffered text was written for (its writer's, see ``write``).
        self._request: str | None = None
        _flusher.add(self)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        return 1 if self.name == "stdout" else 2

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        request = context.current_request  # the writing thread's (a worker's own)
        with self._lock:
            if request != self._request:  # another thread's request: what it wrote first
                if self._buf:
                    self._flush_locked(time.monotonic())
                self._request = request
            self._buf.append(text)
            self._size += len(text)
            self._writes += 1
            if "\n" in text or "\r" in text:
                now = time.monotonic()
                self._partial_at = 0.0 if text[-1] == "\n" else now
                self._held = self._idle = 0
                if self._size >= BATCH_BYTES or now - self._last >= BATCH_INTERVAL:
                    self._flush_locked(now)
                elif not self._armed:
                    self._armed = True
                    _flusher.arm()
            else:  # part of a line (print writes its newline next): within BATCH_INTERVAL
                if not self._partial_at:
                    self._partial_at = time.monotonic()
                    self._held = self._idle = 0
                if not self._armed:
                    self._armed = True
                    _flusher.arm()
        return len(text)

    def flush(self) -> None:
        # Nothing held (the common case: the rank flushes after every call): nothing to
        # do, without the lock. A write racing with this is as one made just after it.
        if not self._buf and not self._armed and not self._partial_at:
            return
        with self._lock:
            self._flush_locked(time.monotonic())

    def flush_batch(self) -> None:
        """The flusher's call: send the batch if one waits for its interval. A line
        still being written is kept for its newline (a later round sends it as it is
        then), so a flood's batches end at line ends: kept while it is younger than
        :data:`BATCH_INTERVAL`, else until the writer wrote nothing for
        :data:`IDLE_ROUNDS` rounds (at most :data:`HOLD_ROUNDS`). Counted in rounds
        and writes, not in time: under load the writer can wait for the CPU (or this
        thread for the GIL) longer than the interval between a line's text and its
        newline, and a line cut there is no line without its newline."""
        with self._lock:
            if not self._armed:
                return
            now = time.monotonic()
            busy = self._writes != self._writes_seen
            self._writes_seen = self._writes
            if self._partial_at:
                self._held += 1
                self._idle = 0 if busy else self._idle + 1
            if self._partial_at and (
                now - self._partial_at < BATCH_INTERVAL
                or (self._idle < IDLE_ROUNDS and self._held < HOLD_ROUNDS)
            ):
                data = "".join(self._buf)
                cut = data.rfind("\n") + 1
                if "\r" not in data[cut:]:  # (a bar's frame goes as it is)
                    self._buf = [data[cut:]]
                    self._size = len(data) - cut
                    if cut:
                        self._send(data[:cut], now)
                    _flusher.arm()
                    return
            self._flush_locked(now)

    def _flush_locked(self, now: float) -> None:
        self._armed = False
        self._partial_at = 0.0
        if self._buf:
            data = "".join(self._buf)
            self._buf.clear()
            self._size = 0
            self._send(data, now)

    def _send(self, data: str, now: float) -> None:
        self._last = now
        self._log.write(data)
        self._sink(self.name, data, self._request)


#: Written into each capture pipe by :meth:`FdCapture.flush`; the drain thread drops it
#: and counts it, so that flush knows everything written before it reached the sink.
_FLUSH_MARK = b"\x00\x1b[mk-fd-flush]\x00"
#: How long :meth:`FdCapture.flush` waits for the drain threads (a loaded machine can
#: keep a thread from running for a while; the cell's result waits, its output is kept).
FLUSH_TIMEOUT = 5.0


def _mark_start(data: bytes) -> int:
    """How many bytes at the end of ``data`` could begin a flush mark (split across two
    reads): they wait for the next read."""
    for k in range(min(len(_FLUSH_MARK) - 1, len(data)), 0, -1):
        if data.endswith(_FLUSH_MARK[:k]):
            return k
    return 0


class FdCapture:
    """Redirect fd 1 and 2 into pipes drained by a daemon thread."""

    def __init__(self, sink: Sink, log_fd: int):
        self._sink = sink
        self.log_fd = log_fd
        self._logs = {name: _LogWriter(log_fd) for name in ("stdout", "stderr")}
        self._threads: list[threading.Thread] = []
        self._read_fds: list[int] = []
        #: Our own non-blocking write end of each pipe, for the flush marks (whatever the
        #: user's code did with fd 1 and 2 since).
        self._mark_fds: dict[str, int] = {}
        self._pid = os.getpid()
        self._flush_lock = threading.Lock()
        self._marks = threading.Condition()
        self._asked: dict[str, int] = {}  # marks written into each pipe
        self._seen: dict[str, int] = {}  # marks each drain thread took out

    def start(self) -> None:
        global _active
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            # a description of its own (O_NONBLOCK here must not reach fd 1's writers)
            try:
                self._mark_fds[name] = os.open(f"/proc/self/fd/{w}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no /proc: flush waits for the pipes to be empty instead
                pass
            os.close(w)
            self._read_fds.append(r)
            self._asked[name] = self._seen[name] = 0
            t = threading.Thread(
                target=self._drain, args=(r, name), name=f"capture-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
        _active = self

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Wait until everything written to fd 1/2 so far has gone to the sink.

        Called before a result is sent, so a cell's C-level output never trails its value
        (nor goes out after its request ended, unattributed). A mark goes into each pipe
        behind what was written; the drain threads count the marks once they handed the
        text before them to the sink. Where no mark can be written (a full pipe, a forked
        child whose drain threads are its parent's), the wait is for the pipes to be
        empty."""
        if os.getpid() != self._pid or len(self._mark_fds) != len(self._read_fds):
            self._wait_empty(min(timeout, 0.5))
            return
        deadline = time.monotonic() + timeout
        with self._flush_lock:
            targets: dict[str, int] = {}
            for name, w in self._mark_fds.items():
                try:
                    os.write(w, _FLUSH_MARK)
                except OSError:  # a pipe full of output (or gone): wait for it to drain
                    continue
                self._asked[name] += 1
                targets[name] = self._asked[name]
            with self._marks:
                self._marks.wait_for(
                    lambda: all(self._seen[n] >= t for n, t in targets.items()),
                    max(0.0, deadline - time.monotonic()),
                )
            if len(targets) < len(self._mark_fds):
                self._wait_empty(max(0.0, deadline - time.monotonic()))

    def _wait_empty(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = 0
            for r in self._read_fds:
                pending += struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0" * 4))[0]
            if not pending:
                return
            time.sleep(0.0005)

    def _drain(self, r: int, name: str) -> None:
        held = b""  # the start of a mark split across reads
        while True:
            try:
                data = os.read(r, 65536)
            except OSError:
                return
            if not data:
                return
            marks = 0
            if held:
                data, held = held + data, b""
            if b"\x00" in data:  # (user output seldom has a NUL: the common case skips this)
                marks = data.count(_FLUSH_MARK)
                if marks:
                    data = data.replace(_FLUSH_MARK, b"")
                cut = _mark_start(data)
                if cut:
                    data, held = data[:-cut], data[-cut:]
            if data:
                text = data.decode("utf-8", "replace")
                self._logs[name].write(text)
                self._sink(name, text, context.current_request)
            if marks:
                with self._marks:
                    self._seen[name] += marks
                    self._marks.notify_all()


_active: FdCapture | None = None
_builtin_print = builtins.print


def rank_log_fd() -> int | None:
    """The descriptor of this rank's log file (append-only), where its output is also
    kept; None outside a rank (or in a process forked from one: not its log)."""
    active = _active
    if active is None or active._pid != os.getpid() or active.log_fd < 0:
        return None
    return active.log_fd


def rank_print(
    *args: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: object = None,
    flush: bool = False,
) -> None:
    """``print`` in a rank: to a :class:`RankStream`, its text in one write.

    CPython's ``print`` writes each argument, separator and ``end`` apart, so every line
    would first look like a line without its newline, which must go within
    :data:`BATCH_INTERVAL` and so wakes the batching thread (a thread switch on the
    path of every line printed after a quiet spell). One write of the whole text is the
    ordinary line path: sent at once, nothing else woken. To any other file it is the
    built-in ``print``."""
    if file is None:
        file = sys.stdout
        if file is None:
            return
    if type(file) is not RankStream:
        _builtin_print(*args, sep=sep, end=end, file=file, flush=flush)  # type: ignore[call-overload]
        return
    if sep is None:
        sep = " "
    elif not isinstance(sep, str):
        raise TypeError(f"sep must be None or a string, not {type(sep).__name__}")
    if end is None:
        end = "\n"
    elif not isinstance(end, str):
        raise TypeError(f"end must be None or a string, not {type(end).__name__}")
    if len(args) == 1:
        file.write(str(args[0]) + end)
    else:
        file.write(sep.join([str(a) for a in args]) + end)
    if flush:
        file.flush()


rank_print.__name__ = rank_print.__qualname__ = "print"


def install_print() -> None:
    """Make :func:`rank_print` the built-in ``print`` (in a rank, once its streams are
    :class:`RankStream`)."""
    builtins.print = rank_print


def flush_fds() -> None:
    """Flush this rank's fd-level capture (no-op outside a rank)."""
    if _active is not None:
        _active.flush()
