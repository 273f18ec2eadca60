"""pdb on a rank, driven from the notebook: ``breakpoint()`` and post-mortem.

A rank has no terminal, so its debugger reads commands through the same path as
``input()`` (:mod:`monarch_kernel.rank.stdio.stdin`): each pdb prompt is an ``input`` message
marked as a debugger prompt, carrying what pdb printed since its last prompt and where the
rank is stopped. The kernel asks the notebook (Jupyter's stdin channel) and sends the
command back; the kernel shows pdb's output itself, grouped by rank, so one command cast
to several ranks gives one answer per distinct output.

Leaving the debugger (``continue``, ``detach``, ``quit``, a timeout, an interrupt) is
announced with a ``resumed`` message, so that the dashboard stops showing the rank as
paused and the kernel withdraws a prompt nobody needs any more.

A forgotten breakpoint never blocks the mesh forever: without a command for
``MONARCH_KERNEL_DEBUG_TIMEOUT`` seconds (default 600) the rank detaches and runs on.
The stop button still works while a rank is paused: KeyboardInterrupt is raised in the
paused frame (pdb's own loop would swallow it).
"""

from __future__ import annotations

import bdb
import io
import os
import pdb
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import IO, Any, cast

from monarch_kernel.rank import context
from monarch_kernel.rank.errors import _user_tb
from monarch_kernel.rank.stdio.stdin import InputTimeout
from monarch_kernel.wire import headers as H

#: Environment variable: seconds a paused rank waits for a debugger command.
TIMEOUT_ENV = "MONARCH_KERNEL_DEBUG_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
#: Most characters of debugger output sent with one prompt (a ``p`` of a huge value).
MAX_OUTPUT = 1 << 20
#: The prompt pdb shows (the kernel prefixes it with the rank).
PROMPT = "(Pdb) "


def debug_timeout() -> float:
    """Seconds a paused rank waits for a command (read at each prompt, so ``%env`` or
    ``--env`` changes it)."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if value > 0 else DEFAULT_TIMEOUT


def describe_where(frame: FrameType, lineno: int | None = None) -> str:
    """``cell line 7`` for a ``%%remote`` cell's frame, ``train.py:12 in step`` else."""
    code = frame.f_code
    line = frame.f_lineno if lineno is None else lineno
    name = code.co_filename
    if name.startswith("<remote cell "):
        where = f"cell line {line}"
        return where if code.co_name == "<module>" else f"{where} in {code.co_name}"
    return f"{os.path.basename(name)}:{line} in {code.co_name}"


class RankDebugger:
    """The rank's debugger state (one per rank): hooks, the kept failure, the timeout."""

    def __init__(self, rank: Any) -> None:
        self.rank = rank
        #: ``detach`` ignores later breakpoints until the current request is over.
        self.detached = False
        #: The exception of the last failed cell or endpoint (kept for post-mortem).
        self.last_failure: BaseException | None = None
        #: Failures before this time (monotonic) are not kept (an abort just happened).
        self.keep_after = 0.0
        #: The serial of the prompt asked last by a debugger that has not resumed yet.
        self.paused_serial: int | None = None
        #: A debugger ran during this request (its trace function is removed at the end).
        self.used = False
        #: Set while the request is driven by the notebook's visual debugger (DAP):
        #: makes the debugger that ``breakpoint()`` stops in (a ``rank.debug.dap.DapPdb``).
        self.dap: Callable[[RankDebugger], RankPdb] | None = None
        self._active = threading.local()

    def install(self) -> None:
        """``breakpoint()`` and ``pdb.set_trace()`` stop in the notebook's debugger."""
        sys.breakpointhook = self.breakpoint
        pdb.set_trace = self.set_trace

    # -- entering --------------------------------------------------------------------
    def breakpoint(self, *args: Any, **kwargs: Any) -> None:
        """``sys.breakpointhook``: stop in the caller's frame."""
        self._trace(sys._getframe(1))

    def set_trace(self, *, header: str | None = None) -> None:
        """``pdb.set_trace()``: stop in the caller's frame."""
        self._trace(sys._getframe(1), header)

    def _trace(self, frame: FrameType, header: str | None = None) -> None:
        if self.detached or getattr(self._active, "pdb", None) is not None:
            return  # detached, or already inside this thread's debugger (a `!breakpoint()`)
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return  # breakpoints turned off, as Python's own hook does
        self.used = True
        debugger = self._new_pdb()
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    def _new_pdb(self) -> RankPdb:
        if self.dap is not None:
            return self.dap(self)
        return RankPdb(self, post_mortem=False)

    def post_mortem(self) -> bool:
        """Debug the kept failure (on the main thread, as user code); False if none."""
        exc, self.last_failure = self.last_failure, None  # released once debugged
        if exc is None:
            return False
        tb = _user_tb(exc.__traceback__) or exc.__traceback__
        debugger = RankPdb(self, post_mortem=True)
        debugger.message("".join(_exception_line(exc)).rstrip("\n"))
        debugger.reset()
        try:
            debugger.interaction(None, tb)
        finally:
            self.resumed("done")
        return True

    def keep_failure(self, exc: BaseException) -> None:
        """Remember ``exc`` (its frames) for ``%debug_remote``; the last one per rank.
        Not right after the process group was aborted (see ``Rank._abort_pg``)."""
        if time.monotonic() < self.keep_after:
            return
        self.last_failure = exc

    # -- leaving ---------------------------------------------------------------------
    def resumed(self, why: str) -> None:
        """Tell the controller the rank runs on (once per pause)."""
        serial, self.paused_serial = self.paused_serial, None
        if serial is None:
            return
        rank = self.rank
        header = H.Resumed(rank=rank.rank, request=context.current_request, serial=serial, why=why)
        rank.send(header.encode())

    def end_of_request(self) -> None:
        """The request is over: no trace function may outlive it (a ``next`` past the
        cell's end would otherwise stop in the next cell), ``detach`` ends."""
        if not self.used:
            return
        self.used = False
        if isinstance(getattr(sys.gettrace(), "__self__", None), RankPdb):
            sys.settrace(None)
            frame: FrameType | None = sys._getframe()
            while frame is not None:  # set_trace hooked the rank's own long-lived frames
                frame.f_trace = None
                frame = frame.f_back
        # pdb notes a frame's return value in its locals: at a cell's top level those
        # are the rank's namespace, where it would stay
        for name in ("__return__", "__exception__"):
            self.rank.namespace.pop(name, None)
        self.detached = False
        if self.dap is not None:
            self.dap = None
            bdb.Breakpoint.clearBreakpoints()  # (class-wide: a later pdb must not see them)
        self.resumed("done")


def _exception_line(exc: BaseException) -> list[str]:
    import traceback

    return traceback.format_exception_only(type(exc), exc)


def _in_user_code(frame: FrameType | None, rank: Any) -> bool:
    """Whether ``frame`` runs under ``Rank.run_user`` (the cell or endpoint) or in a
    thread the user's code started (only the main thread runs the rank's machinery)."""
    if threading.current_thread() is not threading.main_thread():
        return True
    boundary = type(rank).run_user.__code__
    while frame is not None:
        if frame.f_code is boundary:
            return True
        frame = frame.f_back
    return False


class _Commands(io.TextIOBase):
    """pdb's stdin: each line is asked of the notebook, with pdb's output so far."""

    def __init__(self, debugger: RankPdb) -> None:
        self._pdb = debugger

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return self._pdb.ask() + "\n"


class RankPdb(pdb.Pdb):
    """pdb whose prompts are answered from the notebook (see the module docstring)."""

    def __init__(self, owner: RankDebugger, post_mortem: bool) -> None:
        self._owner = owner
        self._post_mortem = post_mortem
        self._out = io.StringIO()
        # skip: stepping out of the cell does not stop in our own frames
        super().__init__(
            stdin=cast(IO[str], _Commands(self)),
            stdout=self._out,
            skip=["monarch_kernel.*"],
            nosigint=True,
            readrc=False,
        )
        self.use_rawinput = False
        self.prompt = PROMPT

    def ask(self) -> str:
        """Send pdb's output and prompt to the notebook; the command it answers."""
        text = self.prompt_text()
        owner = self._owner
        frame = self.curframe
        where = describe_where(frame, frame.f_lineno) if frame is not None else "?"
        if self._post_mortem and frame is not None and self.curindex < len(self.stack):
            where = describe_where(frame, self.stack[self.curindex][1])
        timeout = debug_timeout()
        if len(text) > MAX_OUTPUT:
            cut = len(text) - MAX_OUTPUT
            text = text[:MAX_OUTPUT] + f"\n... ({cut} more characters not shown)\n"

        def sent(serial: int) -> None:
            owner.paused_serial = serial

        try:
            command: str = owner.rank.stdin.ask(
                self.prompt,
                debugger=(where, self._post_mortem),
                timeout=timeout,
                on_sent=sent,
                payload=text.encode(),
            )
            return command
        except InputTimeout:
            # Nobody attached: run on (a forgotten breakpoint must not hold the mesh).
            owner.resumed("timeout")
            here = context.current_rank().rank
            sys.stderr.write(
                f"rank {here}: no debugger command in {timeout:g} s at {where}: "
                "detached, running on\n"
            )
            sys.stderr.flush()
            return "detach" if not self._post_mortem else "quit"
        except EOFError as exc:
            if str(exc) == "interrupted":
                raise KeyboardInterrupt from None
            owner.resumed("detach")
            here = context.current_rank().rank
            sys.stderr.write(f"rank {here}: debugger at {where} detached: {exc}\n")
            sys.stderr.flush()
            return "detach" if not self._post_mortem else "quit"

    def prompt_text(self) -> str:
        """What goes with the prompt: pdb's output since the last one."""
        text = self._out.getvalue()
        self._out.seek(0)
        self._out.truncate()
        if text.endswith(self.prompt):  # the kernel shows the prompt with the input box
            text = text[: -len(self.prompt)]
        return text

    def stop_here(self, frame: FrameType) -> bool:
        # Only in user code: once a ``next`` leaves the cell or endpoint, the rank's own
        # machinery (and the stdlib and zmq code it calls) runs without stopping.
        return bool(super().stop_here(frame)) and _in_user_code(frame, self._owner.rank)

    def _cmdloop(self) -> None:
        # pdb's own loop catches KeyboardInterrupt and prompts again; here an interrupt
        # (the stop button) must reach the paused frame, so it propagates.
        self.allow_kbdint = True
        try:
            self.cmdloop()
        finally:
            self.allow_kbdint = False

    def do_continue(self, arg: str) -> bool | None:
        """c(ont(inue)): run on until the next breakpoint."""
        self._owner.resumed("continue")
        return bool(super().do_continue(arg))

    do_c = do_cont = do_continue

    def do_detach(self, arg: str) -> bool:
        """detach: run on, ignoring breakpoints for the rest of this cell or call."""
        self._owner.resumed("detach")
        self._owner.detached = True
        self.clear_all_breaks()
        self.set_continue()
        return True

    def do_quit(self, arg: str) -> bool | None:
        """q(uit): leave the debugger; at a breakpoint the cell stops with BdbQuit."""
        self._owner.resumed("quit")
        return bool(super().do_quit(arg))

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool | None:
        self._owner.resumed("quit")
        return bool(super().do_EOF(arg))

    def interaction(self, frame: FrameType | None, tb: TracebackType | None) -> None:
        self._owner._active.pdb = self
        try:
            super().interaction(frame, tb)
        except KeyboardInterrupt:
            self._owner.resumed("interrupted")
            raise
        finally:
            self._owner._active.pdb = None
