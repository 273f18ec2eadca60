"""The rank's step clock: what each training step spent where, measured by hooks.

No change to the user's loop: the optimizer's global step hooks bound a step (its
``step()`` ends one), the data loader's ``__next__`` is timed where torch defines it,
and the re-formable process group tells of each collective it issues and completes
(:data:`monarch_kernel.rank.pg.reformable.op_watch`). Forward and backward are what
lies between the batch and the optimizer, less the time blocked in collectives.

Blocked time is counted where the rank cannot go on without a collective: from the
last op issued until every op in flight completed (an op waited for at once counts
whole; DDP's buckets overlapping backward count from the last bucket on).

Threads: the hooks run on the thread of the user's loop; completions come on the
group's reader thread (``_lock`` guards what they share).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from monarch_kernel.rank import context
from monarch_kernel.wire.steps import StepRecord

#: A step that began longer ago than this (s) with nothing measured since its start
#: began when its first activity came (the loop was idle between cells, say).
IDLE_GAP = 5.0


#: Bytes a ring moves per rank, per byte of payload, by op (n ranks), for bus bandwidth
#: (the convention of nccl-tests).
def _bus_factor(name: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if name.startswith("allreduce"):
        return 2.0 * (n - 1) / n
    if name.startswith(("all_gather", "allgather", "reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


#: torch's names of the group's ops, as users read them.
OP_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather",
}

Sink = Callable[[StepRecord, "str | None"], None]


class StepClock:
    """Accumulates one step at a time and hands each finished one to ``sink``."""

    def __init__(self, sink: Sink, clock: Callable[[], float] = time.perf_counter):
        self._sink = sink
        self._now = clock
        self._lock = threading.Lock()
        #: Called on the loop's thread at each step's end (profiling), with its record.
        self.on_step: Callable[[StepRecord], None] | None = None
        self.request: str | None = None
        self.step = 0
        self._open = False
        self._start = 0.0
        self._data = 0.0
        self._data_end = 0.0
        self._opt_start = 0.0
        # shared with the reader thread
        self._pending = 0
        self._busy_start = 0.0
        self._last_issue = 0.0
        self._blocked = 0.0
        self._in_flight = 0.0
        self._nbytes = 0
        self._bus = 0.0
        self._wait_by_op: dict[str, float] = {}

    # -- the step's bounds ---------------------------------------------------------------
    def _begin(self, t: float) -> None:
        """Something of a step happened at ``t``: open the step if none is."""
        request = context.current_request
        if self._open:
            if request == self.request:
                return
            # left open by another request (DDP's first broadcast in a set-up cell, a
            # loop that ended without an optimizer step): this one starts afresh
            self._data = self._data_end = self._opt_start = 0.0
            with self._lock:
                self._blocked = self._in_flight = self._bus = 0.0
                self._nbytes = 0
                self._wait_by_op = {}
        if request != self.request:
            self.request, self.step = request, 0
            self._start = t
        elif t - self._start > IDLE_GAP:
            self._start = t
        self._open = True

    def data(self, t0: float, t1: float) -> None:
        """The data loader's ``__next__`` ran from ``t0`` to ``t1``."""
        self._begin(t0)
        self._data += t1 - t0
        self._data_end = t1

    def optimizer_started(self, *_: Any) -> None:
        """The optimizer's pre-step hook."""
        t = self._now()
        self._begin(t)
        if not self._opt_start:
            self._opt_start = t

    def optimizer_stepped(self, *_: Any) -> None:
        """The optimizer's post-step hook: the step ends."""
        end = self._now()
        self._begin(end)
        start, opt_start = self._start, self._opt_start or end
        with self._lock:
            blocked, in_flight = self._blocked, self._in_flight
            nbytes, bus, waits = self._nbytes, self._bus, self._wait_by_op
            self._blocked = self._in_flight = self._bus = 0.0
            self._nbytes = 0
            self._wait_by_op = {}
        wall = end - start
        data = self._data
        window = opt_start - (self._data_end if self._data_end > start else start)
        compute = max(0.0, window - blocked)
        optim = end - opt_start
        other = max(0.0, wall - data - compute - blocked - optim)
        wait_op = max(waits, key=waits.__getitem__) if waits else ""
        self.step += 1
        record = StepRecord(
            self.step,
            time.time(),
            wall,
            data,
            compute,
            blocked,
            optim,
            other,
            nbytes,
            bus,
            in_flight,
            OP_NAMES.get(wait_op, wait_op),
        )
        self._start, self._open = end, False
        self._data = self._data_end = self._opt_start = 0.0
        self._sink(record, self.request)
        if self.on_step is not None:
            self.on_step(record)

    # -- collectives (pg.reformable.OpWatch) -----------------------------------------------
    def issued(self, op: Any, tensors: Sequence[Any], size: int) -> None:
        """An op of the process group is about to be sent to its worker."""
        t = self._now()
        self._begin(t)
        nbytes = 0
        for tensor in tensors:
            nbytes += tensor.numel() * tensor.element_size()
        op.watcher = self._completed
        with self._lock:
            if self._pending == 0:
                self._busy_start = t
            self._pending += 1
            self._last_issue = t
            self._nbytes += nbytes
            self._bus += nbytes * _bus_factor(op.name, size)

    def _completed(self, op: Any) -> None:
        """An op completed (or failed): the reader thread, or an abort."""
        t = self._now()
        with self._lock:
            self._pending -= 1
            if self._pending > 0:
                return
            self._pending = 0
            blocked = max(0.0, t - self._last_issue)
            self._blocked += blocked
            self._in_flight += t - self._busy_start
            self._wait_by_op[op.name] = self._wait_by_op.get(op.name, 0.0) + blocked
