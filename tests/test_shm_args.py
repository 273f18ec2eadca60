"""Large arguments of calls to a local mesh's ranks go through the controller's
shared-memory arena (``wire.arena``): intact, private to each rank, as they were at call
time; lent in place to a single rank, whose block is not reused while it keeps them;
through host agents' fan-outs; over the socket when the arena is full or off; freed when
a rank that had not read them is restarted; and a rank that cannot map the arena answers
with the reason instead of running the call."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import wait_no_orphans
from helpers import wait_until

from monarch_kernel.actor import Actor, ActorError, endpoint, host_mesh, this_host
from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.wire import arena as arena_mod
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.local

FLOATS = 1 << 18  # 1 MiB of float32


class Receiver(Actor):
    def __init__(self) -> None:
        from monarch_kernel.actor import current_rank

        self.rank = current_rank().rank

    @endpoint
    def bump(self, t: torch.Tensor) -> float:
        t.add_(self.rank)  # in place: each rank's copy is its own
        return float(t.sum())

    @endpoint
    def wait_while(self, path: str) -> int:
        open(path + ".entered", "w").close()
        while os.path.exists(path):
            time.sleep(0.01)
        return os.getpid()

    @endpoint
    def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @endpoint
    def keep(self, t: torch.Tensor) -> float:
        self.kept = t
        return float(t.sum())

    @endpoint
    def kept_sum(self) -> float:
        return float(self.kept.sum())

    @endpoint
    def drop(self) -> None:
        del self.kept

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _arena(procs) -> arena_mod.Arena:
    arena = procs.runtime.transport.arena
    assert arena is not None, "a local mesh on unix sockets has an arena"
    return arena


def _unread(procs) -> int:
    with procs.runtime.transport.send_lock:
        return _arena(procs).unread()


def _ones_sum(rank: int, scale: float = 1.0) -> float:
    return FLOATS * (scale + rank)


def test_large_arguments_reach_each_rank_intact_private_and_as_at_call_time():
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        arena = _arena(procs)
        actors = procs.spawn("rx", Receiver)
        t = torch.ones(FLOATS)
        fut = actors.slice(gpus=2).bump.call_one(t)
        t.mul_(3)  # changed as soon as the call returned: the rank got it as it was
        assert fut.get(timeout=60) == _ones_sum(2)
        assert arena.placed == 1
        # one block for four readers; each adds its rank to its own copy
        sums = actors.bump.call(t).get(timeout=60).values()
        assert sums == [_ones_sum(r, 3.0) for r in range(4)]
        assert arena.placed == 2 and arena.fallbacks == 0
        assert torch.equal(t, torch.full((FLOATS,), 3.0))  # the caller's is untouched
        assert _unread(procs) == 0  # every reader set its own flag
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_an_argument_lent_to_a_rank_that_keeps_it_is_its_own_until_it_drops_it():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        arena = _arena(procs)
        actors = procs.spawn("rx", Receiver)
        assert actors.keep.call_one(torch.ones(FLOATS)).get(timeout=60) == _ones_sum(0)
        assert arena.lent == 1  # one rank, one buffer: the block itself is the rank's
        wait_until(lambda: _unread(procs) == 1, timeout=30, what="the kept block alone")
        # later large calls take other blocks and leave the kept tensor as it was
        for value in (2.0, 3.0):
            got = actors.bump.call_one(torch.full((FLOATS,), value)).get(timeout=60)
            assert got == _ones_sum(0, value)
        assert arena.lent == 3 and arena.fallbacks == 0
        assert actors.kept_sum.call_one().get(timeout=60) == _ones_sum(0)
        wait_until(lambda: _unread(procs) == 1, timeout=30, what="the bumped blocks freed")
        actors.drop.call_one().get(timeout=60)
        wait_until(lambda: _unread(procs) == 0, timeout=30, what="the dropped block freed")
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_a_fan_out_through_two_host_agents_reads_one_block(monkeypatch):
    # 8 a host, without same-machine lanes: through the agents (with lanes, a call to
    # fewer than FANOUT_MIN_RANKS_LANES ranks goes to each directly)
    monkeypatch.setenv("MONARCH_KERNEL_LANES", "0")
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 8})
    try:
        actors = procs.spawn("rx", Receiver)
        inbound = procs.runtime.inbound
        before = inbound.kinds.get(K.FAN_IN, 0)
        sums = actors.bump.call(torch.ones(FLOATS)).get(timeout=120).values()
        assert sums == [_ones_sum(r) for r in range(16)]
        assert inbound.kinds.get(K.FAN_IN, 0) >= before + 2  # it went by both agents
        assert _arena(procs).placed == 1
        assert _unread(procs) == 0  # each rank found its flag from ``si`` and ``d``
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_a_full_arena_sends_over_the_socket_and_order_is_kept(monkeypatch):
    # Room for a 1 MiB block lent in place (it may fill at most half of the arena), and
    # then not for one of 1.5 MiB: 2 MiB and 64 KiB.
    monkeypatch.setattr(arena_mod, "ARENA_BYTES", (2 << 20) + (64 << 10))
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        actors = procs.spawn("rx", Receiver)
        arena = _arena(procs)
        # The block stays taken: it is lent, and the rank keeps the tensor built on it.
        # (A rank busy in an endpoint no longer leaves blocks unread: its relief thread
        # reads the actor's next calls into its line, so a hold cannot fill the arena.)
        first = actors.keep.call_one(torch.ones(FLOATS))
        assert (arena.placed, arena.lent) == (1, 1)
        # ... so the next finds no room and goes over the socket, after the first
        second = actors.bump.call_one(torch.full((FLOATS * 3 // 2,), 2.0))
        assert arena.fallbacks == 1
        assert first.get(timeout=60) == _ones_sum(0)
        assert second.get(timeout=60) == FLOATS * 3 // 2 * 2.0
        assert actors.kept_sum.call_one().get(timeout=60) == _ones_sum(0)
        actors.drop.call_one().get(timeout=60)
        wait_until(lambda: _unread(procs) == 0, timeout=30, what="the dropped block freed")
        # free again: the arena takes the next one
        assert actors.bump.call_one(torch.ones(FLOATS)).get(timeout=60) == _ones_sum(0)
        assert arena.placed == 2
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_a_restarted_rank_frees_what_its_previous_self_did_not_read(tmp_path):
    hold = str(tmp_path / "hold")
    procs = this_host().spawn_procs(per_host={"gpus": 2}, on_failure="restart")
    try:
        actors = procs.spawn("rx", Receiver)
        one = actors.slice(gpus=1)
        pid = one.pid.call_one().get(timeout=60)
        open(hold, "w").close()
        held = one.wait_while.call_one(hold)
        wait_until(lambda: os.path.exists(hold + ".entered"), timeout=60, what="the hold")
        unread = one.bump.call_one(torch.ones(FLOATS))
        assert _unread(procs) == 1
        os.kill(pid, signal.SIGKILL)
        for fut in (held, unread):
            with pytest.raises(RankDiedError):
                fut.get(timeout=60)
        os.remove(hold)
        assert one.pid.call_one().get(timeout=120) != pid  # restarted (the call waits)
        assert _unread(procs) == 0
        assert one.bump.call_one(torch.ones(FLOATS)).get(timeout=60) == _ones_sum(1)
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_a_rank_that_cannot_map_the_arena_answers_with_why_and_goes_on():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        actors = procs.spawn("rx", Receiver)
        transport, arena = procs.runtime.transport, _arena(procs)
        real = arena.path
        with transport.send_lock:  # as if the rank could not open the controller's file
            arena.path = f"/proc/{os.getpid()}/fd/999999"
        with pytest.raises(ActorError) as failed:
            actors.bump.call_one(torch.ones(FLOATS)).get(timeout=60)
        text = str(failed.value)
        assert "could not map the controller's shared memory" in text, text
        assert f"{arena_mod.SHM_ENV}=0" in text, text
        with transport.send_lock:
            arena.path = real
        # nothing wedged: the next calls, small and large, are answered in order
        assert actors.pid.call_one().get(timeout=60) > 0
        assert actors.bump.call_one(torch.ones(FLOATS)).get(timeout=60) == _ones_sum(0)
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


@pytest.mark.parametrize("env", [arena_mod.SHM_ENV, arena_mod.SHM_ARGS_ENV])
def test_with_shared_memory_off_large_arguments_and_results_go_over_the_socket(monkeypatch, env):
    monkeypatch.setenv(env, "0")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        assert procs.runtime.transport.arena is None
        actors = procs.spawn("rx", Receiver)
        sums = actors.bump.call(torch.ones(FLOATS)).get(timeout=60).values()
        assert sums == [_ones_sum(r) for r in range(2)]
        got = actors.echo.call(torch.ones(FLOATS)).get(timeout=60).values()
        assert all(torch.equal(t, torch.ones(FLOATS)) for t in got)
        assert procs.runtime.inbound.mapped_arenas() == 0  # no rank used an arena
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"
