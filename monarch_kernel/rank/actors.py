"""The actors of a rank: spawn, stop and call them, their owners (supervision), and what
the controller is told of actors other ranks made here.

Concurrency (Monarch's model): each actor handles its messages one at a time, in order;
actors do not wait for each other. Which thread runs a message is the inbox's choice
(:mod:`monarch_kernel.rank.lines`): the main thread when it is free, a worker of the
rank when it is held (:mod:`monarch_kernel.rank.runners`), the rank's event loop for
``async def`` endpoints. A message to an actor that is busy (:attr:`ActorHost.busy`: a
message of it runs, or its async endpoint's task) waits in its line
(:attr:`ActorHost.waiting`); the handlers here count each message in and out
(:attr:`ActorHost.enter`, :attr:`ActorHost.leave`), and may run on any of those threads.
An actor endpoint's ``rref`` (a tensor-engine op) that finds its actor busy puts a
:class:`Turn` in the actor's line and waits for it (``rank.tensors.actor_calls``).

An actor spawned by an actor (header ``oa``/``ox``/``on``) is *owned*: its failures
nobody waits for go to the owner (:mod:`monarch_kernel.rank.supervise`). A spawn or stop
that came from another rank (no sequence number) is reported to the controller
(``peer_actor``), which re-creates such actors when the rank restarts.

Lifecycle (Monarch's): a constructor that runs past its limit fails its actor
(``ActorHost._timed_out``); an actor that stops or fails ends the same way
(:meth:`ActorHost.retire`): the meshes it owns stop first, its concurrent calls are
cancelled, then its ``__cleanup__`` runs.

Size: over the ~450-line habit: spawning, calling, supervising and ending an actor share
the actor table, its owners and the gone actors' reasons; the threads and lines are in
``lines``/``runners``, the supervision events in ``supervise``.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from monarch_kernel.rank import actor_logs, context
from monarch_kernel.rank.errors import ActorAborted, ActorGoneError, exception_report
from monarch_kernel.rank.lines import ASYNC, QUICK, SYNC
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.signals import MainThread
from monarch_kernel.wire import Message, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.reports import FailureReport

#: The mark ``@concurrent_endpoint`` puts on what it makes (``actor.actor.CONCURRENT_ATTR``;
#: the rank layer does not import the actor API).
CONCURRENT_ATTR = "__monarch_concurrent__"
#: The mark ``@endpoint`` puts on endpoints (``actor.actor._ENDPOINT_ATTR``).
ENDPOINT_ATTR = "__monarch_endpoint__"


class Running:
    """An async endpoint started as a task while another one awaited (see
    :meth:`monarch_kernel.rank.inbox.Inbox.run_user`)."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task


class Turn:
    """An ``rref``'s place in a busy actor's line (Monarch queues the rref's call in the
    actor's mailbox): the tensor-engine op that runs the rref puts it in the line
    (:class:`TurnCall`) and waits; when the line reaches it, the actor is counted in
    for that op (:meth:`grant`), which runs the endpoint and counts it out. An op that
    gave up meanwhile (the stop button: :meth:`abandon`) is skipped. Any thread."""

    __slots__ = ("actor", "_lock", "_state", "_wake")

    WAITING, GRANTED, ABANDONED = 0, 1, 2

    def __init__(self, actor: str):
        self.actor = actor
        self._lock = threading.Lock()
        self._state = Turn.WAITING
        self._wake: Callable[[], None] | None = None

    @property
    def granted(self) -> bool:
        """Whether the line reached this turn (the actor is counted in for it)."""
        return self._state == Turn.GRANTED

    def grant(self, enter: Callable[[str], None]) -> None:
        """(The thread that drains the actor's line.) Its turn came: count the actor in
        for the waiting op (``enter``), unless that op gave up; wake it."""
        with self._lock:
            if self._state != Turn.WAITING:
                return
            enter(self.actor)
            self._state = Turn.GRANTED
            wake = self._wake
        if wake is not None:
            wake()

    def on_grant(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (any thread) once the turn is granted (now if it is)."""
        with self._lock:
            self._wake = wake
            now = self._state == Turn.GRANTED
        if now:
            wake()

    def abandon(self) -> bool:
        """The waiting op gives up: its turn is skipped when the line reaches it. True
        when it was granted already (the caller then counts the actor out)."""
        with self._lock:
            if self._state == Turn.GRANTED:
                return True
            self._state = Turn.ABANDONED
            return False


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnCall(H.Call):
    """The line entry of a :class:`Turn` (a ``call`` header that no socket carries: the
    line keeps it in order with the actor's calls; :meth:`ActorHost.call` grants it)."""

    turn: Turn


class UserCode(Protocol):
    """How user code is run (``Inbox.run_user``) and its failure kept (the debugger)."""

    def run_user(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` with interrupts enabled; await it if it is a coroutine."""
        ...

    def keep_failure(self, exc: BaseException) -> None:
        """Remember ``exc`` for a post-mortem (``%debug_remote``)."""
        ...

    def on_actor_loop(self) -> bool:
        """Whether this thread runs the actors' event loop now."""
        ...

    def call_on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the actors' event loop."""
        ...


def _nothing(name: str) -> None:
    """Until the inbox is wired in (``Rank``): nothing to count."""


#: Set by ``@concurrent_endpoint`` on an actor: its calls that run now (tasks of the
#: actors' event loop, :class:`ConcurrentCall`), cancelled when the actor stops
#: (``ActorHost.retire``).
CONCURRENT_RUNNING_ATTR = "__monarch_concurrent_running__"
#: How long a stopping actor waits for its cancelled concurrent calls to end.
CONCURRENT_CANCEL_WAIT = 5.0
#: Seconds a rank that stops (its process mesh's ``stop()``) gives its actors' ends
#: (``__cleanup__``) in all: under the stop's grace (``ProcMesh.stop(grace=3.0)``), so
#: that ``__del__``, ``atexit`` handlers and the process group's teardown still run.
EXIT_CLEANUP_WAIT = 2.0


class ConcurrentCall(Protocol):
    """A running call of a ``@concurrent_endpoint`` (``actor.actor._ConcurrentCall``)."""

    task: asyncio.Task[Any] | None

    def cancel(self) -> None:
        """(On the actors' event loop.) Cancel it: its actor stops."""
        ...


def _concurrent_calls(actor: object) -> set[ConcurrentCall]:
    """The actor's running ``@concurrent_endpoint`` calls (empty if none)."""
    running: set[ConcurrentCall] | None = getattr(actor, CONCURRENT_RUNNING_ATTR, None)
    return running if running is not None else set()


async def _cancel_concurrent(running: set[ConcurrentCall]) -> None:
    """Cancel an actor's running ``@concurrent_endpoint`` calls and await them (a
    while), before its ``__cleanup__`` (Monarch). On the actors' event loop, where the
    calls run: a call whose start is still queued there starts, and is cancelled, before
    this runs (the loop keeps the order)."""
    while running:
        calls = list(running)
        for call in calls:
            call.cancel()
        tasks = [c.task for c in calls if c.task is not None and not c.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=CONCURRENT_CANCEL_WAIT)
        for call in calls:
            running.discard(call)  # (ended, or given up on after the wait)


def _after_concurrent(
    running: set[ConcurrentCall], cleanup: Callable[..., Any] | None
) -> Callable[[Exception | None], Any]:
    """An actor's end when it has running concurrent calls: they are cancelled and
    awaited, then its ``__cleanup__`` (sync or async) runs, all on the event loop."""

    async def end(error: Exception | None) -> None:
        await _cancel_concurrent(running)
        if cleanup is not None:
            result = cleanup(error)
            if inspect.isawaitable(result):
                await result

    return end


class ActorHost:
    """The actors of one rank, by name, and their owners."""

    def __init__(
        self,
        rank: int,
        outbox: Outbox,
        main: MainThread,
        user: UserCode,
        owners: dict[str, H.Owner],
    ):
        self.rank = rank
        self.outbox = outbox
        self.main = main
        self.user = user
        self.actors: dict[str, object] = {}
        #: actors gone by their own failure (abort(), a constructor that raised) or
        #: stopped: why (calls to them raise it)
        self.gone: dict[str, ActorGoneError] = {}
        #: actor name -> its owner: an actor spawned by an actor of some rank (shared
        #: with the outbox, which sends such an actor's failures to its owner)
        self.owners = owners
        #: actor name -> how many of its messages run now (on a thread, or a task of
        #: the event loop): absent when it is free. The inbox's (``Lines.busy``).
        self.busy: Mapping[str, int] = {}
        #: The messages that wait for a busy actor (the inbox's ``Lines.waiting``).
        self.waiting: Mapping[str, object] = {}
        #: Count a message of an actor in and out (the inbox's ``Lines.enter`` and
        #: ``Lines.leave``: the end of the last one starts what waits in its line).
        self.enter: Callable[[str], None] = _nothing
        self.leave: Callable[[str], None] = _nothing
        #: (class, method) -> how a call of it runs (:meth:`kind_of`)
        self._kinds: dict[tuple[type, str], int] = {}
        self._async_classes: dict[type, bool] = {}
        #: actor name -> the token of its constructor running now, under a time limit
        self._constructing: dict[str, object] = {}
        self._spawn_lock = threading.Lock()

    def is_busy(self, name: str) -> bool:
        """Whether a message of actor ``name`` runs now (see :attr:`busy`)."""
        return name in self.busy

    def kind_of(self, hdr: H.Ordered) -> int:
        """How message ``hdr`` runs (``rank.lines``): QUICK (returns at once: a
        ``@concurrent_endpoint`` call, a stop without ``__cleanup__``, a call of an actor
        that is not there), ASYNC (a task of the event loop: an ``async def`` endpoint,
        ``__supervise__`` or ``__cleanup__``) or SYNC (user code until it returns)."""
        t = type(hdr)
        if t is H.Call:
            assert isinstance(hdr, H.Call)
            cls = type(self.actors.get(hdr.actor))
            key = (cls, hdr.method)
            kind = self._kinds.get(key)
            if kind is None:
                fn = getattr(cls, hdr.method, None)
                if fn is None or cls is type(None):
                    return QUICK
                if getattr(fn, CONCURRENT_ATTR, False):
                    kind = QUICK
                elif inspect.iscoroutinefunction(fn):
                    kind = ASYNC
                else:
                    kind = SYNC
                self._kinds[key] = kind
            return kind
        if t is TurnCall:
            return QUICK  # an rref's turn: granted at once by the thread that drains
        if t is H.Supervise:
            assert isinstance(hdr, H.Supervise)
            actor = self.actors.get(hdr.owner_name)
            hook = getattr(actor, "__supervise__", None)
        elif t is H.StopActor:
            assert isinstance(hdr, H.StopActor)
            actor = self.actors.get(str(hdr.actor))
            hook = getattr(actor, "__cleanup__", None)
        else:
            return SYNC  # a constructor
        if hook is None:
            return QUICK
        if inspect.iscoroutinefunction(hook) or self._async_actor(type(actor)):
            # Monarch: an async actor's hooks run on its event loop (a sync one there
            # too, between the steps of its endpoints' tasks)
            return ASYNC
        return SYNC

    def _async_actor(self, cls: type) -> bool:
        """Whether ``cls``'s endpoints are ``async def`` (Monarch's async actor)."""
        found = self._async_classes.get(cls)
        if found is None:
            found = False
            for attr in dir(cls):
                fn = getattr(cls, attr, None)
                if getattr(fn, ENDPOINT_ATTR, False) and (
                    inspect.iscoroutinefunction(fn) or getattr(fn, CONCURRENT_ATTR, False)
                ):
                    found = True
                    break
            self._async_classes[cls] = found
        return found

    def _enter(self, name: str) -> None:
        self.enter(name)

    def _leave(self, name: str) -> None:
        self.leave(name)

    def spawn(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """SPAWN_ACTOR: construct actor ``a`` from the pickled ``(cls, args, kwargs)``.
        With a limit (header ``t``, Monarch's ``actor_spawn_max_idle``) a constructor
        that has not returned by then fails the actor (:meth:`_timed_out`)."""
        assert isinstance(hdr, H.SpawnActor)
        name = hdr.actor
        actor_logs.install()  # Monarch's [actor=...] prefix on logging records
        self._enter(name)  # its calls wait for its constructor
        token = object()
        timer = None
        if hdr.limit is not None:
            self._constructing[name] = token
            timer = threading.Timer(
                hdr.limit, self._timed_out, (name, token, request, hdr, threading.get_ident())
            )
            timer.daemon = True
            timer.start()
        try:
            self._spawn(msg, hdr, request, name, token)
        finally:
            if timer is not None:
                timer.cancel()
            self._leave(name)

    def _constructed(self, name: str, token: object) -> bool:
        """The constructor of ``name`` (started with ``token``) ended: False if it had
        timed out meanwhile (the actor failed: what it made or raised is dropped)."""
        with self._spawn_lock:
            if name not in self._constructing:
                return True
            if self._constructing[name] is not token:
                return False
            del self._constructing[name]
            return True

    def _timed_out(
        self, name: str, token: object, request: str | None, hdr: H.SpawnActor, ident: int
    ) -> None:
        """(A timer thread.) Actor ``name``'s constructor has not returned within its
        limit: as in Monarch the actor fails (spawn's caller, its supervision and its
        later callers are told), while the constructor may go on running; what it
        makes then is dropped."""
        with self._spawn_lock:
            if self._constructing.get(name) is not token:
                return
            del self._constructing[name]
        limit = hdr.limit or 0.0
        message = (
            f"actor {name!r} failed: its constructor did not return within {limit:g}s "
            "(actor_spawn_max_idle; configure(actor_spawn_max_idle=...) for a slow one); "
            "it may still be running on this rank"
        )
        self.gone[name] = ActorGoneError(message)
        report = exception_report(TimeoutError(message), f"{name}.__init__")
        frame = sys._current_frames().get(ident)
        if frame is not None:  # where the constructor is now
            stack = "".join(traceback.format_stack(frame))
            report["traceback"] = f"the constructor is at:\n{stack}TimeoutError: {message}"
        report["host"] = self.outbox.hostname
        if request is not None:
            self.outbox.fail(request, report)
        if request is None or name in self.owners:
            self.outbox.fault(report, name)

    def _spawn(
        self, msg: Message, hdr: H.SpawnActor, request: str | None, name: str, token: object
    ) -> None:
        cls = None
        here = context.serving()
        if hdr.owner is not None:  # spawned by an actor of some rank: its failures go there
            self.owners[name] = hdr.owner
        else:
            self.owners.pop(name, None)
        try:
            cls, args, kwargs = loads(msg.payload, msg.buffers, f"constructor of actor {name!r}")
            here.actor = name
            actor = self.user.run_user(cls, *args, **kwargs)
            if not self._constructed(name, token):
                return  # it timed out: the actor failed meanwhile
            self.actors[name] = actor
            self.gone.pop(name, None)
        except (Exception, KeyboardInterrupt) as exc:  # to the caller
            if not self._constructed(name, token):
                return
            where = f"{getattr(cls, '__name__', name)}.__init__"
            self.gone[name] = ActorGoneError(
                f"actor {name!r} failed in its constructor ({where} raised "
                f"{type(exc).__name__}: {exc}); spawn it again"
            )
            self.outbox.reply_error(request, exc, where)
            if request is not None and name in self.owners:  # and to its owner
                self.outbox.fault(exception_report(exc, where), name)
            return
        except BaseException as exc:  # SystemExit ...: that actor is stopped, not the rank
            if self.main.terminating:
                raise
            if self._constructed(name, token):
                self.stopped(request, exc, name, cls, "constructor", "__init__")
            return
        finally:
            here.actor = None
        owner = self.owners.get(name)
        if owner is not None:  # the controller tells the owner if this rank dies
            owned = H.Owned(rank=self.rank, actor=name).encode()
            self.outbox.send(owned, pickle.dumps(owner.encode()))
        if hdr.seq is None:  # from a rank: the controller re-creates it too
            self.tell_peer_actor(name, hdr, msg.payload, msg.buffers)
        if request:
            self.outbox.reply(request, None, f"spawn of {name}")

    def tell_peer_actor(
        self,
        name: str,
        spawn: H.SpawnActor | None,
        payload: bytes | memoryview = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Tell the controller that a rank-to-rank message spawned actor ``name`` here
        (``spawn``: that message's header, with its payload and buffers) or stopped it
        (``spawn`` None): it re-creates on a restart what it knows of."""
        owner = spawn.owner if spawn is not None else None
        header = H.PeerActor(rank=self.rank, actor=name, spawned=spawn is not None, owner=owner)
        self.outbox.send(header.encode(), bytes(payload), buffers)

    def stop_all(self, timeout: float = EXIT_CLEANUP_WAIT) -> list[tuple[str, object]]:
        """The rank stops (its process mesh's ``stop()``): every actor ends the Monarch
        way, newest first (:meth:`retire`: the meshes it owns stop, its concurrent calls
        are cancelled, its ``__cleanup__(None)`` runs, an ``async def`` one on the
        actors' event loop), each after the message it runs now, all within
        ``timeout`` seconds (the stop's grace kills what runs longer). Returns the
        actors, newest first, for the caller to drop (their ``__del__`` runs then)."""
        from monarch_kernel.rank.supervise import stop_owned

        deadline = time.monotonic() + timeout
        ended: list[tuple[str, object]] = []
        while self.actors:
            name, actor = self.actors.popitem()
            ended.append((name, actor))
            self.gone[name] = ActorGoneError(
                f"actor {name!r} was stopped (its process mesh was stopped)", stopped=True
            )
            while name in self.busy and time.monotonic() < deadline:  # its message first
                time.sleep(0.01)
            left = max(0.0, deadline - time.monotonic())
            stop_owned(name, left)  # within the time left (retire would give it 10 s)
            done = threading.Event()
            try:
                if self.retire(name, actor, None, done.set):
                    done.wait(max(0.0, deadline - time.monotonic()))
            except BaseException:  # (SystemExit in __cleanup__): the others still end
                continue
        return ended

    def stop(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """STOP_ACTOR: stop actor ``a`` the Monarch way (:meth:`retire`: what it owns
        first, then its ``__cleanup__``); no error if it is not there."""
        assert isinstance(hdr, H.StopActor)
        name = str(hdr.actor)
        self._enter(name)
        later = False
        try:
            later = self._stop(hdr, request, name)
        finally:
            if not later:  # else when its async __cleanup__ ends
                self._leave(name)

    def _stop(self, hdr: H.StopActor, request: str | None, name: str) -> bool:
        actor = self.actors.pop(name, None)
        if actor is not None:
            self.gone[name] = ActorGoneError(
                f"actor {name!r} was stopped (its actor mesh's stop())", stopped=True
            )
        if name not in self.busy:
            self.owners.pop(name, None)
        # else a message of it runs now (a stop without __cleanup__ does not wait for an
        # async endpoint's task): if that fails, the event still goes to its owner, not
        # to the controller as nobody's (a spawn of the name sets its owner afresh)
        if hdr.seq is None:  # from a rank: not to be re-created any more
            self.tell_peer_actor(name, None)

        def answer() -> None:
            if request:
                self.outbox.reply(request, None, "stop")

        def answer_later() -> None:
            try:
                answer()
            finally:
                self._leave(name)

        if actor is None:
            answer()
            return False
        return self.retire(name, actor, None, answer, answer_later)

    def retire(
        self,
        name: str,
        actor: object,
        exc: BaseException | None,
        then: Callable[[], None] = lambda: None,
        later: Callable[[], None] | None = None,
    ) -> bool:
        """Monarch's end of an actor, stopped (``exc`` None) or failed (with ``exc``):
        the actor meshes it owns stop first (recursively; ``supervise.stop_owned``),
        its running ``@concurrent_endpoint`` calls are cancelled, then its
        ``__cleanup__(exc)`` runs (an ``async def`` one as a task of the actors' event
        loop); what that raises is a supervision event of the actor. ``then()`` comes
        after; True when it comes later, once the task ended (``later()``, default
        ``then``)."""
        from monarch_kernel.rank.supervise import stop_owned

        stop_owned(name)
        cleanup = getattr(actor, "__cleanup__", None)
        if cleanup is not None and not callable(cleanup):
            cleanup = None
        running = _concurrent_calls(actor)
        if running:  # cancelled and awaited on the event loop, then __cleanup__ there
            cleanup = _after_concurrent(running, cleanup)
        if cleanup is None:
            then()
            return False
        error: Exception | None = None
        if exc is not None:  # Monarch gives __cleanup__ an Exception
            error = exc if isinstance(exc, Exception) else Exception(f"{type(exc).__name__}: {exc}")
        if inspect.iscoroutinefunction(cleanup) and not self.user.on_actor_loop():
            # an async __cleanup__ runs on the actors' event loop, wherever that runs
            hook = cleanup

            def on_loop() -> None:
                if not self._cleanup(name, actor, hook, error, later or then):
                    (later or then)()

            self.user.call_on_loop(on_loop)
            return True
        if self._cleanup(name, actor, cleanup, error, later or then):
            return True
        then()
        return False

    def _cleanup(
        self,
        name: str,
        actor: object,
        cleanup: Callable[..., Any],
        error: Exception | None,
        after_task: Callable[[], None],
    ) -> bool:
        """Run ``cleanup(error)``; True when it goes on as a task (``after_task()`` at
        its end)."""
        where = f"{type(actor).__name__}.__cleanup__"
        here = context.serving()
        saved = here.actor
        here.actor = name
        try:
            result = self.user.run_user(cleanup, error)
        except (Exception, KeyboardInterrupt) as failure:
            self._cleanup_failed(name, failure, where)
            return False
        except BaseException as failure:
            if self.main.terminating:
                raise
            self._cleanup_failed(name, failure, where)
            return False
        finally:
            here.actor = saved
        if not isinstance(result, Running):
            return False

        def done(task: asyncio.Task[Any]) -> None:
            try:
                failure = None if task.cancelled() else task.exception()
                if failure is not None:
                    self._cleanup_failed(name, failure, where)
            finally:
                after_task()

        result.task.add_done_callback(done)
        return True

    def _cleanup_failed(self, name: str, exc: BaseException, where: str) -> None:
        """``__cleanup__`` raised: as in Monarch, a supervision event of the actor (to
        its owner's ``__supervise__``, else the controller's fault hook)."""
        report = exception_report(exc, where)
        report["host"] = self.outbox.hostname
        report["message"] = f"{where} raised {type(exc).__name__}: {exc}"
        self.outbox.fault(report, name)

    def call(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """CALL: run endpoint ``m`` of actor ``a`` with the pickled ``(args, kwargs)``.

        Kept in one piece (the hot path of every actor call): the endpoint's result is
        answered here, or by its response port, or when its task ends."""
        assert isinstance(hdr, H.Call)
        name = hdr.actor
        if type(hdr) is TurnCall:  # an rref's turn in the line: its op runs the call
            hdr.turn.grant(self.enter)
            return
        self.enter(name)
        running = False
        try:
            running = self._call(msg, hdr, request, name)
        finally:
            if not running:  # after the reply (what waits in its line starts now)
                self.leave(name)

    def _call(self, msg: Message, hdr: H.Call, request: str | None, name: str) -> bool:
        """:meth:`call`'s work; True when the call goes on as a task (busy until then)."""
        method = hdr.method
        actor = self.actors.get(name)
        here = context.serving()

        def where() -> str:  # only errors need it: not formatted on the hot path
            return f"{type(actor).__name__ if actor is not None else name}.{method}"

        try:
            if actor is None:
                gone = self.gone.get(name)
                if gone is not None:
                    raise ActorGoneError(str(gone), gone.stopped)
                raise ActorGoneError(
                    f"no actor {name!r} on rank {context.current_rank().rank} (was it stopped?)"
                )
            args, kwargs = loads(msg.payload, msg.buffers, lambda: f"arguments of {where()}")
            here.actor = name
            here.slice = hdr.slice
            fn = getattr(actor, method)
            if getattr(fn, context.EXPLICIT_PORT_ATTR, False):
                # @endpoint(explicit_response_port=True): the endpoint answers through
                # the port it is given (now or later, from any thread); no reply here.
                port = ResponsePort(self.outbox, request, where, self._escape(name, actor))
                try:
                    self.user.run_user(fn, port, *args, **kwargs)
                except Exception as exc:  # it escaped the endpoint: the actor fails
                    self.user.keep_failure(exc)
                    port.escaped(exc)
                return False
            result = self.user.run_user(fn, *args, **kwargs)
            if isinstance(result, Running):  # answered when its task ends
                result.task.add_done_callback(
                    lambda task: self.finish(request, task, name, where, actor)
                )
                return True  # busy until then
        except (Exception, KeyboardInterrupt) as exc:  # to the caller
            self.user.keep_failure(exc)  # for %debug_remote (post-mortem)
            self.outbox.reply_error(request, exc, where())
            return False
        except BaseException as exc:  # SystemExit ...: that actor is stopped, not the rank
            if self.main.terminating:
                raise
            self.stopped(request, exc, name, type(actor), "endpoint", method)
            return False
        finally:
            here.actor = None
            here.slice = None
        if request:
            if self.actors.get(name) is not actor:  # it failed meanwhile (supervision)
                self._failed_meanwhile(request, name, where())
                return False
            self.outbox.reply(request, result, lambda: f"result of {where()}", where)
        return False

    def _failed_meanwhile(self, request: str, name: str, where: str) -> None:
        """The actor failed while this call of it ran (a failure of a mesh it owns that
        its ``__supervise__`` did not handle): as in Monarch the caller gets a
        ``SupervisionError``, not the endpoint's value."""
        gone = self.gone.get(name) or ActorGoneError(f"actor {name!r} is gone")
        report = exception_report(gone, where)
        report["host"] = self.outbox.hostname
        self.outbox.fail(request, FailureReport(**{**report, "gone": "failed"}))

    def _escape(self, name: str, actor: object) -> Callable[[BaseException, str | None, str], None]:
        """What a response port of actor ``name`` does with an exception that escaped its
        endpoint (see :meth:`ResponsePort.escaped`)."""

        def escaped(exc: BaseException, request: str | None, where: str) -> None:
            self.failed_by(name, actor, exc, request, where)

        return escaped

    def failed_by(
        self, name: str, actor: object, exc: BaseException, request: str | None, where: str
    ) -> None:
        """``exc`` escaped an endpoint that answers through a response port and did not
        answer: as in Monarch, the actor fails. The caller (if it waits) gets a
        ``SupervisionError`` with it, supervision hears of it (the owner's
        ``__supervise__``, else the fault hook) and later calls say why. Any thread."""
        report = exception_report(exc, where)
        report["host"] = self.outbox.hostname
        why = (
            f"actor {name!r} ({type(actor).__name__}) failed: {where} raised "
            f"{type(exc).__name__}: {exc} without answering through its response port"
        )
        mine = self.actors.get(name) is actor
        if mine:
            self.actors.pop(name, None)
            self.gone[name] = ActorGoneError(why)
        if request is not None:
            self.outbox.fail(request, FailureReport(**{**report, "gone": "failed"}))
        self.outbox.fault(report, name)
        if mine:
            self.retire(name, actor, exc)

    def finish(
        self,
        request: str | None,
        task: asyncio.Task[Any],
        name: str,
        where: Callable[[], str],
        actor: Any,
    ) -> None:
        """Answer a call that ran as a task (see :class:`Running`)."""
        here = context.serving()
        saved = here.actor
        here.actor = name
        try:
            self._answer(request, task, name, where, actor)
        finally:
            here.actor = saved
            self._leave(name)

    def _answer(
        self,
        request: str | None,
        task: asyncio.Task[Any],
        name: str,
        where: Callable[[], str],
        actor: Any,
    ) -> None:
        if task.cancelled():
            self.outbox.reply_error(request, KeyboardInterrupt("cancelled"), where())
            return
        exc = task.exception()
        if isinstance(exc, (Exception, KeyboardInterrupt)):
            self.outbox.reply_error(request, exc, where())
        elif exc is not None:
            self.stopped(request, exc, name, type(actor), "endpoint", where())
        elif request:
            if self.actors.get(name) is not actor:  # it failed meanwhile (supervision)
                self._failed_meanwhile(request, name, where())
                return
            self.outbox.reply(request, task.result(), lambda: f"result of {where()}", where)

    def stopped(
        self, request: str | None, exc: BaseException, name: str, cls: Any, what: str, method: str
    ) -> None:
        """User code of actor ``name`` raised a BaseException that is no Exception (say
        SystemExit): like Monarch, only that actor stops; the rank and its other actors
        keep running. Monarch's end of an actor follows (:meth:`retire`)."""
        actor = self.actors.pop(name, None)
        cls_name = getattr(cls, "__name__", "?")
        report = exception_report(exc, f"{cls_name}.{method}")
        if isinstance(exc, ActorAborted):
            report["message"] = (
                f"actor {name!r} ({cls_name}) aborted: {exc.reason}; other actors on this "
                "rank keep running"
            )
        elif isinstance(exc, SystemExit):  # sys.exit(): Monarch's panic, with its code
            code = exc.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            report["message"] = (
                f"actor {name!r} ({cls_name}) was stopped: its {what} raised {exc!r} "
                f"(sys.exit: exit code {status}); other actors on this rank keep running"
            )
        else:
            report["message"] = (
                f"actor {name!r} ({cls_name}) was stopped: its {what} raised {exc!r}; "
                "other actors on this rank keep running"
            )
        report["host"] = self.outbox.hostname
        self.gone[name] = ActorGoneError(report["message"])
        constructor = what == "constructor"
        if request is not None and constructor:  # spawn() returns; the mesh is failed
            self.outbox.fail(request, report)
        elif request is not None:  # the caller: a SupervisionError (the actor is gone)
            self.outbox.fail(request, FailureReport(**{**report, "gone": "failed"}))
        # Monarch: the actor failed, an event of its own whether a caller waited or
        # not: to its owner's __supervise__, else the controller's fault hook (once; a
        # spawn the controller waits for tells its hook itself)
        if request is None or not constructor or name in self.owners:
            self.outbox.fault(report, name)
        if actor is not None:
            self.retire(name, actor, exc)

    def supervise(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """SUPERVISE: a mesh owned by actor ``on`` of this rank failed; its
        ``__supervise__(failure)`` handles it (returns True) or it goes on up."""
        assert isinstance(hdr, H.Supervise)
        self._enter(hdr.owner_name)  # one message of the owner, as in Monarch
        later = False
        try:
            later = self._supervise(msg, hdr)
        finally:
            if not later:  # else when its task ends
                self._leave(hdr.owner_name)

    def _supervise(self, msg: Message, hdr: H.Supervise) -> bool:
        """Give the failure to the owner's ``__supervise__``; True when its answer comes
        later (an async handler run as a task while another endpoint awaits)."""
        from monarch_kernel.rank.supervise import MeshFailure

        body = pickle.loads(msg.payload)
        owner_name = hdr.owner_name
        owner = self.actors.get(owner_name)
        failure = MeshFailure(
            body["mesh"], body["actor"], body["rank"], body["report"], tuple(body["path"])
        )
        supervise = getattr(owner, "__supervise__", None)
        if supervise is None:
            self._unhandled(owner_name, owner, body, failure)
            return False
        where = f"{type(owner).__name__}.__supervise__"
        context.current_actor = owner_name
        try:
            answer = self.user.run_user(supervise, failure)
        except Exception as exc:  # it raised: not handled (told once, below)
            self._unhandled(owner_name, owner, body, failure, exception_report(exc, where))
            return False
        finally:
            context.current_actor = None
        if isinstance(answer, Running):  # async, started while another endpoint awaits

            def done(task: asyncio.Task[Any]) -> None:
                try:
                    error = None if task.cancelled() else task.exception()
                    if error is not None:
                        report = exception_report(error, where)
                        self._unhandled(owner_name, owner, body, failure, report)
                    elif task.cancelled() or not task.result():
                        self._unhandled(owner_name, owner, body, failure)
                finally:
                    self._leave(owner_name)

            answer.task.add_done_callback(done)
            return True
        if not answer:
            self._unhandled(owner_name, owner, body, failure)
        return False

    def _unhandled(
        self,
        owner_name: str,
        owner: object,
        body: dict[str, Any],
        failure: Any,
        handler_error: FailureReport | None = None,
    ) -> None:
        """The owner did not handle a failure of a mesh it owns (no ``__supervise__``,
        it returned False, or it raised: ``handler_error``): as in Monarch the owner
        fails with it (its calls raise ``SupervisionError``), and the event goes on up
        once, as the owner's (its own owner, else the controller's fault hook)."""
        me = f"{self.outbox.mesh}/{owner_name}[{context.current_rank().rank}]"
        report = dict(body["report"])
        report.setdefault("origin", failure.actor_id)  # who failed first, on the way up
        if handler_error is not None:
            report["message"] = (
                f"{report.get('message', '')} (and {handler_error['where']} raised "
                f"{handler_error['type']}: {handler_error['message']})"
            )
        failed = owner is not None and self.actors.get(owner_name) is owner
        if failed:
            self.actors.pop(owner_name, None)
            self.gone[owner_name] = ActorGoneError(
                f"actor {owner_name!r} ({type(owner).__name__}) failed: it did not handle "
                f"a failure of a mesh it owns ({failure.actor_id}: "
                f"{body['report'].get('type')}: {body['report'].get('message')})"
            )
        self.outbox.fault(FailureReport(**report), owner_name, (*failure.path, me))
        if failed:  # it ends the Monarch way: what it owns stops with it, __cleanup__
            self.retire(owner_name, owner, failure)


class ResponsePort:
    """Where an endpoint declared with ``explicit_response_port=True`` sends its answer
    (Monarch's ``Port``): ``send(value)`` or ``exception(exc)``, once, from any thread.
    For a fire-and-forget call (``broadcast``) a value goes nowhere and an exception to
    supervision."""

    def __init__(
        self,
        outbox: Outbox,
        request: str | None,
        where: Callable[[], str],
        on_escape: Callable[[BaseException, str | None, str], None] | None = None,
    ):
        self._outbox = outbox
        self._request = request
        self._where = where
        self._on_escape = on_escape
        self._sent = False

    def send(self, value: Any) -> None:
        """Answer the call with ``value``."""
        if self._claim() and self._request is not None:
            self._outbox.reply(self._request, value, lambda: f"result of {self._where()}")

    def exception(self, exc: BaseException) -> None:
        """Answer the call with the failure ``exc``."""
        if self._claim():
            self._outbox.reply_error(self._request, exc, self._where())

    def escaped(self, exc: BaseException) -> None:
        """``exc`` escaped the endpoint (it was not sent with :meth:`exception`): as in
        Monarch, the actor fails (the caller, if not answered yet, gets it as a
        ``SupervisionError``)."""
        request = self._request if self._claim() else None
        if self._on_escape is None:
            self._outbox.reply_error(request, exc, self._where())
            return
        self._on_escape(exc, request, self._where())

    def _claim(self) -> bool:
        """The first answer wins (a request gets one reply); later ones are dropped."""
        if self._sent:
            return False
        self._sent = True
        return True
