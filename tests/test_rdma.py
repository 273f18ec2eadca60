"""``monarch_kernel.rdma.RDMABuffer``: another process's memory, read and written in
place over the data plane (shared memory within a host, its socket otherwise)."""

from __future__ import annotations

import os
import pickle

import psutil
import pytest
import torch
from helpers import wait_until

from monarch_kernel.actor import Actor, ActorError, endpoint, this_host
from monarch_kernel.rdma import RDMABuffer, RDMAError

pytestmark = pytest.mark.local

BIG = 2 * 1024 * 1024  # over SHM_MIN_BYTES: lives in shared memory (other ranks on host)


class Owner(Actor):
    def __init__(self) -> None:
        self.data: dict[int, torch.Tensor] = {}

    @endpoint
    def make(self, n: int) -> RDMABuffer:
        self.data[n] = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
        return RDMABuffer(self.data[n])

    @endpoint
    def head(self, n: int, k: int) -> list[int]:
        return self.data[n][:k].tolist()

    @endpoint
    def in_shm(self, buf: RDMABuffer) -> bool:
        return bool(buf._ref.shm)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def die(self) -> None:
        os._exit(3)


class AsyncReader(Actor):
    @endpoint
    async def write(self, buf: RDMABuffer, value: int, k: int) -> None:
        await buf.write_from(torch.full((k,), value, dtype=torch.uint8))


class Reader(Actor):
    @endpoint
    def read_sum(self, buf: RDMABuffer) -> int:
        dst = torch.zeros(buf.size(), dtype=torch.uint8)
        buf.read_into(dst).get()
        return int(dst.sum())

    @endpoint
    def write(self, buf: RDMABuffer, value: int, k: int) -> None:
        buf.write_from(torch.full((k,), value, dtype=torch.uint8)).get()

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get()

    @endpoint
    def read_memoryview(self, buf: RDMABuffer) -> bytes:
        out = bytearray(buf.size())
        buf.read_into(memoryview(out)).get()
        return bytes(out[:4])


def _expected_sum(n: int) -> int:
    return int(torch.arange(n, dtype=torch.int64).remainder(251).sum())


@pytest.fixture(scope="module")
def two_meshes():
    a = this_host().spawn_procs(per_host={"gpus": 2})
    b = this_host().spawn_procs(per_host={"gpus": 1})
    yield (
        a.spawn("owner", Owner).slice(gpus=0),
        b.spawn("reader", Reader),
        b.spawn("ar", AsyncReader),
    )
    a.stop()
    b.stop()


@pytest.mark.parametrize("n", [1000, BIG], ids=["socket", "shm"])
def test_read_and_write_between_two_meshes(two_meshes, n):
    owner, reader, async_reader = two_meshes
    buf = owner.make.call_one(n).get()
    assert buf.size() == n and "rank 0" in buf.owner
    assert owner.in_shm.call_one(buf).get() is (n == BIG)
    assert reader.read_sum.call_one(buf).get() == _expected_sum(n)
    assert reader.read_memoryview.call_one(buf).get() == bytes([0, 1, 2, 3])
    reader.write.call_one(buf, 9, 5).get()
    assert owner.head.call_one(n, 7).get() == [9, 9, 9, 9, 9, 5, 6]
    async_reader.write.call_one(buf, 8, 2).get()  # awaited in an async endpoint
    assert owner.head.call_one(n, 3).get() == [8, 8, 9]
    reader.write.call_one(buf, 9, 5).get()
    assert owner.head.call_one(n, 7).get() == [9, 9, 9, 9, 9, 5, 6]  # the owner sees it
    # the controller reads it too
    dst = torch.zeros(n, dtype=torch.uint8)
    buf.read_into(dst).get()
    assert dst[:7].tolist() == [9, 9, 9, 9, 9, 5, 6]


def test_controller_buffer_written_by_a_rank(two_meshes):
    _, reader, _ = two_meshes
    mine = torch.zeros(64, dtype=torch.uint8)
    buf = RDMABuffer(mine)
    reader.write.call_one(buf, 4, 10).get()
    assert mine[:11].tolist() == [4] * 10 + [0]
    assert reader.read_sum.call_one(buf).get() == 40
    buf.drop().get()


def test_drop_then_use_is_a_clear_error(two_meshes):
    owner, reader, _ = two_meshes
    buf = owner.make.call_one(100).get()
    reader.drop.call_one(buf).get()
    with pytest.raises(ActorError, match="was dropped by its owner"):
        reader.read_sum.call_one(buf).get()
    with pytest.raises(RDMAError, match="was dropped by its owner"):
        buf.write_from(torch.ones(3, dtype=torch.uint8)).get()
    mine = RDMABuffer(torch.zeros(8, dtype=torch.uint8))
    mine.drop().get()
    with pytest.raises(RDMAError, match="dropped and can no longer be read"):
        mine.read_into(torch.zeros(8, dtype=torch.uint8))


def test_bad_sizes_and_types():
    with pytest.raises(ValueError, match="size 0"):
        RDMABuffer(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        RDMABuffer(torch.zeros(4, 4).t())
    buf = RDMABuffer(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 4 bytes; the buffer has 8"):
        buf.read_into(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 16 bytes; the buffer has 8"):
        buf.write_from(torch.zeros(16, dtype=torch.uint8))
    assert pickle.loads(pickle.dumps(buf)).size() == 8
    buf.drop().get()


def test_owner_dying_fails_the_future_clearly(two_meshes):
    _, reader, _ = two_meshes
    procs = this_host().spawn_procs(per_host={"gpus": 1}, on_failure="continue")
    try:
        owner = procs.spawn("mortal_owner", Owner)
        buf = owner.make.call_one(100).get()
        pid = owner.pid.call_one().get()
        owner.die.broadcast()
        wait_until(lambda: not psutil.pid_exists(pid), timeout=30, what="the owner's exit")
        with pytest.raises(ActorError, match=r"died before answering"):
            reader.read_sum.call_one(buf).get(timeout=30)
        with pytest.raises(RDMAError, match=r"rank 0 \(pid \d+ on .*\), the owner, died"):
            buf.read_into(torch.zeros(100, dtype=torch.uint8)).get(timeout=30)
    finally:
        procs.stop()
