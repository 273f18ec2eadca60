"""The shared-memory arena for large arguments (``wire.arena``) in one process: blocks
are placed lowest first and reused once every reader copied out, readers that are gone
free theirs, and a reference a rank cannot trust is refused (the message answered with
why, never dropped: the messages after it would wait for it)."""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import numpy as np
import pytest

from monarch_kernel.wire import arena as A
from monarch_kernel.wire.codec import Message

pytestmark = pytest.mark.unit

MIB = 1 << 20


@pytest.fixture
def arena():
    a = A.Arena(8 * MIB)
    yield a
    a.close()


def _message(where: dict, **header: object) -> Message:
    return Message({"k": "call", "sh": dict(where), **header}, b"payload")


def test_buffers_come_out_as_private_writable_copies_and_the_block_is_reused(arena):
    data = np.arange(MIB // 8, dtype=np.int64)
    where = arena.place([data], readers=[5])
    assert where is not None and where["z"] == [MIB] and where["o"] == 0
    reader = A.ArenaReader()
    got = reader.take(_message(where), slot=5)
    assert "sh" not in got.header and got.payload == b"payload" and not got.lost
    out = np.frombuffer(got.buffers[0], dtype=np.int64)
    assert np.array_equal(out, data)
    out[:] = -1  # writable, and its own: the arena's copy does not change
    data[:] = 7
    # read: the next block starts where that one did
    again = arena.place([data], readers=[5])
    assert again is not None and again["o"] == 0
    assert np.array_equal(np.frombuffer(reader.take(_message(again), 5).buffers[0], np.int64), data)
    assert arena.unread() == 0


def test_each_reader_of_a_fan_out_sets_its_own_flag(arena):
    data = bytes(range(256)) * 1024  # 256 KiB
    slots = [10, 11, 12, 20, 21]  # two hosts' ranks, in the order the flags are in
    where = arena.place([data], readers=slots)
    assert where is not None
    reader = A.ArenaReader()
    # host 1's message names its ranks in ``d`` and its first flag in ``si``
    for slot in (20, 21):
        msg = _message(where, f=1, d=[20, 21], si=3)
        assert bytes(reader.take(msg, slot).buffers[0]) == data
    assert arena.unread() == 1  # host 0's ranks have not read yet
    for i, slot in enumerate((10, 11, 12)):
        assert bytes(reader.take(_message(where, si=i), slot).buffers[0]) == data
    assert arena.unread() == 0


@pytest.fixture
def lending():
    a = A.Arena(8 * MIB, lend=True)
    yield a
    a.close()


def test_a_block_for_one_reader_is_lent_until_what_was_built_on_it_is_gone(lending):
    import torch

    from monarch_kernel.wire.serialize import _rebuild_tensor

    data = np.arange(MIB // 4, dtype=np.float32)
    where = lending.place([data], readers=[3])
    assert where is not None and where.get("l") == 1 and lending.lent == 1
    got = A.ArenaReader(lend=True).take(_message(where), slot=3)
    tensor = _rebuild_tensor(got.buffers[0], "float32", (MIB // 4,), False, False)
    del got
    gc.collect()
    assert lending.unread() == 1  # the tensor still uses the block: not reused
    assert torch.equal(tensor, torch.from_numpy(data))
    tensor.add_(1)  # writable, in place: the block is the rank's while it holds it
    second = lending.place([data], readers=[3])
    assert second is not None and second["o"] > where["o"]
    assert bytes(lending._view[second["o"] + 64 : second["o"] + 64 + 16]) == data[:4].tobytes()
    del tensor
    gc.collect()
    assert lending.unread() == 1  # the first block's flag is set: only the second is left
    third = lending.place([data], readers=[3])
    assert third is not None and third["o"] == where["o"]


def test_a_block_lent_when_the_reader_forks_is_kept(lending):
    where = lending.place([bytes(MIB)], readers=[3])
    assert where is not None and where.get("l") == 1
    got = A.ArenaReader(lend=True).take(_message(where), slot=3)
    pid = os.fork()  # the child shares the lent bytes: they must never be reused
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    del got
    gc.collect()
    assert lending.unread() == 1


def test_a_block_of_several_buffers_is_lent_until_every_one_of_them_is_gone(lending):
    """A state dict for one reader: its tensors are the block, in place; the block comes
    back once the last of them is dropped, in whatever order and thread."""
    import threading

    from monarch_kernel.wire.serialize import _rebuild_tensor

    parts = [np.full(n, i, dtype=np.float32) for i, n in enumerate((MIB // 4, 3, MIB // 8))]
    where = lending.place(parts, readers=[3])
    assert where is not None and where.get("l") == 1
    got = A.ArenaReader(lend=True).take(_message(where), slot=3)
    tensors = [
        _rebuild_tensor(b, "float32", (p.size,), False, False) for b, p in zip(got.buffers, parts)
    ]
    del got
    gc.collect()
    assert [float(t.sum()) for t in tensors] == [float(p.sum()) for p in parts]
    tensors[1].add_(1)  # writable, in place: the block holds what was written
    second = where["o"] + 64 + MIB  # past the flags and the first buffer
    assert bytes(lending._view[second : second + 12]) == np.full(3, 2, np.float32).tobytes()
    middle = tensors.pop(1)
    dropper = threading.Thread(target=tensors.pop)  # the last one, from another thread
    dropper.start()
    dropper.join()
    gc.collect()
    assert lending.unread() == 1  # two of three gone: still lent
    del middle
    gc.collect()
    assert lending.unread() == 1  # the first of three is left
    tensors.clear()
    gc.collect()
    assert lending.unread() == 0


@pytest.mark.parametrize("case", ["two readers", "a reader that copies", "an arena half full"])
def test_other_blocks_are_copied_out_at_once(lending, case):
    data = bytes(MIB)
    if case == "an arena half full":
        assert lending.place([bytes(4 * MIB - 64)], readers=[9]) is not None
    readers = [3, 4] if case == "two readers" else [3]
    buffers = [data, data] if case == "two readers" else [data]
    where = lending.place(buffers, readers=readers)
    assert where is not None
    assert ("l" in where) is (case == "a reader that copies")
    reader = A.ArenaReader(lend=case != "a reader that copies")
    blocks = lending.unread()
    for slot in readers:
        got = reader.take(_message(where, f=1, d=readers), slot)
        assert all(bytes(b) == data for b in got.buffers)
    # copied out: the block is free while the copies live
    assert lending.unread() == blocks - 1


def test_unread_blocks_are_skipped_and_a_full_arena_sends_over_the_socket(arena):
    big = bytes(3 * MIB)
    first = arena.place([big], readers=[0])
    second = arena.place([big], readers=[1])
    assert first is not None and second is not None and second["o"] > first["o"]
    assert arena.place([big], readers=[2]) is None  # 8 MiB: no room for a third
    assert arena.fallbacks == 1
    arena.release([1])  # rank 1 restarted: what was for it is not read now
    third = arena.place([big], readers=[2])
    assert third is not None and third["o"] == second["o"]
    assert arena.unread() == 2


def test_small_and_oversized_messages_stay_on_the_socket(arena):
    assert arena.place([bytes(A.MIN_BYTES - 1)], readers=[0]) is None
    assert arena.place([bytes(A.MIN_BYTES)], readers=[0]) is not None
    huge = A.Arena(A.MAX_BYTES + 2 * MIB)
    try:
        assert huge.place([bytes(A.MAX_BYTES + 1)], readers=[0]) is None
    finally:
        huge.close()
    assert arena.placed == 1 and arena.fallbacks == 0


@pytest.mark.parametrize(
    "change",
    [
        {"p": "/etc/passwd"},  # not a descriptor of the controller's
        {"p": "/proc/1/fd/../../self/mem"},
        {"o": -64},
        {"n": 1, "index": 1},  # a flag beyond the block's readers
        {"z": [1, "x"]},
    ],
)
def test_a_reference_a_rank_cannot_trust_is_refused(arena, change):
    where = arena.place([bytes(A.MIN_BYTES)], readers=[0])
    assert where is not None
    index = change.pop("index", 0)
    where.update(change)
    got = A.ArenaReader().take(_message(where, si=index), slot=0)
    assert got.buffers == [] and got.lost.startswith("malformed shared-memory reference")


def test_a_reference_beyond_the_arena_is_refused(arena):
    where = arena.place([bytes(A.MIN_BYTES)], readers=[0])
    assert where is not None
    where["o"] = 8 * MIB - 64
    got = A.ArenaReader().take(_message(where), slot=0)
    assert got.buffers == [] and got.lost == "shared-memory reference beyond the arena"


def test_an_arena_that_cannot_be_opened_says_so_in_the_message(arena):
    where = arena.place([bytes(A.MIN_BYTES)], readers=[0])
    assert where is not None
    where["p"] = f"/proc/{os.getpid()}/fd/999999"
    got = A.ArenaReader().take(_message(where), slot=0)
    assert got.buffers == [] and A.SHM_ENV + "=0" in got.lost
    assert "could not map the controller's shared memory" in got.lost


def test_another_file_under_the_same_descriptor_number_is_not_mapped(arena, tmp_path):
    where = arena.place([bytes(A.MIN_BYTES)], readers=[0])
    assert where is not None
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        where["p"] = f"/proc/{os.getpid()}/fd/{fd}"  # a real file, not the arena's inode
        got = A.ArenaReader().take(_message(where), slot=0)
    finally:
        os.close(fd)
    assert "is not the writer's arena" in got.lost


def test_a_full_arena_frees_the_blocks_of_readers_that_died(arena):
    big = bytes(3 * MIB)
    assert arena.place([big], readers=[0]) is not None
    assert arena.place([big], readers=[4]) is not None
    asked = []

    def dead() -> list[int]:
        asked.append(True)
        return [4]

    third = arena.place([big], readers=[1], gone=dead)
    assert third is not None and asked  # asked only once there was no room
    assert arena.unread() == 2 and arena.fallbacks == 0
    assert arena.place([big], readers=[2], gone=list) is None
    assert arena.fallbacks == 1


def test_an_idle_arena_gives_back_what_no_block_uses_above_what_it_keeps(monkeypatch):
    a = A.Arena(64 * MIB)
    try:
        big = np.ones(24 * MIB, dtype=np.uint8)
        where = a.place([big.data], readers=[0])
        assert where is not None and a.backed() >= 24 * MIB
        now = time.monotonic()
        assert a.trim(now) == 0  # just placed: a loop of large calls keeps its pages
        reader = A.ArenaReader()
        assert bytes(reader.take(_message(where), 0).buffers[0][:4]) == b"\x01" * 4
        later = now + A.TRIM_AFTER + 1
        freed = a.trim(later)
        assert freed > 0 and a.backed() == A.KEEP_BYTES  # read: all above KEEP_BYTES goes
        assert a.trim(later) == 0
        # the next block reserves its pages again and reads back intact
        again = a.place([np.full(16 * MIB, 7, dtype=np.uint8).data], readers=[0])
        assert again is not None and a.backed() >= 16 * MIB
        out = np.frombuffer(reader.take(_message(again), 0).buffers[0], np.uint8)
        assert out.min() == out.max() == 7
    finally:
        a.close()


def test_trim_keeps_the_pages_of_a_block_not_read_yet():
    a = A.Arena(64 * MIB)
    try:
        low = a.place([np.ones(MIB, dtype=np.uint8).data], readers=[0])
        high = a.place([np.ones(20 * MIB, dtype=np.uint8).data], readers=[1])
        assert low is not None and high is not None and high["o"] > 0
        top = a.backed()
        a.trim(time.monotonic() + A.TRIM_AFTER + 1)
        assert a.backed() == top  # reader 1 has not read the high block: all kept
        assert np.frombuffer(A.ArenaReader().take(_message(high), 1).buffers[0], np.uint8).all()
    finally:
        a.close()


def test_only_the_process_that_made_an_arena_places_blocks(arena):
    pid = os.fork()
    if pid == 0:  # a forked child (a rank's fork): the socket, never the parent's arena
        os._exit(0 if arena.place([bytes(MIB)], readers=[0]) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert arena.place([bytes(MIB)], readers=[0]) is not None


def test_a_reader_forgets_the_arenas_of_a_process_that_died(arena):
    where = arena.place([bytes(MIB)], readers=[0])
    assert where is not None
    reader = A.ArenaReader(keep=8)
    reader.take(_message(where), 0)
    assert reader.mapped() == 1
    reader.forget(os.getpid() + 1)  # another process: kept
    assert reader.mapped() == 1
    reader.forget(os.getpid())
    assert reader.mapped() == 0


def test_a_reader_prunes_arenas_whose_writer_is_gone():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a writer process: make an arena, place a block, say where, wait
        os.close(r)
        child = A.Arena(4 * MIB)
        os.write(w, json.dumps(child.place([bytes(MIB)], readers=[0])).encode() + b"\n")
        time.sleep(120)  # until killed
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as f:
            where = json.loads(f.readline())
        reader = A.ArenaReader(keep=8)
        assert not reader.take(_message(where), 0).lost
        assert reader.prune() == 0 and reader.mapped() == 1  # its writer runs
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert reader.prune() == 1 and reader.mapped() == 0  # gone: /proc/<pid> is no more
