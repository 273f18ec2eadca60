"""``ProcMesh.logging_option(level=...)``: the Python root logger's level on every rank of
a process mesh, set as Monarch 0.7 sets it (its ``LoggerRuntimeActor`` calls
``logging.getLogger().setLevel(level)`` in each process of the mesh).

A short-lived actor of this module does it: spawned on the mesh, called once, stopped.
It is not an actor of the user's: its name starts with ``_monarch_``.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol

from monarch_kernel.actor.actor import Actor, endpoint

_names = itertools.count()


class Spawner(Protocol):
    """What spawns the helper actor: a ``ProcMesh`` (not imported: it imports this)."""

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> Any: ...


class LoggerRuntime(Actor):
    """Sets its process's root logger level (Monarch's ``LoggerRuntimeActor``)."""

    @endpoint
    def set_level(self, level: int) -> int:
        """``logging.getLogger().setLevel(level)``; returns the level now."""
        root = logging.getLogger()
        root.setLevel(level)
        return root.level


def check_level(level: object) -> int:
    """``level`` as Monarch takes it: an int from 0 to 255 (``logging.INFO`` ...)."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(
            f"logging_option(level=...) takes a logging level number such as logging.INFO "
            f"or logging.DEBUG, not {type(level).__name__} {level!r}"
        )
    if level < 0 or level > 255:
        raise ValueError(
            f"Invalid logging level: {level} (a number from 0 to 255, e.g. logging.INFO)"
        )
    return level


def set_root_level(procs: Spawner, level: int) -> None:
    """Set the root logger's level on every rank of ``procs`` (done when this returns)."""
    runtime = procs.spawn(f"_monarch_log_level{next(_names)}", LoggerRuntime)
    try:
        runtime.set_level.call(level).get()
    finally:
        runtime.stop().get()
