# mypy: disable-error-code="attr-defined,union-attr"
"""An actor endpoint's ``rref`` waits for the actor (issue 50; Monarch queues it in the
actor's mailbox, and its stream waits for the result): a call the actor runs when the
rref comes ends first, and so do the calls issued before the rref; those issued after
it run after it. A wait that never ends is released by the stop button, and an actor
that ended meanwhile fails the rref, saying so.

Real ranks (a local mesh of 2, started without a kernel), real sockets. The endpoints
that block wait for a file the test creates; nothing waits a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import torch
from helpers import wait_until

from monarch_kernel import inspect
from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.mesh_controller import RemoteException, spawn_tensor_engine

pytestmark = [pytest.mark.local, pytest.mark.timeout(240)]

#: Seconds a test waits for the ranks (a loaded 2-core machine).
WAIT = 60


@pytest.fixture(scope="module")
def pm():
    """A mesh of 2 ranks shared by the module; checked for orphans after."""
    from conftest import local_mesh

    yield from local_mesh({"gpus": 2})


def _wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


async def _await_file(path: str) -> None:
    while not os.path.exists(path):
        await asyncio.sleep(0.01)


class Blocker(Actor):
    """Sync endpoints: ``block`` until a file exists; every call is logged."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @endpoint
    def block(self, path: str) -> None:
        _wait_for_file(path)
        self.log.append("block")

    @endpoint
    def note(self, what: str) -> None:
        self.log.append(what)

    @endpoint(propagate=lambda t: t.clone())
    def times(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append("times")
        return t * len(self.log)  # its place in the log: the order is in the value

    @endpoint
    def history(self) -> list[str]:
        return list(self.log)


class AsyncBlocker(Actor):
    """``async def`` endpoints; ``block`` awaits a file."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @endpoint
    async def block(self, path: str, then_exit: bool = False) -> None:
        await _await_file(path)
        self.log.append("block")
        if then_exit:
            sys.exit(3)  # the actor stops (only it: the rank goes on)

    @endpoint
    async def note(self, what: str) -> None:
        self.log.append(what)

    @endpoint(propagate=lambda t: t.clone())
    async def times(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append("times")
        return t * len(self.log)

    @endpoint
    async def history(self) -> list[str]:
        return list(self.log)


def _busy_on_the_loop(pm, name: str, path, **kw):
    """Actor mesh ``name`` busy on every rank with ``block(path)`` run as a task of the
    rank's event loop: it starts while another actor's ``block`` (the holder's) awaits
    on the rank's main thread, and goes on after that one ended. Returns (actors, the
    holder's file, the blocked call): create the holder's file once the rref is issued
    (the rref's op then runs, and finds the actor busy)."""
    holder = pm.spawn(f"{name}_holder", AsyncBlocker)
    actors = pm.spawn(name, AsyncBlocker)
    # both built, and the ranks idle: the holder's call then runs on the main thread
    # (a call that comes while the main thread is busy may start elsewhere)
    holder.history.call().get(timeout=WAIT)
    actors.history.call().get(timeout=WAIT)
    hold = path.parent / f"{name}_hold"
    holder.block.call(str(hold))
    blocked = actors.block.call(str(path), **kw)
    return actors, hold, blocked


class Probe(Actor):
    """What the rref ops of this rank wait for (a call of another actor runs while the
    op waits: the rank keeps serving its inbox)."""

    @endpoint
    def waits(self) -> list[str]:
        from monarch_kernel.rank.tensors.actor_calls import waiting_for

        return waiting_for()


def _all_wait_for(probe, name: str) -> bool:
    answers = probe.waits.call().get(timeout=WAIT)
    return all(name in answers.item(gpus=g) for g in range(2))


def _log(actors) -> list[list[str]]:
    got = actors.history.call().get(timeout=WAIT)
    return [got.item(gpus=g) for g in range(2)]


def test_rref_runs_after_a_sync_call_that_blocks(pm, tmp_path):
    go = tmp_path / "go"
    with pm.activate():
        actors = pm.spawn("rref_sync", Blocker)
        actors.note.call("first").get(timeout=WAIT)
        blocked = actors.block.call(str(go))
        actors.note.call("before")
        out = actors.times.rref(torch.ones(()))
        actors.note.call("after")
        go.touch()
        blocked.get(timeout=WAIT)
        # "first", "block", "before", then the rref: 4th in the log on every rank
        assert inspect(out, gpus=0).item() == 4.0
        assert inspect(out, gpus=1).item() == 4.0
        assert _log(actors) == [["first", "block", "before", "times", "after"]] * 2
    actors.stop().get(timeout=WAIT)


def test_rref_waits_for_an_async_call_that_blocks(pm, tmp_path):
    go = tmp_path / "go"
    with pm.activate():
        probe = pm.spawn("rref_probe", Probe)
        actors, hold, blocked = _busy_on_the_loop(pm, "rref_async", go)
        actors.note.call("before")  # waits in the actor's line
        out = actors.times.rref(torch.ones(()) * 10)
        later = actors.note.call("after")  # issued after the rref: runs after it
        hold.touch()
        # the rref's op waits on every rank for the blocked call (not failed: waiting)
        wait_until(lambda: _all_wait_for(probe, "rref_async"), timeout=WAIT, what="rref waits")
        assert not later.done()
        go.touch()
        blocked.get(timeout=WAIT)
        later.get(timeout=WAIT)
        assert inspect(out, gpus=0).item() == 30.0  # "block", "before", "times"
        assert inspect(out, gpus=1).item() == 30.0
        assert _log(actors) == [["block", "before", "times", "after"]] * 2
        # and the actor is free again: an rref with nothing ahead runs at once
        assert inspect(actors.times.rref(torch.ones(())), gpus=1).item() == 5.0
    probe.stop().get(timeout=WAIT)


def test_the_stop_button_releases_an_rref_that_waits(pm, tmp_path):
    never = tmp_path / "never"
    with pm.activate():
        probe = pm.spawn("rref_probe_stop", Probe)
        actors, hold, blocked = _busy_on_the_loop(pm, "rref_stuck", never)
        out = actors.times.rref(torch.ones(()))
        hold.touch()
        wait_until(lambda: _all_wait_for(probe, "rref_stuck"), timeout=WAIT, what="rref waits")
        client = spawn_tensor_engine(pm).client
        client.cell_ended(interrupted=True)  # what the stop button does at a cell's end
        with pytest.raises(RemoteException, match="interrupted by the stop button"):
            inspect(out, gpus=0)
        assert _all_wait_for(probe, "rref_stuck") is False
        # the rank stays usable (ops run again); the actor's own call goes on, and once
        # it ends the actor serves the next rref (the stopped one's turn is skipped)
        assert inspect(torch.ones(()) * 7, gpus=1).item() == 7.0
        assert not blocked.done()
        never.touch()
        blocked.get(timeout=WAIT)
        assert inspect(actors.times.rref(torch.ones(())), gpus=0).item() == 2.0
        assert _log(actors) == [["block", "times"]] * 2
    probe.stop().get(timeout=WAIT)


def test_an_actor_stopped_before_the_rref_s_turn_fails_it(pm, tmp_path):
    go = tmp_path / "go"
    with pm.activate():
        probe = pm.spawn("rref_probe_gone", Probe)
        actors, hold, blocked = _busy_on_the_loop(pm, "rref_gone", go)
        stopping = actors.stop()  # waits in the actor's line, ahead of the rref
        out = actors.times.rref(torch.ones(()))
        hold.touch()
        wait_until(lambda: _all_wait_for(probe, "rref_gone"), timeout=WAIT, what="rref waits")
        go.touch()
        blocked.get(timeout=WAIT)
        stopping.get(timeout=WAIT)
        with pytest.raises(RemoteException, match="ended on rank .* while AsyncBlocker.times"):
            inspect(out, gpus=1)
    probe.stop().get(timeout=WAIT)
