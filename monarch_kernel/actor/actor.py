"""``Actor`` and ``@endpoint``."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.rank.context import (
    EXPLICIT_PORT_ATTR,
    end_serve_tasks,
    serve_tasks,
    services,
)

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
    ``propagate=`` (Monarch's): what the endpoint's ``rref`` adverb returns as mesh
    tensors, a function of the endpoint's arguments (without ``self``) run on fake
    tensors, or ``"inspect"`` (no tensors). Other options (``instrument``) are accepted
    for Monarch compatibility and ignored.
    """
    explicit = bool(options.get("explicit_response_port", False))
    propagate = options.get("propagate")

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint decorates methods, not {type(f).__name__}")
        setattr(f, _ENDPOINT_ATTR, True)
        f._propagator = propagate  # type: ignore[attr-defined]  # (Monarch's name)
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
    tasks of its actor's own event loop (the loop its other ``async def`` endpoints,
    ``__supervise__`` and ``__cleanup__`` run on), so the actor takes its next message
    while earlier calls still await, and the calls share the actor's loop-bound state
    (an ``asyncio.Event`` or ``Queue`` made in ``__init__`` or another endpoint). Calls
    start in the order they arrive. The loop goes on while the rank's main thread runs
    another actor's sync endpoint (a worker thread runs it meanwhile); a ``%%remote``
    cell runs alone.

    It takes ``@endpoint``'s options itself: with ``explicit_response_port=True`` the
    method gets the :class:`Port` after ``self`` and answers through it (what it returns
    is ignored; an exception it raises instead of sending it with ``port.exception``
    fails the actor, as in Monarch: the caller gets a ``SupervisionError`` and
    supervision hears of it). Without it, an exception goes to the caller as an
    ordinary endpoint's does. When the actor stops, its running calls are cancelled
    and awaited before its ``__cleanup__`` (Monarch). As in Monarch, a sync method is a
    ``ValueError``, and so is stacking it over ``@endpoint`` (pass the options to
    ``@concurrent_endpoint`` instead)."""
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
            # made here, so that wrong arguments fail the call as an ordinary endpoint's
            if explicit_response_port:
                coro = f(self, port, *args, **kwargs)
            else:
                coro = f(self, *args, **kwargs)
            call = _ConcurrentCall(f.__name__, port, coro, explicit_response_port)
            call.track(self)
            # its task serves this message: its actor (``context()``), its request (output)
            token = serve_tasks()
            try:
                _on_actor_loop(call.start)
            finally:
                end_serve_tasks(token)

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
    """One call of a ``@concurrent_endpoint``: a task of its actor's event loop, answered
    through its port when it ends; cancelled, and awaited, when its actor stops, before
    its ``__cleanup__`` (Monarch; ``rank.actors.ActorHost.retire`` does it)."""

    def __init__(self, name: str, port: Any, coro: Any, explicit: bool) -> None:
        self.name = name
        self.port = port
        self.coro = coro
        self.explicit = explicit
        #: its task, once started on the actor's loop
        self.task: asyncio.Task[Any] | None = None
        #: its actor stopped (the call is cancelled, or never starts)
        self.stopped = False
        self._running: set[_ConcurrentCall] | None = None

    def track(self, actor: Any) -> None:
        """Count the call among ``actor``'s running ones until it ends."""
        running = getattr(actor, _RUNNING_ATTR, None)
        if running is None:
            running = set()
            try:
                object.__setattr__(actor, _RUNNING_ATTR, running)
            except AttributeError:  # an actor with __slots__: its calls are not tracked
                return
        running.add(self)
        self._running = running

    def start(self) -> None:
        """(On the actor's event loop.) The call's task starts, unless its actor stopped
        first (then it is answered as cancelled)."""
        if self.stopped:
            self.coro.close()
            self._end(None)
            return
        self.task = asyncio.get_running_loop().create_task(self.coro)
        self.task.add_done_callback(self._end)

    def cancel(self) -> None:
        """(On the actor's event loop.) Its actor stops: the call is cancelled."""
        self.stopped = True
        if self.task is not None:
            self.task.cancel()

    def _end(self, task: asyncio.Task[Any] | None) -> None:
        if self._running is not None:
            self._running.discard(self)
        port = self.port
        if task is None or task.cancelled():
            why = "its actor stopped" if self.stopped else "its task was cancelled"
            port.exception(asyncio.CancelledError(f"{self.name} was cancelled: {why}"))
            return
        exc = task.exception()
        if exc is not None and self.explicit:
            # Not sent through the port: as in Monarch, the actor fails.
            escaped = getattr(port, "escaped", None)
            (escaped or port.exception)(exc)
        elif exc is not None:  # to the caller, as an ordinary endpoint's exception
            port.exception(exc)
        elif not self.explicit:
            port.send(task.result())


def _on_actor_loop(start: Callable[[], None]) -> None:
    """Run ``start`` on the event loop of the actor this thread serves: now, when this
    thread runs that loop (a rank's actors' loop, or the own loop of an actor of the
    controller's process), else at the loop's next turn (a rank's loop, which a worker
    thread runs when nobody else does). Calls keep their order either way."""
    runtime = services()
    running = asyncio._get_running_loop()
    if running is not None and (runtime is None or runtime.on_actor_loop()):
        start()
        return
    if runtime is None:
        raise RuntimeError(
            "a @concurrent_endpoint runs on its actor's event loop: call it through its "
            "actor mesh (mesh.endpoint.call()), not as a plain method outside an actor"
        )
    runtime.call_on_loop(start)


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
