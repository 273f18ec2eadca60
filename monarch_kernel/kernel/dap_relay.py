"""The paused ranks of a ``%%remote`` cell, as one visual-debugger (DAP) session.

While the notebook's debugger is on, a foreground ``%%remote`` cell is sent with its
gutter breakpoints; a rank that stops there (or at ``breakpoint()``) prompts with a JSON
state (:mod:`monarch_kernel.rank.dap`) instead of pdb's text. The :class:`DapRelay`
keeps each paused rank's latest prompt, announces it with a ``stopped`` event (one per
rank: JupyterLab keeps only the thread of the event it saw), answers queries by sending
them to that rank as the answer of its prompt and waiting for the next one, and resumes
ranks with pdb's commands.

Ids of every rank share one session: a rank's thread, frames and variables references
are :func:`tag`-ged with the rank, far above the ids of the kernel's own debugger
(debugpy's), so a request names which rank it is for.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from monarch_kernel.controller.events import DebuggerResumed, InputRequested, MeshEvent

#: Ids at or above this are a rank's (debugpy's are small counters).
BASE = 1 << 40
#: Bits of a tagged id that are the rank's own id.
SHIFT = 24
#: A prompt's answer that is a query (as :data:`monarch_kernel.rank.dap.QUERY_MARK`).
QUERY_MARK = "\x1edap "
#: Seconds a query waits for the rank's answer.
QUERY_WAIT = 30.0
#: pdb's command for each DAP request that runs a rank on.
RUN_COMMANDS = {"continue": "c", "next": "n", "stepIn": "s", "stepOut": "r"}


def tag(rank: int, local: int) -> int:
    """The session-wide id of rank ``rank``'s own id ``local``."""
    return BASE + (rank << SHIFT) + local


def untag(value: int) -> tuple[int, int]:
    """(rank, its own id) of a tagged id."""
    value -= BASE
    return value >> SHIFT, value & ((1 << SHIFT) - 1)


def is_tagged(value: object) -> bool:
    return isinstance(value, int) and value >= BASE


def thread_id(rank: int) -> int:
    return tag(rank, 0)


class Answerer(Protocol):
    """What the relay needs of a mesh: answering a rank's prompt."""

    def answer_input(
        self, rank: int, serial: int, line: str | None = None, error: str | None = None
    ) -> None: ...


class RankNotPaused(Exception):
    """The request names a rank that is not paused (it ran on, or never stopped)."""


@dataclass
class Paused:
    """A paused rank's latest prompt and the state it sent."""

    event: InputRequested
    stack: list[dict[str, Any]]
    where: str


@dataclass
class DapRelay:
    """The ranks of the debugged cell (module docstring). ``publish`` sends a DAP event
    to the front end (IOPub ``debug_event``)."""

    publish: Callable[[dict[str, Any]], None]
    runtime: Answerer | None = None
    #: The dumped cell's path (what JupyterLab shows the cell's frames as).
    cell_path: str = ""
    paused: dict[int, Paused] = field(default_factory=dict)
    _querying: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    _waiting: set[int] = field(default_factory=set)
    _stepping: set[int] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _rank_locks: dict[int, threading.Lock] = field(default_factory=dict)
    _seq: int = 0

    # -- the debugged cell (its thread) ---------------------------------------------
    def begin(self, runtime: Answerer, cell_path: str) -> None:
        with self._cond:
            self.runtime, self.cell_path = runtime, cell_path
            self.paused.clear()
            self._stepping.clear()

    def end(self) -> None:
        """The cell is over: no rank is paused any more."""
        with self._cond:
            had = bool(self.paused)
            self.paused.clear()
            self._waiting.clear()
            self._cond.notify_all()
        if had:
            self.event("continued", {"threadId": 0, "allThreadsContinued": True})

    def feed(self, event: MeshEvent) -> None:
        """A rank's debugger prompt or resumption (the cell's thread)."""
        if isinstance(event, DebuggerResumed):
            with self._cond:
                paused = self.paused.get(event.rank)
                if paused is not None and paused.event.serial <= event.serial:
                    del self.paused[event.rank]
                self._waiting.discard(event.rank)
                self._cond.notify_all()
            if paused is not None:  # (not by a request of ours: those popped it)
                resumed = {"threadId": thread_id(event.rank), "allThreadsContinued": False}
                self.event("continued", resumed)
            return
        assert isinstance(event, InputRequested)
        try:
            state = json.loads(event.output)
        except ValueError:  # not a visual-debugger prompt (cannot happen on one rank)
            state = {"stack": [], "where": event.where, "reply": None}
        with self._cond:
            self.paused[event.rank] = Paused(event, state.get("stack", []), state.get("where", ""))
            if event.rank in self._waiting:
                self._waiting.discard(event.rank)
                self._querying[event.rank] = state.get("reply")
                self._cond.notify_all()
                return
            stepped = event.rank in self._stepping
            self._stepping.discard(event.rank)
        reason = "step" if stepped else ("exception" if event.post_mortem else "breakpoint")
        body: dict[str, Any] = {
            "reason": reason,
            "threadId": thread_id(event.rank),
            "allThreadsStopped": False,
        }
        if state.get("exception"):
            body["text"] = body["description"] = state["exception"]
        self.event("stopped", body)

    # -- requests (the control thread) ----------------------------------------------
    def query(self, rank: int, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Ask paused rank ``rank`` (``scopes``, ``variables``, ``evaluate``); the body."""
        lock = self._rank_locks.setdefault(rank, threading.Lock())
        with lock:
            with self._cond:
                paused = self.paused.get(rank)
                runtime = self.runtime
                if paused is None or runtime is None:
                    raise RankNotPaused(f"rank {rank} is not paused (it ran on)")
                self._waiting.add(rank)
            line = QUERY_MARK + json.dumps({"command": command, "arguments": arguments})
            runtime.answer_input(rank, paused.event.serial, line=line)
            with self._cond:
                got = self._cond.wait_for(lambda: rank not in self._waiting, QUERY_WAIT)
                self._waiting.discard(rank)
                reply = self._querying.pop(rank, None)
            if not got:
                raise TimeoutError(f"rank {rank} did not answer {command} in {QUERY_WAIT:g} s")
            if reply is None:
                raise RankNotPaused(f"rank {rank} ran on before answering {command}")
            if "error" in reply:
                raise ValueError(str(reply["error"]))
            body: dict[str, Any] = reply["body"]
            return body

    def run_on(self, ranks: list[int], command: str) -> list[int]:
        """Send pdb's ``command`` to the paused ``ranks``; those it was sent to."""
        sent = []
        for rank in ranks:
            # after a query in flight (its answer is the prompt to answer: the one we
            # have may be answered already)
            with self._rank_locks.setdefault(rank, threading.Lock()):
                with self._cond:
                    runtime = self.runtime
                    paused = self.paused.pop(rank, None)
                    if command != "c" and paused is not None:
                        self._stepping.add(rank)
                if paused is not None and runtime is not None:
                    runtime.answer_input(rank, paused.event.serial, line=command)
                    sent.append(rank)
        return sent

    def paused_ranks(self) -> list[int]:
        with self._cond:
            return sorted(self.paused)

    def stack_of(self, rank: int) -> list[dict[str, Any]]:
        with self._cond:
            paused = self.paused.get(rank)
        if paused is None:
            raise RankNotPaused(f"rank {rank} is not paused (it ran on)")
        return paused.stack

    def event(self, name: str, body: dict[str, Any]) -> None:
        with self._cond:
            self._seq += 1
            seq = self._seq
        self.publish({"seq": seq, "type": "event", "event": name, "body": body})
