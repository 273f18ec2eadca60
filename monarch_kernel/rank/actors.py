"""The actors of a rank: spawn, stop and call them (on the main thread), their owners
(supervision), and what the controller is told of actors other ranks made here.

Concurrency (Monarch's model, on one thread): each actor handles the controller's
messages one at a time, in order; actors do not wait for each other. While an endpoint
waits (``.get()`` on a call, ``await``), the inbox starts other actors' messages
(``Inbox.pump``); a message to an actor that is busy (:attr:`ActorHost.busy`: a message
of it runs, or its async endpoint's task) waits in its line (``Inbox.waiting``) and
starts when it is free (:attr:`ActorHost.on_idle`). Everything here runs on the rank's
main thread (the stop button's SIGINT, CUDA, output under the calling cell).

An actor spawned by an actor (header ``oa``/``ox``/``on``) is *owned*: its failures
nobody waits for go to the owner (:mod:`monarch_kernel.rank.supervise`). A spawn or stop
that came from another rank (no sequence number) is reported to the controller
(``peer_actor``), which re-creates such actors when the rank restarts.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from monarch_kernel.rank import context
from monarch_kernel.rank.errors import ActorAborted, ActorGoneError, exception_report
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.signals import MainThread
from monarch_kernel.wire import Message, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.reports import FailureReport

#: The mark ``@concurrent_endpoint`` puts on what it makes (``actor.actor.CONCURRENT_ATTR``;
#: the rank layer does not import the actor API).
CONCURRENT_ATTR = "__monarch_concurrent__"


class Running:
    """An async endpoint started as a task while another one awaited (see
    :meth:`monarch_kernel.rank.inbox.Inbox.run_user`)."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task


class UserCode(Protocol):
    """How user code is run (``Inbox.run_user``) and its failure kept (the debugger)."""

    def run_user(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` with interrupts enabled; await it if it is a coroutine."""
        ...

    def keep_failure(self, exc: BaseException) -> None:
        """Remember ``exc`` for a post-mortem (``%debug_remote``)."""
        ...


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
        #: actor name -> how many of its messages run now (on the stack, or a task of
        #: an async endpoint): absent when it is free. Main thread only.
        self.busy: dict[str, int] = {}
        #: Told (main thread) when an actor is free again while messages wait for one
        #: (``waiting``, the inbox's lines: its own dict): the inbox starts them.
        self.on_idle: Callable[[str], None] | None = None
        self.waiting: Mapping[str, object] = {}

    def is_busy(self, name: str) -> bool:
        """Whether a message of actor ``name`` runs now (see :attr:`busy`)."""
        return name in self.busy

    def starts_as_task(self, hdr: H.Ordered) -> bool:
        """Whether message ``hdr`` would run as a task of the rank's event loop (a call
        of an ``async def`` endpoint) or return at once (a concurrent endpoint), so
        that it may start while that loop runs: a sync endpoint started there would
        hold the loop, and with it every async endpoint it may wait for."""
        if isinstance(hdr, H.StopActor):
            return True  # no user code: it returns at once
        if not isinstance(hdr, H.Call):
            return False  # a constructor, a sync __supervise__: after the loop
        fn = getattr(type(self.actors.get(hdr.actor)), hdr.method, None)
        return inspect.iscoroutinefunction(fn) or bool(getattr(fn, CONCURRENT_ATTR, False))

    def _enter(self, name: str) -> None:
        busy = self.busy
        busy[name] = busy.get(name, 0) + 1

    def _leave(self, name: str) -> None:
        busy = self.busy
        left = busy.get(name, 1) - 1
        if left > 0:
            busy[name] = left
            return
        busy.pop(name, None)
        on_idle = self.on_idle
        if on_idle is not None and self.waiting:
            on_idle(name)

    def spawn(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """SPAWN_ACTOR: construct actor ``a`` from the pickled ``(cls, args, kwargs)``."""
        assert isinstance(hdr, H.SpawnActor)
        name = hdr.actor
        self._enter(name)  # its calls wait for its constructor
        try:
            self._spawn(msg, hdr, request, name)
        finally:
            self._leave(name)

    def _spawn(self, msg: Message, hdr: H.SpawnActor, request: str | None, name: str) -> None:
        cls = None
        if hdr.owner is not None:  # spawned by an actor of some rank: its failures go there
            self.owners[name] = hdr.owner
        else:
            self.owners.pop(name, None)
        try:
            cls, args, kwargs = loads(msg.payload, msg.buffers, f"constructor of actor {name!r}")
            context.current_actor = name
            self.actors[name] = self.user.run_user(cls, *args, **kwargs)
            self.gone.pop(name, None)
        except (Exception, KeyboardInterrupt) as exc:  # to the caller
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
            self.stopped(request, exc, name, cls, "constructor", "__init__")
            return
        finally:
            context.current_actor = None
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

    def stop(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """STOP_ACTOR: forget actor ``a`` (no error if it is not there)."""
        assert isinstance(hdr, H.StopActor)
        name = str(hdr.actor)
        if self.actors.pop(name, None) is not None:
            self.gone[name] = ActorGoneError(
                f"actor {name!r} was stopped (its actor mesh's stop())", stopped=True
            )
        self.owners.pop(name, None)
        if hdr.seq is None:  # from a rank: not to be re-created any more
            self.tell_peer_actor(name, None)
        if request:
            self.outbox.reply(request, None, "stop")

    def call(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """CALL: run endpoint ``m`` of actor ``a`` with the pickled ``(args, kwargs)``.

        Kept in one piece (the hot path of every actor call): the endpoint's result is
        answered here, or by its response port, or when its task ends."""
        assert isinstance(hdr, H.Call)
        name = hdr.actor
        busy = self.busy
        busy[name] = busy.get(name, 0) + 1  # _enter, inline: the hot path
        running = False
        try:
            running = self._call(msg, hdr, request, name)
        finally:
            if not running:  # _leave, inline; after the reply (what waits starts now)
                left = busy[name] - 1
                if left:
                    busy[name] = left
                else:
                    del busy[name]
                    if self.waiting and self.on_idle is not None:
                        self.on_idle(name)

    def _call(self, msg: Message, hdr: H.Call, request: str | None, name: str) -> bool:
        """:meth:`call`'s work; True when the call goes on as a task (busy until then)."""
        method = hdr.method
        actor = self.actors.get(name)

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
            context.current_actor = name
            context.current_slice = hdr.slice
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
            context.current_actor = None
            context.current_slice = None
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
        if self.actors.get(name) is actor:
            self.actors.pop(name, None)
            self.gone[name] = ActorGoneError(why)
        if request is not None:
            self.outbox.fail(request, FailureReport(**{**report, "gone": "failed"}))
        self.outbox.fault(report, name)

    def finish(
        self,
        request: str | None,
        task: asyncio.Task[Any],
        name: str,
        where: Callable[[], str],
        actor: Any,
    ) -> None:
        """Answer a call that ran as a task (see :class:`Running`)."""
        saved = context.current_actor
        context.current_actor = name
        try:
            self._answer(request, task, name, where, actor)
        finally:
            context.current_actor = saved
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
        keep running."""
        self.actors.pop(name, None)
        cls_name = getattr(cls, "__name__", "?")
        report = exception_report(exc, f"{cls_name}.{method}")
        if isinstance(exc, ActorAborted):
            report["message"] = (
                f"actor {name!r} ({cls_name}) aborted: {exc.reason}; other actors on this "
                "rank keep running"
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
        if owner is not None and self.actors.get(owner_name) is owner:
            self.actors.pop(owner_name, None)
            self.gone[owner_name] = ActorGoneError(
                f"actor {owner_name!r} ({type(owner).__name__}) failed: it did not handle "
                f"a failure of a mesh it owns ({failure.actor_id}: "
                f"{body['report'].get('type')}: {body['report'].get('message')})"
            )
        self.outbox.fault(FailureReport(**report), owner_name, (*failure.path, me))


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
