"""Streams of chunks (``wire/chunks.py``) on the decoder alone: exact reassembly,
bounded frames, and what a forged, stray, reordered, tampered or oversized part can do
(nothing but be dropped and counted). Against a real mesh: ``test_wire_streams_mesh.py``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from monarch_kernel import config
from monarch_kernel.wire import Codec, WireError, dumps, loads
from monarch_kernel.wire import chunks as S
from monarch_kernel.wire import codec as C
from monarch_kernel.wire import limits as L
from monarch_kernel.wire.serialize import ValueTooLargeError

pytestmark = pytest.mark.unit

MIB = 1 << 20
KEY = b"k" * 32


def _parts(codec: Codec, value: object, kind: str = "res") -> list[list]:
    payload, buffers = dumps(value)
    return [
        [bytes(memoryview(f)) for f in p]
        for p in S.encode_parts(codec, {"k": kind}, payload, buffers)
    ]


def _feed_all(asm: S.Assembler, codec: Codec, parts: list[list]):
    out = [asm.receive(codec, p) for p in parts]
    assert all(m is None for m in out[:-1]), "a message was handed on before its last chunk"
    return out[-1]


def test_stream_reassembles_payload_and_buffers_exactly():
    value: dict[str, Any] = {
        "text": bytes(range(256)) * (24 * 1024),  # 6 MiB inside the pickle: the payload streams
        "tensor": torch.arange(3 * MIB, dtype=torch.int32),  # 12 MiB out of band
        "array": np.arange(1000, dtype=np.float64),
        "empty": torch.empty(0),
    }
    enc, dec = Codec(KEY), Codec(KEY)
    parts = _parts(enc, value)
    assert len(parts) > 5
    limit = L.CHUNK_SIZE + C.MAX_HEADER
    assert all(len(f) <= limit for p in parts for f in p), "a frame is larger than a chunk"
    msg = _feed_all(S.Assembler(), dec, parts)
    back = loads(msg.payload, msg.buffers)
    assert back["text"] == value["text"] and torch.equal(back["tensor"], value["tensor"])
    assert (back["array"] == value["array"]).all() and back["empty"].numel() == 0
    assert msg.kind == "res" and dec.rejected == 0


def test_small_messages_are_not_streamed():
    enc = Codec(KEY)
    payload, buffers = dumps(torch.ones(MIB - 256))  # just under 4 MiB: one message
    assert len(S.encode_parts(enc, {"k": "res"}, payload, buffers)) == 1
    payload, buffers = dumps(torch.ones(MIB + 256))  # just over: a start and three chunks
    assert len(S.encode_parts(enc, {"k": "res"}, payload, buffers)) == 4


def test_start_above_the_bound_is_refused_before_allocating(monkeypatch):
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    parts = _parts(enc, torch.ones(4 * MIB))  # 16 MiB
    monkeypatch.setenv(L.MAX_VALUE_ENV, "8M")
    with pytest.raises(WireError, match=r"above the 8\.0 MiB bound"):
        asm.receive(dec, parts[0])
    assert asm.pending == 0 and dec.rejected == 1
    with pytest.raises(WireError, match="no stream known"):  # its chunks go nowhere
        asm.receive(dec, parts[1])
    # the sender refuses first, naming the bound and how to raise it
    with pytest.raises(ValueTooLargeError, match="MONARCH_KERNEL_MAX_VALUE.*max_value_size"):
        dumps(torch.ones(4 * MIB), "argument 'x' of f")


def test_stray_reordered_and_forged_chunks_are_dropped():
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    # the start, the payload's chunk, then the tensor's three chunks
    parts = _parts(enc, torch.arange(3 * MIB, dtype=torch.int32))
    assert len(parts) == 5
    with pytest.raises(WireError, match="no stream known"):  # a chunk with no start before it
        asm.receive(dec, parts[2])
    assert asm.receive(dec, parts[0]) is None
    with pytest.raises(WireError, match="out of order"):  # two chunks skipped
        asm.receive(dec, parts[3])
    assert asm.pending == 0
    with pytest.raises(WireError, match="no stream known"):  # the stream was dropped
        asm.receive(dec, parts[1])
    wrong = Codec(b"w" * 32)  # signed with another key: refused by the signature
    with pytest.raises(WireError, match="signature"):
        asm.receive(dec, _parts(wrong, torch.ones(2 * MIB))[0])
    # a stream of one codec is not fed by a chunk another codec (another mesh) decoded
    other_dec = Codec(KEY)
    parts = _parts(enc, torch.ones(2 * MIB))
    asm.receive(dec, parts[0])
    with pytest.raises(WireError, match="no stream known"):
        asm.receive(other_dec, parts[1])
    assert dec.rejected == 4 and other_dec.rejected == 1


def test_tampered_payload_chunk_fails_its_signed_mac():
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    parts = _parts(enc, b"p" * (6 * MIB))  # a payload of 6 MiB: start + 2 payload chunks
    victim = bytearray(parts[1][1])  # a chunk: its envelope, then its data
    victim[100] ^= 1
    parts[1][1] = bytes(victim)
    with pytest.raises(WireError, match="does not match its signed MAC"):
        _feed_all(asm, dec, parts)
    assert dec.rejected == 1 and asm.pending == 0


@pytest.mark.parametrize(
    "sizes,payload",
    [
        ("not a list", b""),
        ([-1], b""),
        ([1] * (C.MAX_BUFFERS + 2), b""),
        ([10], b"a payload where there must be none"),
    ],
)
def test_malformed_starts_are_refused(sizes, payload):
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    frames = enc.encode({"k": "res", "z": sizes, "pm": b"m" * 32}, payload)
    with pytest.raises(WireError, match="malformed stream start"):
        asm.receive(dec, frames)
    assert asm.pending == 0 and dec.rejected == 1


def test_streams_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(S, "MAX_STREAMS", 2)
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    starts = [_parts(enc, torch.ones(2 * MIB))[0] for _ in range(3)]
    for frames in starts:
        asm.receive(dec, frames)
    assert asm.pending == 2
    monkeypatch.setattr(S, "STALE_AFTER", 0.0)  # senders that died mid-way are forgotten
    asm.receive(dec, _parts(enc, torch.ones(2 * MIB))[0])
    assert asm.pending == 1


def test_streams_of_a_sender_that_died_are_dropped():
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    for rank in (1, 2):
        payload, buffers = dumps(torch.ones(2 * MIB))
        start = S.encode_parts(enc, {"k": "res", "r": rank}, payload, buffers)[0]
        asm.receive(dec, [bytes(memoryview(f)) for f in start])
    assert asm.forget(lambda h: h.get("r") == 1) == 1 and asm.pending == 1


def test_sizes_and_the_configured_bound():
    assert L.parse_size("8G", "X") == 8 << 30 and L.parse_size("123", "X") == 123
    for bad in ("lots", "-1", "0", "1.5G"):
        with pytest.raises(ValueError, match="X="):
            L.parse_size(bad, "X")
    before = os.environ.get(L.MAX_VALUE_ENV)
    with config.configured(max_value_size="3G"):
        assert L.max_value() == 3 << 30
        assert L.inherited_env() == {L.MAX_VALUE_ENV: str(3 << 30)}  # what ranks take on
    assert os.environ.get(L.MAX_VALUE_ENV) == before
    with pytest.raises(ValueError, match="max_value_size"):
        config.configure(max_value_size="a lot")
    assert L.max_value() >= 1 << 30  # default: half the machine's memory, at least 1 GiB
