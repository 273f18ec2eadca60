"""A silent host agent that still runs is busy, not frozen (``controller.lifecycle.busy_agents``).

Judged on real processes standing in for the agent's process: one that spins, one that
is stopped (the frozen agent of ``test_faults``' SIGSTOP test), one that sleeps (a
deadlocked loop). The whole supervision keeps its SIGSTOP tests (a frozen agent is
still lost within 3 s: ``test_faults``, ``test_join``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import freeze, wait_until

from monarch_kernel.controller.lifecycle.busy_agents import (
    MAX_BUSY_SILENCE,
    BusyAgents,
    main_thread_cpu_ns,
)

ALLOWED = 2.5  # the silence bound on a quiet machine (the mesh's hb_timeout)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> int:
        p = subprocess.Popen([sys.executable, "-c", code])
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def _ran(pid: int) -> int:
    cpu = main_thread_cpu_ns(pid)
    assert cpu is not None
    return cpu


def _verdict(pid: int, pause: float = 0.3) -> bool:
    """Sample at half the bound, then ask past it, ``pause`` seconds later."""
    busy = BusyAgents()
    busy.watch(0, pid, silence=ALLOWED / 2 + 0.1, allowed=ALLOWED)
    time.sleep(pause)
    return busy.working(0, pid, silence=ALLOWED + 0.5)


def test_an_agent_that_runs_is_busy(spawn):
    pid = spawn("while True: pass")
    wait_until(lambda: _ran(pid) > 10_000_000, what="the process to run")
    assert _verdict(pid)


def test_a_stopped_agent_is_frozen(spawn):
    pid = spawn("while True: pass")
    wait_until(lambda: _ran(pid) > 10_000_000, what="the process to run")
    freeze(pid)
    assert not _verdict(pid)


def test_an_agent_asleep_is_frozen(spawn, tmp_path):
    asleep = tmp_path / "asleep"
    pid = spawn(f"import time; open({str(asleep)!r}, 'w').close(); time.sleep(60)")
    # past its start-up (which uses CPU for as long as a loaded machine makes it take)
    wait_until(asleep.exists, what="the process to fall asleep")
    assert not _verdict(pid)


def test_busy_has_a_limit_and_needs_a_sample_and_a_pid(spawn):
    pid = spawn("while True: pass")
    wait_until(lambda: _ran(pid) > 10_000_000, what="the process to run")
    busy = BusyAgents()
    assert not busy.working(0, pid, silence=ALLOWED + 0.5)  # never sampled while silent
    busy.watch(0, pid, silence=ALLOWED, allowed=ALLOWED)
    time.sleep(0.2)
    assert not busy.working(0, pid, silence=MAX_BUSY_SILENCE)  # spinning forever: lost
    busy.watch(0, None, silence=ALLOWED, allowed=ALLOWED)  # a remote agent: no pid
    assert not busy.working(0, None, silence=ALLOWED + 0.5)
    # heard again: the sample goes, and a later silence starts afresh
    busy.watch(1, pid, silence=ALLOWED, allowed=ALLOWED)
    busy.watch(1, pid, silence=0.1, allowed=ALLOWED)
    assert not busy.working(1, pid, silence=ALLOWED + 0.5)
