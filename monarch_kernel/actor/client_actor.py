"""One actor of the controller's own process (``this_proc()`` there; see
:mod:`monarch_kernel.actor.client_proc`).

Each actor has a thread of its own running an event loop, as Monarch runs the actors
of its client process: different actors run at the same time, and one actor takes its
messages in the order they were posted. A plain endpoint runs to its end before the next
message; the calls of an ``async`` endpoint run as tasks of the actor's loop, so they
interleave at ``await`` (Monarch's semantics). Arguments and results are pickled, as for
an actor in a rank: a caller never shares objects with the actor by accident.

Each message runs in a :mod:`contextvars` context of its own, a copy of its caller's:
in the notebook, what an endpoint prints goes under the cell that called it. A failure
nobody waits for (under ``broadcast``) goes to supervision (:class:`FaultSink`).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from monarch_kernel.actor import local_context
from monarch_kernel.rank.context import EXPLICIT_PORT_ATTR
from monarch_kernel.rank.errors import ActorAborted, ActorGoneError, exception_report
from monarch_kernel.rank.supervise import MeshFailure
from monarch_kernel.wire import SerializationError, dumps, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.reports import FailureReport


class Answer(Protocol):
    """Where the answer of one message goes: ``ok`` and the pickled value, or not ``ok``
    and a pickled :class:`FailureReport`. Called once, from any thread."""

    def __call__(self, ok: bool, payload: bytes, buffers: Sequence[Buffer]) -> None: ...


class FaultSink(Protocol):
    """Who hears of an actor's failure that nobody waited for (its process: it knows
    the owners)."""

    @property
    def hostname(self) -> str: ...

    def fault(self, actor: LocalActor, report: FailureReport, path: tuple[str, ...] = ()) -> None:
        """``actor`` failed with ``report``; ``path``: owners that did not handle it."""
        ...


@dataclass(frozen=True)
class Work:
    """One message for an actor: its constructor (``method`` empty) or an endpoint call.
    ``answer`` None: fire and forget. ``context``: what it runs in (see module doc);
    ``slice``: the slice the call was sent to (header ``sl``)."""

    method: str
    payload: bytes | memoryview
    buffers: Sequence[Buffer]
    answer: Answer | None
    context: contextvars.Context
    slice: Any = None


class LocalActor:
    """An actor of the controller's process: its thread, its instance and its owner
    (the actor that spawned it, which supervises it; None: the fault hook does)."""

    def __init__(
        self,
        proc: str,
        name: str,
        owner: H.Owner | None,
        sink: FaultSink,
        owner_of: Callable[[str], H.Owner],
    ):
        self.proc = proc
        self.name = name
        self.owner = owner
        self.actor_id = f"{proc}/{name}[0]"
        self.class_name = name
        self.instance: Any = None
        #: why calls to it fail now (it aborted, its constructor failed, it was stopped)
        self.gone: ActorGoneError | None = None
        self._sink = sink
        self._owner_of = owner_of
        self._loop = asyncio.new_event_loop()
        #: set (under the lock) when the stop runs: nothing more is posted to the loop
        self._closing = False
        self._closing_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"mk-actor-{name}", daemon=True)
        self._thread.start()

    # -- the thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            # what was posted while the stop ran: its calls are answered (the actor is gone)
            self._loop.run_until_complete(asyncio.sleep(0))
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:  # stopped: calls still awaiting are cancelled (and answered)
                task.cancel()
            if tasks:
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            self._loop.close()

    def post(self, work: Work) -> None:
        """Run ``work`` on this actor's thread, after what was posted before. A plain
        endpoint called from this actor's own thread runs at once (it would otherwise
        wait for itself)."""
        if threading.current_thread() is self._thread and not self._is_async(work.method):
            work.context.run(self._handle, work)
            return
        if not self._post(work.context, self._handle, work):
            work.context.run(self._handle, work)  # stopped: answered at once, that it is gone

    def _post(self, context: contextvars.Context, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` on this actor's thread, in ``context``; False once it is
        stopping (the thread takes nothing more)."""
        with self._closing_lock:
            if self._closing:
                return False
            self._loop.call_soon_threadsafe(context.run, fn, *args)
            return True

    def stop(self, answer: Answer | None, context: contextvars.Context) -> None:
        """Forget the instance (its ``__del__`` runs once nothing else holds it), answer,
        and end the thread; the messages posted before run first."""

        def stop_here() -> None:
            self.instance = None
            self.gone = ActorGoneError(f"actor {self.name!r} was stopped", stopped=True)
            with self._closing_lock:
                self._closing = True
            if answer is not None:
                _answer_value(answer, None, "stop")
            self._loop.stop()

        if not self._post(context, stop_here) and answer is not None:
            _answer_value(answer, None, "stop")  # stopped already

    def join(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the thread to end after :meth:`stop`."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _owner(self) -> H.Owner:
        """This actor as the owner of the actors it spawns."""
        return self._owner_of(self.name)

    def _is_async(self, method: str) -> bool:
        fn = getattr(type(self.instance), method, None) if method else None
        return fn is not None and inspect.iscoroutinefunction(fn)

    # -- one message -----------------------------------------------------------------------
    def _handle(self, work: Work) -> None:
        local_context.enter(local_context.LocalRun(self.name, self.proc, self._owner, work.slice))
        if not work.method:
            self._construct(work)
            return
        where = f"{self.class_name}.{work.method}"
        try:
            if self.gone is not None or self.instance is None:
                raise ActorGoneError(str(self.gone or f"actor {self.name!r} is not running"),
                                     self.gone.stopped if self.gone else False)  # fmt: skip
            args, kwargs = loads(work.payload, work.buffers, f"arguments of {where}")
            fn = getattr(self.instance, work.method)
            if getattr(fn, EXPLICIT_PORT_ATTR, False):  # it answers through the port
                port = LocalPort(self, work, where)
                try:
                    fn(port, *args, **kwargs)
                except Exception as exc:  # it escaped the endpoint: the actor fails
                    port.escaped(exc)
                return
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                task = self._loop.create_task(_awaited(result))  # in this message's context
                task.add_done_callback(lambda t: self._finished(work, where, t))
                return
        except (Exception, KeyboardInterrupt) as exc:
            self.fail(work, exc, where)
            return
        except BaseException as exc:  # SystemExit, abort(): this actor stops, not the process
            self._stopped(work, exc, where)
            return
        _answer_value(work.answer, result, where)

    def _construct(self, work: Work) -> None:
        where = f"{self.name}.__init__"
        try:
            cls, args, kwargs = loads(work.payload, work.buffers, f"constructor of {self.name!r}")
            self.class_name = cls.__name__
            where = f"{cls.__name__}.__init__"
            self.instance = cls(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:
            self.gone = ActorGoneError(
                f"actor {self.name!r} failed in its constructor ({where} raised "
                f"{type(exc).__name__}: {exc}); spawn it again"
            )
            self.fail(work, exc, where)
            if work.answer is not None and self.owner is not None:  # and to its owner
                self._sink.fault(self, self._report(exc, where))
            return
        except BaseException as exc:
            self._stopped(work, exc, where)
            return
        _answer_value(work.answer, None, f"spawn of {self.name}")

    def _finished(self, work: Work, where: str, task: asyncio.Task[Any]) -> None:
        """Answer a call that ran as a task."""
        if task.cancelled():
            self.fail(work, KeyboardInterrupt("cancelled: the actor was stopped"), where)
            return
        exc = task.exception()
        if isinstance(exc, (Exception, KeyboardInterrupt)):
            self.fail(work, exc, where)
        elif exc is not None:
            self._stopped(work, exc, where)
        else:
            _answer_value(work.answer, task.result(), where)

    def fail(self, work: Work, exc: BaseException, where: str) -> None:
        """Answer ``work`` with the failure ``exc``; nobody waits: to supervision."""
        report = self._report(exc, where)
        if work.answer is None:
            self._sink.fault(self, report)
        else:
            work.answer(False, pickle.dumps(report), ())

    def failed_by(self, work: Work, exc: BaseException, where: str, answered: bool) -> None:
        """``exc`` escaped an endpoint that answers through a response port and did not
        answer (``answered``: it had): as in Monarch, the actor fails. The caller gets a
        ``SupervisionError`` with it, supervision hears of it, later calls say why."""
        self.instance = None
        report = self._report(exc, where)
        self.gone = ActorGoneError(
            f"actor {self.name!r} ({self.class_name}) failed: {where} raised "
            f"{type(exc).__name__}: {exc} without answering through its response port"
        )
        if work.answer is not None and not answered:
            work.answer(False, pickle.dumps(FailureReport(**report, gone="failed")), ())
        self._sink.fault(self, report)

    def _stopped(self, work: Work, exc: BaseException, where: str) -> None:
        """User code raised a BaseException that is no Exception (SystemExit, abort()):
        as in Monarch, this actor stops; the process and its other actors run on."""
        self.instance = None
        report = self._report(exc, where)
        if isinstance(exc, ActorAborted):
            report["message"] = f"actor {self.name!r} ({self.class_name}) aborted: {exc.reason}"
        else:
            report["message"] = (
                f"actor {self.name!r} ({self.class_name}) was stopped: {where} raised {exc!r}"
            )
        self.gone = ActorGoneError(report["message"])
        if work.answer is not None:
            work.answer(False, pickle.dumps(report), ())
        if work.answer is None or isinstance(exc, ActorAborted):  # Monarch: its creator too
            self._sink.fault(self, report)

    def _report(self, exc: BaseException, where: str) -> FailureReport:
        report = exception_report(exc, where)
        report["host"] = self._sink.hostname
        return report

    # -- supervision -----------------------------------------------------------------------
    def supervise(self, failure: MeshFailure, context: contextvars.Context) -> None:
        """An actor this one owns failed: its ``__supervise__(failure)`` decides (True:
        handled); otherwise, or if it has none, the failure goes on up, through this
        actor's own owner."""
        if not self._post(context, self._supervise, failure):
            self._unhandled(failure)  # it is stopping: it goes on up

    def _supervise(self, failure: MeshFailure) -> None:
        local_context.enter(local_context.LocalRun(self.name, self.proc, self._owner))
        fn = getattr(self.instance, "__supervise__", None)
        if fn is None:
            self._unhandled(failure)
            return
        try:
            handled = fn(failure)
        except Exception as exc:  # __supervise__ itself failed: its owner is told
            self._sink.fault(self, self._report(exc, f"{self.class_name}.__supervise__"))
            return
        if inspect.isawaitable(handled):
            task = self._loop.create_task(_awaited(handled))
            task.add_done_callback(lambda t: self._supervised(failure, t))
        elif not handled:
            self._unhandled(failure)

    def _supervised(self, failure: MeshFailure, task: asyncio.Task[Any]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._sink.fault(self, self._report(exc, f"{self.class_name}.__supervise__"))
        elif task.cancelled() or not task.result():
            self._unhandled(failure)

    def _unhandled(self, failure: MeshFailure) -> None:
        report = FailureReport(**failure.failure)
        report.setdefault("origin", failure.actor_id)  # who failed first, on the way up
        self._sink.fault(self, report, (*failure.path, self.actor_id))


class LocalPort:
    """The port an ``@endpoint(explicit_response_port=True)`` of a controller-process
    actor answers through (Monarch's ``Port``): ``send(value)`` or ``exception(exc)``,
    once, from any thread. Under ``broadcast`` a value goes nowhere and an exception to
    supervision."""

    def __init__(self, actor: LocalActor, work: Work, where: str):
        self._actor = actor
        self._work = work
        self._where = where
        self._sent = False
        self._lock = threading.Lock()

    def send(self, value: Any) -> None:
        """Answer the call with ``value``."""
        if self._claim():
            _answer_value(self._work.answer, value, self._where)

    def exception(self, exc: BaseException) -> None:
        """Answer the call with the failure ``exc``."""
        if self._claim():
            self._actor.fail(self._work, exc, self._where)

    def escaped(self, exc: BaseException) -> None:
        """``exc`` escaped the endpoint (it was not sent with :meth:`exception`): as in
        Monarch, the actor fails."""
        answered = not self._claim()
        self._actor.failed_by(self._work, exc, self._where, answered)

    def _claim(self) -> bool:
        with self._lock:  # the first answer wins (a call gets one); later ones are dropped
            first, self._sent = not self._sent, True
        return first


def _answer_value(answer: Answer | None, value: Any, where: str) -> None:
    """Answer with ``value`` pickled; a value that does not pickle is the call's failure."""
    if answer is None:
        return
    try:
        payload, buffers = dumps(value, f"result of {where}")
    except SerializationError as exc:
        answer(False, pickle.dumps(exception_report(exc, where)), ())
        return
    answer(True, payload, buffers)


async def _awaited(aw: Any) -> Any:
    return await aw


__all__ = ["Answer", "FaultSink", "LocalActor", "LocalPort", "Work"]
