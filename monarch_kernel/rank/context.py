"""What a rank knows about itself, readable from user code (``current_rank()`` ...).

Outside a rank (in the controller or a plain script) the rank is a zero-dim point of a
mesh of size 1 and :func:`report` does nothing.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from monarch_kernel.shape import Point, Shape

if TYPE_CHECKING:
    from monarch_kernel.rank.config import RankConfig
    from monarch_kernel.wire.codec import Buffer, Header
    from monarch_kernel.wire.headers import Owner, SpawnActor
    from monarch_kernel.wire.peer_address import PeerAddress

#: A namespace user code runs in: a rank's cell namespace, the notebook's ``user_ns``.
UserNamespace: TypeAlias = dict[str, Any]


class RankServices(Protocol):
    """What the layers above use of the rank they run in (the actor API: mesh handles,
    rank-to-rank calls, channels, the data plane). Implemented by
    :class:`monarch_kernel.rank.runtime.Rank`; get it with :func:`services`."""

    @property
    def rank(self) -> int:
        """This process's wire id (its slot): the ``r`` of what it sends and its
        routing ids. Equal to its flat rank until a shrink renumbers the ranks; the
        rank it is now is :func:`current_rank` ``().rank`` (``config.rank``)."""
        ...

    @property
    def config(self) -> RankConfig:
        """The rank's configuration."""
        ...

    @property
    def key(self) -> str:
        """The mesh's signing key, hex."""
        ...

    @property
    def peer(self) -> PeerAddress:
        """The address this rank's inbox listens on for calls from other ranks."""
        ...

    @property
    def actors(self) -> dict[str, object]:
        """This rank's actors by name."""
        ...

    @property
    def owners(self) -> dict[str, Owner]:
        """Actor name -> the actor that owns it (spawned it from some rank)."""
        ...

    def send(self, header: Header, payload: bytes = b"", buffers: Sequence[Buffer] = ()) -> None:
        """Send a message (a wire header: ``headers.X(...).encode()``) to the controller."""
        ...

    def report(self, metrics: Mapping[str, Any]) -> None:
        """``monarch_kernel.report(...)``: numbers for the dashboard."""
        ...

    def reply_error(self, request: str | None, exc: BaseException, where: str) -> None:
        """Answer ``request`` with the failure ``exc``, or send it to supervision."""
        ...

    def tell_peer_actor(
        self,
        name: str,
        spawn: SpawnActor | None,
        payload: bytes | memoryview = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Tell the controller a rank-to-rank message spawned (``spawn``: its header) or
        stopped (None) actor ``name`` here."""
        ...

    def serve_until(self, fut: Any, timeout: float | None) -> None:
        """Serve calls from other ranks until ``fut`` is done or ``timeout`` passed."""
        ...

    def claim(self, name: str) -> bool:
        """Count a message of actor ``name`` in if it may run on this thread now (it
        is free, or its endpoint waits on this thread); False otherwise."""
        ...

    def release(self, name: str) -> None:
        """Count a message of actor ``name`` (claimed with :meth:`claim`) out."""
        ...

    def on_actor_loop(self) -> bool:
        """Whether this thread runs the actors' event loop now."""
        ...

    def call_on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the actors' event loop, at its next turn (any thread; a worker
        runs the loop when nobody does)."""
        ...


_point: Point = Point({}, 0)
_extent: dict[str, int] = {}
#: The running rank (set in rank processes only). Read :func:`services` instead.
_runtime: Any = None
#: Set (by ``@endpoint(explicit_response_port=True)``) on endpoint functions that take a
#: response port as their first argument.
EXPLICIT_PORT_ATTR = "__monarch_explicit_port__"


class Serving:
    """What one thread is serving. A rank runs actor messages on its main thread and,
    while that one is held, on threads of its own (``rank.runners``): each has its own
    request, actor and slice. User code reads and sets them as this module's
    ``current_request``, ``current_actor`` and ``current_slice`` (for the thread that
    asks); the rank's own code holds a thread's :class:`Serving` (:func:`serving`), and
    the control thread reads the main thread's (:func:`main_serving`)."""

    __slots__ = ("request", "actor", "slice")

    def __init__(self) -> None:
        #: id of the message this thread is serving
        self.request: str | None = None
        #: name of the actor whose endpoint (or constructor) this thread runs, if any
        self.actor: str | None = None
        #: the slice the current call was sent to, when not the whole mesh (header
        #: ``sl``: labels, sizes, strides, offset); see ``message_rank``
        self.slice: Any = None


#: thread ident -> what it serves (threads that served something; see :func:`serving`)
_serving: dict[int, Serving] = {}
#: This thread's entry of ``_serving`` (the fast way to it, on the hot path).
_mine = threading.local()


def serving(ident: int | None = None) -> Serving:
    """What thread ``ident`` (default: this one) serves, made on first use."""
    if ident is None:
        try:
            return _mine.serving  # type: ignore[no-any-return]
        except AttributeError:
            ident = threading.get_ident()
            s = _serving.get(ident)
            if s is None:
                s = _serving[ident] = Serving()
            _mine.serving = s
            return s
    s = _serving.get(ident)
    if s is None:
        s = _serving[ident] = Serving()
    return s


def forget_thread() -> None:
    """This thread ends (a thread of ``rank.runners``): drop its :class:`Serving`."""
    _serving.pop(threading.get_ident(), None)
    _mine.__dict__.pop("serving", None)


def main_serving() -> Serving:
    """What the process's main thread serves (read by the control thread)."""
    return serving(threading.main_thread().ident)


#: What an asyncio task serves, when that is not its thread's: the tasks of a
#: ``@concurrent_endpoint`` (they share one event loop's thread) inherit it from the
#: message that started them (``serve_tasks``).
_task_serving: contextvars.ContextVar[Serving | None] = contextvars.ContextVar(
    "monarch_kernel_serving", default=None
)


def serve_tasks(snapshot: Serving | None = None) -> contextvars.Token[Serving | None]:
    """Tasks created from now on in this context (and the coroutines scheduled from it
    onto another thread's loop) serve what this thread serves now (a copy), until
    ``_task_serving.reset(token)``."""
    if snapshot is None:
        mine = _reading()
        snapshot = Serving()
        snapshot.request, snapshot.actor, snapshot.slice = mine.request, mine.actor, mine.slice
    return _task_serving.set(snapshot)


def end_serve_tasks(token: contextvars.Token[Serving | None]) -> None:
    """Undo :func:`serve_tasks`."""
    _task_serving.reset(token)


def _reading() -> Serving:
    """What the calling task or thread serves; for a thread that serves nothing itself
    (the output capture's, the control thread), the main thread's: the request its
    output and reports belong to."""
    task = _task_serving.get()
    if task is not None:
        return task
    s = _serving.get(threading.get_ident())
    return s if s is not None else main_serving()


if TYPE_CHECKING:  # module attributes, per thread (see _ContextModule)
    current_request: str | None
    current_actor: str | None
    current_slice: Any


def install(point: Point, extent: dict[str, int], runtime: RankServices) -> None:
    """Called once by the rank: where it is, and its services."""
    global _point, _extent, _runtime
    _point, _extent, _runtime = point, dict(extent), runtime


def services() -> RankServices | None:
    """The services of the rank this code runs in; None outside a rank."""
    runtime: RankServices | None = _runtime
    return runtime


def current_rank() -> Point:
    """This rank's position in its process mesh (``.rank`` is the global flat rank)."""
    return _point


def current_size() -> dict[str, int]:
    """The extent of this rank's process mesh, e.g. ``{"hosts": 2, "gpus": 4}``."""
    return dict(_extent)


def message_rank() -> Point:
    """This rank's point within the slice the current message was sent to (Monarch's
    ``context().message_rank``); :func:`current_rank` outside of such a call."""
    sl = _reading().slice
    if not sl:
        return _point

    try:
        shape = Shape(tuple(sl[0]), tuple(sl[1]), tuple(sl[2]), int(sl[3]))
        index = shape.ranks().index(_point.rank)
    except (ValueError, TypeError, IndexError):
        return _point
    return shape.points()[index]


def in_rank() -> bool:
    """Whether this code runs in a rank process."""
    return _runtime is not None


def report(metrics: Mapping[str, float]) -> None:
    """Send numbers to the dashboard (nothing outside a rank)."""
    runtime = services()
    if runtime is not None:
        runtime.report(metrics)


class _ContextModule(types.ModuleType):
    """This module, with ``current_request``, ``current_actor`` and ``current_slice``
    read and set for the calling thread (:class:`Serving`; read in a thread that serves
    nothing: the main thread's)."""

    @property
    def current_request(self) -> str | None:
        return _reading().request

    @current_request.setter
    def current_request(self, value: str | None) -> None:
        serving().request = value

    @property
    def current_actor(self) -> str | None:
        return _reading().actor

    @current_actor.setter
    def current_actor(self, value: str | None) -> None:
        serving().actor = value

    @property
    def current_slice(self) -> Any:
        return _reading().slice

    @current_slice.setter
    def current_slice(self, value: Any) -> None:
        serving().slice = value


sys.modules[__name__].__class__ = _ContextModule
