"""Fire-and-forget broadcasts made back to back travel batched (``batch`` messages,
:mod:`monarch_kernel.controller.messaging.batching`): fewer wire messages than calls reach each
rank, in the order the calls were made, interleaved with calls that wait for answers,
across the ranks of two host agents; a lone broadcast is not held back."""

from __future__ import annotations

import threading

import pytest
from actors import Batched
from helpers import wait_for_rank_line

from monarch_kernel.actor import host_mesh

K = 3_000  # broadcasts per round


@pytest.fixture(scope="module")
def procs():
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 2})  # 2 agents x 2 ranks
    yield procs
    procs.stop()


def _counts(actors) -> list[dict[str, int]]:
    return list(actors.inbox_counts.call().get(timeout=30).values())


def test_back_to_back_broadcasts_travel_batched_and_in_order(procs):
    actors = procs.spawn("batched", Batched)
    transport = procs.runtime.transport
    before, batches_before = _counts(actors), transport.batches_sent
    answered = []
    for i in range(K):
        if i % 500 == 250:  # a call that waits for its answer, in the middle of the flood
            answered.append(actors.record.call(i))
        else:
            actors.record.broadcast(i)
    assert all(len(f.get(timeout=60)) == 4 for f in answered)
    logs = actors.get_log.call().get(timeout=60)
    assert [log == list(range(K)) for log in logs.values()] == [True] * 4
    after = _counts(actors)
    for b, a in zip(before, after, strict=True):
        messages = a["messages"] - b["messages"]
        batched = a["batched_calls"] - b["batched_calls"]
        # every call arrived; most of them inside batches, so far fewer messages than calls
        assert batched >= K // 2, (b, a)
        assert messages <= K // 4, (b, a)
    assert transport.batches_sent > batches_before
    assert transport.backlog_messages == 0


def test_broadcasts_from_two_threads_each_stay_in_order(procs):
    actors = procs.spawn("two_threads", Batched)

    # two callers at once: each one's broadcasts reach every rank in its own order
    def flood(offset: int) -> None:
        for i in range(K):
            actors.record.broadcast(offset + i)

    threads = [threading.Thread(target=flood, args=(o,)) for o in (0, 10 * K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for log in actors.get_log.call().get(timeout=60).values():
        assert len(log) == 2 * K
        assert [i for i in log if i < 10 * K] == list(range(K))
        assert [i - 10 * K for i in log if i >= 10 * K] == list(range(K))


def test_a_lone_broadcast_goes_at_once(procs):
    """Nothing is sent after it: the I/O thread sends it, it does not wait for more."""
    actors = procs.spawn("lone", Batched)
    actors.shout.broadcast("a lone broadcast arrived")
    for r in range(4):
        wait_for_rank_line(procs, r, "a lone broadcast arrived", timeout=10)
