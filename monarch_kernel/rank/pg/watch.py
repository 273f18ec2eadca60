"""The watcher of the re-formable group's ops (step telemetry): a slot that costs no
import of torch, so the telemetry can set it at a rank's start before any group exists
(:mod:`.reformable` reads it for every op it sends to its worker)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol


class OpWatch(Protocol):
    """Told of every op sent to the worker, before it is sent (``rank.telemetry``)."""

    def issued(self, op: Any, tensors: Sequence[Any], size: int) -> None:
        """``op`` (a ``work.PendingOp``) carries ``tensors`` in a group of ``size``
        ranks; it may set ``op.watcher`` to hear of its completion."""


#: The watcher of ops (None: telemetry is off, and ops cost nothing more).
op_watch: OpWatch | None = None


def tell(op: Any, tensors: Sequence[Any], size: int) -> None:
    """Tell the watcher of ``op``; a watcher that fails is dropped (logged), so that
    telemetry can never fail a collective."""
    global op_watch
    watcher = op_watch
    if watcher is None:
        return
    try:
        watcher.issued(op, tensors, size)
    except Exception:
        op_watch = None
        logging.getLogger("monarch_kernel.rank").exception(
            "step telemetry: the op watcher failed; collectives are no longer measured"
        )
