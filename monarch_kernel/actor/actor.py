"""``Actor`` and ``@endpoint``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.rank.context import EXPLICIT_PORT_ATTR

F = TypeVar("F", bound=Callable[..., Any])

_ENDPOINT_ATTR = "__monarch_endpoint__"


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
    ``port.exception(exc)``), now or later from any thread; what it returns is ignored.
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


def endpoints_of(cls: type) -> dict[str, Callable[..., Any]]:
    """Endpoint name -> function for an actor class (including inherited ones)."""
    out = {}
    for name, member in inspect.getmembers(cls):
        if getattr(member, _ENDPOINT_ATTR, False):
            out[name] = member
    return out
