"""What a rank knows about itself, readable from user code (``current_rank()`` ...).

Outside a rank (in the controller or a plain script) the rank is a zero-dim point of a
mesh of size 1 and :func:`report` does nothing.
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.shape import Point, Shape

_point: Point = Point({}, 0)
_extent: dict[str, int] = {}
_runtime: Any = None  # the running rank.runtime.Rank, set in rank processes only
current_request: str | None = None  # id of the message the main thread is serving
#: Set (by ``@endpoint(explicit_response_port=True)``) on endpoint functions that take a
#: response port as their first argument.
EXPLICIT_PORT_ATTR = "__monarch_explicit_port__"
#: The slice the current call was sent to, when not the whole mesh (header ``sl``:
#: labels, sizes, strides, offset); see ``message_rank``.
current_slice: Any = None
#: Name of the actor whose endpoint (or constructor) the main thread is running, if any.
current_actor: str | None = None


def install(point: Point, extent: dict[str, int], runtime: Any) -> None:
    global _point, _extent, _runtime
    _point, _extent, _runtime = point, dict(extent), runtime


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
    return _runtime is not None


def report(metrics: dict[str, Any]) -> None:
    if _runtime is not None:
        _runtime.report(metrics)
