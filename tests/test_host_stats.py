"""The ranks' once-a-second stats travel through their host agent (``host.fanin``): the
controller gets one ``host_stats`` message a second per host instead of one ``stats``
per rank, and every rank's record still fills in; a dead rank's stats stop; with
fan-in off (``MONARCH_KERNEL_FANIN=0`` when the agents start) each rank sends its own."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import wait_until

from monarch_kernel.actor import host_mesh
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.local


def _latest(procs) -> list[float]:
    """Each rank's latest stats time (0: none yet)."""
    return [float(i.stats.get("time", 0.0)) for i in procs.runtime.ranks]


def _all_newer_than(procs, times: list[float]) -> bool:
    return all(now > then for now, then in zip(_latest(procs), times, strict=True))


def test_stats_come_as_one_message_per_host(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_FANIN", "1")
    # on_failure="continue": a dead rank stays dead (not restarted)
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 3}, on_failure="continue")
    try:
        inbound = procs.runtime.inbound
        wait_until(lambda: all(_latest(procs)), timeout=60, what="every rank's first stats")
        before, kinds = _latest(procs), dict(inbound.kinds)
        # every rank's stats come again (twice: they went through a whole interval) ...
        wait_until(lambda: _all_newer_than(procs, before), timeout=60, what="newer stats")
        wait_until(
            lambda: inbound.kinds.get(K.HOST_STATS, 0) - kinds.get(K.HOST_STATS, 0) >= 4,
            timeout=60,
            what="four more host_stats messages",
        )
        # ... carried by the agents only: no rank sent a stats message of its own
        assert inbound.kinds.get(K.STATS, 0) == kinds.get(K.STATS, 0), inbound.kinds
        stats = procs.runtime.ranks[4].stats
        assert stats["rss"] > 10 * 2**20, stats  # a real process's memory, from rank 4
        # a dead rank's stats stop; its host's other ranks' go on
        victim = procs.runtime.ranks[1].pid
        assert victim
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: not procs.runtime.ranks[1].alive, timeout=60, what="rank 1's death noticed"
        )
        dead_at = _latest(procs)
        wait_until(
            lambda: all(
                now > then
                for r, (now, then) in enumerate(zip(_latest(procs), dead_at, strict=True))
                if r != 1
            ),
            timeout=60,
            what="the living ranks' next stats",
        )
        assert _latest(procs)[1] == dead_at[1]
    finally:
        procs.stop()


def test_without_fan_in_each_rank_sends_its_own(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_FANIN", "0")
    procs = host_mesh(hosts=1).spawn_procs(per_host={"gpus": 2})
    try:
        inbound = procs.runtime.inbound
        wait_until(lambda: all(_latest(procs)), timeout=60, what="every rank's first stats")
        before = _latest(procs)
        wait_until(lambda: _all_newer_than(procs, before), timeout=60, what="newer stats")
        assert inbound.kinds.get(K.STATS, 0) >= 4, inbound.kinds
        assert inbound.kinds.get(K.HOST_STATS, 0) == 0, inbound.kinds
    finally:
        procs.stop()
