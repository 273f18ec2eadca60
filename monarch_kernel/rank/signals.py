"""What a rank's main thread is doing, and the signals that interrupt it.

SIGINT interrupts user code only (never the rank's own loop); SIGTERM (the mesh
stops) leaves by :class:`RankTerminated` from wherever the main thread is, so that
``run_forked`` runs the clean-up. Either is deferred while the main thread is in the
middle of sending a message (a multipart message is never cut in half) and raised once
that send is over (:meth:`MainThread.raise_pending`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType

from monarch_kernel.wire.osutil import runs_in

#: Exit status of a rank that ended on SIGTERM without running user clean-up to the end
#: (it normally ends killed by SIGTERM itself, after the clean-up; see ``run_forked``).
TERMINATED_CODE = 128 + signal.SIGTERM


class RankTerminated(SystemExit):
    """Raised in the main thread by SIGTERM: the rank exits (it never stops an actor)."""


class MainThread:
    """The main thread's state that other threads and signal handlers read.

    ``send_code`` is the code object of the method that sends messages (a signal that
    finds the main thread inside it is deferred)."""

    def __init__(self, send_code: CodeType):
        self._send_code = send_code
        #: User code runs now (a SIGINT raises KeyboardInterrupt in it).
        self.in_user_code = False
        #: SIGTERM came: the rank is on its way out.
        self.terminating = False
        #: A signal that came while the main thread was sending, raised after the send.
        self.pending_signal: int | None = None
        #: Requests cancelled before or while they ran.
        self.cancelled: set[str] = set()
        #: Told of every SIGINT (in the main thread's handler): the rank's other threads
        #: that run user code stop too (``Inbox.interrupt_others``). Must not block.
        self.on_interrupt: Callable[[], None] | None = None

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (from the main thread)."""
        signal.signal(signal.SIGINT, self.on_sigint)
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Only user code is interrupted (here and, through :attr:`on_interrupt`, on the
        rank's other threads); a SIGINT while we wait is ignored, one while user code
        sends (prints) is raised when that send is over."""
        others = self.on_interrupt
        if others is not None:
            others()
        if self.in_user_code:
            if self._sending(frame):
                self.pending_signal = signal.SIGINT
                return
            raise KeyboardInterrupt

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM (the mesh stops): leave by SystemExit from wherever the main thread is
        (idle in its receive loop or in user code), so that ``run_forked`` runs the
        clean-up (``destroy_process_group``, ``atexit`` handlers). Deferred while the
        main thread is in the middle of sending a message."""
        if self._sending(frame):
            self.pending_signal = signal.SIGTERM
            return
        self.terminating = True
        raise RankTerminated(TERMINATED_CODE)

    def raise_pending(self) -> None:
        """Raise the signal deferred while the main thread was sending (in the main
        thread only: other threads send too)."""
        if threading.current_thread() is not threading.main_thread():
            return
        sig, self.pending_signal = self.pending_signal, None
        if sig == signal.SIGTERM:
            self.on_sigterm(sig, None)
        elif sig == signal.SIGINT and self.in_user_code:
            raise KeyboardInterrupt

    def _sending(self, frame: FrameType | None) -> bool:
        """Whether ``frame`` (where a signal found the main thread) is inside the send."""
        return runs_in(frame, (self._send_code,))
