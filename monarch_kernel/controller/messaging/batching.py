"""Fire-and-forget calls queued back to back, sent as one ``batch`` message per target.

``endpoint.broadcast()`` costs the controller an encoding (marshal, signature) and a ZeroMQ
send per rank, and each rank a receive, a verification and a dispatch per call; a loop of
broadcasts pays all of that per call. :class:`Batcher` keeps the calls that the
transport's I/O path has not sent yet (in call order); when it sends them (as soon as it
is free: see ``Transport.send_fire``), every set of ranks that was sent the same run of
calls gets them as one signed ``batch`` message (:mod:`monarch_kernel.wire.kinds`),
encoded once for all of them, with one sequence number per rank, so the ordering
contract (calls and broadcasts reach a rank in the order they were made) is that of a
single message.

Only small calls without out-of-band buffers wait here (:func:`batchable`); the
pending list is bounded, so that what the transport's flow control counts stays close to
what was sent.
"""

from __future__ import annotations

import marshal
from collections.abc import Iterator, Sequence

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header

#: A call's payload at most this large may wait in a batch (larger ones go alone).
BATCH_ITEM_MAX_BYTES = 16 * 1024
#: A batch holds at most this many calls ...
BATCH_MAX_CALLS = 64
#: ... and this many payload bytes: past either, it is sent at once by the caller.
BATCH_MAX_BYTES = 256 * 1024

#: Marshal's format for the batch payload (as for headers).
_MARSHAL = 4


def batchable(header: Header, payload: bytes | memoryview, buffers: Sequence[Buffer]) -> bool:
    """Whether a fire-and-forget message may wait in a batch: a small ``call`` with no
    out-of-band buffers, no reply wanted and no envelope of its own."""
    return (
        not buffers
        and header.get("k") == K.CALL
        and len(payload) <= BATCH_ITEM_MAX_BYTES
        and "i" not in header
        and "q" not in header
    )


class Batcher:
    """The calls waiting to be sent, in call order (guarded by the transport's send lock)."""

    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: list[tuple[tuple[int, ...], Header, bytes]] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, ranks: Sequence[int], header: Header, payload: bytes) -> bool:
        """Queue a call to ``ranks``; True when the batch is full (send it now)."""
        self.items.append((tuple(ranks), header, bytes(payload)))
        self.nbytes += len(payload)
        return len(self.items) >= BATCH_MAX_CALLS or self.nbytes >= BATCH_MAX_BYTES

    def clear(self) -> None:
        """Forget what waits (the transport closed)."""
        self.items = []
        self.nbytes = 0

    def take(self) -> Iterator[tuple[list[int], list[tuple[Header, bytes]]]]:
        """Empty the batch: ``(ranks, calls)`` per set of ranks that was sent exactly the
        same calls, in order. Every rank appears in one group; the groups may go in any
        order (each rank's calls are in call order within its group)."""
        items, self.items, self.nbytes = self.items, [], 0
        runs: dict[int, list[int]] = {}  # rank -> indices of its calls
        for i, (targets, _, _) in enumerate(items):
            for r in targets:
                runs.setdefault(r, []).append(i)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, run in runs.items():
            groups.setdefault(tuple(run), []).append(r)
        for indices, members in groups.items():
            yield members, [(items[i][1], items[i][2]) for i in indices]


def batch_payload(calls: list[tuple[Header, bytes]]) -> bytes:
    """The payload of a ``batch`` message carrying ``calls`` (see ``wire.kinds``)."""
    return marshal.dumps([[h, p] for h, p in calls], _MARSHAL)
