"""Framing and signing of control messages.

A message on the wire is ``[header, signature, payload, *buffers]``:

* ``header``: a dict (kind, request id, sender, targets, buffer sizes ...) of plain
  values in :mod:`marshal` format 4 (stable across Python 3 versions, and several times
  cheaper than JSON both ways; it is parsed only once the signature verified);
* ``signature``: HMAC-SHA256 over the header's length, header and payload with the
  mesh's random key (the length keeps bytes from moving between header and payload);
* ``payload``: a pickle (see :mod:`monarch_kernel.wire.serialize`);
* ``buffers``: out-of-band pickle-5 buffers (tensor and array data), sent zero-copy.

:meth:`Codec.decode` checks the signature **before** anything is parsed or unpickled;
a message that fails is dropped and counted in :attr:`Codec.rejected`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import marshal
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.backend import Socket as _BaseSocket

try:  # the C HMAC object behind hmac.HMAC: copy/update/digest without Python frames
    from _hashlib import hmac_new as _hmac_new
except ImportError:  # pragma: no cover - Python built without OpenSSL
    _hmac_new = None  # type: ignore[assignment]

log = logging.getLogger("monarch_kernel.wire")

MARSHAL_VERSION = 4

# The backend's send/recv, without the sugar layer's per-call type checks and enum
# arithmetic (several microseconds per message on the hot path).
_send = _BaseSocket.send
_recv = _BaseSocket.recv
_SNDMORE = int(zmq.SNDMORE)

#: Buffers smaller than this are copied into the zmq message (cheaper than zero-copy).
ZERO_COPY_THRESHOLD = 64 * 1024


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

    @property
    def kind(self) -> str:
        return self.header["k"]

    @property
    def nbytes(self) -> int:
        return len(self.payload) + sum(memoryview(b).nbytes for b in self.buffers)


def new_key() -> bytes:
    """A fresh random per-mesh signing key."""
    import secrets

    return secrets.token_bytes(32)


class Codec:
    """Signs outgoing frames and verifies incoming ones with one mesh key."""

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("a mesh signing key must not be empty")
        if _hmac_new is not None:
            self._mac = _hmac_new(key, digestmod="sha256")
        else:  # pragma: no cover
            self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self.rejected = 0
        self.bytes_out = 0
        self.bytes_in = 0

    def _sign(self, header: bytes, payload: bytes | memoryview) -> bytes:
        mac = self._mac.copy()
        mac.update(len(header).to_bytes(4, "little"))
        mac.update(header)
        mac.update(payload)
        return mac.digest()

    def encode(
        self, header: Header, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> list[Any]:
        """Frames for ``header`` + ``payload`` + zero-copy ``buffers``."""
        size = len(payload)
        if buffers:
            header["b"] = sizes = [memoryview(b).nbytes for b in buffers]
            size += sum(sizes)
        hb = marshal.dumps(header, MARSHAL_VERSION)
        self.bytes_out += len(hb) + size
        return [hb, self._sign(hb, payload), payload, *buffers]

    def decode(self, frames: list[Any]) -> Message:
        """Verify and split ``frames`` (bytes or zmq Frames); raise WireError if forged."""
        if len(frames) < 3:
            self.rejected += 1
            raise WireError(f"malformed message: {len(frames)} frames, expected at least 3")
        hb, sig, payload = frames[0], frames[1], frames[2]
        if hb.__class__ is not bytes:
            hb, sig = _as_bytes(hb), _as_bytes(sig)
        if payload.__class__ is not bytes:
            payload = _payload_of(payload)
        if not hmac.compare_digest(self._sign(hb, payload), sig):
            self.rejected += 1
            raise WireError("message signature does not verify (forged or wrong mesh key)")
        try:
            header = _load_header(hb)
            sizes = header.get("b")
            buffers = _check_buffers(sizes, frames[3:]) if sizes or len(frames) > 3 else []
        except (ValueError, TypeError) as exc:
            self.rejected += 1
            raise WireError(f"malformed message: {exc}") from None
        self.bytes_in += len(hb) + len(payload) + (sum(sizes) if sizes else 0)
        return Message(header, payload, buffers)


def _check_buffers(sizes: Any, frames: list[Any]) -> list[memoryview]:
    buffers = [_as_buffer(f) for f in frames]
    sizes = sizes or []
    if len(sizes) != len(buffers) or any(s != b.nbytes for s, b in zip(sizes, buffers)):
        raise ValueError("buffer frames do not match the sizes in the header")
    return buffers


def _load_header(hb: bytes) -> dict[str, Any]:
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
    return frame.bytes  # zmq.Frame


def _payload_of(frame: Any) -> bytes | bytearray | memoryview:
    """A zero-copy view of a large zmq Frame; a copy of a small one.

    A small copy costs less than the view, and lets the Frame go at once: pyzmq runs
    pending signal handlers when a Frame is freed and drops what they raise, so a Frame
    freed later in user code could swallow a Ctrl-C.
    """
    if isinstance(frame, (bytearray, memoryview)):
        return frame
    if len(frame) < ZERO_COPY_THRESHOLD:
        return frame.bytes
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
    message goes or none of it does.
    """
    more = _SNDMORE | flags
    if prefix:
        for p in prefix:
            _send(sock, p, more)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        size = len(f) if f.__class__ is bytes else memoryview(f).nbytes
        _send(sock, f, flags if i == last else more, size < ZERO_COPY_THRESHOLD)


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
