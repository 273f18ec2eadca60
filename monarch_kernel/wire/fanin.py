"""Fan-in: what a host agent makes of its ranks' answers to one fanned-out request.

A request the controller fans out through a host agent (header ``f``, with ``w``: a
reply is wanted) is answered by several ranks of that host. Each of them sends what it
has for that request (its output, its reply) to its agent instead of the controller, and
the agent sends them on as *one* ``fan_in`` message per host, so that the controller's
cost of a gathered call grows with hosts, not ranks:

* identical output chunks and identical replies of several ranks become one
  :class:`Part` naming the ranks (the notebook collapses identical lines per cell
  anyway; a failure report is the rank's own bytes, so its per-rank detail stays);
* each rank's parts keep their order (a rank's output before its reply);
* a :class:`Batch` goes when every rank it waits on replied (or died), or
  :data:`WINDOW` seconds after its first part came, with what it has (a rank that is
  slow or stuck holds up the others by no more than that); what comes later goes in
  the next batch.

This module is the pure part (no sockets): :class:`FanIn`, the agent's table of
batches, and the wire form of the parts (:func:`encode_parts`, :func:`decode_parts`),
marshal-encoded inside a signed message like a header. The agent's loop
(:mod:`monarch_kernel.host.agent`) feeds it, the controller
(:mod:`monarch_kernel.controller.messaging.inbound`) reads ``fan_in`` messages.
"""

from __future__ import annotations

import enum
import marshal
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

#: How long a batch waits for the rest of its ranks after its first part came (s).
WINDOW = float(os.environ.get("MONARCH_KERNEL_FANIN_WINDOW", "0.02"))
#: A reply larger than this (bytes of payload) is not combined: it goes to the
#: controller directly (no copy through the agent), and the agent is only told.
MAX_COMBINED = 64 * 1024
#: Parts of one batch at most before it goes (a flood of output is not held).
MAX_PARTS = 512


class PartKind(enum.IntEnum):
    """What a :class:`Part` carries."""

    STREAM = 0  #: output text (``name``: ``stdout`` or ``stderr``)
    RESULT = 1  #: a reply (``ok``: its value, else its failure report, pickled)


@dataclass(frozen=True, slots=True)
class Part:
    """One item of a ``fan_in`` message: the same bytes from each of ``ranks``."""

    kind: PartKind
    ranks: tuple[int, ...]
    data: bytes
    name: str = ""  #: the stream (STREAM parts)
    ok: bool = True  #: the reply succeeded (RESULT parts)


class PartError(ValueError):
    """A ``fan_in`` payload that does not decode to parts."""


def encode_parts(parts: Iterable[Part]) -> bytes:
    """The payload of a ``fan_in`` message (marshal: plain values only)."""
    return marshal.dumps([(int(p.kind), p.ranks, p.name, p.ok, p.data) for p in parts], 4)


def decode_parts(payload: bytes | memoryview) -> list[Part]:
    """The parts of a (verified) ``fan_in`` payload; :class:`PartError` if malformed."""
    try:
        raw = marshal.loads(payload)
        parts = [
            Part(PartKind(kind), tuple(ranks), bytes(data), str(name), bool(ok))
            for kind, ranks, name, ok, data in raw
        ]
    except (ValueError, TypeError, EOFError) as exc:
        raise PartError(f"malformed fan_in payload: {exc}") from None
    for p in parts:
        if not all(isinstance(r, int) for r in p.ranks):
            raise PartError("malformed fan_in payload: a rank that is not an int")
    return parts


@dataclass(slots=True)
class _Building:
    """A part being collected (its ranks grow as identical bytes come)."""

    kind: PartKind
    name: str
    ok: bool
    data: bytes
    ranks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """What a host's ranks sent for one request and the agent has not sent on yet."""

    request: str
    waiting: set[int]  #: ranks that still owe their reply
    parts: list[_Building] = field(default_factory=list)
    #: (kind, name, ok, data) -> index of the part those bytes are collected in
    index: dict[tuple[int, str, bool, bytes], int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  #: rank -> index of its last part
    since: float | None = None  #: when its first part (not sent yet) came

    def add(self, kind: PartKind, rank: int, data: bytes, name: str, ok: bool, now: float) -> None:
        """Add ``rank``'s bytes: to an identical part of other ranks if that keeps the
        rank's own order (the part comes after its last one), else as a new part."""
        key = (int(kind), name, ok, data)
        at = self.index.get(key)
        if at is None or self.last.get(rank, -1) >= at:
            at = self.index[key] = len(self.parts)
            self.parts.append(_Building(kind, name, ok, data))
        self.parts[at].ranks.append(rank)
        self.last[rank] = at
        if self.since is None:
            self.since = now

    def due(self, now: float, window: float) -> bool:
        """Whether its parts go now: nobody is waited on, the window is over, or many."""
        if not self.parts:
            return False
        if not self.waiting or len(self.parts) >= MAX_PARTS:
            return True
        return self.since is not None and now - self.since >= window

    def take(self) -> list[Part]:
        """Its parts, as sent; the batch starts empty again."""
        parts = [Part(p.kind, tuple(p.ranks), p.data, p.name, p.ok) for p in self.parts]
        self.parts, self.index, self.last, self.since = [], {}, {}, None
        return parts


class FanIn:
    """The host agent's batches, one per fanned-out request still answered by some of
    its ranks (not thread-safe: the agent's loop only)."""

    def __init__(self, window: float = WINDOW):
        self.window = window
        self.batches: dict[str, Batch] = {}

    def expect(self, request: str, ranks: Iterable[int]) -> None:
        """``ranks`` (of this host) were sent ``request``: each will reply once."""
        batch = self.batches.get(request)
        if batch is None:
            self.batches[request] = Batch(request, set(ranks))
        else:
            batch.waiting.update(ranks)

    def _batch(self, request: str) -> Batch:
        batch = self.batches.get(request)
        if batch is None:  # not fanned out by us (or already answered): goes at once
            batch = self.batches[request] = Batch(request, set())
        return batch

    def stream(self, request: str, rank: int, name: str, text: bytes, now: float) -> None:
        """Output ``rank`` wrote while serving ``request``."""
        self._batch(request).add(PartKind.STREAM, rank, text, name, True, now)

    def result(self, request: str, rank: int, ok: bool, payload: bytes, now: float) -> None:
        """``rank``'s reply to ``request`` (combined with identical ones)."""
        batch = self._batch(request)
        batch.add(PartKind.RESULT, rank, payload, "", ok, now)
        batch.waiting.discard(rank)

    def answered_elsewhere(self, request: str, rank: int) -> None:
        """``rank`` replied to ``request`` another way (a large value, sent directly)."""
        batch = self.batches.get(request)
        if batch is not None:
            batch.waiting.discard(rank)

    def rank_gone(self, rank: int) -> list[tuple[str, list[Part]]]:
        """``rank`` died: nothing more is waited for from it. Returns the batches that
        hold something of it, as ``(request, parts)``, to send at once: what a rank sent
        before it died (its reply, its last output) must reach the controller before
        the agent's report of its death, or the controller fails a request it answered."""
        out = []
        for request, batch in list(self.batches.items()):
            batch.waiting.discard(rank)
            if rank in batch.last:
                out.append((request, batch.take()))
            if not batch.waiting and not batch.parts:
                del self.batches[request]
        return out

    def take(self, request: str) -> list[Part]:
        """What ``request``'s batch holds now (to send before something that must follow
        it); the batch is forgotten once nobody is waited on."""
        batch = self.batches.get(request)
        if batch is None:
            return []
        parts = batch.take()
        if not batch.waiting:
            del self.batches[request]
        return parts

    def due(self, now: float) -> list[tuple[str, list[Part]]]:
        """The batches to send now, as ``(request, parts)``; finished ones forgotten."""
        out = []
        for request, batch in list(self.batches.items()):
            if batch.due(now, self.window):
                out.append((request, batch.take()))
            if not batch.waiting and not batch.parts:
                del self.batches[request]
        return out

    def next_deadline(self) -> float | None:
        """When the earliest batch with parts is due (None: none waits)."""
        times = [b.since for b in self.batches.values() if b.parts and b.since is not None]
        return min(times) + self.window if times else None


__all__ = [
    "MAX_COMBINED",
    "WINDOW",
    "Batch",
    "FanIn",
    "Part",
    "PartError",
    "PartKind",
    "decode_parts",
    "encode_parts",
]
