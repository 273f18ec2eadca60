"""The paused ranks of a ``%%remote`` cell, as one visual-debugger (DAP) session.

While the notebook's debugger is on, a foreground ``%%remote`` cell is sent with its
gutter breakpoints; a rank that stops there (or at ``breakpoint()``) prompts with a JSON
state (:mod:`monarch_kernel.rank.debug.dap`) instead of pdb's text. The :class:`DapRelay`
keeps each paused rank's latest prompt, announces it with a ``stopped`` event (one per
rank: JupyterLab keeps only the thread of the event it saw), answers queries by sending
them to that rank as the answer of its prompt and waiting for the next one, and resumes
ranks with pdb's commands.

Ranks paused in an actor endpoint defined in the notebook (no cell waits for them: the
mesh's input router hands their prompts here) join the same session, whichever mesh they
are on. Ids of every rank share one session: a paused rank's thread, frames and
variables references are :func:`tag`-ged with its *key* (its mesh's slot and its rank,
:meth:`DapRelay.key_of`), far above the ids of the kernel's own debugger (debugpy's),
so a request names which rank it is for.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from monarch_kernel.controller.state.events import DebuggerResumed, InputRequested, MeshEvent

#: Ids at or above this are a rank's (debugpy's are small counters).
BASE = 1 << 40
#: Bits of a tagged id that are the rank's own id.
SHIFT = 24
#: A prompt's answer that is a query (as :data:`monarch_kernel.rank.debug.dap.QUERY_MARK`).
QUERY_MARK = "\x1edap "
#: Seconds a query waits for the rank's answer.
QUERY_WAIT = 30.0
#: Bits of a key that are the rank (the mesh's slot is above them).
RANK_BITS = 16
#: The prompt of a rank's visual-debugger pdb (as :data:`monarch_kernel.rank.debug.dap.PROMPT`).
PROMPT = "(dap) "
#: Cells whose file names are kept (their frames shown as their dumped files).
CELLS_KEPT = 256
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
    """What the relay needs of a mesh: its name, answering a rank's prompt."""

    name: str

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
    runtime: Answerer
    #: Paused in the debugged cell (else in an endpoint nobody waits for).
    cell: bool = True


@dataclass
class DapRelay:
    """The paused ranks of the debugged cell and of endpoints (module docstring), by
    key. ``publish`` sends a DAP event to the front end (IOPub ``debug_event``)."""

    publish: Callable[[dict[str, Any]], None]
    runtime: Answerer | None = None
    #: A cell's file on the ranks (``<remote cell 5>``) -> its dumped path (what
    #: JupyterLab shows its frames as); the last :data:`CELLS_KEPT` cells debugged.
    cell_paths: dict[str, str] = field(default_factory=dict)
    paused: dict[int, Paused] = field(default_factory=dict)
    _querying: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    _waiting: set[int] = field(default_factory=set)
    _stepping: set[int] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _rank_locks: dict[int, threading.Lock] = field(default_factory=dict)
    _seq: int = 0
    #: The key of the last ``stopped`` event (the thread JupyterLab shows).
    _last_stopped: int | None = None
    #: mesh name -> its slot (the high bits of its ranks' keys), in order of first pause
    _slots: dict[str, int] = field(default_factory=dict)
    #: Keys a ``stopped`` event announced, with no ``continued`` since (-> of the cell)
    _announced: dict[int, bool] = field(default_factory=dict)
    #: Keys a ``continue`` is resuming now: their ``continued`` event is its one, sent
    #: once every rank was told (a rank's own resumption may come back before that).
    _continuing: set[int] = field(default_factory=set)

    def key_of(self, mesh: str, rank: int) -> int:
        """The key of ``rank`` of mesh ``mesh`` (a thread of the session)."""
        with self._cond:
            slot = self._slots.setdefault(mesh, len(self._slots))
        return slot << RANK_BITS | rank

    def thread_name(self, key: int) -> str:
        """``rank 3 · MainThread``; an endpoint's pause names its mesh too."""
        with self._cond:
            paused = self.paused.get(key)
        rank = key & ((1 << RANK_BITS) - 1)
        if paused is None or paused.cell:
            return f"rank {rank} · MainThread"
        return f"rank {rank} · MainThread (mesh {paused.runtime.name})"

    # -- the debugged cell (its thread) ---------------------------------------------
    def name_cell(self, filename: str, path: str) -> None:
        """The frames of a cell run with the visual debugger (``filename`` on the ranks)
        show as its dumped file ``path``."""
        with self._cond:
            self.cell_paths.pop(filename, None)
            self.cell_paths[filename] = path
            while len(self.cell_paths) > CELLS_KEPT:
                del self.cell_paths[next(iter(self.cell_paths))]

    def begin(self, runtime: Answerer) -> None:
        """A foreground cell of ``runtime`` starts: its ranks' prompts come through
        :meth:`feed` from its thread."""
        with self._cond:
            self.runtime = runtime
            for key in [k for k, p in self.paused.items() if p.cell]:
                del self.paused[key]
            self._stepping.clear()

    def end(self) -> None:
        """The cell is over: none of its ranks is paused any more."""
        with self._cond:
            ended = {k for k, p in self.paused.items() if p.cell}
            for key in ended:
                del self.paused[key]
            self._waiting -= ended
            self._cond.notify_all()
            ended |= {k for k, cell in self._announced.items() if cell}
        self._ran_on(ended, every=True)

    def _ran_on(self, keys: Iterable[int], every: bool) -> None:
        """Tell the front end that these announced ranks run on: one ``continued`` event
        naming the thread JupyterLab shows (it forgets that one, and its "Paused in
        Debugger" overlay goes); ``every``: no rank of the session is paused."""
        with self._cond:
            gone = sorted(k for k in keys if k in self._announced)
            for key in gone:
                del self._announced[key]
            last = self._last_stopped
        if gone:
            shown = last if last in gone else gone[0]
            self.event("continued", {"threadId": thread_id(shown), "allThreadsContinued": every})

    def feed(self, event: MeshEvent, endpoint: Answerer | None = None) -> None:
        """A rank's debugger prompt or resumption: of the cell (the cell's thread), or of
        an endpoint on mesh ``endpoint`` (its input router, the receiving thread)."""
        runtime = endpoint or self.runtime
        if runtime is None:
            return
        assert isinstance(event, (InputRequested, DebuggerResumed))
        key = self.key_of(runtime.name, event.rank)
        if isinstance(event, DebuggerResumed):
            with self._cond:
                paused = self.paused.get(key)
                if paused is not None and paused.event.serial <= event.serial:
                    del self.paused[key]
                self._waiting.discard(key)
                self._stepping.discard(key)  # (a step that ran off the cell or endpoint)
                self._cond.notify_all()
                running = key not in self.paused and key not in self._continuing
            if running:
                self._ran_on([key], every=False)
            return
        try:
            state = json.loads(event.output)
        except ValueError:  # not a visual-debugger prompt (cannot happen on one rank)
            state = {"stack": [], "where": event.where, "reply": None}
        with self._cond:
            self.paused[key] = Paused(
                event, state.get("stack", []), state.get("where", ""), runtime, endpoint is None
            )
            if key in self._waiting:
                self._waiting.discard(key)
                self._querying[key] = state.get("reply")
                self._cond.notify_all()
                return
            stepped = key in self._stepping
            self._stepping.discard(key)
            self._last_stopped = key
            self._announced[key] = endpoint is None
        reason = "step" if stepped else ("exception" if event.post_mortem else "breakpoint")
        body: dict[str, Any] = {
            "reason": reason,
            "threadId": thread_id(key),
            "allThreadsStopped": False,
        }
        if state.get("exception"):
            body["text"] = body["description"] = state["exception"]
        self.event("stopped", body)

    # -- requests (the control thread) ----------------------------------------------
    def query(self, key: int, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Ask the paused rank of ``key`` (``scopes``, ``variables``, ``evaluate``); the
        body of its answer."""
        rank = key & ((1 << RANK_BITS) - 1)
        with self._rank_locks.setdefault(key, threading.Lock()):
            with self._cond:
                paused = self.paused.get(key)
                if paused is None:
                    raise RankNotPaused(f"rank {rank} is not paused (it ran on)")
                self._waiting.add(key)
            line = QUERY_MARK + json.dumps({"command": command, "arguments": arguments})
            paused.runtime.answer_input(rank, paused.event.serial, line=line)
            with self._cond:
                got = self._cond.wait_for(lambda: key not in self._waiting, QUERY_WAIT)
                self._waiting.discard(key)
                reply = self._querying.pop(key, None)
            if not got:
                raise TimeoutError(f"rank {rank} did not answer {command} in {QUERY_WAIT:g} s")
            if reply is None:
                raise RankNotPaused(f"rank {rank} ran on before answering {command}")
            if "error" in reply:
                raise ValueError(str(reply["error"]))
            body: dict[str, Any] = reply["body"]
            return body

    def run_on(self, keys: list[int], command: str) -> list[int]:
        """Send pdb's ``command`` to the paused ranks of ``keys``; the keys it was sent to."""
        sent: list[int] = []
        if command == "c":
            with self._cond:
                self._continuing.update(keys)
        try:
            self._answer_each(keys, command, sent)
        finally:
            if command == "c":
                with self._cond:
                    every = not self.paused
                self._ran_on(sent, every)
                with self._cond:
                    self._continuing.difference_update(keys)
        return sent

    def _answer_each(self, keys: list[int], command: str, sent: list[int]) -> None:
        """Answer each paused rank of ``keys`` with ``command``; the ones told go to
        ``sent``."""
        for key in keys:
            # after a query in flight (its answer is the prompt to answer: the one we
            # have may be answered already)
            with self._rank_locks.setdefault(key, threading.Lock()):
                with self._cond:
                    paused = self.paused.pop(key, None)
                    if command != "c" and paused is not None:
                        self._stepping.add(key)
                if paused is not None:
                    rank = key & ((1 << RANK_BITS) - 1)
                    paused.runtime.answer_input(rank, paused.event.serial, line=command)
                    sent.append(key)

    def shown_key(self) -> int | None:
        """The key of the paused rank JupyterLab shows (its last ``stopped`` event)."""
        with self._cond:
            if self._last_stopped in self.paused:
                return self._last_stopped
            return min(self.paused, default=None)

    def owns(self, key: int) -> bool:
        """Whether the rank of ``key`` is paused here, or was told to step by us."""
        with self._cond:
            return key in self.paused or key in self._stepping or key in self._announced

    def paused_keys(self) -> list[int]:
        """The keys of the paused ranks (cell and endpoints)."""
        with self._cond:
            return sorted(self.paused)

    def stack_of(self, key: int) -> list[dict[str, Any]]:
        with self._cond:
            paused = self.paused.get(key)
        if paused is None:
            raise RankNotPaused(f"rank {key & ((1 << RANK_BITS) - 1)} is not paused (it ran on)")
        return paused.stack

    def event(self, name: str, body: dict[str, Any]) -> None:
        with self._cond:
            self._seq += 1
            seq = self._seq
        self.publish({"seq": seq, "type": "event", "event": name, "body": body})
