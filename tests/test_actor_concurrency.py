"""Actors of one rank are concurrent (Monarch's model, issue 51): meshes on the same ranks
call each other from sync and async endpoints without a hang, an async endpoint that
awaits does not hold another actor's calls, one actor keeps its own order, and the stop
button and ``%mesh stacks`` see every actor that runs."""

from __future__ import annotations

import itertools

import pytest
from concurrency_actors import AsyncCallee, AsyncCaller, SyncCallee, SyncCaller
from helpers import wait_for_rank_line

from monarch_kernel.actor import ActorError, this_host
from monarch_kernel.controller.lifecycle.stacks import collect_stacks

pytestmark = pytest.mark.local

_names = itertools.count()


@pytest.fixture(scope="module")
def shared():
    """One proc mesh of 2 ranks: every actor mesh of this module lives on it."""
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="conc")
    yield procs
    procs.stop()


def _spawn(procs, caller, callee):
    n = next(_names)
    other = procs.spawn(f"callee{n}", callee)
    return procs.spawn(f"caller{n}", caller, other), other


@pytest.mark.parametrize("callee", [SyncCallee, AsyncCallee], ids=["sync-callee", "async-callee"])
@pytest.mark.parametrize("caller", [SyncCaller, AsyncCaller], ids=["sync-caller", "async-caller"])
def test_two_meshes_on_the_same_ranks_call_each_other(shared, caller, callee):
    """Rank 0's endpoint waits for rank 1's actor of the other mesh while rank 1's waits
    for rank 0's: 100 rounds, no hang."""
    a, _ = _spawn(shared, caller, callee)
    for i in range(100):
        assert a.f.call(i).get(timeout=30).values() == [2 * i + 1, 2 * i + 1]


def test_an_awaiting_endpoint_does_not_hold_another_actor(shared):
    """An async endpoint waits for a gate that only the other actor's call (from the
    controller, on the same ranks) opens. (A sync endpoint's call waits until the
    rank's event loop is free: docs/guide/actors.md, what is not copied.)"""
    a, b = _spawn(shared, AsyncCaller, AsyncCallee)
    waiting = a.wait_gate.call("g1")
    assert b.open_gate.call("g1").get(timeout=10).values() == ["opened"] * 2
    assert waiting.get(timeout=10).values() == ["released"] * 2


def test_one_actor_keeps_its_order_while_others_run(shared):
    a, b = _spawn(shared, AsyncCaller, AsyncCallee)
    waiting = a.wait_gate.call("g2")  # a is busy: its next calls wait in its line
    later = [a.record.call(i) for i in range(5)]
    assert b.open_gate.call("g2").get(timeout=10).values() == ["opened"] * 2
    assert waiting.get(timeout=10).values() == ["released"] * 2
    assert [f.get(timeout=10).values() for f in later][-1] == [[0, 1, 2, 3, 4]] * 2


def test_stop_button_interrupts_every_running_actor(shared):
    a, _ = _spawn(shared, AsyncCaller, AsyncCallee)
    c, _ = _spawn(shared, AsyncCaller, AsyncCallee)
    first = a.wait_gate.call("never1")
    second = c.wait_gate.call("never2")  # starts while the first awaits

    for rank in (0, 1):  # both endpoints run (the second started while the first awaits)
        wait_for_rank_line(shared, rank, "waiting at never1")
        wait_for_rank_line(shared, rank, "waiting at never2")
    shared.interrupt()
    for fut in (first, second):
        with pytest.raises(ActorError, match="KeyboardInterrupt"):
            fut.get(timeout=10)
    assert a.record.call(1).get(timeout=10).values() == [[1], [1]]  # both still serve
    assert c.record.call(2).get(timeout=10).values() == [[2], [2]]


def test_mesh_stacks_answer_while_actors_run(shared):
    """``%mesh stacks`` (the control thread) answers while two actors' endpoints run on
    the main thread, and shows where it is: inside an actor's call."""
    a, b = _spawn(shared, AsyncCaller, AsyncCallee)
    c, _ = _spawn(shared, AsyncCaller, AsyncCallee)
    first = a.wait_gate.call("g3")
    second = c.wait_gate.call("g4")
    for rank in (0, 1):
        try:
            wait_for_rank_line(shared, rank, "waiting at g4", timeout=5)
        except AssertionError:
            for st in collect_stacks(shared.runtime, [rank]):
                for t in st.threads:
                    if t.main:
                        print("STACK", [f"{f.function}:{f.lineno}" for f in t.frames])
            raise
    stacks = collect_stacks(shared.runtime, [0, 1])
    assert all(st.error is None for st in stacks)
    for st in stacks:
        (main,) = [t for t in st.threads if t.main]
        functions = [fr.function for fr in main.frames]
        assert "call" in functions and "run_until_complete" in functions, functions
    b.open_gate.call("g3").get(timeout=10)
    b.open_gate.call("g4").get(timeout=10)
    assert first.get(timeout=10).values() == second.get(timeout=10).values() == ["released"] * 2


def test_failure_policy_releases_every_running_actor():
    """A rank dies while two actors run on every rank (the second started while the
    first awaits): the calls fail naming the dead rank, the restart policy releases the
    survivor's two endpoints, and the mesh serves again."""
    from concurrency_actors import Dies

    from monarch_kernel.actor import RankDiedError

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="conc_policy")
    try:
        a, _ = _spawn(procs, AsyncCaller, AsyncCallee)
        c, _ = _spawn(procs, AsyncCaller, AsyncCallee)
        dies = procs.spawn("dies", Dies).slice(gpus=0)
        first = a.wait_gate.call("p1")
        second = c.wait_gate.call("p2")
        for rank in (0, 1):
            wait_for_rank_line(procs, rank, "waiting at p2")
        dies.die.broadcast()
        for fut in (first, second):
            with pytest.raises(RankDiedError, match="rank 0"):
                fut.get(timeout=30)
        procs.runtime.wait_recovered()
        assert a.record.call(1).get(timeout=30).values() == [[1], [1]]
        assert c.record.call(2).get(timeout=30).values() == [[2], [2]]
    finally:
        procs.stop()
