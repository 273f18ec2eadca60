"""Capture of a rank's stdout/stderr at Python and file-descriptor level.

Python-level writes go straight to the controller, tagged with the request the main
thread is serving. Writes to fd 1/2 (C extensions, subprocesses) go through a pipe and
a reader thread. Everything is also appended (unbuffered) to the rank's log file so the
host agent can report the last lines of a rank that died without warning.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable

from monarch_kernel.rank import context

Sink = Callable[[str, str, "str | None"], None]  # (stream name, text, request id)


class RankStream(io.TextIOBase):
    """A line-buffered text stream that forwards complete lines to ``sink``."""

    def __init__(self, name: str, sink: Sink, log_fd: int):
        self.name = name
        self._sink = sink
        self._log_fd = log_fd
        self._buf: list[str] = []
        self._lock = threading.Lock()

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
        with self._lock:
            self._buf.append(text)
            if "\n" in text or "\r" in text:
                self._flush_locked()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._buf:
            return
        data = "".join(self._buf)
        self._buf.clear()
        try:
            os.write(self._log_fd, data.encode("utf-8", "replace"))
        except OSError:
            pass
        self._sink(self.name, data, context.current_request)


class FdCapture:
    """Redirect fd 1 and 2 into pipes drained by a daemon thread."""

    def __init__(self, sink: Sink, log_fd: int):
        self._sink = sink
        self._log_fd = log_fd
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(
                target=self._drain, args=(r, name), name=f"capture-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _drain(self, r: int, name: str) -> None:
        while True:
            try:
                data = os.read(r, 65536)
            except OSError:
                return
            if not data:
                return
            try:
                os.write(self._log_fd, data)
            except OSError:
                pass
            self._sink(name, data.decode("utf-8", "replace"), context.current_request)
