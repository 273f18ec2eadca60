"""Debugging ranks from the notebook: the kernel's side of a rank's pdb.

A rank's pdb prompt arrives as an :class:`InputRequested` event with ``debug`` set. A
:class:`DebugConsole` serves those prompts from the thread of the cell that waits (a
``%%remote`` cell, or ``%debug_remote``), through the notebook's ``input()`` (Jupyter's
stdin channel: JupyterLab, Notebook 7 and VS Code all answer it).

One rank is *attached* at a time; the others that stopped wait in a list, and are
attached in turn (when the attached one runs on) or together: at the prompt,

* ``@3`` attaches rank 3 instead;
* ``@all CMD``, ``@0:4 CMD`` or ``--ranks 0:4 CMD`` cast ``CMD`` to those paused ranks:
  the answers come back grouped by rank, identical answers collapsed;
* anything else is a pdb command for the attached rank (``detach`` runs on and ignores
  the later breakpoints of this cell).

Prompts of ranks that nobody waits for (a ``--bg`` cell, an actor endpoint) are
*parked* by the mesh's :class:`~monarch_kernel.kernel.remote.InputRouter` until
``%debug_remote NAME`` attaches to them (:mod:`monarch_kernel.kernel.debug_remote`).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.controller.state.events import DebuggerResumed, InputRequested, MeshEvent
from monarch_kernel.shape import SliceError, parse_ranks

#: pdb commands after which the attached rank runs on (no prompt follows soon).
RUN_ON = frozenset({"c", "cont", "continue", "detach", "q", "quit", "exit"})
#: How long a cast waits for every rank's answer before it shows what it has.
CAST_WAIT = 30.0
#: What a rank did instead of answering a cast with a prompt.
_WHY = {
    "continue": "running on (continue)",
    "detach": "running on (detached)",
    "quit": "quit the debugger",
    "timeout": "running on (debugger timed out)",
    "interrupted": "interrupted",
    "done": "finished",
}


class _Withdrawn(Exception):
    """The prompt being asked needs no answer any more (the rank ran on)."""


@dataclass(eq=False)  # hashed by identity: a router keeps a set of the asking ones
class DebugConsole:
    """Serves debugger prompts of one mesh's ranks in the calling thread.

    ``events`` is where the prompts (and :class:`DebuggerResumed` notices) arrive;
    ``running(rank)`` tells whether that rank is still inside the work being debugged
    (False once it answered the cell, so the console stops waiting for it).
    """

    runtime: MeshRuntime
    events: queue.Queue[MeshEvent | None]
    running: Callable[[int], bool] = lambda rank: True
    #: rank -> its prompt waiting for a command
    pending: dict[int, InputRequested] = field(default_factory=dict)
    #: The rank the person is attached to (its next prompt is served first).
    current: int | None = None
    #: Ranks paused now (announced once per pause).
    paused: set[int] = field(default_factory=set)
    #: Events read while a cast waited that are not debugger events: handed back.
    others: list[InputRequested] = field(default_factory=list)
    _shown: set[tuple[int, int]] = field(default_factory=set)
    _asking: tuple[int, int, int] | None = None  # rank, serial, thread id
    _withdrawn: str = ""
    #: Guards ``_asking`` and ``_withdrawn`` (read by other threads to interrupt).
    _ask_lock: threading.Lock = field(default_factory=threading.Lock)
    _last_asked: int | None = None

    # -- events (the cell's thread) ---------------------------------------------------
    def feed(self, event: MeshEvent) -> bool:
        """Take a debugger event; False if ``event`` is none (the caller handles it)."""
        if isinstance(event, InputRequested) and event.debug:
            if event.rank not in self.paused:
                self.paused.add(event.rank)
                what = "post-mortem debugger" if event.post_mortem else "stopped"
                print(f"rank {event.rank} {what} at {event.where}", flush=True)
            self.pending[event.rank] = event
            return True
        if isinstance(event, DebuggerResumed):
            waiting = self.pending.get(event.rank)
            if waiting is not None and waiting.serial <= event.serial:
                del self.pending[event.rank]
            if self.current == event.rank:
                self.current = None
            if event.rank in self.paused and event.why == "timeout":  # (not said yet)
                print(f"rank {event.rank}: {_WHY['timeout']}", flush=True)
            self.paused.discard(event.rank)
            return True
        return False

    def withdraw(self, event: DebuggerResumed) -> None:
        """(Any thread.) The rank ran on: stop asking for its prompt if we ask now."""
        self._stop_asking(event.why, event.rank, event.serial)

    def abandon(self) -> None:
        """(Any thread.) The work being debugged is over: stop asking."""
        self._stop_asking("done")

    def _stop_asking(self, why: str, rank: int | None = None, serial: int = 0) -> None:
        """Interrupt the prompt being asked (of ``rank``, up to ``serial``), once.

        The first reason wins: a rank that timed out and then finished its cell is
        reported as timed out (the later ``done`` is a consequence), and a second
        interrupt never lands in the asking thread after it left ``input()``.
        """
        with self._ask_lock:
            asking = self._asking
            if asking is None or self._withdrawn:
                return
            if rank is not None and (asking[0] != rank or asking[1] > serial):
                return
            self._withdrawn = why
            signal.pthread_kill(asking[2], signal.SIGINT)

    # -- serving ---------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether a prompt can be served now (the attached rank is not running a
        command whose next prompt is about to come)."""
        if not self.pending:
            return False
        current = self.current
        if current is None or current in self.pending:
            return True
        if not self.running(current) or current not in self.paused:
            self.current = None
            return True
        return False

    def busy(self) -> bool:
        """Whether a session is open: prompts wait, or the attached rank will prompt."""
        if self.pending:
            return True
        current = self.current
        return current is not None and current in self.paused and self.running(current)

    def serve(self) -> None:
        """Serve prompts while one can be served."""
        while self.ready():
            self._ask_one()

    def _ask_one(self) -> None:
        rank = self.current if self.current in self.pending else min(self.pending)
        self.current = rank
        event = self.pending.pop(rank)
        key = (rank, event.serial)
        if self._last_asked is not None and self._last_asked != rank:
            print(f"-- attached to rank {rank} (stopped at {event.where}) --")
        self._last_asked = rank
        if key not in self._shown:
            self._shown.add(key)
            if event.output:
                print(event.output, end="" if event.output.endswith("\n") else "\n")
        others = sorted(r for r in self.pending if r != rank)
        if others and len(self._shown) <= 1 + len(others):
            print(
                f"(also paused: ranks {format_ranks(others)}; @R attaches rank R, "
                "@all CMD sends CMD to every paused rank)",
                flush=True,
            )
        try:
            line = self._input(event, f"[rank {rank}] {event.prompt}")
        except _Withdrawn as why:
            print(f"rank {rank}: {_WHY.get(str(why), str(why))}", flush=True)
            self.current = None
            self.paused.discard(rank)
            return
        except Exception as exc:  # e.g. a front-end that cannot answer input requests
            self.pending[rank] = event
            self._cannot_ask(exc)
            return
        self._drain()  # prompts that came while the person typed count for a cast
        target, command = _split_target(line)
        if target is None:
            self.runtime.answer_input(rank, event.serial, line=line)
            if command.split(" ", 1)[0] in RUN_ON:
                self.current = None
            return
        self.pending[rank] = event  # not answered: still waiting
        try:
            ranks = self._targets(target)
        except SliceError as exc:
            print(f"{exc}; paused ranks: {format_ranks(sorted(self.pending))}")
            return
        if not command:  # @R: attach rank R
            if ranks and ranks[0] in self.pending:
                self.current = ranks[0]
            else:
                print(f"rank {target} is not paused; paused: {format_ranks(sorted(self.pending))}")
            return
        self.cast(ranks, command)

    def _drain(self) -> None:
        """Take the events already queued (never waits)."""
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if event is None:
                self.events.put(None)  # the job's end: for the waiting loop
                return
            if not self.feed(event) and isinstance(event, InputRequested):
                self.others.append(event)

    def _cannot_ask(self, exc: Exception) -> None:
        """The notebook cannot give input: every paused rank runs on (detached)."""
        why = f"the notebook cannot answer a debugger prompt ({type(exc).__name__}: {exc})"
        paused = sorted(self.pending)
        for r, event in sorted(self.pending.items()):
            self.runtime.answer_input(r, event.serial, error=why)
        self.pending.clear()
        self.current = None
        print(f"ranks {format_ranks(paused)}: {why}; detached, running on", flush=True)

    def _targets(self, spec: str) -> list[int]:
        if spec == "all":
            return sorted(self.pending)
        return parse_ranks(spec, self.runtime.world)

    def _input(self, event: InputRequested, prompt: str) -> str:
        with self._ask_lock:
            self._withdrawn = ""
            self._asking = (event.rank, event.serial, threading.get_ident())
        try:
            return input(prompt)
        except KeyboardInterrupt:
            if self._withdrawn:
                raise _Withdrawn(self._withdrawn) from None
            self.runtime.answer_input(event.rank, event.serial, error="interrupted")
            raise
        finally:
            with self._ask_lock:
                self._asking = None

    def cast(self, ranks: list[int], command: str) -> None:
        """Send ``command`` to the paused ``ranks``; show their answers grouped."""
        targets = [r for r in ranks if r in self.pending]
        skipped = [r for r in ranks if r not in self.pending]
        if not targets:
            print(f"none of ranks {format_ranks(ranks)} is paused")
            return
        for r in targets:
            asked = self.pending.pop(r)
            self._shown.add((r, asked.serial))
            self.runtime.answer_input(r, asked.serial, line=command)
        answers: dict[int, str] = {}
        deadline = time.monotonic() + CAST_WAIT
        while len(answers) < len(targets) and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                # (checked only once the events are read: a rank's answer comes before
                # its end of the cell)
                for r in targets:
                    if r not in answers and not self.running(r):
                        answers[r] = _WHY["done"]
                continue
            if event is None:
                continue
            if isinstance(event, InputRequested) and event.debug and event.rank in targets:
                self.pending[event.rank] = event
                self._shown.add((event.rank, event.serial))
                answers.setdefault(event.rank, event.output)
            elif isinstance(event, DebuggerResumed) and event.rank in targets:
                self.feed(event)
                answers.setdefault(event.rank, _WHY.get(event.why, event.why))
            elif not self.feed(event) and isinstance(event, InputRequested):
                self.others.append(event)
        for r in targets:
            answers.setdefault(r, f"no answer within {CAST_WAIT:g} s")
        for text, group in _grouped(answers):
            head = f"[rank {group[0]}]" if len(group) == 1 else f"[ranks {format_ranks(group)}]"
            body = text.rstrip("\n")
            sep = "\n" if "\n" in body else " "
            print(f"{head}{sep}{body}" if body else f"{head} (no output)")
        if skipped:
            print(f"(not paused: ranks {format_ranks(skipped)})")
        if self.current in targets and self.current not in self.pending:
            self.current = None


def _split_target(line: str) -> tuple[str | None, str]:
    """``@2 p x`` -> (``2``, ``p x``); ``--ranks 0:4 p x`` -> (``0:4``, ``p x``)."""
    text = line.strip()
    if text.startswith("@"):
        spec, _, rest = text[1:].partition(" ")
        return spec, rest.strip()
    if text.startswith("--ranks "):
        spec, _, rest = text[len("--ranks ") :].strip().partition(" ")
        return spec, rest.strip()
    return None, line


def _grouped(answers: dict[int, str]) -> list[tuple[str, list[int]]]:
    """Identical answers collapsed: ``[(text, ranks)]`` in rank order of first ranks."""
    groups: dict[str, list[int]] = {}
    for r in sorted(answers):
        groups.setdefault(answers[r], []).append(r)
    return sorted(groups.items(), key=lambda item: item[1][0])
