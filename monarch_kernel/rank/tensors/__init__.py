"""The rank's half of the tensor engine: a ``tensor_ops`` message's records run in order
on the main thread (where cells and CUDA run), against this rank's table of local tensors
(ref -> tensor, or the :class:`~monarch_kernel.wire.tensor_ops.RankError` that poisoned
it). The controller's half is :mod:`monarch_kernel.tensor_engine`.

Face: :func:`make_handler` (the inbox handler of ``tensor_ops``), :func:`ops_done`
(the count the rank's stats carry); torch is imported on
the first message, not when the rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.wire.headers import TensorOps

if TYPE_CHECKING:
    from monarch_kernel.rank.tensors.worker import TensorWorker


#: This rank's worker, once the first ``tensor_ops`` message made it.
_worker: list[TensorWorker] = []


def ops_done() -> int | None:
    """Tensor-engine ops this rank ran (None before the first message): the rank's
    stats carry it, for the dashboard. Safe from any thread at any time."""
    return _worker[0].ops_done if _worker else None


def make_handler(outbox: Outbox) -> Any:
    """The inbox handler of ``tensor_ops`` (one :class:`TensorWorker` per rank, made on
    the first message)."""
    worker = _worker

    def on_tensor_ops(msg: Any, hdr: TensorOps, request: str | None) -> None:
        if not worker:
            from monarch_kernel.rank.tensors.worker import TensorWorker

            worker.append(TensorWorker(outbox))
        worker[0].run(msg.payload, request)

    return on_tensor_ops


__all__ = ["make_handler", "ops_done"]
