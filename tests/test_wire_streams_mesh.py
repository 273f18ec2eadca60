"""Streams of chunks against a real mesh whose sockets refuse frames above 64 MiB:
values far larger pass in chunks, and forged stream parts sent to a rank are dropped and
counted without allocating anything."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from actors import Counter
from helpers import wait_until

from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.wire import Codec
from monarch_kernel.wire import codec as C

pytestmark = pytest.mark.local

MIB = 1 << 20


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
