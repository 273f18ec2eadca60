"""The rank's half of the tensor engine: a ``tensor_ops`` message's records run in order
on the main thread (where cells and CUDA run), against this rank's table of local tensors
(ref -> tensor, or the :class:`~monarch_kernel.wire.tensor_ops.RankError` that poisoned
it). The controller's half is :mod:`monarch_kernel.tensor_engine`.

Face: :func:`make_handler` (the inbox handler of ``tensor_ops``), :func:`ops_done`
(the count the rank's stats carry), :func:`stop_ops` (the stop button's
``tensor_stop``); torch is imported on
the first message, not when the rank starts."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.wire.headers import TensorOps

if TYPE_CHECKING:
    from monarch_kernel.rank.tensors.worker import TensorWorker


#: This rank's worker, once the first ``tensor_ops`` message made it.
_worker: list[TensorWorker] = []
#: A ``tensor_stop`` told before the worker was made (see :func:`stop_ops`), and the
#: lock that orders the two (the control thread tells, the main thread makes).
_early_stop: list[int] = []
_making = threading.Lock()


def ops_done() -> int | None:
    """Tensor-engine ops this rank ran (None before the first message): the rank's
    stats carry it, for the dashboard. Safe from any thread at any time."""
    return _worker[0].ops_done if _worker else None


def stop_ops(through: int) -> None:
    """The stop button stopped the ops numbered up to ``through`` (``tensor_stop``, on
    the control thread): those not run yet do not run. Told before the first
    ``tensor_ops`` message made the worker (it is on its way), it is kept for it."""
    with _making:
        if _worker:
            _worker[0].stop_through(through)
        else:
            _early_stop[:] = [through]


def make_handler(outbox: Outbox) -> Any:
    """The inbox handler of ``tensor_ops`` (one :class:`TensorWorker` per rank, made on
    the first message)."""
    worker = _worker

    def on_tensor_ops(msg: Any, hdr: TensorOps, request: str | None) -> None:
        if not worker:
            from monarch_kernel.rank.tensors.worker import TensorWorker

            made = TensorWorker(outbox)
            with _making:
                for through in _early_stop:
                    made.stop_through(through)
                worker.append(made)
        worker[0].run(msg.payload, request)

    return on_tensor_ops


__all__ = ["make_handler", "ops_done", "stop_ops"]
