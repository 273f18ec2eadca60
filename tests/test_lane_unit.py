"""Same-machine lanes (wire.lane, controller.messaging.lanes, rank.lane): the rings'
records, their wrap-around and records larger than a ring, the checks on what a ring
holds, the doorbell, and both ends of a lane opened through /proc, one of them in a
second process."""

from __future__ import annotations

import contextlib
import os
import random
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from monarch_kernel.controller.messaging.lanes import Lanes
from monarch_kernel.rank.lane import LaneGone, RankLane
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import lane as L

pytestmark = pytest.mark.skipif(
    not L.supported(), reason="lanes need Linux on x86-64 with /dev/shm"
)


@contextlib.contextmanager
def _pair(capacity: int) -> Iterator[tuple[L.LaneFile, L.LaneFile]]:
    """Two mappings of one lane file (the controller's, and one opened by path), closed
    after."""
    mine, fd = L.LaneFile.create(capacity)
    try:
        other = L.LaneFile.open(L.proc_path(fd), capacity)
        try:
            yield mine, other
        finally:
            other.close()
    finally:
        mine.close()
        os.close(fd)


@pytest.mark.unit
def test_records_come_out_as_they_went_in_across_the_wrap():
    with _pair(256) as (mine, other):
        writer, reader = mine.down, other.down
        writer.attach_writer()
        reader.attach_reader()
        for i in range(200):  # many times round a 256-byte ring
            frames = [b"e%03d" % i + b"." * (i % 37), b"", bytes(range(i % 11))]
            assert writer.try_put(frames)
            got = reader.take()
            assert got is not None and [bytes(f) for f in got] == frames
        assert reader.take() is None and not reader.pending()


@pytest.mark.unit
def test_try_put_writes_nothing_when_the_record_does_not_fit():
    with _pair(128) as (mine, other):
        writer, reader = mine.up, other.up
        assert writer.try_put([b"a" * 60])
        assert not writer.try_put([b"b" * 60])  # 72 + 72 > 128
        assert writer.room() == 128 - L.record_size([b"a" * 60])
        got = reader.take()
        assert got is not None and bytes(got[0]) == b"a" * 60
        assert reader.take() is None
        assert writer.try_put([b"b" * 60])  # room again once read


@pytest.mark.unit
def test_a_record_larger_than_the_ring_goes_in_pieces_as_the_reader_makes_room():
    with _pair(4096) as (mine, other):
        writer, reader = mine.up, other.up
        big = os.urandom(100_000)
        got: list[bytes] = []

        def read() -> None:
            while True:
                frames = reader.take()
                if frames is not None:
                    got.extend(bytes(f) for f in frames)
                    return

        t = threading.Thread(target=read)
        t.start()
        writer.put([b"head", big], wait=lambda: None)
        t.join(30)
        assert got == [b"head", big]
        assert writer.try_put([b"next"])  # the ring is whole again
        frames = reader.take()
        assert frames is not None and bytes(frames[0]) == b"next"


@pytest.mark.unit
def test_a_record_that_breaks_the_format_is_refused():
    with _pair(256) as (mine, other):
        mine.down.try_put([b"x" * 8])
        mine.mem[L._DATA + 4 : L._DATA + 8] = (10_000).to_bytes(4, "little")  # frame count
        with pytest.raises(L.LaneError, match="frames"):
            other.down.take()


@pytest.mark.unit
def test_a_file_of_another_size_is_not_taken_for_a_lane():
    mine, fd = L.LaneFile.create(1024)
    try:
        with pytest.raises(OSError, match="not a lane"):
            L.LaneFile.open(L.proc_path(fd), 2048)
    finally:
        mine.close()
        os.close(fd)


@pytest.mark.unit
def test_the_doorbell_names_the_slots_and_says_when_it_overflowed():
    assert L.bell_slots(L.slot_bytes(3) + L.slot_bytes(7) + L.slot_bytes(3)) == ({3, 7}, False)
    slots, overflow = L.bell_slots(L.slot_bytes(1) * (L._BELL_FULL // 4 + 1))
    assert slots == {1} and overflow
    r, w = L.pipe()
    try:
        for _ in range(20_000):  # more than a pipe holds: the extra bytes are dropped
            L.ring_bell(w, L.slot_bytes(5))
        data = L.drain(r)
        assert L.bell_slots(data)[1]  # a full read: look at every ring
    finally:
        os.close(r)
        os.close(w)


def _offer_header(lanes: Lanes, slot: int) -> H.Lane:
    offer = lanes.offer(slot, b"r%d" % slot)
    assert offer is not None
    return H.Lane(
        path=offer.path,
        wake=offer.wake,
        bell=offer.bell,
        capacity=offer.capacity,
        controller=offer.pid,
    )


@pytest.mark.unit
def test_both_ends_of_a_lane_carry_messages_both_ways_and_close():
    fds = set(os.listdir("/proc/self/fd"))
    lanes = Lanes(capacity=4096)
    rank = RankLane(_offer_header(lanes, 2), 2)
    try:
        assert not lanes.send(2, [[b"early"]])  # not before the rank said lane_on
        assert lanes.activate(2)
        assert lanes.send(2, [[b"down", b"1"]])
        assert lanes.send(2, [[b"stream-start"], [b"chunk"]])  # a stream's parts, whole
        assert not lanes.send(2, [[b"x" * 5000]])  # no room: the socket takes it
        assert lanes.fallbacks == 1
        assert [bytes(f) for f in rank.take() or []] == [b"down", b"1"]
        assert [bytes(f) for f in rank.take() or []] == [b"stream-start"]
        assert [bytes(f) for f in rank.take() or []] == [b"chunk"]
        assert rank.take() is None
        rank.send([b"up", b"2"])
        assert lanes.pending()
        first = lanes.take()
        assert first is not None and first[0].bytes == b"r2"
        assert [bytes(f) for f in first[1:]] == [b"up", b"2"]
        # larger than the ring: in pieces, as the controller reads
        writer = threading.Thread(target=rank.send, args=([b"y" * 10_000],))
        writer.start()
        big = None
        while big is None:
            select.select([lanes.bell_r], [], [], 1)
            big = lanes.take()
        writer.join(10)
        assert bytes(big[1]) == b"y" * 10_000
        rank.send([b"last words"])
        lanes.drop(2)  # what the rank wrote is read before the lane closes
        last = lanes.take()
        assert last is not None and bytes(last[1]) == b"last words"
        assert not lanes.send(2, [[b"after"]])
    finally:
        rank.close()
        lanes.close()
    assert set(os.listdir("/proc/self/fd")) <= fds


@pytest.mark.local
def test_a_rank_writing_to_a_full_lane_of_a_gone_controller_stops_waiting():
    lanes = Lanes(capacity=1024)
    hdr = _offer_header(lanes, 0)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(gone.stdout)
    rank = RankLane(
        H.Lane(
            path=hdr.path, wake=hdr.wake, bell=hdr.bell, capacity=hdr.capacity, controller=dead_pid
        ),
        0,
    )
    try:
        with pytest.raises(LaneGone, match=str(dead_pid)):
            rank.send([b"z" * 5000])  # nobody reads: the ring stays full
    finally:
        rank.close()
        lanes.close()


_WRITER = r"""
import sys
from monarch_kernel.wire import headers as H
from monarch_kernel.rank.lane import RankLane
path, wake, bell, cap, pid = sys.argv[1:6]
lane = RankLane(H.Lane(path=path, wake=wake, bell=bell, capacity=int(cap), controller=int(pid)), 9)
sys.stdout.write("open\n")
sys.stdout.flush()
for i in range(3000):
    lane.send([b"%d" % i, b"." * (i % 500)])
got = None
while got is None:
    got = lane.take()
    if got is None:
        lane.drain_wake()
        import select
        select.select([lane.wake], [], [], 1)
sys.stdout.write(bytes(got[0]).decode())
"""


@pytest.mark.local
def test_another_process_writes_thousands_of_records_in_order_and_reads_one():
    lanes = Lanes(capacity=8192)
    hdr = _offer_header(lanes, 9)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, hdr.path, hdr.wake, hdr.bell, str(hdr.capacity),
         str(hdr.controller)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"open\n"
        lanes.activate(9)  # as its lane_on would
        seen = 0
        while seen < 3000:
            frames = lanes.take()
            if frames is None:
                assert proc.poll() is None
                select.select([lanes.bell_r], [], [], 5)
                continue
            assert bytes(frames[1]) == b"%d" % seen
            assert bytes(frames[2]) == b"." * (seen % 500)
            seen += 1
        assert lanes.send(9, [[b"done"]])
        out, _ = proc.communicate(timeout=30)
        assert out == b"done"
        assert proc.returncode == 0
        assert lanes.received == 3000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lanes.close()


_RING_WRITER = r"""
import random, sys, time
from monarch_kernel.wire import lane as L
ring = L.LaneFile.open(sys.argv[1], int(sys.argv[2])).up
ring.attach_writer()
rnd = random.Random(5)
for i in range(int(sys.argv[3])):
    size = rnd.randint(0, 4 << 20) if i % 2 else rnd.randint(0, 200)
    ring.put([b"%d" % i, bytes([i % 251]) * size], lambda: time.sleep(50e-6))
"""


@pytest.mark.local
def test_records_larger_than_the_ring_come_whole_while_both_ends_run_at_once():
    """Records up to sixteen rings long, written by another process while this one reads
    without pause: every byte as written. (The ends stored ``head`` and ``tail`` with
    ``struct.pack_into``, which zero-fills before it writes: a reader that read ``head``
    meanwhile saw 0, and wrote the rest of a large record over its start; this failed
    after 1,100-1,900 records in every run.)"""
    count, capacity = 2000, 256 << 10
    mine, fd = L.LaneFile.create(capacity)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RING_WRITER, L.proc_path(fd), str(capacity), str(count)]
    )
    try:
        ring = mine.up
        ring.attach_reader()
        rnd = random.Random(5)
        deadline = time.monotonic() + 120
        for i in range(count):
            size = rnd.randint(0, 4 << 20) if i % 2 else rnd.randint(0, 200)
            frames = ring.take()
            while frames is None:
                assert proc.poll() in (None, 0), "the writer failed"
                assert time.monotonic() < deadline, f"record {i} never came"
                time.sleep(0)
                frames = ring.take()
            assert bytes(frames[0]) == b"%d" % i
            assert len(frames[1]) == size and bytes(frames[1]) == bytes([i % 251]) * size, i
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mine.close()
