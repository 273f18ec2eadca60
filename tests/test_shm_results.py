"""Large results from a local mesh's ranks come back through each rank's shared-memory
arena (``wire.arena``): intact and private, directly and through host agents' fan-ins;
lent in place, the block held while the notebook holds the result and reused once it is
dropped; results the notebook keeps hold at most half a rank's arena (later ones are
copied out); an idle arena gives its memory back; a result the controller cannot map
fails its call with the reason and the next calls go on; a dead rank's mapping is
dropped, and a stopped mesh's, while a result lent from it stays intact."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
from conftest import wait_no_orphans
from helpers import wait_until

from monarch_kernel.actor import Actor, ActorError, endpoint, this_host
from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.wire import arena as arena_mod

pytestmark = pytest.mark.local

FLOATS = 1 << 18  # 1 MiB of float32


class Giver(Actor):
    def __init__(self) -> None:
        from monarch_kernel.actor import current_rank

        self.rank = current_rank().rank
        self.kept = torch.zeros(1)

    @endpoint
    def give(self, value: float, floats: int = FLOATS) -> torch.Tensor:
        self.kept = torch.full((floats,), value + self.rank)
        return self.kept  # kept here too: the controller's copy must be its own

    @endpoint
    def give_state(self) -> dict[str, torch.Tensor]:
        """A state dict: several large buffers in one reply (one block)."""
        return {"w": torch.full((FLOATS,), 1.0), "b": torch.full((FLOATS // 2,), 2.0)}

    @endpoint
    def kept_sum(self) -> float:
        return float(self.kept.sum())

    @endpoint
    def arena_state(self) -> tuple[int, int, int, int]:
        """(blocks placed, blocks the controller has not read or still holds, bytes
        backed, blocks lent)."""
        arena = _outbox().arena
        if arena is None:
            return (0, 0, 0, 0)
        return (arena.placed, arena.unread(), arena.backed(), arena.lent)

    @endpoint
    def use_small_arena(self, size: int) -> None:
        from monarch_kernel.wire.arena import Arena

        _outbox()._arena = Arena(size, lend=True)

    @endpoint
    def point_arena_at(self, path: str) -> str:
        arena = _outbox().arena
        assert arena is not None
        old, arena.path = arena.path, path
        return old

    @endpoint
    def size_of(self, t: torch.Tensor) -> int:
        return t.numel()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _outbox():
    from monarch_kernel.rank import context

    return context._runtime.outbox


def _held(actors) -> int:
    """Blocks of the one rank's arena the controller has not given back."""
    return actors.arena_state.call_one().get(timeout=60)[1]


def test_large_results_come_back_intact_and_private_through_the_ranks_arenas():
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        actors = procs.spawn("gv", Giver)
        inbound = procs.runtime.inbound
        one = actors.slice(gpus=2)
        got = one.give.call_one(1.0).get(timeout=60)
        assert torch.equal(got, torch.full((FLOATS,), 3.0))
        # lent: placed once, and held while the notebook holds the result
        assert one.arena_state.call_one().get(timeout=60)[:2] == (1, 1)
        assert inbound.mapped_arenas() == 1
        got.mul_(10)  # the controller's tensor is writable and its own
        assert one.kept_sum.call_one().get(timeout=60) == 3.0 * FLOATS
        again = one.give.call_one(5.0).get(timeout=60)  # another block: got's is held
        assert torch.equal(got, torch.full((FLOATS,), 30.0))
        assert torch.equal(again, torch.full((FLOATS,), 7.0))
        assert one.arena_state.call_one().get(timeout=60)[:2] == (2, 2)
        del got, again
        gc.collect()
        assert _held(one) == 0  # dropped: both blocks are the rank's again
        assert one.give.call_one(6.0).get(timeout=60)[0] == 8.0
        assert one.arena_state.call_one().get(timeout=60)[:2] == (3, 0)
        # a gathered call: every rank's large reply comes from its own arena
        values = actors.give.call(0.5).get(timeout=60).values()
        assert [float(v[0]) for v in values] == [0.5 + r for r in range(4)]
        assert all(torch.equal(v, torch.full((FLOATS,), v[0].item())) for v in values)
        states = actors.arena_state.call().get(timeout=60).values()
        assert [s[1] for s in states] == [1, 1, 1, 1] and all(s[0] >= 1 for s in states)
        assert inbound.mapped_arenas() == 4
        del values
        gc.collect()
        states = actors.arena_state.call().get(timeout=60).values()
        assert [s[1] for s in states] == [0, 0, 0, 0]
        # small results stay on the socket
        assert actors.slice(gpus=0).give.call_one(1.0, 16).get(timeout=60).numel() == 16
        assert actors.slice(gpus=0).arena_state.call_one().get(timeout=60)[0] == 1
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


@pytest.fixture
def one_giver():
    """A fresh 1-rank mesh with a ``Giver``: ``(procs, actors)``; stopped after the test,
    and checked for processes left behind."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        yield procs, procs.spawn("gv", Giver)
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"


def test_results_the_notebook_keeps_hold_at_most_half_of_a_ranks_arena(one_giver):
    _, actors = one_giver
    actors.use_small_arena.call_one(4 << 20).get(timeout=60)  # lends up to 2 MiB
    kept = [actors.give.call_one(float(i)).get(timeout=60) for i in range(6)]
    placed, held, _, lent = actors.arena_state.call_one().get(timeout=60)
    # the first 1 MiB block is lent; with a second one more than half would be held,
    # so the rest were copied out (their blocks free at once), none went over the socket
    assert (placed, lent, held) == (6, 1, 1)
    assert [float(t[0]) for t in kept] == [float(i) for i in range(6)]
    assert all(torch.equal(t, torch.full((FLOATS,), t[0].item())) for t in kept)
    kept.clear()
    gc.collect()
    assert _held(actors) == 0
    assert actors.give.call_one(9.0).get(timeout=60)[0] == 9.0
    assert actors.arena_state.call_one().get(timeout=60)[3] == 2  # lent again


def test_a_state_dict_result_is_lent_as_one_block_until_every_tensor_is_dropped(one_giver):
    _, actors = one_giver
    state = actors.give_state.call_one().get(timeout=60)
    assert torch.equal(state["w"], torch.full((FLOATS,), 1.0))
    assert torch.equal(state["b"], torch.full((FLOATS // 2,), 2.0))
    placed, held, _, lent = actors.arena_state.call_one().get(timeout=60)
    assert (placed, held, lent) == (1, 1, 1)
    weights = state.pop("w")
    del state  # the bias is gone, the weights are still held: so is the block
    gc.collect()
    assert _held(actors) == 1
    weights.mul_(3)  # writable, in place
    assert float(weights.sum()) == 3.0 * FLOATS
    del weights
    gc.collect()
    assert _held(actors) == 0


def test_idle_arenas_give_their_memory_back_on_both_sides(one_giver):
    procs, actors = one_giver
    floats = 16 * FLOATS  # 16 MiB each way: above what an idle arena keeps
    assert actors.give.call_one(2.0, floats).get(timeout=60).numel() == floats
    assert actors.size_of.call_one(torch.ones(floats)).get(timeout=60) == floats
    controller = procs.runtime.transport.arena
    assert controller is not None and controller.backed() > arena_mod.KEEP_BYTES
    assert actors.arena_state.call_one().get(timeout=60)[2] > arena_mod.KEEP_BYTES

    def both_trimmed() -> bool:  # small calls place nothing: they do not keep it busy
        rank_backed = actors.arena_state.call_one().get(timeout=60)[2]
        return controller.backed() <= arena_mod.KEEP_BYTES >= rank_backed

    wait_until(both_trimmed, timeout=60, interval=0.2, what="idle arenas trimmed")
    # and they grow again when needed
    got = actors.give.call_one(3.0, floats).get(timeout=60)
    assert torch.equal(got, torch.full((floats,), 3.0))


def test_a_result_the_controller_cannot_map_fails_its_call_with_why_and_calls_go_on(one_giver):
    _, actors = one_giver
    assert actors.give.call_one(1.0).get(timeout=60).numel() == FLOATS  # arena made
    real = actors.point_arena_at.call_one("/proc/1/fd/999999").get(timeout=60)
    with pytest.raises(ActorError) as failed:
        actors.give.call_one(1.0).get(timeout=60)
    text = str(failed.value)
    assert "SharedResultError" in text and "could not map the rank's shared memory" in text
    assert f"{arena_mod.SHM_ENV}=0" in text, text
    actors.point_arena_at.call_one(real).get(timeout=60)
    # nothing wedged: the next calls, small and large, are answered in order
    assert actors.pid.call_one().get(timeout=60) > 0
    got = actors.give.call_one(4.0).get(timeout=60)
    assert torch.equal(got, torch.full((FLOATS,), 4.0))


def test_a_dead_ranks_arena_and_a_stopped_meshs_are_no_longer_mapped():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        actors = procs.spawn("gv", Giver)
        inbound = procs.runtime.inbound
        assert len(actors.give.call(1.0).get(timeout=60).values()) == 2
        assert inbound.mapped_arenas() == 2
        kept = actors.slice(gpus=1).give.call_one(7.0).get(timeout=60)  # lent: its block
        pid = actors.slice(gpus=1).pid.call_one().get(timeout=60)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankDiedError):
            actors.slice(gpus=1).give.call_one(1.0).get(timeout=60)
        wait_until(lambda: inbound.mapped_arenas() == 1, timeout=60, what="mapping dropped")
        # a result lent by the dead rank keeps its own mapping: intact, and writable
        assert torch.equal(kept, torch.full((FLOATS,), 8.0))
        kept.add_(1)
        assert float(kept[-1]) == 9.0
        del kept
        got = actors.slice(gpus=0).give.call_one(2.0).get(timeout=60)
        assert torch.equal(got, torch.full((FLOATS,), 2.0))
    finally:
        procs.stop()
    assert inbound.mapped_arenas() == 0  # a stopped mesh maps nothing of its ranks'
    assert not wait_no_orphans(), "the mesh left processes behind"
