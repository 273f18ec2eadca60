"""Large values travel as a stream of bounded messages, reassembled on receipt.

A message whose payload and out-of-band buffers together exceed :data:`STREAM_ABOVE`
is sent by :func:`encode_parts` as:

* a **start** message: the original header plus ``z`` (the byte size of the payload
  and of each buffer) and ``pm`` (the payload's MAC, :meth:`Codec.payload_mac`), with
  an empty payload and no buffers; signed like any message;
* **chunks**: ``k`` = ``ck``, ``st`` (the start's counter ``sc``: the stream), ``x``
  (the section: 0 the payload, 1... the buffers), ``o`` (the offset in it) and one
  buffer frame of at most :data:`CHUNK_SIZE` bytes, in order. A fan-out's chunks carry
  its ``f`` and ``d`` too, so the host agent forwards them like the start.

An :class:`Assembler` (one per receiving loop) checks a start before anything is
allocated (signed, sizes well formed and within :func:`~.limits.max_value`), then
preallocates each section once (anonymous memory: nothing is touched before the bytes
arrive), copies each chunk in place, and hands the whole message on, exactly as if it
had come in one piece, once the last chunk is in and the payload's MAC verified. So a
value costs its receiver one copy of itself plus the chunks in flight, and every frame
on the wire stays small enough for a tight ``MONARCH_KERNEL_MAX_MESSAGE``. Chunks of an
unknown stream, out of order or beyond a section are dropped and counted in the
codec's ``rejected`` (with the whole stream, for the latter two).
"""

from __future__ import annotations

import hmac
import mmap
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import (
    ENVELOPE_MIN,
    MAX_BUFFERS,
    SEPARATE_PAYLOAD,
    Buffer,
    Codec,
    Header,
    Message,
    WireError,
)
from monarch_kernel.wire.limits import CHUNK_SIZE, STREAM_ABOVE, max_value, too_large
from monarch_kernel.wire.serialize import ValueTooLargeError

#: The kind of a chunk message.
CHUNK = K.CHUNK
#: Streams one assembler keeps at once (the least recently fed is dropped beyond).
MAX_STREAMS = 4096
#: A stream fed nothing for this long (its sender died mid-way) is dropped.
STALE_AFTER = 600.0
#: Sections smaller than this are plain bytearrays; larger ones anonymous mappings.
_MAP_ABOVE = 1 << 20
_MAC_SIZE = 32


def frames_size(frames: Sequence[Any]) -> int:
    """Bytes of a message's payload and buffers (``frames`` from ``Codec.encode``): the
    envelope less its word, header and signature (an inline payload), plus the frames
    after it (a separate payload, the buffers)."""
    env = frames[0]
    inline = len(env) - ENVELOPE_MIN - (int.from_bytes(env[:4], "little") & ~SEPARATE_PAYLOAD)
    if len(frames) == 1:  # most messages
        return inline
    return inline + sum(memoryview(f).nbytes for f in frames[1:])


def flat_view(buf: Buffer) -> memoryview:
    """A one-dimensional byte view of ``buf``, without copying."""
    if isinstance(buf, pickle.PickleBuffer):
        return buf.raw()
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def check_size(header: Header, payload: bytes, buffers: Sequence[Buffer] = ()) -> None:
    """Raise :class:`ValueTooLargeError` if the message is above the bound on values
    (before a sender commits to it: sequence numbers, a registered request)."""
    total = len(payload) + (sum(memoryview(b).nbytes for b in buffers) if buffers else 0)
    if total > STREAM_ABOVE:
        limit = max_value()
        if total > limit:
            raise ValueTooLargeError(too_large(f"a {header.get('k')!r} message", total, limit))


def encode_parts(
    codec: Codec,
    header: Header,
    payload: bytes = b"",
    buffers: Sequence[Buffer] = (),
    route: Header | None = None,
) -> list[list[Any]]:
    """The messages that carry ``header`` + ``payload`` + ``buffers``: the one message of
    ``codec.encode`` when it is small, else a start and its chunks (module docstring).

    ``route``: keys every chunk carries too (a fan-out's ``f`` and ``d``). Raises
    :class:`ValueTooLargeError` above :func:`~.limits.max_value`."""
    if not buffers and len(payload) <= STREAM_ABOVE:  # most messages: one, no views to take
        return [codec.encode(header, payload)]
    views = [flat_view(b) for b in buffers] if buffers else []
    total = len(payload) + sum(v.nbytes for v in views)
    if total <= STREAM_ABOVE:
        return [codec.encode(header, payload, buffers)]
    limit = max_value()
    if total > limit:
        raise ValueTooLargeError(too_large(f"a {header.get('k')!r} message", total, limit))
    sections = [memoryview(payload), *views]
    start = dict(header, z=[s.nbytes for s in sections], pm=codec.payload_mac(payload))
    parts = [codec.encode(start)]
    extra = route or {}
    stream = start["sc"]
    for x, section in enumerate(sections):
        for offset in range(0, section.nbytes, CHUNK_SIZE):
            chunk = {"k": CHUNK, "st": stream, "x": x, "o": offset, **extra}
            parts.append(codec.encode(chunk, b"", [section[offset : offset + CHUNK_SIZE]]))
    return parts


@dataclass
class _Stream:
    """A message being reassembled: its sections and where the next chunk goes."""

    codec: Codec
    header: Header
    mac: bytes
    sections: list[memoryview]
    section: int = 0
    offset: int = 0
    fed: float = field(default_factory=time.monotonic)

    def skip_empty(self) -> None:
        while self.section < len(self.sections) and not self.sections[self.section].nbytes:
            self.section += 1

    @property
    def done(self) -> bool:
        return self.section >= len(self.sections)


def _allocate(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes; large ones are anonymous mappings, whose pages
    cost nothing until written."""
    if n <= _MAP_ABOVE:
        return memoryview(bytearray(n))
    # private: Python's default for anonymous maps is shared (shmem), much slower to fill
    return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


class Assembler:
    """Reassembles streamed messages for one receiving loop (thread-safe)."""

    def __init__(self) -> None:
        self._streams: OrderedDict[tuple[int, int, int], _Stream] = OrderedDict()
        self._lock = threading.Lock()

    def receive(self, codec: Codec, frames: list[Any]) -> Message | None:
        """Verify and decode ``frames``: the message, or None while it is a part of a
        stream not complete yet. WireError for anything forged, malformed or refused
        (counted in ``codec.rejected``)."""
        return self.feed(codec, codec.decode(frames))

    def feed(self, codec: Codec, msg: Message) -> Message | None:
        """``msg`` as it is (most messages), None for a stream's part, or the whole
        message its last chunk completes."""
        h = msg.header
        start = "z" in h
        if not start and h["k"] != CHUNK:
            return msg
        try:
            return self._start(codec, msg) if start else self._chunk(codec, msg)
        except WireError:
            codec.rejected += 1
            raise

    @property
    def pending(self) -> int:
        """Streams being reassembled now."""
        return len(self._streams)

    def forget(self, started_by: Callable[[Header], bool]) -> int:
        """Drop the streams whose start header ``started_by`` accepts (their sender
        died mid-way); how many."""
        with self._lock:
            gone = [k for k, s in self._streams.items() if started_by(s.header)]
            for key in gone:
                del self._streams[key]
        return len(gone)

    def _start(self, codec: Codec, msg: Message) -> Message | None:
        h = msg.header
        sizes, mac = h.pop("z"), h.pop("pm", None)
        if (
            type(sizes) is not list
            or not 1 <= len(sizes) <= 1 + MAX_BUFFERS
            or any(type(n) is not int or n < 0 for n in sizes)
            or type(mac) is not bytes
            or len(mac) != _MAC_SIZE
            or len(msg.payload)
            or msg.buffers
        ):
            raise WireError("malformed stream start (sizes, payload MAC or frames)")
        total, limit = sum(sizes), max_value()
        if total > limit:
            raise WireError(too_large(f"a streamed {h['k']!r} message", total, limit))
        stream = _Stream(codec, h, mac, [_allocate(n) for n in sizes])
        stream.skip_empty()
        if stream.done:  # nothing to wait for (no sender of ours streams an empty value)
            return self._complete(stream)
        with self._lock:
            self._forget_stale()
            while len(self._streams) >= MAX_STREAMS:
                self._streams.popitem(last=False)
            self._streams[(id(codec), h["sn"], h["sc"])] = stream
        return None

    def _forget_stale(self) -> None:
        cutoff = time.monotonic() - STALE_AFTER
        for key, stream in list(self._streams.items()):
            if stream.fed < cutoff:
                del self._streams[key]

    def _chunk(self, codec: Codec, msg: Message) -> Message | None:
        h = msg.header
        stream_id = h.get("st")
        if type(stream_id) is not int:
            raise WireError("a chunk without its stream's counter")
        key = (id(codec), h["sn"], stream_id)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.codec is not codec:
                raise WireError("a chunk of no stream known here (dropped)")
            self._streams.move_to_end(key)
            if len(msg.buffers) != 1 or not self._place(stream, h, msg.buffers[0]):
                del self._streams[key]
                raise WireError("a chunk out of order or beyond its section (stream dropped)")
            if not stream.done:
                return None
            del self._streams[key]
        return self._complete(stream)

    @staticmethod
    def _place(stream: _Stream, h: Header, data: Any) -> bool:
        """Copy a chunk where the stream expects its next bytes; False if it is not that."""
        n = memoryview(data).nbytes
        if stream.done or h.get("x") != stream.section or h.get("o") != stream.offset:
            return False
        target = stream.sections[stream.section]
        if not 0 < n <= target.nbytes - stream.offset:
            return False
        target[stream.offset : stream.offset + n] = memoryview(data).cast("B")
        stream.offset += n
        stream.fed = time.monotonic()
        if stream.offset == target.nbytes:
            stream.section += 1
            stream.offset = 0
            stream.skip_empty()
        return True

    @staticmethod
    def _complete(stream: _Stream) -> Message:
        payload, *buffers = stream.sections
        if not hmac.compare_digest(stream.codec.payload_mac(payload), stream.mac):
            raise WireError("a streamed payload does not match its signed MAC (dropped)")
        header = stream.header
        if buffers:
            header["b"] = [b.nbytes for b in buffers]
        return Message(header, payload, list(buffers))
