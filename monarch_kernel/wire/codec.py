"""Framing and signing of control messages.

A message on the wire is ``[envelope, *buffers]``, or ``[envelope, payload, *buffers]``
when its payload is large. The envelope is one frame::

    word (4 bytes, little-endian) | header | signature (32 bytes) | payload (if inline)

* ``word``: the header's length in its low 31 bits; bit 31 set when the payload is not
  in the envelope but in the next frame (payloads above :data:`INLINE_PAYLOAD` bytes:
  they go zero-copy on their own instead of being copied into the envelope);
* ``header``: a dict (kind, request id, sender, targets, buffer sizes ...) of plain
  values in :mod:`marshal` format 4 (stable across Python 3 versions, and several times
  cheaper than JSON both ways; it is parsed only once the signature verified);
* ``signature``: keyed BLAKE2b-256 (:func:`signer`) with the mesh's random key over
  the word, the header and the payload (the word fixes where the header ends, so no
  byte can move between header and payload, and where the payload travels); HMAC-SHA256
  until protocol 14;
* ``payload``: a pickle (see :mod:`monarch_kernel.wire.serialize`);
* ``buffers``: out-of-band pickle-5 buffers (tensor and array data), sent zero-copy.

One frame instead of three for the common message: every zmq frame costs a send and a
receive call (and a ``zmq.Frame`` object) on each side, the largest part of the wire's
CPU cost for a small message.

:meth:`Codec.decode` checks, in this order and before anything is parsed or unpickled,
the frame count (1 to :data:`MAX_FRAMES`), the envelope's size against its word (the
header at most :data:`MAX_HEADER` bytes, room for it and the signature, nothing after
the signature when the payload is a frame of its own), then the signature; only then is
the header parsed, the buffer frames matched against its sizes (``b``) and the message
checked against replay. A message that fails any check is dropped and counted in
:attr:`Codec.rejected` (replays also in :attr:`Codec.replayed`). The payload is never
unpickled here: the callers unpickle a decoded (verified) message's payload.

Replay protection. Every encoded header carries, inside the signed part, the sender's
nonce ``sn`` (random, 64 bits, one per :class:`Codec` instance, i.e. per process side;
renewed in a forked child) and a counter ``sc`` (0, 1, 2 ... per nonce). The decoder
remembers, per nonce, which counters it has seen (a bit per counter in 64-bit chunks,
:data:`MAX_CHUNKS` chunks at most, above a floor below which everything is refused) and
drops a counter seen before. Messages may arrive out of order (several threads encode
concurrently; a rank receives the controller's messages on three paths), and a receiver
sees only its share of a sender's counters, so the bound is on the messages this
receiver decoded, not on counter distance. At most :data:`MAX_SENDERS` nonces are
remembered (least recently seen evicted). The state is per receiving codec: a message
may legitimately reach several receivers (a fan-out reaches every rank of a host byte
for byte), so a copy captured on its way to one receiver is not refused by a receiver
that never saw it. See SECURITY.md.

Sizes (:mod:`monarch_kernel.wire.limits`). :func:`max_message` is set as
``ZMQ_MAXMSGSIZE`` on every socket that receives from a peer (:func:`limit_size`):
libzmq drops the connection of a peer that announces a larger frame before it
allocates it. :meth:`Codec.encode` refuses to build a frame above it (a clear error at
the sender instead of a silently dropped connection). Values larger than a chunk travel
as a stream of bounded messages (:mod:`monarch_kernel.wire.chunks`), so no legitimate
frame comes near the limit.

Size: over the ~450-line habit: the framing, signing and verification of every message
are one hot path, kept in one module so that each step can be inlined and measured
together (``make bench``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import marshal
import os
import pickle
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.backend import Socket as _BaseSocket

from monarch_kernel.wire.handoff import current as current_handoff

# Re-exported: the limits lived here first, and tests and callers import them from here.
from monarch_kernel.wire.limits import DEFAULT_MAX_MESSAGE as DEFAULT_MAX_MESSAGE
from monarch_kernel.wire.limits import MAX_HEADER as MAX_HEADER
from monarch_kernel.wire.limits import MAX_MESSAGE_ENV as MAX_MESSAGE_ENV
from monarch_kernel.wire.limits import limit_size as limit_size
from monarch_kernel.wire.limits import max_message as max_message

log = logging.getLogger("monarch_kernel.wire")

MARSHAL_VERSION = 4

# The backend's send/recv, without the sugar layer's per-call type checks and enum
# arithmetic (several microseconds per message on the hot path).
_send = _BaseSocket.send
_recv = _BaseSocket.recv
_SNDMORE = int(zmq.SNDMORE)
#: ``flags`` for :func:`send` / :func:`recv` that never block (raise ``zmq.Again``): a
#: plain int, as pyzmq's enum arithmetic costs microseconds per call.
NOBLOCK = int(zmq.NOBLOCK)

#: Buffers smaller than this are copied into the zmq message (cheaper than zero-copy).
ZERO_COPY_THRESHOLD = 64 * 1024

#: Most out-of-band buffer frames in one message (``serialize.dumps`` keeps further
#: buffers in the pickle).
MAX_BUFFERS = 1024
#: Most frames in one message: the envelope, a separate payload and the buffers.
MAX_FRAMES = 2 + MAX_BUFFERS
#: Length of a signature (keyed BLAKE2b-256).
SIGNATURE_SIZE = 32
#: Payloads up to this many bytes travel inside the envelope (copied into it once: less
#: than a frame of their own costs both sides); larger ones are a zero-copy frame.
INLINE_PAYLOAD = 16 * 1024
#: The envelope's word: bit 31 says the payload is the next frame, the rest is the
#: header's length (at most MAX_HEADER, so a word is never 0xFFFFFFFF, the prefix of a
#: streamed payload's MAC: the two never sign the same bytes).
SEPARATE_PAYLOAD = 1 << 31
_LENGTH = SEPARATE_PAYLOAD - 1
#: The envelope's fixed part: the word and the signature.
ENVELOPE_MIN = 4 + SIGNATURE_SIZE
#: Replay state per sender: counters are remembered in 64-bit chunks (bit ``c & 63`` of
#: chunk ``c >> 6``) above a floor (counters below it are refused). Leading chunks whose
#: counters were all seen are folded into the floor, so a sender whose counters a
#: receiver sees densely (a rank's messages to the controller) costs a chunk or two.
#: One seen sparsely (the controller's counter is shared by all its destinations)
#: takes up to a chunk per message: at most this many chunks per sender, the oldest
#: forgotten first (the floor rises over it). A message held back on one path (e.g. in
#: a busy rank's inbox) is refused only once this receiver has decoded this many newer
#: messages from the same sender on other paths.
MAX_CHUNKS = 2048
#: Counters before a new sender's first one that are still accepted (once each): it
#: may come on one path while earlier ones are on their way on another.
_FIRST_SLACK = 1024
_FULL = (1 << 64) - 1
#: Senders (nonces) whose replay windows one codec remembers.
MAX_SENDERS = 4096

#: A decoded header: plain marshal-able values under the short keys documented in
#: :mod:`monarch_kernel.wire.kinds`.
Header = dict[str, Any]
#: An out-of-band buffer: anything that exports the buffer protocol.
Buffer = bytes | bytearray | memoryview | pickle.PickleBuffer


class WireError(Exception):
    """A message was forged, malformed or failed verification."""


@dataclass
class Message:
    """A decoded control message."""

    header: Header
    payload: bytes | memoryview = b""
    buffers: list[Any] = field(default_factory=list)
    #: Why its out-of-band buffers could not be read (``wire.arena``): the receiver
    #: answers the message with this error instead of running it. Empty: they were.
    lost: str = ""

    @property
    def kind(self) -> str:
        """The message's kind (header ``k``)."""
        kind: str = self.header["k"]
        return kind

    @property
    def nbytes(self) -> int:
        buffers = self.buffers  # none, most often: no generator to run then
        size = len(self.payload)
        return size + sum(memoryview(b).nbytes for b in buffers) if buffers else size


#: BLAKE2b's personalisation for message signatures: a digest made for anything else
#: with the same key never equals a message's. Fixed: it names the protocol that
#: introduced it, and changes only with the signature scheme, not with every version.
SIGNATURE_PERSON = b"monarch-wire-v14"


def signer(key: bytes) -> hashlib.blake2b:
    """The keyed BLAKE2b-256 state that signs with ``key``: :class:`Codec` copies it
    for each message (``copy``, ``update``, ``digest``).

    Keyed BLAKE2b is a MAC by design (RFC 7693: the key is a parameter, no HMAC
    construction needed). Its C code is CPython's own and short: a copy, update and
    digest per small message costs about a fifth of OpenSSL's HMAC-SHA256 (0.6 against
    3.1 µs on the 2-core benchmark machine; ``bench/wire_floor.py`` measures both on
    the wire). Keys above BLAKE2b's 64 bytes are hashed down first.
    """
    if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
        key = hashlib.blake2b(key).digest()
    return hashlib.blake2b(key=key, digest_size=SIGNATURE_SIZE, person=SIGNATURE_PERSON)


def new_key() -> bytes:
    """A fresh random per-mesh signing key."""
    import secrets

    return secrets.token_bytes(32)


_live_codecs: weakref.WeakSet[Codec] = weakref.WeakSet()


def _renew_nonces() -> None:  # in a forked child: never encode under the parent's nonce
    for codec in list(_live_codecs):
        codec._new_sender()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_nonces)


class Codec:
    """Signs outgoing frames and verifies incoming ones with one mesh key.

    Thread-safe: several threads may encode and decode with one codec.
    """

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("a mesh signing key must not be empty")
        self._mac = signer(key)
        #: Messages dropped: malformed, forged, oversized or replayed.
        self.rejected = 0
        #: Of those, signed messages dropped as replays (duplicate or too old a counter).
        self.replayed = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.max_message = max_message()
        # per sender nonce: [floor, {chunk: 64-bit word}]: counters below floor and
        # those whose bit is set were seen (or are too old)
        self._windows: OrderedDict[int, list[Any]] = OrderedDict()
        self._window_lock = threading.Lock()
        self._new_sender()
        _live_codecs.add(self)

    def _new_sender(self) -> None:
        self.nonce = secrets.randbits(64)
        self._counter = itertools.count()

    def _seal(self, hb: bytes, payload: bytes | bytearray | memoryview = b"") -> list[Any]:
        """The envelope (and payload frame, if separate) for a marshalled header ``hb``:
        the signed frames of a message without its buffers."""
        mac = self._mac.copy()
        if len(payload) <= INLINE_PAYLOAD:  # the common case: one frame
            word = len(hb).to_bytes(4, "little") + hb
            mac.update(word)
            mac.update(payload)
            return [b"".join((word, mac.digest(), payload))]
        word = (len(hb) | SEPARATE_PAYLOAD).to_bytes(4, "little") + hb
        mac.update(word)
        mac.update(payload)
        return [word + mac.digest(), payload]

    def payload_mac(self, payload: Buffer) -> bytes:
        """The MAC (keyed BLAKE2b) of a streamed payload, sent in its signed start
        header (its prefix, a word no envelope has (:data:`SEPARATE_PAYLOAD`), keeps it
        apart from message signatures)."""
        mac = self._mac.copy()
        mac.update(b"\xff\xff\xff\xff")
        mac.update(payload)
        return mac.digest()

    def encode(
        self, header: Header, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> list[Any]:
        """Frames for ``header`` + ``payload`` + zero-copy ``buffers``.

        Sets ``sn``/``sc`` (and ``b`` when there are buffers) in ``header``. Raises
        WireError for a message no peer would accept (too many buffers, too large a
        header or frame).
        """
        size = len(payload)
        limit = self.max_message
        if buffers:
            header["b"] = sizes = [memoryview(b).nbytes for b in buffers]
            size += sum(sizes)
            if len(sizes) > MAX_BUFFERS or max(sizes) > limit:
                raise WireError(_too_big(sizes, limit))
        if len(payload) > limit:
            raise WireError(_too_big([len(payload)], limit))
        header["sn"] = self.nonce
        header["sc"] = next(self._counter)
        hb = marshal.dumps(header, MARSHAL_VERSION)
        if len(hb) > MAX_HEADER:
            raise WireError(f"message header of {len(hb)} bytes exceeds {MAX_HEADER} bytes")
        self.bytes_out += len(hb) + size
        frames = self._seal(hb, payload)
        if buffers:
            frames += buffers
        return frames

    def decode(self, frames: list[Any]) -> Message:
        """Verify and split ``frames`` (bytes or zmq Frames); raise WireError if forged,
        malformed, oversized or replayed. Nothing is unpickled.

        One function of ~75 lines on purpose: every message of every process passes
        here, and the checks run in the order that keeps forged input cheapest (sizes,
        then the signature, then the header, then the replay window) without a call per step.

        Long on purpose: the hot receive path (every message of every process), inlined for speed:
        each call it would make costs about as much as a small message's decode (``make bench``).
        """
        n = len(frames)
        if n < 1 or n > MAX_FRAMES:
            self.rejected += 1
            raise WireError(f"malformed message: {n} frames, expected 1 to {MAX_FRAMES}")
        env = frames[0]
        if env.__class__ is not bytes:
            env = _as_bytes(env)
        size = len(env)
        word = int.from_bytes(env[:4], "little")
        hl = word & _LENGTH
        end = 4 + hl + SIGNATURE_SIZE
        first = 2 if word & SEPARATE_PAYLOAD else 1  # the first buffer frame
        if (
            size < end
            or hl > MAX_HEADER
            or n - first > MAX_BUFFERS
            or (first == 2 and (size != end or n < 2))
        ):
            self.rejected += 1
            raise WireError(_bad_envelope(size, hl, first == 2, n))
        hb = env[4 : end - SIGNATURE_SIZE]
        if first == 1:
            payload: Any = env[end:]
        else:
            payload = frames[1]
            if payload.__class__ is not bytes:
                payload = _payload_of(payload)
        mac = self._mac.copy()
        mac.update(env[: end - SIGNATURE_SIZE])
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), env[end - SIGNATURE_SIZE : end]):
            self.rejected += 1
            raise WireError("message signature does not verify (forged or wrong mesh key)")
        try:
            header = _load_header(hb)
            sizes = header.get("b")
            buffers = _check_buffers(sizes, frames[first:]) if sizes or n > first else []
            nonce = header["sn"]
            count = header["sc"]
            if type(nonce) is not int or type(count) is not int or count < 0:
                raise ValueError("bad sender nonce or counter")
        except (ValueError, TypeError, KeyError) as exc:
            self.rejected += 1
            raise WireError(f"malformed message: {exc!r}") from None
        # Replay check (inline: this is the hot path); see MAX_CHUNKS.
        lock = self._window_lock
        lock.acquire()
        try:
            windows = self._windows
            w = windows.get(nonce)
            if w is None:
                if len(windows) >= MAX_SENDERS:
                    windows.popitem(last=False)
                # [floor, chunks, first counter seen, counters seen before that one]
                w = windows[nonce] = [count & ~63, OrderedDict(), count, set()]
            else:
                windows.move_to_end(nonce)
            if count < w[2]:  # sent before the first one seen: up to _FIRST_SLACK, once
                pre = w[3]
                fresh = count >= w[2] - _FIRST_SLACK and count not in pre
                if fresh:
                    pre.add(count)
            elif count < w[0]:
                fresh = False
            else:
                chunks = w[1]
                key = count >> 6
                bit = 1 << (count & 63)
                word = chunks.get(key, 0)
                fresh = not word & bit
                if fresh:
                    chunks[key] = word = word | bit
                    if word == _FULL or w[2] > key << 6:
                        _compact(w)
                    if len(chunks) > MAX_CHUNKS:  # forget the oldest chunk
                        old = chunks.popitem(last=False)[0]
                        if (old + 1) << 6 > w[0]:
                            w[0] = (old + 1) << 6
        finally:
            lock.release()
        if not fresh:
            self.rejected += 1
            self.replayed += 1
            raise WireError("replayed message (its sender's counter was seen before)")
        self.bytes_in += len(hb) + len(payload) + (sum(sizes) if sizes else 0)
        return Message(header, payload, buffers)


def _bad_envelope(size: int, hl: int, separate: bool, n: int) -> str:
    """Why an envelope of ``size`` bytes whose word says ``hl`` and ``separate`` (in a
    message of ``n`` frames) is malformed."""
    if size < ENVELOPE_MIN:
        return (
            f"malformed message: envelope of {size} bytes, shorter than its length word "
            f"and {SIGNATURE_SIZE}-byte signature"
        )
    if hl > MAX_HEADER:
        return f"malformed message: header of {hl} bytes (at most {MAX_HEADER})"
    if size < 4 + hl + SIGNATURE_SIZE:
        return (
            f"malformed message: envelope of {size} bytes, too short for its header of "
            f"{hl} bytes and {SIGNATURE_SIZE}-byte signature"
        )
    if n - (2 if separate else 1) > MAX_BUFFERS:
        return f"malformed message: {n} frames, more than {MAX_BUFFERS} buffers"
    if n < 2:
        return "malformed message: its payload frame is missing"
    return "malformed message: payload both in the envelope and in a frame of its own"


def _compact(w: list[Any]) -> None:
    """Raise a sender's floor over its leading chunks whose counters were all seen
    (counters before the first one seen are tracked apart): a dense sender keeps a chunk
    or two. A chunk with a counter missing (a message held back on another path) stops
    it, so such a message is never refused for being late."""
    floor, chunks, start, _ = w
    key = floor >> 6
    while True:
        base = key << 6
        below = 0 if start <= base else _FULL if start >= base + 64 else (1 << (start - base)) - 1
        if chunks.get(key, 0) | below != _FULL:
            break
        chunks.pop(key, None)
        key += 1
    w[0] = key << 6


def _too_big(sizes: list[int], limit: int) -> str:
    if len(sizes) > MAX_BUFFERS:
        return f"a message carries at most {MAX_BUFFERS} buffers, not {len(sizes)}"
    return (
        f"a frame of {max(sizes)} bytes exceeds the {limit}-byte limit on messages "
        f"({MAX_MESSAGE_ENV}); raise it on every process of the mesh to send it"
    )


def _check_buffers(sizes: Any, frames: list[Any]) -> list[memoryview]:
    buffers = [_as_buffer(f) for f in frames]
    sizes = sizes or []
    if len(sizes) != len(buffers) or any(s != b.nbytes for s, b in zip(sizes, buffers)):
        raise ValueError("buffer frames do not match the sizes in the header")
    return buffers


def _load_header(hb: bytes) -> Header:
    # Only ever called on a header whose signature verified: marshal is not meant for
    # data from untrusted sources.
    try:
        header = marshal.loads(hb)
    except EOFError:
        raise ValueError("truncated header") from None
    if type(header) is not dict or "k" not in header:
        raise ValueError("header is not a dict with a kind")
    return header


def _as_bytes(frame: Any) -> bytes:
    if frame.__class__ is bytes:
        return frame
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    data: bytes = frame.bytes  # zmq.Frame
    return data


def _payload_of(frame: Any) -> bytes | bytearray | memoryview:
    """A zero-copy view of a large zmq Frame; a copy of a small one.

    A small copy costs less than the view, and lets the Frame go at once: pyzmq runs
    pending signal handlers when a Frame is freed and drops what they raise, so a Frame
    freed later in user code could swallow a Ctrl-C.
    """
    if isinstance(frame, (bytearray, memoryview)):
        return frame
    if len(frame) < ZERO_COPY_THRESHOLD:
        data: bytes = frame.bytes
        return data
    return _as_buffer(frame)


def _as_buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


def send(sock: Any, frames: list[Any], prefix: list[bytes] | None = None, flags: int = 0) -> None:
    """Send ``frames`` on a zmq socket, zero-copy for large buffers.

    ``flags=zmq.NOBLOCK``: raise ``zmq.Again`` instead of blocking when the peer's queue
    is full. A ROUTER decides that on the first (identity) frame, so either the whole
    message goes or none of it does. Inside :func:`monarch_kernel.wire.handoff.values`
    the zero-copy frames are tracked (the block waits until libzmq let go of them).
    """
    more = _SNDMORE | flags
    if prefix:
        for p in prefix:
            _send(sock, p, more)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        flag = flags if i == last else more
        if f.__class__ is bytes:  # immutable: zero-copy when large, never tracked
            _send(sock, f, flag, len(f) < ZERO_COPY_THRESHOLD)  # type: ignore[call-overload]
            continue
        if memoryview(f).nbytes < ZERO_COPY_THRESHOLD:
            _send(sock, f, flag, True)
            continue
        tracking = current_handoff()  # the sender's value must not change under libzmq
        if tracking is None:
            _send(sock, f, flag, False)
        else:
            tracking.trackers.append(_send(sock, f, flag, False, True))


_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def readable(sock: Any) -> bool:
    """Whether a message is waiting on ``sock`` (no syscall when one is)."""
    return bool(_BaseSocket.get(sock, _EVENTS) & _POLLIN)  # type: ignore[operator]


def recv(sock: Any, flags: int = 0) -> list[Any]:
    """Receive one multipart message as zmq Frames (zero-copy; ``.bytes`` copies)."""
    f = _recv(sock, flags, False)
    parts = [f]
    while f.more:
        f = _recv(sock, 0, False)
        parts.append(f)
    return parts
