"""One op in flight on the re-formable group, and the Work torch gets for it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.rank.pg.protocol import TensorRef
from monarch_kernel.rank.pg.shm import Slot

log = logging.getLogger("monarch_kernel.rank")

# torch's stubs do not let a Python class derive from Work the way torch does it (see
# torch/csrc/distributed/c10d/PyProcessGroup.hpp, the trampoline).
_WorkBase: Any = dist.Work


def _value(future: Any) -> Any:
    return future.value()


@dataclass(eq=False)
class PendingOp:
    """One op in flight.

    ``future`` (what ``get_future()`` gives) is a ``then`` of the future we complete:
    torch's ``Future.set_exception`` from Python completes a future *successfully* with
    the exception object as its value, which C++ waiters (DDP's reducer) take for the
    result; a callback that raises is how an error reaches C++ as an error.
    """

    name: str
    slot: Slot | None
    outputs: list[tuple[torch.Tensor, TensorRef]]
    value: object
    #: CUDA devices of the op's tensors: torch's future must be told them to hold
    #: CUDA tensors (it then orders its waiters' streams after the result).
    devices: list[Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    #: Told first when the op completes (step telemetry: ``rank.telemetry``); None: nobody.
    watcher: Callable[[PendingOp], None] | None = None

    def __post_init__(self) -> None:
        self._base: Any = torch.futures.Future(devices=self.devices or None)
        self.future: Any = self._base.then(_value)

    def finish(self, error: BaseException | None) -> None:
        if self.watcher is not None:
            try:
                self.watcher(self)
            except Exception:  # telemetry must never keep an op from completing
                log.exception("step telemetry: the op watcher failed")
        self.error = error
        try:
            if error is None:
                self._base.set_result(self.value)
            else:
                self._base.set_exception(error)
        finally:
            self.done.set()


class OpWork(_WorkBase):
    """What an op returns: ``wait()`` (interruptible), ``get_future()``."""

    def __init__(self, op: PendingOp):
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if seconds is None or seconds <= 0:  # torch's kNoTimeout is 0
            while not self._op.done.wait(1.0):  # Ctrl-C lands between waits
                pass
        elif not self._op.done.wait(seconds):
            raise RuntimeError(f"{self._op.name} did not complete within {seconds:.1f}s")
        if self._op.error is not None:
            raise self._op.error
        return True

    def get_future(self) -> Any:
        return self._op.future

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self) -> BaseException | None:
        return self._op.error

    def result(self) -> Any:
        self.wait()
        return self._op.value

    def synchronize(self) -> None:
        self.wait()
