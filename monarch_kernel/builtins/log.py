"""Logging on the ranks: ``log_remote(msg, *args)`` logs on every rank of the active
mesh (mesh-tensor arguments read as each rank's local tensor), in order with its ops."""

from __future__ import annotations

import logging
from typing import Any

from monarch_kernel.tensor_engine.remote_functions import remote

logger = logging.getLogger(__name__)


@remote(propagate="inspect")
def log_remote(*args: Any, level: int = logging.WARNING, **kwargs: Any) -> None:
    """``logging.Logger.log(level, *args, **kwargs)`` on each rank (a warning by default)."""
    logging.getLogger("monarch_kernel.builtins.log").log(level, *args, **kwargs)


@remote(propagate="inspect")
def set_logging_level_remote(level: int) -> None:
    """Set the level of ``log_remote``'s logger on each rank."""
    logging.getLogger("monarch_kernel.builtins.log").setLevel(level)


__all__ = ["log_remote", "logger", "set_logging_level_remote"]
