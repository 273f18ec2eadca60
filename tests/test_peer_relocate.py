"""References survive a host relaunch: an actor of mesh A holds a handle to an actor of
mesh B; B's host agent is killed, the restart policy relaunches it (a new agent, so a new
private directory and new peer addresses) and re-creates the actor; A's call through its
old handle then asks the controller where the rank is now and reaches it. A rank that is
really gone still fails the call with a clear RankDiedError."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import wait_until

from monarch_kernel.actor import Actor, ActorError, endpoint, this_host
from monarch_kernel.controller.state.records import MeshPhase

pytestmark = pytest.mark.local


class Target(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Holder(Actor):
    """Holds a handle to a Target mesh of another mesh, made before anything moved."""

    def __init__(self, targets) -> None:
        self.targets = targets

    @endpoint
    def call_target(self) -> int:
        return self.targets.pid.call_one().get(timeout=60)


def _recovered(procs, restarts: int) -> bool:
    info = procs.runtime.ranks[0]
    return info.restarts >= restarts and info.alive and procs.runtime.state is MeshPhase.RUNNING


def _kill_host_and_wait(procs) -> None:
    """SIGKILL the mesh's host agent (its rank dies with it); wait until the restart
    policy has relaunched it and the rank and its actors are back."""
    restarts = procs.runtime.ranks[0].restarts
    os.kill(procs.runtime.hosts[0].pid, signal.SIGKILL)
    wait_until(
        lambda: _recovered(procs, restarts + 1),
        timeout=90,
        what="the host to be relaunched and its rank restarted",
        detail=lambda: (procs.runtime.state, procs.runtime.ranks[0]),
    )


def test_old_handle_reaches_a_rank_whose_host_was_relaunched():
    a = this_host().spawn_procs(per_host={"gpus": 2})
    b = this_host().spawn_procs(per_host={"gpus": 1})  # restarts what dies (the default)
    try:
        targets = b.spawn("targets", Target)
        talked = a.slice(gpus=0).spawn("talked", Holder, targets)  # calls before the relaunch
        silent = a.slice(gpus=1).spawn("silent", Holder, targets)  # another process: after
        first = talked.call_target.call_one().get(timeout=60)
        old_agent, old_peer = b.runtime.hosts[0].pid, b.runtime.ranks[0].peer
        _kill_host_and_wait(b)
        new_peer = b.runtime.ranks[0].peer
        assert b.runtime.hosts[0].pid != old_agent, "the host agent was not relaunched"
        assert new_peer.ipc != old_peer.ipc, "the rank listens where it did: nothing moved"
        now = targets.pid.call_one().get(timeout=60)  # the notebook's own handle
        assert now != first
        assert talked.call_target.call_one().get(timeout=60) == now
        assert silent.call_target.call_one().get(timeout=60) == now
        # and again, after a second relaunch: the address learned is replaced too
        _kill_host_and_wait(b)
        again = targets.pid.call_one().get(timeout=60)
        assert talked.call_target.call_one().get(timeout=60) == again != now
    finally:
        a.stop()
        b.stop()


def test_rank_really_gone_fails_the_call_clearly():
    a = this_host().spawn_procs(per_host={"gpus": 1})
    b = this_host().spawn_procs(per_host={"gpus": 1}, on_failure="continue")
    try:
        targets = b.spawn("targets", Target)
        holder = a.spawn("holder", Holder, targets)
        pid = holder.call_target.call_one().get(timeout=60)
        os.kill(pid, signal.SIGKILL)  # not restarted: on_failure='continue'
        wait_until(lambda: not b.runtime.ranks[0].alive, timeout=15, what="B's rank dead")
        with pytest.raises(ActorError) as dead:  # raised in the holder's endpoint
            holder.call_target.call_one().get(timeout=60)
        text = str(dead.value)
        assert text.startswith("RankDiedError in Holder.call_target"), text
        assert f"rank 0 of mesh {b.name!r} (host" in text and "killed by SIGKILL" in text, text
        b.stop()
        with pytest.raises(ActorError, match=f"rank 0 of mesh {b.name!r} is gone: the mesh was"):
            holder.call_target.call_one().get(timeout=60)
    finally:
        a.stop()
        b.stop()
