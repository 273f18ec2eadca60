"""The floors of our wire format: how close to raw ZeroMQ a call *could* be.

Row 2 compares a gathered call with raw pings (one byte out, one byte back, nothing
parsed). Between the two lie two costs of different kinds: what our wire format itself
costs per message in Python (framing, signing, pickling, the codec's checks), which any
implementation of this protocol pays, and what our runtime adds on top (request
bookkeeping, routing, the actor's dispatch, telemetry). This module measures the first,
so that ``bench/results/call-floor.md`` can split the gap between the two.

Each "rank" is a server process (``python -m bench.wire_floor MODE ADDR``) that answers
a no-op call, and the client sends one call to each of N servers and reads N replies,
the shape of a gathered call, in one of five modes (each adds one layer to the one
before it, except ``signed``, which replaces ``hmac``'s signature with ours):

* ``pickled``: the call and the reply are pickles (``("ping", ())`` and ``None``), one
  frame each; nothing else;
* ``framed``: plus our envelope's header (a marshal-ed dict with the kind and the
  request id, prefixed by its length), parsed on both sides;
* ``hmac``: plus an HMAC-SHA256 signature over word, header and payload (OpenSSL's,
  through ``hmac``), verified before anything is parsed: what signed our messages until
  protocol 14;
* ``signed``: the same with our signature instead, keyed BLAKE2b-256
  (:func:`monarch_kernel.wire.codec.signer`);
* ``codec``: :class:`monarch_kernel.wire.codec.Codec` itself: size limits, the sender's
  nonce and counter, the receiver's replay window.

The servers use the same send and receive functions as the ranks
(:func:`monarch_kernel.wire.codec.send` / :func:`recv`) and the same transport as the
raw floor they are compared with (tcp loopback).
"""

from __future__ import annotations

import hmac
import marshal
import pickle
import sys
from collections.abc import Callable
from typing import Any

import zmq

from bench.server_procs import ServerProcs
from monarch_kernel.wire.codec import SIGNATURE_SIZE, Codec, recv, send, signer

#: The modes, in the order of the module's docstring.
MODES = ("pickled", "framed", "hmac", "signed", "codec")
#: The key every process of one measurement signs with (a benchmark, not a secret).
_KEY = b"wire-floor-benchmark-key-32bytes"
_CALL = pickle.dumps(("ping", ()), 5)
_QUIT = "q"
#: How long the client waits for a server's port or reply before it gives up (a server
#: that died must fail the measurement, not hang it).
TIMEOUT_S = 10.0


def _openssl_hmac() -> Any:
    try:
        from _hashlib import hmac_new
    except ImportError:  # Python built without OpenSSL
        return hmac.new(_KEY, digestmod="sha256")
    return hmac_new(_KEY, digestmod="sha256")


class Wire:
    """One mode's encoding and decoding of a message (header dict + pickled payload)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown wire mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.codec = Codec(_KEY)
        # the keyed state each message copies: ours, or OpenSSL's HMAC for "hmac" (its C
        # object, as the codec used it: no Python frames in copy, update, digest)
        self._mac: Any = _openssl_hmac() if mode == "hmac" else signer(_KEY)

    def encode(self, header: dict[str, Any], payload: bytes) -> list[Any]:
        """The frames of one message in this mode."""
        mode = self.mode
        if mode == "codec":
            return self.codec.encode(header, payload)
        if mode == "pickled":
            return [payload]
        hb = marshal.dumps(header, 4)
        word = len(hb).to_bytes(4, "little") + hb
        if mode == "framed":
            return [word + payload]
        mac = self._mac.copy()
        mac.update(word)
        mac.update(payload)
        return [b"".join((word, mac.digest(), payload))]

    def decode(self, frames: list[Any]) -> tuple[dict[str, Any], bytes]:
        """``(header, payload)`` of received frames (zmq Frames; bytes for ``codec``);
        ValueError (``WireError`` for ``codec``) if the signature does not verify."""
        mode = self.mode
        if mode == "codec":
            m = self.codec.decode(frames)
            return m.header, bytes(m.payload)
        env = frames[0].bytes
        if mode == "pickled":
            return {}, env
        end = 4 + int.from_bytes(env[:4], "little")
        if mode == "framed":
            return marshal.loads(env[4:end]), env[end:]
        payload = env[end + SIGNATURE_SIZE :]
        mac = self._mac.copy()
        mac.update(env[:end])
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), env[end : end + SIGNATURE_SIZE]):
            raise ValueError("signature does not verify")
        return marshal.loads(env[4:end]), payload


def serve(mode: str, addr: str) -> None:
    """Print the port, then answer calls in ``mode`` until told to quit."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    print(sock.bind_to_random_port(f"tcp://{addr}"), flush=True)
    wire = Wire(mode)
    endpoints: dict[str, Callable[..., object]] = {"ping": lambda: None}
    try:
        while True:
            ident, *frames = recv(sock)
            header, payload = wire.decode(frames)
            name, args = pickle.loads(payload)
            if name == _QUIT:
                return
            result = endpoints[name](*args)
            reply = wire.encode({"k": "r", "i": header.get("i", 0)}, pickle.dumps(result, 5))
            send(sock, reply, [ident.bytes])
    finally:
        ctx.destroy(linger=0)


class WireServers:
    """``n`` server processes answering in ``mode``; :meth:`call` is one gathered call."""

    def __init__(self, n: int, mode: str) -> None:
        self.wire = Wire(mode)
        self._servers = ServerProcs("bench.wire_floor", [[mode, "127.0.0.1"]] * n, TIMEOUT_S)
        self.procs = self._servers.procs
        self.socks = self._servers.socks
        self._id = 0

    def call(self) -> list[object]:
        """A no-op call on every server, all replies gathered (and checked)."""
        self._id += 1
        wire = self.wire
        for s in self.socks:
            send(s, wire.encode({"k": "c", "i": self._id}, _CALL))
        out = []
        for s in self.socks:
            header, payload = wire.decode(recv(s))  # zmq.Again after TIMEOUT_S
            if header.get("i", self._id) != self._id:
                raise RuntimeError(f"reply to call {header['i']}, expected {self._id}")
            out.append(pickle.loads(payload))
        return out

    def close(self) -> None:
        """Tell every server to quit and wait for it (killed after ``TIMEOUT_S``)."""
        self._servers.close(self.wire.encode({"k": "c", "i": 0}, pickle.dumps((_QUIT, ()), 5)))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
