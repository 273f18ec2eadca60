"""What a rank knows about itself, readable from user code (``current_rank()`` ...).

Outside a rank (in the controller or a plain script) the rank is a zero-dim point of a
mesh of size 1 and :func:`report` does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


_point: Point = Point({}, 0)
_extent: dict[str, int] = {}
#: The running rank (set in rank processes only). Read :func:`services` instead.
_runtime: Any = None
current_request: str | None = None  # id of the message the main thread is serving
#: Set (by ``@endpoint(explicit_response_port=True)``) on endpoint functions that take a
#: response port as their first argument.
EXPLICIT_PORT_ATTR = "__monarch_explicit_port__"
#: The slice the current call was sent to, when not the whole mesh (header ``sl``:
#: labels, sizes, strides, offset); see ``message_rank``.
current_slice: Any = None
#: Name of the actor whose endpoint (or constructor) the main thread is running, if any.
current_actor: str | None = None


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
    sl = current_slice
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
