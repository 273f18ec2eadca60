"""``input()``, ``getpass()`` and ``sys.stdin`` in a rank: the notebook answers them.

A rank has no terminal (its stdin is /dev/null), so the rank replaces
``builtins.input``, ``getpass.getpass`` and ``sys.stdin`` with functions that send an
``input`` message to the controller (the prompt, and whether to hide what is typed) and
wait for the ``input_reply`` that the control thread hands over. The prompt is not
printed on the rank: the notebook shows it with the input box.

The wait is interruptible (a cancel of the cell raises KeyboardInterrupt in it) and
bounded: without an answer in :data:`INPUT_TIMEOUT` seconds, EOFError.
"""

from __future__ import annotations

import builtins
import getpass
import io
import queue
import sys
import threading
import time
from typing import Any

from monarch_kernel.rank import context
from monarch_kernel.wire import headers as H

#: Seconds an ``input()`` waits for the notebook's answer before it raises EOFError.
INPUT_TIMEOUT = 600.0
#: How often the wait wakes up (a signal interrupts it at once anyway).
_TICK = 0.1


class InputBridge:
    """The rank's side of input forwarding (one per rank)."""

    def __init__(self, rank: Any) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._serial = 0
        self._waiting: dict[int, queue.Queue[H.InputReply]] = {}

    def install(self) -> None:
        """Route ``input()``, ``getpass.getpass()`` and ``sys.stdin`` through the notebook."""
        builtins.input = self.input
        getpass.getpass = self.getpass
        sys.stdin = RankStdin(self)

    # -- the user's side -------------------------------------------------------------
    def input(self, prompt: object = "") -> str:
        """``input()``: the line the notebook's user typed (no newline)."""
        return self.ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: Any = None) -> str:
        """``getpass.getpass()``: like ``input()``, but the notebook hides what is typed."""
        return self.ask(str(prompt), password=True)

    def ask(
        self,
        prompt: str,
        password: bool = False,
        debugger: tuple[str, bool] | None = None,
        timeout: float | None = None,
        on_sent: Any = None,
        payload: bytes = b"",
    ) -> str:
        """Send an ``input`` request and wait for the answer; EOFError if there is none.

        ``debugger`` makes it a debugger prompt: where it stopped, and whether
        post-mortem (header ``dbg``, ``at``, ``pm``),
        ``timeout`` replaces :data:`INPUT_TIMEOUT`, ``on_sent(serial)`` is called once
        the request is out (the debugger remembers which prompt to withdraw),
        ``payload`` goes with it (a debugger's output: too big for a header)."""
        answers: queue.Queue[H.InputReply] = queue.Queue(1)
        with self._lock:
            self._serial += 1
            serial = self._serial
            self._waiting[serial] = answers
        rank = self._rank
        try:
            # What was printed before the prompt arrives before it.
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            header = H.Input(
                rank=rank.rank,
                request=context.current_request,
                serial=serial,
                prompt=prompt,
                password=password,
                debugger=debugger is not None,
                where=debugger[0] if debugger is not None else None,
                post_mortem=debugger[1] if debugger is not None else None,
            )
            rank.send(header.encode(), payload)
            if on_sent is not None:
                on_sent(serial)
            try:
                reply = self._wait(answers, INPUT_TIMEOUT if timeout is None else timeout)
            except InputTimeout as exc:
                if debugger is not None:  # the debugger tells a timeout from other ends of input
                    raise
                raise EOFError(str(exc)) from None  # input() raises what Python's does
        finally:
            with self._lock:
                self._waiting.pop(serial, None)
        if reply.error is not None:
            raise EOFError(str(reply.error))
        return str(reply.value or "")

    def _wait(self, answers: queue.Queue[H.InputReply], timeout: float) -> H.InputReply:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InputTimeout(
                    f"input() on rank {context.current_rank().rank}: no answer from the notebook "
                    f"in {timeout:g} s"
                )
            try:
                # Short waits: a cancel's KeyboardInterrupt gets in between them.
                return answers.get(timeout=min(_TICK, left))
            except queue.Empty:
                continue

    # -- the control thread's side ---------------------------------------------------
    def answer(self, reply: H.InputReply) -> None:
        """An ``input_reply``: wake the ``input()`` waiting for it (if it still waits)."""
        with self._lock:
            waiting = self._waiting.get(reply.serial)
        if waiting is not None:
            try:
                waiting.put_nowait(reply)
            except queue.Full:  # answered twice: the first answer counts
                pass


class InputTimeout(EOFError):
    """Nobody answered in time (a debugger prompt continues the rank then)."""


class RankStdin(io.TextIOBase):
    """``sys.stdin`` of a rank: each line read is asked of the notebook."""

    def __init__(self, bridge: InputBridge) -> None:
        self._bridge = bridge

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def name(self) -> str:
        return "<stdin>"

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        """One line the notebook's user typed, with its newline."""
        return self._bridge.ask("") + "\n"

    def read(self, size: int | None = -1) -> str:
        """One line, like :meth:`readline`: a notebook answers line by line."""
        return self.readline()

    def readlines(self, hint: int = -1) -> list[str]:  # type: ignore[override]
        return [self.readline()]
