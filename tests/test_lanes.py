"""A local mesh talks to its ranks through same-machine lanes (``wire.lane``): both ways,
in one order with what still goes over the sockets (a call too large for a ring), with
results larger than a ring, after a rank was killed and restarted, and not at all where
``MONARCH_KERNEL_LANES=0`` says so. The rest of the suite runs its local meshes over
lanes too: these tests check that they are used and where they are not."""

from __future__ import annotations

import os
import signal

import pytest
from actors import Batched, Worker
from conftest import local_mesh
from helpers import wait_until

from monarch_kernel.actor import RankDiedError, this_host
from monarch_kernel.wire import lane as L

pytestmark = [
    pytest.mark.local,
    pytest.mark.skipif(not L.supported(), reason="lanes need Linux on x86-64 with /dev/shm"),
]


def _lanes(procs):
    lanes = procs.runtime.transport.lanes
    assert lanes is not None, "a local mesh on this machine has lanes"
    return lanes


def _all_open(lanes, n: int) -> bool:
    return len(lanes._lanes) == n and all(lane.active for lane in lanes._lanes.values())


@pytest.fixture(scope="module")
def procs2():
    """One 2-rank local mesh for the tests that do not stop or kill anything."""
    yield from local_mesh({"gpus": 2})


def test_calls_and_replies_go_through_the_lanes_in_order(procs2):
    lanes = _lanes(procs2)
    log = procs2.spawn("log", Batched)
    wait_until(lambda: _all_open(lanes, 2), timeout=30, what="both ranks took their lanes")
    sent, received = lanes.sent, lanes.received
    for i in range(20):
        log.record.call(i).get(timeout=60)
    assert lanes.sent - sent >= 2 * 20  # every call to each rank, down its lane
    assert lanes.received - received >= 2 * 20  # every reply, up
    for i in range(20, 50):  # back to back: some travel as batches
        log.record.broadcast(i)
    assert log.get_log.call().get(timeout=60).values() == [list(range(50))] * 2
    # a call too large for a ring goes over the socket, between calls that do not (to
    # one rank: to both, the host agent fans it out, another path to keep in order)
    big = os.urandom(L.RING_BYTES).hex()  # a str: pickled inline, not put in shared memory
    for target in (log.slice(gpus=0), log):
        before = lanes.fallbacks
        for i in range(20):
            if i % 5 == 2:
                target.record_blob.broadcast(i, big)
            else:
                target.record.broadcast(i)
        if target is not log:
            assert lanes.fallbacks - before >= 4
    assert log.get_log.call().get(timeout=60).values() == [list(range(20)) * 2, list(range(20))]


def test_a_result_larger_than_a_ring_comes_whole(procs2):
    lanes = _lanes(procs2)
    log = procs2.spawn("blobs", Batched)
    n = 3 * L.RING_BYTES + 17
    expected = bytes(range(256)) * (n // 256) + b"!" * (n % 256)
    for _ in range(3):
        assert log.blob.call(n).get(timeout=60).values() == [expected, expected]
    assert _all_open(lanes, 2)


def test_a_killed_rank_comes_back_with_a_new_lane():
    procs = this_host().spawn_procs(per_host={"gpus": 2}, on_failure="continue")
    try:
        lanes = _lanes(procs)
        workers = procs.spawn("w", Worker)
        pids = workers.pid.call().get(timeout=60).values()
        wait_until(lambda: _all_open(lanes, 2), timeout=30, what="both ranks took their lanes")
        first = lanes._lanes[procs.runtime.ranks[1].slot]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankDiedError):
            workers.slice(gpus=1).sleep.call_one(30).get(timeout=60)
        procs.restart()
        assert workers.echo.call(7).get(timeout=60).values() == [7, 7]
        wait_until(lambda: _all_open(lanes, 2), timeout=30, what="the new rank took a lane")
        assert lanes._lanes[procs.runtime.ranks[1].slot] is not first
        sent = lanes.sent
        assert workers.echo.call(8).get(timeout=60).values() == [8, 8]
        assert lanes.sent - sent >= 2
    finally:
        procs.stop()
    assert lanes.closed and not lanes._lanes


def test_no_lanes_where_the_environment_turns_them_off(monkeypatch):
    monkeypatch.setenv(L.LANES_ENV, "0")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        assert procs.runtime.transport.lanes is None
        assert procs.spawn("w", Worker).echo.call(3).get(timeout=60).values() == [3, 3]
    finally:
        procs.stop()
