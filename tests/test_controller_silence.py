"""A silent controller is given up on only once it is known to be gone.

A notebook cell in C code that holds the GIL silences the controller (its heartbeats come
from a Python thread) while it is perfectly alive; so does a thousand-rank mesh on two
cores. Host agents used to shut down, with their ranks, after ``hb_timeout`` of silence
whatever the cause. Now they wait while the controller's process runs (on its machine)
or its connection answers libzmq's pings (elsewhere), and still leave at once when it is
gone (``monarch_kernel.host.liveness``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq
from conftest import wait_no_orphans
from helpers import wait_until

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.controller.lifecycle import startup
from monarch_kernel.host import liveness
from monarch_kernel.wire.desk import ControllerId, process_started


class Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def bump(self) -> tuple[int, int]:
        self.n += 1
        return os.getpid(), self.n


def _hold_the_gil(seconds: int) -> None:
    """C code that keeps the GIL: ``sleep(3)`` through ``ctypes.PyDLL`` (which does not
    release it), as a long C call in a notebook cell would."""
    ctypes.PyDLL(None).sleep(seconds)


def test_a_controller_busy_past_the_agents_patience_keeps_its_mesh(monkeypatch):
    # The agents' patience: 2.5 s (the mesh's hb_timeout) instead of 10, so that the
    # test's stall, twice that, stays short.
    monkeypatch.setattr(startup, "AGENT_SILENCE_TIMEOUT", 1.0)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, on_failure="stop")
    try:
        counters = procs.spawn("counters", Counter)
        before = dict(counters.bump.call().get().items())
        agent = procs.runtime.hosts[0].pid
        _hold_the_gil(6)
        after = dict(counters.bump.call().get(timeout=30).items())
        # the same processes, with their state: nothing was restarted
        assert [pid for pid, _ in after.values()] == [pid for pid, _ in before.values()]
        assert [n for _, n in after.values()] == [2, 2]
        assert procs.runtime.hosts[0].pid == agent and not procs.runtime.hosts[0].lost
    finally:
        procs.stop()
    assert not wait_no_orphans()


# -- the verdict on a controller on another machine: its connection ------------------

# A stand-in controller end: a ROUTER in a process of its own, whose Python is then
# made busy, stopped or killed (its libzmq I/O thread is what answers the pings).
_PEER = """
import ctypes, sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
sys.stdin.readline()            # "busy": hold the GIL in C from now on
ctypes.PyDLL(None).sleep(60)
"""

#: Not this machine: the verdict cannot look at the process, only at the connection.
_ELSEWHERE = "a-machine-that-is-not-this-one"


@pytest.fixture
def peer(monkeypatch):
    monkeypatch.setattr(liveness, "LINK_PING_INTERVAL", 0.2)
    monkeypatch.setattr(liveness, "LINK_TIMEOUT", 2.0)  # (a loaded CI machine: not less)
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    ctx = zmq.Context()
    out = ctx.socket(zmq.DEALER)
    out.setsockopt(zmq.LINGER, 0)
    liveness.arm_heartbeats(out)
    link = liveness.ControllerLink(out)
    out.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield proc, link
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        link.close()
        out.close(0)
        ctx.term()


def _link_state(link: liveness.ControllerLink) -> bool:
    link.on_events()
    return link.up


def _connected(link: liveness.ControllerLink) -> bool:
    """The connection was made (libzmq pings it only from then; ``up`` is True from
    the start)."""
    link.on_events()
    return link.handshakes > 0


def test_a_busy_controller_elsewhere_is_waited_for(peer):
    proc, link = peer
    holder = ControllerId(proc.pid, _ELSEWHERE, 0.0)
    silent = liveness.SilentController(0, link)
    assert proc.stdin is not None
    wait_until(lambda: _connected(link), what="the connection to be made")
    proc.stdin.write("busy\n")
    proc.stdin.flush()
    # Its Python is stuck for good; its libzmq answers. Three times the link timeout:
    # the connection stays up and the verdict stays "alive".
    end = time.monotonic() + 3 * liveness.LINK_TIMEOUT
    while time.monotonic() < end:
        assert _link_state(link)
        assert silent.gone(30.0, holder) is None
        time.sleep(0.05)


def test_a_stopped_controller_elsewhere_is_gone_when_its_pings_go_unanswered(peer):
    proc, link = peer
    holder = ControllerId(proc.pid, _ELSEWHERE, 0.0)
    wait_until(lambda: _connected(link), what="the connection to be made")
    os.kill(proc.pid, signal.SIGSTOP)  # a machine that vanished: no FIN, no answers
    wait_until(lambda: not _link_state(link), timeout=15, what="libzmq to drop the link")
    why = liveness.SilentController(0, link).gone(30.0, holder)
    assert why is not None and "connection" in why and "closed" in why


def test_a_killed_controller_is_gone(peer):
    proc, link = peer
    elsewhere = ControllerId(proc.pid, _ELSEWHERE, 0.0)
    here = ControllerId(proc.pid, socket.gethostname(), process_started(proc.pid) or 0.0)
    assert liveness.gone_reason(here, link) is None  # it runs
    wait_until(lambda: _connected(link), what="the connection to be made")
    proc.kill()
    proc.wait()
    assert "ended" in (liveness.gone_reason(here, link) or "")  # its process, here
    # elsewhere: its OS closed the connection at once
    wait_until(lambda: not _link_state(link), timeout=15, what="the link to close")
    assert "closed" in (liveness.gone_reason(elsewhere, link) or "")
