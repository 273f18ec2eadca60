"""Actors of one rank are concurrent (Monarch's model, issue 51): meshes on the same ranks
call each other from sync and async endpoints without a hang, an endpoint that awaits or
blocks (``threading.Event.wait``, ``time.sleep``) does not hold another actor's calls
(they run on a worker thread of the rank), one actor keeps its own order, and the stop
button, ``%mesh stacks`` and the failure policy see every actor that runs, on any
thread."""

from __future__ import annotations

import itertools
import time

import pytest
from concurrency_actors import (
    AsyncBlocker,
    AsyncCallee,
    AsyncCaller,
    AsyncSetter,
    Blocker,
    Setter,
    SyncCallee,
    SyncCaller,
)
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
    controller, on the same ranks) opens."""
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
        # The thread that runs the actors' event loop, where both endpoints wait: the main
        # thread inside an actor's call, or, where the main thread was held when the
        # calls came (a loaded machine: the relief thread took the inbox over), the
        # worker that runs the loop instead ("actor event loop", rank/lines.py _run_loop)
        threads = [(t.name, t.main, [fr.function for fr in t.frames]) for t in st.threads]
        looping = [
            (main, functions)
            for _, main, functions in threads
            if "run_until_complete" in functions
            and (("call" in functions and main) or "_run_loop" in functions)
        ]
        assert looping, threads
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


def _pair(procs, first, second):
    n = next(_names)
    return procs.spawn(f"first{n}", first), procs.spawn(f"second{n}", second)


@pytest.mark.parametrize(
    "blocker, setter",
    [(Blocker, Setter), (Blocker, AsyncSetter), (AsyncBlocker, Setter)],
    ids=["sync-blocks-sync-sets", "sync-blocks-async-sets", "async-blocks-sync-sets"],
)
def test_a_blocking_endpoint_does_not_hold_another_actor(shared, blocker, setter):
    """Actor A's endpoint blocks its thread on a ``threading.Event`` (no ``.get()``, no
    ``await``) that only actor B's endpoint, on the same ranks, sets; both are called
    from the controller: B's call runs on a thread of its own, A's returns."""
    a, b = _pair(shared, blocker, setter)
    name = f"ev{next(_names)}"
    waiting = a.block.call(name, 30)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, f"blocking at {name}")
    assert b.set.call(name).get(timeout=10).values() == ["set"] * 2
    assert waiting.get(timeout=10).values() == ["released"] * 2
    assert a.block.call(f"{name}x", 0.01).get(timeout=10).values() == ["timed out"] * 2


def test_a_sleeping_endpoint_holds_only_its_own_actor(shared):
    """While A sleeps, B answers at once (on a worker: its thread's name says so), many
    times, in order; A's own next call waits for A."""
    a, b = _pair(shared, Blocker, Blocker)
    napping = a.nap.call(3.0)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, "napping 3.0")
    t0 = time.monotonic()
    calls = [b.record.call(i) for i in range(20)]
    assert [f.get(timeout=10).values() for f in calls][-1] == [list(range(20))] * 2
    assert all(name.startswith("actor ") for name in b.thread.call().get(timeout=10).values())
    assert time.monotonic() - t0 < 2.0  # not behind A's nap
    after = a.record.call(1)
    assert not after.done()  # A's next call waits for A's nap
    assert napping.get(timeout=10).values() == ["rested"] * 2
    assert after.get(timeout=10).values() == [[1], [1]]


def _stop_a_worker(shared, spin: str, says: str):
    """A holds the main thread (a blocking wait), B runs its endpoint ``spin`` (a Python
    loop that prints ``says`` first) on a worker; the stop button then stops both (each
    call raises KeyboardInterrupt). Returns ``(a, b)``."""
    a, b = _pair(shared, Blocker, Blocker)
    name = f"stop{next(_names)}"
    held = a.block.call(name, 60)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, f"blocking at {name}")
    spinning = getattr(b, spin).call(name)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, f"{says} at {name}")
    shared.interrupt()
    for fut in (held, spinning):
        with pytest.raises(ActorError, match="KeyboardInterrupt"):
            fut.get(timeout=10)
    return a, b


def test_stop_button_interrupts_a_worker_thread(shared):
    """A holds the main thread (a blocking wait), B spins in Python on a worker: the
    stop button stops both, and both serve again."""
    a, b = _stop_a_worker(shared, "spin", "spinning")
    assert a.record.call(1).get(timeout=10).values() == [[1], [1]]
    assert b.record.call(2).get(timeout=10).values() == [[2], [2]]


def test_stop_button_on_a_worker_leaves_gradient_tracking_on(shared):
    """B turns torch's gradient tracking off on a worker thread (A holds the main one),
    the stop button lands: the worker puts it back and says so (``rank.torch_modes``), so
    the next endpoint that thread runs is not left without gradients."""
    _, b = _stop_a_worker(shared, "spin_without_grad", "spinning without grad")
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, "left torch's gradient tracking off")
    assert b.record.call(3).get(timeout=10).values() == [[3], [3]]


def test_mesh_stacks_show_a_worker_thread(shared):
    """``%mesh stacks`` shows the worker that runs B's endpoint (named after its actor)
    while A holds the main thread."""
    a, b = _pair(shared, Blocker, Blocker)
    name = f"stk{next(_names)}"
    held = a.block.call(name, 60)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, f"blocking at {name}")
    spinning = b.spin.call(name, 60)
    for rank in (0, 1):
        wait_for_rank_line(shared, rank, f"spinning at {name}")
    try:
        stacks = collect_stacks(shared.runtime, [0, 1])
        for st in stacks:
            assert st.error is None
            (main,) = [t for t in st.threads if t.main]
            assert "block" in [f.function for f in main.frames]
            (worker,) = [t for t in st.threads if t.name == f"actor {b.name}"]
            assert "spin" in [f.function for f in worker.frames]
    finally:
        shared.interrupt()
        for fut in (held, spinning):
            with pytest.raises(ActorError):
                fut.get(timeout=10)


def test_failure_policy_releases_a_worker_thread():
    """A rank dies while, on every rank, one actor holds the main thread and another
    runs on a worker: the calls fail naming the dead rank, the restart policy releases
    the survivor's endpoints on both threads, and the mesh serves again."""
    from concurrency_actors import Dies

    from monarch_kernel.actor import RankDiedError

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="conc_policy2")
    try:
        a, b = _pair(procs, Blocker, Blocker)
        dies = procs.spawn("dies", Dies).slice(gpus=0)
        name = f"pol{next(_names)}"
        held = a.block.call(name, 120)
        for rank in (0, 1):
            wait_for_rank_line(procs, rank, f"blocking at {name}")
        spinning = b.spin.call(name, 120)
        for rank in (0, 1):
            wait_for_rank_line(procs, rank, f"spinning at {name}")
        dies.die.broadcast()
        for fut in (held, spinning):
            with pytest.raises(RankDiedError, match="rank 0"):
                fut.get(timeout=30)
        procs.runtime.wait_recovered()
        assert a.record.call(1).get(timeout=30).values() == [[1], [1]]
        assert b.record.call(2).get(timeout=30).values() == [[2], [2]]
    finally:
        procs.stop()
