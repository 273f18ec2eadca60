"""Streams of chunks (``wire/chunks.py``): exact reassembly, bounded frames, and what a
forged, stray, reordered, tampered or oversized part can do (nothing but be dropped and
counted), on the decoder alone and against a real mesh whose frame limit is far below
the values it carries."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from actors import Counter
from helpers import wait_until

from monarch_kernel import config
from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.wire import Codec, WireError, dumps, loads
from monarch_kernel.wire import chunks as S
from monarch_kernel.wire import codec as C
from monarch_kernel.wire import limits as L
from monarch_kernel.wire.serialize import ValueTooLargeError

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


@pytest.mark.unit
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


@pytest.mark.unit
def test_small_messages_are_not_streamed():
    enc = Codec(KEY)
    payload, buffers = dumps(torch.ones(MIB - 256))  # just under 4 MiB: one message
    assert len(S.encode_parts(enc, {"k": "res"}, payload, buffers)) == 1
    payload, buffers = dumps(torch.ones(MIB + 256))  # just over: a start and three chunks
    assert len(S.encode_parts(enc, {"k": "res"}, payload, buffers)) == 4


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_tampered_payload_chunk_fails_its_signed_mac():
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    parts = _parts(enc, b"p" * (6 * MIB))  # a payload of 6 MiB: start + 2 payload chunks
    victim = bytearray(parts[1][3])
    victim[100] ^= 1
    parts[1][3] = bytes(victim)
    with pytest.raises(WireError, match="does not match its signed MAC"):
        _feed_all(asm, dec, parts)
    assert dec.rejected == 1 and asm.pending == 0


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_streams_of_a_sender_that_died_are_dropped():
    enc, dec, asm = Codec(KEY), Codec(KEY), S.Assembler()
    for rank in (1, 2):
        payload, buffers = dumps(torch.ones(2 * MIB))
        start = S.encode_parts(enc, {"k": "res", "r": rank}, payload, buffers)[0]
        asm.receive(dec, [bytes(memoryview(f)) for f in start])
    assert asm.forget(lambda h: h.get("r") == 1) == 1 and asm.pending == 1


@pytest.mark.unit
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


# -- a real mesh whose frames are limited to 64 MiB ----------------------------------------
LIMIT = 64 * MIB


class Bytes(Actor):
    @endpoint
    def size_and_sum(self, t: torch.Tensor) -> tuple[int, int]:
        return t.numel(), int(t[:: 1 << 16].sum())

    @endpoint
    def make(self, n: int) -> torch.Tensor:
        return torch.full((n,), 2, dtype=torch.uint8)

    @endpoint
    def rss(self) -> int:
        return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def workers():
    """A 2-rank local mesh whose sockets refuse frames above 64 MiB (a shared fixture
    name: the orphan check runs at its teardown)."""
    from conftest import wait_no_orphans

    from monarch_kernel.actor import this_host

    old = os.environ.get(C.MAX_MESSAGE_ENV)
    os.environ[C.MAX_MESSAGE_ENV] = str(LIMIT)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2})
    finally:
        if old is None:
            del os.environ[C.MAX_MESSAGE_ENV]
        else:
            os.environ[C.MAX_MESSAGE_ENV] = old
    yield procs, procs.spawn("bytes", Bytes), procs.spawn("counter", Counter, 0)
    procs.stop()
    left = wait_no_orphans()
    assert not left, f"mesh left processes behind: {[p.pid for p in left]}"


def _rejected(procs) -> list[int]:
    return [v["rejected"] for v in procs.ping().get().values()]


def test_values_far_above_the_frame_limit_pass_in_chunks(workers):
    procs, data, _ = workers
    n = 200 * MIB  # > 3x the 64 MiB frame limit of every socket of this mesh
    t = torch.full((n,), 1, dtype=torch.uint8)
    assert data.size_and_sum.call(t).get().values() == [(n, n >> 16)] * 2  # fanned out
    back = data.slice(gpus=1).make.call_one(n).get()
    assert back.numel() == n and int(back[:: 1 << 16].sum()) == 2 * (n >> 16)
    procs.push(pushed=t)
    del t, back
    pulled = procs.pull("pushed").values()
    assert [x.numel() for x in pulled] == [n, n]
    assert _rejected(procs) == [0, 0]


def test_forged_stream_parts_at_a_rank_are_dropped(workers):
    procs, data, counter = workers
    rt = procs.runtime
    before = _rejected(procs)
    rss = data.slice(gpus=0).rss.call_one().get()
    forged = [
        # signed with the mesh key: a start announcing 1 TiB, far above the bound
        rt.codec.encode({"k": "push", "i": "x", "w": 1, "z": [0, 1 << 40], "pm": b"m" * 32}),
        # signed: chunks of a stream this rank never saw start
        rt.codec.encode({"k": "ck", "st": 10**9, "x": 1, "o": 0}, b"", [b"c" * 1000]),
        # no key: a start, and a chunk, signed with another
        Codec(os.urandom(32)).encode({"k": "push", "z": [0, 4 << 20], "pm": b"m" * 32}),
        Codec(os.urandom(32)).encode({"k": "ck", "st": 0, "x": 1, "o": 0}, b"", [b"c"]),
        # signed, announcing nothing, with a MAC that cannot match: refused at once
        rt.codec.encode({"k": "push", "i": "y", "w": 1, "z": [0], "pm": b"m" * 32}),
    ]
    for frames in forged:
        with rt.transport.send_lock:
            rt.transport.send_sock.send_multipart([b"c0", *frames])
    wait_until(
        lambda: _rejected(procs)[0] >= before[0] + 5,
        what="rank 0 to drop the forged parts",
        detail=lambda: _rejected(procs),
    )
    assert data.slice(gpus=0).rss.call_one().get() - rss < 64 * MIB  # nothing allocated
    before_value = counter.value.call().get().values()
    assert counter.incr.call(1).get().values() == [v + 1 for v in before_value]
