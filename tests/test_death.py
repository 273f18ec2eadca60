"""Rank death: pushed at once, names the rank, and never poisons the other ranks."""

from __future__ import annotations

import os
import signal

import pytest
from actors import Counter, Worker
from conftest import pid_alive
from helpers import wait_for_rank_line

from monarch_kernel.actor import MeshStoppedError, RankDiedError, this_host

pytestmark = pytest.mark.local


@pytest.fixture
def mesh():
    # "continue": a dead rank stays dead (the restart policy is tested in test_faults.py)
    procs = this_host().spawn_procs(per_host={"gpus": 4}, on_failure="continue")
    yield procs
    procs.stop()


def test_sigkill_mid_call_fails_future_from_the_exit_report(mesh):
    workers = mesh.spawn("w", Worker)
    pids = workers.pid.call().get().values()
    fut = workers.slice(gpus=2).sleep.call_one(60, "alone")
    gather = workers.sleep.call(60, "all")
    # Rank 2 is inside the first call (it dies mid-call); the others inside the gather
    # (so that mesh.interrupt() below stops them).
    wait_for_rank_line(mesh, 2, "sleeping alone")
    for r in (0, 1, 3):
        wait_for_rank_line(mesh, r, "sleeping all")
    os.kill(pids[2], signal.SIGKILL)
    with pytest.raises(RankDiedError) as err:
        fut.get(timeout=5)
    text = str(err.value)
    assert "rank 2 of mesh" in text and f"pid {pids[2]}" in text
    assert "killed by SIGKILL" in text
    assert "sleeping" in text  # its last output lines
    assert err.value.death is not None
    # the host agent's exit report (a death found by missed heartbeats has a reason and
    # no signal); how soon it comes is bench row 7's (death), not a timed test's
    assert err.value.death.signal == signal.SIGKILL and err.value.death.reason is None
    # the gather fails once the others were released (interrupted after the grace)
    with pytest.raises(RankDiedError, match="rank 2") as err:
        gather.get(timeout=5)
    assert "ranks 0-1, 3 were still running w.sleep" in str(err.value)
    assert "left running (on_failure='continue'): 0-1, 3" in str(err.value)
    mesh.interrupt()  # "continue" left them sleeping
    # the other ranks keep answering (unlike Monarch, one death does not poison the mesh)
    for r in (0, 1, 3):
        assert workers.slice(gpus=r).echo.call_one(r).get(timeout=5) == r
    # calls that include the dead rank fail at once with a clear error
    with pytest.raises(RankDiedError, match="Restart it with"):
        workers.echo.call(1)


@pytest.mark.parametrize(
    "how,expect",
    [("exit", "exit code 7"), ("segv", "killed by SIGSEGV"), ("kill", "killed by SIGKILL")],
)
def test_death_reports_exit_code_or_signal_and_last_output(mesh, how, expect):
    workers = mesh.spawn("w", Worker)
    with pytest.raises(RankDiedError) as err:
        workers.slice(gpus=1).die.call_one(how).get(timeout=5)
    text = str(err.value)
    assert expect in text
    assert f"about to die by {how}" in text
    if how == "segv":
        assert "Segmentation fault" in text  # faulthandler's report from the log


def test_restart_dead_rank_recreates_actors(mesh):
    counters = mesh.spawn("c", Counter, 100)
    workers = mesh.spawn("w", Worker)
    old = workers.pid.call().get().values()
    with pytest.raises(RankDiedError):
        workers.slice(gpus=0).die.call_one("exit").get(timeout=5)
    mesh.restart()
    new = workers.pid.call().get().values()
    assert new[0] != old[0] and new[1:] == old[1:]
    assert not pid_alive(old[0])
    assert counters.value.call().get().values() == [100] * 4
    info = workers.slice(gpus=0).whoami.call_one().get()
    assert info["rank"] == 0 and info["env"]["RANK"] == "0"


def test_restart_live_rank(mesh):
    workers = mesh.spawn("w", Worker)
    old = workers.pid.call().get().values()
    mesh.restart([3])
    new = workers.pid.call().get().values()
    assert new[:3] == old[:3] and new[3] != old[3]


def test_stopped_mesh_gives_clear_errors():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    workers = procs.spawn("w", Worker)
    pids = workers.pid.call().get().values()
    fut = workers.sleep.call(30)
    procs.stop()
    with pytest.raises(MeshStoppedError):
        fut.get(timeout=5)
    with pytest.raises(MeshStoppedError, match="is stopped"):
        workers.echo.call(1)
    with pytest.raises(MeshStoppedError):
        procs.spawn("again", Worker)
    procs.stop()  # idempotent
    assert not any(pid_alive(p) for p in pids)


def test_last_output_of_a_dead_rank_is_its_own_from_the_call_it_died_in(mesh):
    workers = mesh.spawn("w2", Worker)
    workers.slice(gpus=1).say.call_one("an earlier call's line").get(timeout=5)
    with pytest.raises(RankDiedError) as err:
        workers.slice(gpus=1).die.call_one("exit").get(timeout=5)
    text = str(err.value)
    assert "about to die by exit" in text  # what it printed in this call
    assert "an earlier call's line" not in text  # not what an earlier call printed
    mesh.restart()
    workers.slice(gpus=1).say.call_one("said before").get(timeout=5)
    with pytest.raises(RankDiedError) as err:
        workers.slice(gpus=1).exit_silently.call_one().get(timeout=5)
    assert "said before" not in str(err.value)
    assert "no output in what it was running" in str(err.value)
