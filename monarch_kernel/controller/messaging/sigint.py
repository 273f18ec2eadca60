"""Ctrl-C that never lands in the middle of a message.

A KeyboardInterrupt raised in the middle of a multipart send would glue the parts sent
so far to the next message (both lost: the rank then waits forever for that sequence
number); in the middle of a receive it would lose the part just received, and inside a
reply handler it would leave a request half done. :class:`DeferSigint` holds SIGINT
back around such sections of the main thread and re-raises it afterwards.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # C module: signal.signal()'s enum wrapping costs µs
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

MAIN_THREAD = threading.main_thread().ident

SignalHandler = Callable[[int, "FrameType | None"], Any]


class DeferSigint:
    """Hold Ctrl-C back while the main thread sends or receives; raise it between messages.

    While deferred, a SIGINT only calls ``wake`` (for a receive loop: a message to the
    socket it blocks on), which stops at the next message boundary; the previous handler
    then runs. In other threads (where Python never runs signal handlers) it does nothing.
    """

    __slots__ = ("_wake", "_previous", "pending")

    def __init__(self, wake: Callable[[], None] | None = None):
        self._wake = wake
        self._previous: SignalHandler | None = None
        self.pending: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> DeferSigint:
        if threading.get_ident() == MAIN_THREAD:
            previous = _signal.getsignal(_signal.SIGINT)
            if callable(previous):  # SIG_DFL / SIG_IGN raise nothing in Python
                _signal.signal(_signal.SIGINT, self._defer)
                self._previous = previous
        return self

    def _defer(self, signum: int, frame: FrameType | None) -> None:
        self.pending = (signum, frame)
        if self._wake is not None:
            self._wake()

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            _signal.signal(_signal.SIGINT, previous)
            if self.pending is not None:
                previous(*self.pending)  # usually raises KeyboardInterrupt
