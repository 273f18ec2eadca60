"""Per-step telemetry on the wire: what a rank measured of each training step.

A rank sends its finished steps in batches (kind ``steps``, payload :func:`encode_steps`):
the request (cell) they ran in, then one :class:`StepRecord` per step as a plain tuple,
so a batch pickles small and fast. Times are seconds, bytes are bytes.

Categories (they add up to ``wall``):

* ``data``: time in the data loader's ``__next__``;
* ``compute``: forward and backward (and anything else between the batch and the
  optimizer), less the time blocked in collectives;
* ``comm``: time the rank was blocked waiting for collectives to complete;
* ``optim``: the optimizer's ``step()``;
* ``other``: the rest of the step (logging, ``zero_grad`` before the batch ...).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import NamedTuple

#: The categories of a step, in the order the dashboard stacks them.
CATEGORIES = ("compute", "comm", "data", "optim", "other")


class StepRecord(NamedTuple):
    """One training step of one rank (a named tuple: made on the loop's thread at every
    step, so it must cost next to nothing)."""

    #: Steps counted since the request (cell) started, from 1.
    step: int
    #: ``time.time()`` at the step's end.
    end: float
    wall: float
    data: float
    compute: float
    comm: float
    optim: float
    other: float
    #: Bytes the step's collectives carried (each op's tensor payload), and the bytes a
    #: ring moves per rank for them (all-reduce counts ``2(n-1)/n``), for bus bandwidth.
    nbytes: int
    bus_bytes: float
    #: Seconds collectives were in flight (issued, not complete) during the step.
    in_flight: float
    #: The collective the rank waited in longest during the step ("" if none).
    wait_op: str

    def category(self, name: str) -> float:
        """The seconds of category ``name`` (one of :data:`CATEGORIES`)."""
        value: float = getattr(self, name)
        return value

    @property
    def bus_bandwidth(self) -> float:
        """Bytes per second a ring moved for this rank while collectives were in flight."""
        return self.bus_bytes / self.in_flight if self.in_flight > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Steps of one rank, sent together."""

    #: The request (cell, endpoint call) they ran in; None between requests.
    request: str | None
    steps: list[StepRecord]


def encode_steps(batch: StepBatch) -> bytes:
    """The payload of a ``steps`` message."""
    return pickle.dumps((batch.request, [tuple(s) for s in batch.steps]), protocol=5)


def decode_steps(payload: bytes | memoryview) -> StepBatch:
    """A ``steps`` payload back (raises ValueError on a malformed one)."""
    try:
        request, rows = pickle.loads(payload)
        steps = [StepRecord(*row) for row in rows]
    except Exception as exc:
        raise ValueError(f"malformed steps payload: {exc}") from None
    if request is not None and not isinstance(request, str):
        raise ValueError("malformed steps payload: bad request id")
    return StepBatch(request, steps)


@dataclass(frozen=True)
class ProfileOrder:
    """What ``%mesh profile`` asks of a rank (the ``profile`` message's payload)."""

    name: str
    steps: int
    #: ``time.time()`` after which the first step boundary starts the profiler (when
    #: ``start_step`` is 0: the controller has seen no steps of the running loop yet).
    start_after: float = 0.0
    #: The loop's step the profile starts with (its first profiled step): the same
    #: step on every rank of a loop in lockstep, whenever the order reached each and
    #: however far apart their step boundaries lie in time. 0: by ``start_after``.
    start_step: int = 0


@dataclass
class RankTrace:
    """A rank's answer: its Chrome trace (zlib-compressed JSON), where it was taken,
    the anchor to align it, and the top ops (name, self CPU µs, calls)."""

    rank: int
    hostname: str
    steps: int
    trace: bytes
    #: ``time.time()`` (µs) at the anchor event's start, and that event's ``ts``.
    anchor_epoch_us: float
    anchor_ts: float
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)
    #: ``time.time()`` when the rank sent it (clock offset between machines).
    sent_at: float = 0.0
    error: str = ""
    #: Seconds per profiled step blocked in collectives (the step clock's ``comm``).
    comm_per_step: float = 0.0
    #: The loop's number of the first profiled step (the ranks of one loop agree on it).
    first_step: int = 0
