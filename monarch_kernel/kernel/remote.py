"""Running a cell on a mesh's ranks: the machinery behind ``%%remote``.

Size: over the ~450-line habit: a ``%%remote`` job's start, its prompts
(``InputRouter``) and its end (what a death or the stop button made of it) share the
job's request and output; the cell-level parsing is ``remote_cell``, the words of its
failures ``failure_voice``.
"""

from __future__ import annotations

import getpass
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable

from monarch_kernel.actor import ProcMesh, ValueMesh
from monarch_kernel.calls.errors import (
    ActorError,
    MeshStartError,
    MonarchError,
    RankDiedError,
    format_ranks,
)
from monarch_kernel.calls.future import Future
from monarch_kernel.calls.gather import Gather
from monarch_kernel.calls.requester import CallOptions
from monarch_kernel.controller.attach_file import JobRecord
from monarch_kernel.controller.detach.takeover import Attached
from monarch_kernel.controller.mesh import MeshRuntime, new_request_id
from monarch_kernel.controller.state.events import (
    DebuggerResumed,
    DisplayOutput,
    InputRequested,
    MeshEvent,
    RankDied,
    RequestFailed,
)
from monarch_kernel.kernel.debug import requests as dap_requests
from monarch_kernel.kernel.debug.console import DebugConsole
from monarch_kernel.kernel.debug.relay import PROMPT as DAP_PROMPT
from monarch_kernel.kernel.debug.relay import DapRelay
from monarch_kernel.kernel.failure_voice import Death, assigned_names, death_text, interrupt_lines
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.shape import Shape
from monarch_kernel.wire import dumps
from monarch_kernel.wire import kinds as K

#: For --bg jobs: how long after the last result their output block is closed (output of
#: threads the cell left running may still come in). Foreground cells close at once:
#: ranks send all of a cell's output before its result.
OUTPUT_GRACE = 0.05
INTERRUPT_WAIT = 3.0
#: How long a cell that failed because a rank died waits for the failure policy to
#: restart it, so that its error says what was restarted and lost (past it: the error
#: says it is restarting, and the next cell waits).
RESTART_WAIT = 60.0


class RemoteCellError(ActorError):
    """A ``%%remote`` cell failed on one or more ranks (grouped, root cause first)."""


class RemoteInterrupted(MonarchError):
    """The stop button (or Ctrl-C) interrupted a ``%%remote`` cell; says where each
    rank was, or which ranks did not stop."""


class InputRouter:
    """Answers ranks' ``input()`` calls: those of a foreground cell go to the cell that
    waits for it (which asks the notebook), any other gets a clear EOFError at once.

    Debugger prompts nobody waits for (a ``--bg`` cell's, an endpoint's) are *parked*
    until ``%debug_remote`` attaches to them (the rank stays paused meanwhile, up to its
    debugger timeout). One per mesh, subscribed to its input and debugger events.
    """

    _routers: weakref.WeakKeyDictionary[MeshRuntime, InputRouter] = weakref.WeakKeyDictionary()

    def __init__(self, runtime: MeshRuntime):
        # Weak: the runtime's event bus holds this router, and the map of routers is
        # keyed by the runtime (a strong reference back would keep it alive forever).
        self._runtime = weakref.ref(runtime)
        self._cells: dict[str, queue.Queue[MeshEvent | None]] = {}
        #: rank -> its parked debugger prompt (nobody waits to answer it)
        self.parked: dict[int, InputRequested] = {}
        #: ``%debug_remote``'s queue while it is attached to parked prompts
        self._attached: queue.Queue[MeshEvent | None] | None = None
        #: consoles asking the notebook now (withdrawn when their rank runs on)
        self.consoles: set[DebugConsole] = set()
        self._lock = threading.Lock()
        runtime.events.subscribe(self._on_event, InputRequested, DebuggerResumed)

    @classmethod
    def of(cls, runtime: MeshRuntime) -> InputRouter:
        router = cls._routers.get(runtime)
        if router is None:
            router = cls._routers[runtime] = cls(runtime)
        return router

    def listen(self, request_id: str, inbox: queue.Queue[MeshEvent | None]) -> None:
        self._cells[request_id] = inbox

    def forget(self, request_id: str) -> None:
        self._cells.pop(request_id, None)

    def attach(self, inbox: queue.Queue[MeshEvent | None], ranks: set[int]) -> int:
        """Send the parked prompts of ``ranks``, and every later debugger event nobody
        else waits for, to ``inbox`` (``%debug_remote``); how many were parked."""
        with self._lock:
            self._attached = inbox
            moved = [e for r, e in sorted(self.parked.items()) if r in ranks]
            for e in moved:
                del self.parked[e.rank]
                inbox.put(e)
        return len(moved)

    def detach(self) -> None:
        self._attached = None

    def _notice(self, event: InputRequested) -> None:
        """Say where the output of the paused work goes that its rank waits for us."""
        runtime = self._runtime()
        if runtime is None:
            return
        what = "post-mortem debugger" if event.post_mortem else "stopped"
        text = (
            f"{what} at {event.where}; nothing here waits on it: attach with "
            f"%debug_remote {runtime.name} --rank {event.rank} (interrupt a cell blocked on "
            "its result first)\n"
        )
        try:
            runtime.output.sink_for(event.request)(event.rank, "stderr", text)
        except Exception:  # a notice must never break the receiving thread
            pass

    def _to_visual_debugger(self, event: InputRequested | DebuggerResumed) -> bool:
        """Give the notebook's visual debugger what is its own: the prompts of ranks it
        armed (an endpoint's gutter breakpoint) and their resumptions."""
        remote = dap_requests.current()
        runtime = self._runtime()
        if remote is None or runtime is None:
            return False
        relay = remote.relay
        if isinstance(event, InputRequested):
            if event.prompt != DAP_PROMPT:
                return False
        elif not relay.owns(relay.key_of(runtime.name, event.rank)):
            return False
        relay.feed(event, endpoint=runtime)
        return True

    def _on_event(self, event: MeshEvent) -> None:  # receiving thread: never blocks
        if isinstance(event, DebuggerResumed):
            for console in list(self.consoles):
                console.withdraw(event)
        assert isinstance(event, (InputRequested, DebuggerResumed))
        inbox = self._cells.get(event.request or "")
        if inbox is not None:
            inbox.put(event)
            return
        debug = isinstance(event, DebuggerResumed) or event.debug
        if debug and self._to_visual_debugger(event):
            return
        if debug:
            with self._lock:
                attached = self._attached
                if attached is not None:
                    attached.put(event)
                elif isinstance(event, InputRequested):
                    if event.rank not in self.parked:
                        self._notice(event)
                    self.parked[event.rank] = event
                else:
                    parked = self.parked.get(event.rank)
                    if parked is not None and parked.serial <= event.serial:
                        del self.parked[event.rank]
            return
        runtime = self._runtime()
        if runtime is not None:
            from monarch_kernel.controller.messaging.rank_output import NO_READER

            runtime.answer_input(event.rank, event.serial, error=NO_READER)


def _is_debugger_event(event: MeshEvent) -> bool:
    return isinstance(event, DebuggerResumed) or (isinstance(event, InputRequested) and event.debug)


class RemoteJob:
    """One ``%%remote`` execution. ``--bg`` returns it at once.

    ``wait()``/``result()`` give the ValueMesh of the cell's last expression (or raise
    the grouped error), ``done()`` tells whether all ranks finished, ``cancel()``
    interrupts the ranks still running it.

    The cell is one request: its replies are gathered by the actor API's
    :class:`~monarch_kernel.calls.gather.Gather`, and its output is routed (by request
    id) to this job's :class:`CellOutput` through the mesh's stream router.
    """

    def __init__(
        self,
        procs: ProcMesh,
        code: str,
        cell: str,
        output: CellOutput | None,
        ranks: list[int] | None = None,
        shape: Shape | None = None,
        on_finished: Callable[[RemoteJob], None] | None = None,
        header: list[str] | None = None,
        kind: str = K.EXEC,
        spec: dict[str, object] | None = None,
    ):
        self.procs = procs
        self.code = code
        self.cell = cell
        self.output = output
        self.ranks = ranks if ranks is not None else procs.ranks()
        self.shape = shape or procs.shape
        self.on_finished = on_finished
        self.header = header or []
        #: The message kind sent (``exec``: a cell; ``debug``: a post-mortem) and, for
        #: kinds other than ``exec``, its header keys.
        self.kind = kind
        self.spec = spec or {}
        self.started = time.time()
        self.finished: float | None = None
        self.request_id = new_request_id()
        # Not a waiter: the I/O thread receives cell replies (a cell's output must keep
        # flowing while the notebook's main thread blocks in wait()).
        self._gather = Gather(
            self.ranks, self.shape, None, error_class=RemoteCellError, value_name="cell value"
        )
        self.future: Future[ValueMesh[object]] = self._gather.future
        self._closing = threading.Lock()  # held for good once the output is closed
        #: Wakes :meth:`wait`: a rank's input() to answer, or None when the job is done.
        self._inbox: queue.Queue[MeshEvent | None] = queue.Queue()
        #: Serves the ranks' debugger prompts (breakpoints, post-mortem) while it waits.
        self.debug = DebugConsole(procs.runtime, self._inbox, self._running)
        self.cancelled = ""  #: why it was cancelled (empty if it was not)
        #: The thread blocked in the notebook's input() for a rank, if one is.
        self._asking: int | None = None
        #: The job ended while that thread waited for a person: it was interrupted.
        self._input_abandoned = False
        self._display_ids: list[str] = []
        #: Told when a rank fails while the others still run it (a ``--bg`` block's
        #: title says so at once).
        self.on_failing: Callable[[RemoteJob], None] | None = None
        #: The notebook's visual debugger, when it drives this cell's ranks.
        self.dap: DapRelay | None = None
        #: Ranks that showed output (lines, bars, displays) in this cell.
        self.heard: set[int] = set()
        #: The mesh's last restart report when the job started (a later one is ours).
        self._recovery_before = procs.runtime.last_recovery

    def start(self) -> RemoteJob:
        header: dict[str, object] = {"k": self.kind}
        if self.kind == K.EXEC:
            spec: dict[str, object] = {"code": self.code, "cell": self.cell, "header": self.header}
            self._start_visual_debugger(spec)
            payload, buffers = dumps(spec, "cell")
        else:
            header.update(self.spec)
            payload, buffers = b"", []
        rt = self.procs.runtime
        if self.output is not None:
            rt.output.route(self.request_id, self._feed, self._show)
        router = InputRouter.of(rt)
        if self.on_finished is None:  # a foreground cell: it answers its ranks' input()
            router.listen(self.request_id, self._inbox)
        self.future.add_done_callback(self._on_done)
        if self.on_finished is not None:
            rt.events.subscribe(self._on_failure, RequestFailed, RankDied)
        try:
            rt.request(
                self.ranks,
                header,
                payload,
                buffers,
                self._gather,
                CallOptions(what=f"cell {self.cell}"),
                self.request_id,
            )
        except BaseException:
            rt.output.unroute(self.request_id)
            router.forget(self.request_id)
            raise
        return self

    def _feed(self, rank: int, name: str, text: str) -> None:
        self.heard.add(rank)
        assert self.output is not None
        self.output.feed(rank, name, text)

    def _show(self, event: DisplayOutput) -> None:
        self.heard.add(event.rank)
        assert self.output is not None
        self.output.show_event(event)

    def resume(self, attached: Attached, job: JobRecord) -> RemoteJob:
        """Follow ``job``, a cell an earlier kernel started on the mesh this one took
        over (``%mesh attach``): its output and its result come here now."""
        self.request_id, self.started = job.request, job.started
        rt = self.procs.runtime
        self.future.add_done_callback(self._on_done)
        rt.events.subscribe(self._on_failure, RequestFailed, RankDied)
        attached.follow(job, self._gather, self.output.feed if self.output is not None else None)
        return self

    def _on_failure(self, event: MeshEvent) -> None:
        """A rank failed or died (receiving thread): if it was running this job, show
        the job's state once the failure is recorded (the work posted runs after it)."""
        ours = (
            event.request == self.request_id
            if isinstance(event, RequestFailed)
            else isinstance(event, RankDied) and self.request_id in event.requests
        )
        if ours and not self.done():
            # Posted: it runs once the failure is recorded; on a thread of its own, as
            # updating the displays must never hold up the receiving thread (the failure
            # policy's release waits on it).
            self.procs.runtime.receiver.post(self._start_failing)

    def _start_failing(self) -> None:
        threading.Thread(target=self._failing, name="mk-job-failing", daemon=True).start()

    def _failing(self) -> None:
        try:
            self._update_displays()
            if self.on_failing is not None and not self.done():
                self.on_failing(self)
        except Exception:  # never break the receiving thread
            pass

    def _start_visual_debugger(self, spec: dict[str, object]) -> None:
        """With the notebook's debugger on, a cell goes with its gutter breakpoints, and
        its ranks' debugger prompts go to the panel (not to pdb's): a foreground cell's
        through this job, a ``--bg`` cell's through the mesh's input router."""
        remote = dap_requests.current()
        if remote is None or not self.header:
            return
        path, lines = remote.breaks_for_current_cell()
        spec["dap"] = lines
        spec["dap_exc"] = bool(remote.exception_filters)
        remote.relay.name_cell(f"<remote cell {self.cell}>", path)
        if self.on_finished is None:
            remote.relay.begin(self.procs.runtime)
            self.dap = remote.relay

    def _end_visual_debugger(self) -> None:
        """(The cell's thread, which publishes the panel's events.) No rank is paused."""
        if self.dap is not None:
            self.dap.end()

    def _on_done(self, _: Future[ValueMesh[object]]) -> None:
        """Every rank answered or one was lost (a controller thread: never sleep here)."""
        self.finished = time.time()
        InputRouter.of(self.procs.runtime).forget(self.request_id)
        self._inbox.put(None)
        asking = self._asking
        if asking is not None:  # nobody needs that answer any more: stop asking
            self._input_abandoned = True
            signal.pthread_kill(asking, signal.SIGINT)
        self.debug.abandon()  # a debugger prompt, likewise
        # Close the output and report after a short grace, on a timer thread.
        threading.Timer(OUTPUT_GRACE, self._after_finish).start()

    def _after_finish(self) -> None:
        self.procs.runtime.events.unsubscribe(self._on_failure)
        self._close_output()
        try:
            self._update_displays()
        except Exception:  # the kernel may be shutting down
            pass
        if self.on_finished is not None:
            self.on_finished(self)

    def _close_output(self) -> None:
        if not self._closing.acquire(blocking=False):
            return  # closed already (wait() and the timer both get here)
        self.procs.runtime.output.unroute(self.request_id)
        if self.output is not None:
            self.output.close()

    # -- user side -----------------------------------------------------------------
    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> ValueMesh:
        """Block until every rank finished; Ctrl-C / the stop button interrupts the ranks
        (then :class:`RemoteInterrupted` says where they were). Meanwhile the ranks'
        ``input()`` calls are answered from the notebook (in this, the cell's thread)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            try:
                while not self.future.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    try:
                        event = self._inbox.get(timeout=0.2 if left is None else min(left, 0.2))
                    except queue.Empty:
                        event = None
                    self._handle(event)
                    if self.debug.pending:
                        self._serve_debugger()
                try:
                    return self.future.get(0 if deadline is not None else None)
                except RankDiedError as exc:
                    raise self.death_error(exc) from None
            finally:
                if self.future.done():
                    self._close_output()
                    self._end_visual_debugger()
        except KeyboardInterrupt:
            if self._input_abandoned and self.future.done():
                return self.future.get(0)  # our own interrupt of a stale input() prompt
            raise self._interrupted() from None

    result = wait

    def _running(self, rank: int) -> bool:
        return not self.future.done() and not self._gather.answered(rank)

    def _handle(self, event: MeshEvent | None) -> None:
        if event is None:
            return
        if self.dap is not None and _is_debugger_event(event):
            self.dap.feed(event)
            return
        if self.debug.feed(event):
            return
        assert isinstance(event, InputRequested)
        self._answer(event)

    def _serve_debugger(self) -> None:
        """Serve the ranks' debugger prompts (in this, the cell's thread)."""
        if self.output is not None:
            self.output.flush(force=True)  # what the ranks printed comes first
        router = InputRouter.of(self.procs.runtime)
        router.consoles.add(self.debug)
        try:
            self.debug.serve()
            for event in self.debug.others:
                self._answer(event)
            self.debug.others.clear()
        finally:
            router.consoles.discard(self.debug)

    def _answer(self, event: InputRequested) -> None:
        """Ask the notebook for the line a rank's input() waits for."""
        rt = self.procs.runtime
        prompt = f"[rank {event.rank}] {event.prompt}"
        self._asking = threading.get_ident()
        try:
            if self.future.done():
                return
            line = getpass.getpass(prompt) if event.password else input(prompt)
        except KeyboardInterrupt:
            if self._input_abandoned:
                return  # the job ended while we asked: the wait loop sees it is done
            rt.answer_input(event.rank, event.serial, error="interrupted")
            raise
        except Exception as exc:  # e.g. the front-end does not accept input
            rt.answer_input(
                event.rank, event.serial, error=f"the notebook cannot give input: {exc}"
            )
        else:
            rt.answer_input(event.rank, event.serial, line=line)
        finally:
            self._asking = None

    def death_error(self, exc: RankDiedError) -> RankDiedError:
        """A cell failed because a rank died: once the restart policy brought it back,
        one message of what died, what was done and what state was lost where
        (:func:`~monarch_kernel.kernel.failure_voice.death_text`). Other policies, and
        deaths outside this cell's ranks, keep the error as it is."""
        rt = self.procs.runtime
        death = exc.death
        if (
            death is None
            or self.kind != K.EXEC
            or rt.on_failure != "restart"
            or not isinstance(self._gather.lost(death.rank), RankDiedError)
        ):
            return exc
        restarting = False
        try:
            rt.wait_recovered(RESTART_WAIT)
        except (KeyboardInterrupt, MeshStartError):
            restarting = True  # the next cell waits for it
        report = rt.last_recovery
        if report is self._recovery_before:
            report = None
        incident = self._gather.incident
        released = dict(incident.released) if incident is not None else {}
        consequences: dict[int, str] = {}
        for r in self._gather.failed:
            if r == death.rank or r in released:
                continue
            lost = self._gather.lost(r)
            if lost is not None:
                consequences[r] = str(lost).split("\n", 1)[0]
                continue
            f = self._gather.failure(r)
            if f is not None:
                message = str(f.get("message") or "").split("\n", 1)[0]
                consequences[r] = f"{f.get('type')}: {message}" if message else str(f.get("type"))
        info = rt.ranks[death.rank] if death.rank < len(rt.ranks) else None
        alive = info is not None and info.alive
        voice = Death(
            death=death,
            mesh=self.procs.name,
            cell=self.cell,
            policy=rt.on_failure,
            restarted=alive and not restarting,
            report=report if report is not None and death.rank in report.restarted else None,
            restarting=restarting or not alive,
            error=rt.recovery_error if not alive and not restarting else None,
            names=assigned_names(self.code),
            world=rt.world,
            released=released,
            consequences=consequences,
            heard=death.rank in self.heard,
        )
        return type(exc)(death_text(voice), death, exc.mesh)

    def _interrupted(self) -> RemoteInterrupted:
        """Interrupt the ranks; the short message the stop button shows."""
        self.cancel()
        head = f"interrupted cell {self.cell} on mesh {self.procs.name!r}"
        try:
            self.future.get(INTERRUPT_WAIT)
        except TimeoutError:
            stuck = [r for r in self.ranks if not self._gather.answered(r)]
            spec = ",".join(map(str, stuck))
            name = self.procs.name
            return RemoteInterrupted(
                f"{head}: rank(s) {format_ranks(stuck)} did not stop within "
                f"{INTERRUPT_WAIT:.0f}s (stuck in C code or a collective?). See where with "
                f"%mesh stacks {name} --ranks {spec}; kill and restart them with "
                f"%mesh restart {name} --ranks {spec}."
            )
        except RankDiedError as exc:
            return RemoteInterrupted(f"{head}\n{exc}")
        except ActorError as exc:
            return RemoteInterrupted(self._interrupt_text(head, exc))
        except BaseException as exc:
            return RemoteInterrupted(f"{head}\n{exc}")
        finally:
            if self.future.done():
                self._close_output()
                self._end_visual_debugger()
        return RemoteInterrupted(f"{head}: every rank had finished it already")

    def _interrupt_text(self, head: str, exc: ActorError) -> str:
        """The stop button's short message: where each group of ranks was, one line
        each, no traceback. What the mesh did afterwards (the process group re-formed,
        the replicas compared) is not part of the error: it is printed before it."""
        failed = {int(f.get("rank", -1)) for f in exc.failures}
        finished = [r for r in self.ranks if r not in failed and self._gather.answered(r)]
        lines = [head, *interrupt_lines(exc.failures, self.ranks, len(self.ranks), finished)]
        incident = self._gather.incident
        if incident is not None:
            outcome = incident.outcome
            released = incident.summary()
            if outcome and released.endswith(outcome):
                released = released[: -len(outcome)].rstrip()
            if released:
                lines.append(released)  # ranks that had to be released: part of it
            if outcome:
                print(outcome, flush=True)
        return "\n".join(lines)

    def cancel(self, why: str = "") -> None:
        """Raise KeyboardInterrupt in the ranks still running this cell (``why`` is
        shown in a ``--bg`` cell's output)."""
        if self.done():
            return
        self.cancelled = why or "cancelled"
        # Interrupts it where it runs, skips it where it has not started; marked as a
        # person's doing, so the failure policy does not treat it as a fault.
        self.procs.runtime.cancel_request(self.request_id)

    @property
    def state(self) -> str:
        """``running``, ``failing: rank(s) 1 failed, the others still run``,
        ``cancelling``, then ``done``, ``failed`` or ``cancelled``."""
        if not self.done():
            if self.cancelled:
                return "cancelling"
            failed = self._gather.failed
            if failed:
                return f"failing: rank(s) {format_ranks(failed)} failed, the others still run"
            return "running"
        if self.cancelled and self.future.exception() is not None:
            return "cancelled"
        return "failed" if self.future.exception() is not None else "done"

    def _ipython_display_(self) -> None:
        """Shown in a cell: a line that keeps its state up to date until it ends."""
        from IPython.display import display

        handle = display({"text/plain": repr(self)}, raw=True, display_id=True)
        if handle is not None and not self.done():
            self._display_ids.append(handle.display_id)

    def _update_displays(self) -> None:
        if not self._display_ids:
            return
        from IPython.display import update_display

        for display_id in self._display_ids:
            update_display({"text/plain": repr(self)}, raw=True, display_id=display_id)

    def __repr__(self) -> str:
        took = f" in {self.finished - self.started:.1f}s" if self.finished else ""
        return (
            f"<RemoteJob cell {self.cell} on {self.procs.name} ranks "
            f"{self.ranks}: {self.state}{took}>"
        )
