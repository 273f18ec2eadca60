"""``Actor`` and ``@endpoint``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.rank.context import EXPLICIT_PORT_ATTR, end_serve_tasks, serve_tasks

F = TypeVar("F", bound=Callable[..., Any])

_ENDPOINT_ATTR = "__monarch_endpoint__"
#: Set on the functions ``@concurrent_endpoint`` makes.
CONCURRENT_ATTR = "__monarch_concurrent__"


class Actor:
    """Base class of actors. Subclasses define ``@endpoint`` methods.

    An actor instance lives in one rank and handles one message at a time, in the order
    each sender sent them. Endpoints may be plain or ``async def`` methods.
    """


def endpoint(fn: F | None = None, **options: Any) -> F:
    """Mark a method of an :class:`Actor` as callable from the controller.

    Inside the actor, the method stays an ordinary method (``self.incr(1)`` works).
    ``explicit_response_port=True`` (Monarch's): the method takes a :class:`Port` as its
    first argument after ``self`` and answers by ``port.send(value)`` (or
    ``port.exception(exc)``), now or later from any thread; what it returns is ignored,
    and an exception it raises (not sent with ``port.exception``) fails the actor, as in
    Monarch: the caller gets a ``SupervisionError``, supervision hears of it.
    Other options are accepted for Monarch compatibility (e.g. ``propagate=``) and ignored.
    """
    explicit = bool(options.get("explicit_response_port", False))

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint decorates methods, not {type(f).__name__}")
        setattr(f, _ENDPOINT_ATTR, True)
        if explicit:
            setattr(f, EXPLICIT_PORT_ATTR, True)
        return f

    return mark(fn) if fn is not None else mark  # type: ignore[return-value]


def concurrent_endpoint(
    method: F | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> F:
    """Monarch's ``@concurrent_endpoint``: an ``async def`` endpoint whose calls run as
    tasks on the rank's concurrent event loop (a thread of its own, shared by the
    concurrent endpoints of every actor of the rank), so the actor takes its next
    message while earlier calls still await. Calls start in the order they arrive;
    ordinary endpoints keep running on the rank's main thread meanwhile (guard shared
    state accordingly).

    It takes ``@endpoint``'s options itself: with ``explicit_response_port=True`` the
    method gets the :class:`Port` after ``self`` and answers through it (what it returns
    is ignored; an exception it raises instead of sending it with ``port.exception``
    fails the actor, as in Monarch: the caller gets a ``SupervisionError`` and
    supervision hears of it). Without it, an exception goes to the caller. As in
    Monarch, a sync method is a ``ValueError``, and so is stacking it over ``@endpoint``
    (pass the options to ``@concurrent_endpoint`` instead)."""
    del instrument  # accepted as Monarch's

    def mark(f: F) -> F:
        if getattr(f, _ENDPOINT_ATTR, False):
            raise ValueError(
                "concurrent_endpoint does not wrap @endpoint; pass endpoint options to "
                "@concurrent_endpoint"
            )
        if not inspect.iscoroutinefunction(f):
            raise ValueError("concurrent_endpoint can only wrap async endpoints")

        @functools.wraps(f)
        def start(self: Any, port: Any, *args: Any, **kwargs: Any) -> None:
            if explicit_response_port:
                coro = f(self, port, *args, **kwargs)
            else:
                coro = f(self, *args, **kwargs)
            call = _ConcurrentCall()
            running = _running_calls(self)
            running.add(call)
            # its task serves this message: its actor (``context()``), its request (output)
            token = serve_tasks()
            try:
                fut = call.future = asyncio.run_coroutine_threadsafe(
                    call.run(coro), _concurrent_loop()
                )
            finally:
                end_serve_tasks(token)

            def done(task: Any) -> None:
                running.discard(call)
                if task.cancelled():  # its actor stopped (``ActorHost.retire``)
                    port.exception(
                        asyncio.CancelledError(f"{f.__name__} was cancelled: its actor stopped")
                    )
                    return
                exc = task.exception()
                if exc is not None and explicit_response_port:
                    # Not sent through the port: as in Monarch, the actor fails.
                    escaped = getattr(port, "escaped", None)
                    (escaped or port.exception)(exc)
                elif exc is not None:
                    port.exception(exc)
                elif not explicit_response_port:
                    port.send(task.result())

            fut.add_done_callback(done)

        setattr(start, _ENDPOINT_ATTR, True)
        setattr(start, EXPLICIT_PORT_ATTR, True)
        setattr(start, CONCURRENT_ATTR, True)  # an async endpoint (the kinds check)
        # Monarch's endpoint attributes (its ``EndpointProperty``'s, and the wrapper's)
        start._method = f  # type: ignore[attr-defined]
        start._propagator = propagate  # type: ignore[attr-defined]
        start._explicit_response_port = True  # type: ignore[attr-defined]
        start._instrument = False  # type: ignore[attr-defined]
        start._monarch_concurrent_endpoint_wrapper = True  # type: ignore[attr-defined]
        start.__signature__ = _port_signature(  # type: ignore[attr-defined]
            f, explicit_response_port
        )
        return start  # type: ignore[return-value]

    return mark(method) if method is not None else mark  # type: ignore[return-value]


def _port_signature(method: Callable[..., Any], explicit: bool) -> inspect.Signature:
    """Monarch's signature of a concurrent endpoint's wrapper: the method's own, with the
    response port after ``self`` when the method did not take one itself."""
    signature = inspect.signature(method)
    params = list(signature.parameters.values())
    if explicit or not params:
        return signature
    name = "_monarch_response_port"
    while name in signature.parameters:
        name += "_"
    only = inspect.Parameter.POSITIONAL_ONLY
    positional = any(p.kind is only for p in params[1:])
    port = inspect.Parameter(name, only if positional else inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[params[0], port, *params[1:]], return_annotation=None)


#: The attribute of an actor instance that holds its running concurrent calls (the rank
#: cancels them when the actor stops: ``rank.actors.CONCURRENT_RUNNING_ATTR``).
_RUNNING_ATTR = "__monarch_concurrent_running__"


class _ConcurrentCall:
    """One running call of a ``@concurrent_endpoint``: cancelled, and waited for, when
    its actor stops (before ``__cleanup__``, as in Monarch)."""

    def __init__(self) -> None:
        self.future: Any = None
        self.started = False
        self.ended = threading.Event()

    async def run(self, coro: Any) -> Any:
        self.started = True
        try:
            return await coro
        finally:
            self.ended.set()

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()

    def result(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) until the call's coroutine has ended."""
        if self.started:
            self.ended.wait(timeout)


def _running_calls(actor: Any) -> set[_ConcurrentCall]:
    running = getattr(actor, _RUNNING_ATTR, None)
    if running is None:
        running = set()
        try:
            object.__setattr__(actor, _RUNNING_ATTR, running)
        except AttributeError:  # an actor with __slots__: its calls are not tracked
            pass
    return running


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _concurrent_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for concurrent endpoints, on a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="mk-concurrent", daemon=True).start()
        return _loop


def check_endpoint_kinds(cls: type) -> None:
    """Monarch's rule, checked at spawn: an actor's endpoints are all plain ``def`` or
    all ``async def`` (a ``@concurrent_endpoint`` counts as async), and a sync actor's
    ``__supervise__`` is sync too; a ValueError (Monarch's text) otherwise."""
    sync, asynchronous = [], []
    for name, fn in endpoints_of(cls).items():
        if inspect.iscoroutinefunction(fn) or getattr(fn, CONCURRENT_ATTR, False):
            asynchronous.append(name)
        else:
            sync.append(name)
    why = (
        "Synchronous endpoints cannot be mixed with async endpoints because they can cause "
        "the asyncio loop to deadlock if they wait."
    )
    if sync and asynchronous:
        raise ValueError(
            f"{cls} mixes both async and sync endpoints. {why} "
            f"sync: {sorted(sync)} async: {sorted(asynchronous)}"
        )
    supervise = getattr(cls, "__supervise__", None)
    if sync and supervise is not None and inspect.iscoroutinefunction(supervise):
        raise ValueError(
            f"{cls} has sync endpoints, but an async __supervise__. Make sure __supervise__ "
            f"is also synchronous. {why} sync: {sorted(sync)}"
        )


def endpoints_of(cls: type) -> dict[str, Callable[..., Any]]:
    """Endpoint name -> function for an actor class (including inherited ones)."""
    out = {}
    for name, member in inspect.getmembers(cls):
        if getattr(member, _ENDPOINT_ATTR, False):
            out[name] = member
    return out
