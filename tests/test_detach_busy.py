"""A detached mesh whose host agent is slow to answer is still there: a late answer is
never taken for a mesh that ended (whose attach file would then be removed, leaving its
ranks running with no way back to them).

The agent is stopped with SIGSTOP, the extreme of a loaded machine (the CI's
``test_a_fast_loop_never_blocks_when_its_kernel_dies`` once lost its mesh so, to an
agent starved for a second).
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
from conftest import pid_alive
from detach_place import ok
from helpers import freeze, wait_until

from monarch_kernel.controller.detach.attach import DeskClient, read_file, stop_detached
from monarch_kernel.wire.desk import ControllerId, DeskOp, DeskRequest

pytestmark = pytest.mark.local


def test_a_stopped_agents_mesh_is_kept_listed_and_attached_once_it_answers(place):
    k1 = place.kernel()
    ok(k1, "%mesh db --gpus 1 --detachable --keep 5m")
    ok(k1, "%%remote db\nx = 41")
    place.kill(k1)
    agent = place.attach_file("db")["hosts"][0]["pid"]
    pids = place.mesh_pids("db")
    k2 = place.kernel()
    try:
        freeze(agent)  # all its threads: kill() returns before they stop
        listed = ok(k2, "%mesh").text
        assert "db" in listed and "not answering" in listed and "?/1" in listed, listed
        assert os.path.exists(place.attach_path("db"))
        r = k2.run("%mesh attach db")
        assert "host agent(s) [0] run but did not answer" in r.stderr, r.text
        assert "try %mesh attach db again" in r.stderr
        r = k2.run("%mesh db --gpus 1 --detachable")
        assert "a detached mesh is already named 'db'" in r.stderr, r.text
        assert os.path.exists(place.attach_path("db"))
    finally:
        os.kill(agent, signal.SIGCONT)
    ok(k2, "%mesh attach db")
    assert "{gpus=0}: 42" in ok(k2, "%%remote db\nx + 1").text
    assert "mesh 'db' stopped" in ok(k2, "%mesh stop db").stdout
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="the mesh to end")


def test_stop_asks_again_an_agent_that_was_too_busy_to_answer(place, monkeypatch):
    k1 = place.kernel()
    ok(k1, "%mesh ds --gpus 1 --detachable --keep 5m")
    place.kill(k1)
    agent = place.attach_file("ds")["hosts"][0]["pid"]
    pids = place.mesh_pids("ds")
    asked: list[bool] = []
    ask = DeskClient.ask

    def wake() -> None:
        # Once it answered ``stop`` the agent may already have ended: nothing to wake.
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGCONT)

    def ask_then_wake(self, host, req, timeout):  # the real ask; the agent runs on after
        reply = ask(self, host, req, timeout)
        asked.append(reply is not None)
        wake()
        return reply

    monkeypatch.setattr(DeskClient, "ask", ask_then_wake)
    try:
        freeze(agent)  # all its threads: kill() returns before they stop
        said = stop_detached(None, path=place.attach_path("ds"))
    finally:
        wake()
    assert asked == [False, True]  # not answered while stopped, then answered
    assert said == "mesh 'ds' stopped (1 host agent(s) answered)"
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="the mesh to end")
    assert not os.path.exists(place.attach_path("ds"))


def test_a_stop_not_answered_in_time_is_not_carried_out_later(place):
    """A timed-out ask is withdrawn: the agent, stopped while it was asked, never gets
    it once it runs again (no one waits for that answer any more)."""
    k1 = place.kernel()
    ok(k1, "%mesh dl --gpus 1 --detachable --keep 5m")
    place.kill(k1)
    agent = place.attach_file("dl")["hosts"][0]["pid"]
    pids = place.mesh_pids("dl")
    client = DeskClient(read_file(None, place.attach_path("dl")))
    host = client.file.hosts[0]
    me = ControllerId.of_this_process()
    try:
        freeze(agent)
        assert client.ask(host, DeskRequest(DeskOp.STOP, me), timeout=0.5) is None
    finally:
        os.kill(agent, signal.SIGCONT)
    for _ in range(3):  # served: had the stop come, it would have come before these
        reply = client.ask(host, DeskRequest(DeskOp.STATUS, me), timeout=30)
        assert reply is not None and reply.ok, reply
    assert all(pid_alive(p) for p in [agent, *pids])
    assert "mesh 'dl' stopped" in stop_detached(None, path=place.attach_path("dl"))
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="the mesh to end")


def test_a_killed_agents_left_socket_is_not_taken_for_a_running_mesh(place):
    k1 = place.kernel()
    ok(k1, "%mesh dk --gpus 1 --detachable --keep 5m")
    place.kill(k1)
    f = place.attach_file("dk")
    desk = f["hosts"][0]["desk"].removeprefix("ipc://")
    for pid in place.mesh_pids("dk"):
        os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: not any(pid_alive(p) for p in place.mesh_pids("dk")),
        timeout=30,
        what="the killed mesh to end",
    )
    assert os.path.exists(desk)  # a killed agent cannot remove its socket
    k2 = place.kernel()
    assert "dk" not in ok(k2, "%mesh").text
    assert not os.path.exists(place.attach_path("dk"))
    assert "no mesh named 'dk'" in k2.run("%mesh stop dk").stderr
    # Its private directory stays behind (a killed agent cannot remove it): the next
    # kernel's sweep removes it once its owners are gone; here the place does.
    import shutil

    shutil.rmtree(os.path.dirname(desk), ignore_errors=True)
