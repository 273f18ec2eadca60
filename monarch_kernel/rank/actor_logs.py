"""Monarch's ``[actor=<...>] `` prefix on the ``logging`` records of code an actor runs
(Monarch's ``_ActorFilter``): a filter on the root logger's handlers, and on every
handler added to any logger afterwards, that starts each record's message with the
running actor's instance (``str(context().actor_instance)``). Switched by
``monarch_kernel.config.prefix_python_logs_with_actor`` (Monarch's
``config.prefix_python_logs_with_actor``; per process: set it where the actors run).
Records with an empty message are left alone (torch.compile's structured logs need it).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

#: What names the running actor for a record: its instance's ``str()``, or None outside
#: an actor (set by the actor API: ``actor.api.actor_label``).
label: Callable[[], str | None] = lambda: None

_installed = False
_lock = threading.Lock()


class ActorFilter(logging.Filter):
    """Prefix a record's message with ``[actor=<instance>] `` inside an actor."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            from monarch_kernel import config

            if not getattr(config, "prefix_python_logs_with_actor", True):
                return True
            if getattr(record, "actor_prefix", None) is not None:
                return True  # another handler's filter already did
            who = label()
            if who is not None:
                prefix = f"[actor={who}] "
                record.actor_prefix = prefix
                if record.msg:
                    record.msg = f"{prefix}{record.msg}"
        except Exception as exc:  # never lose a record over its prefix
            warnings.warn(
                f"failed to add monarch actor information to python logs: {exc}",
                stacklevel=2,
            )
        return True


_filter = ActorFilter()


def install() -> None:
    """Put the filter on the root logger's handlers and on every handler added later
    (once per process; a rank calls it when it spawns its first actor)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    for handler in logging.getLogger().handlers:
        if _filter not in handler.filters:
            handler.addFilter(_filter)
    original: Any = logging.Logger.addHandler

    def add_handler(self: logging.Logger, hdlr: logging.Handler) -> None:
        original(self, hdlr)
        if _filter not in hdlr.filters:
            hdlr.addFilter(_filter)

    logging.Logger.addHandler = add_handler  # type: ignore[method-assign]
