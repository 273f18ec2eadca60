"""Nothing outlives its controller; start-up failures are reported clearly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import pid_alive
from helpers import WaitTimeout, wait_until

from monarch_kernel.actor import MeshStartError, host_mesh, this_host
from monarch_kernel.launchers import get_launcher
from monarch_kernel.launchers.local import LocalLauncher

CONTROLLER = textwrap.dedent(
    """
    import json, os, sys, time
    from monarch_kernel.actor import host_mesh
    procs = host_mesh(hosts={hosts}).spawn_procs(per_host={{"gpus": 2}})
    rt = procs.runtime
    pids = [r.pid for r in rt.ranks] + [h.pid for h in rt.hosts]
    print(json.dumps(pids), flush=True)
    {tail}
    """
)


def _start_controller(hosts: int, tail: str) -> tuple[subprocess.Popen, list[int]]:
    code = CONTROLLER.format(hosts=hosts, tail=tail)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "controller script failed to start a mesh"
    return proc, json.loads(line)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for ``pids`` to exit; return those still alive."""
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=timeout, what="exit")
    return [p for p in pids if pid_alive(p)]


@pytest.mark.parametrize("hosts", [1, 2])
def test_killed_controller_leaves_no_processes(hosts):
    proc, pids = _start_controller(hosts, "time.sleep(60)")
    assert all(pid_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = _wait_gone(pids, 5.0)
    for p in left:  # clean up before failing, so one bug does not leak into other tests
        os.kill(p, signal.SIGKILL)
    assert not left, f"still alive after the controller was killed: {left}"


def test_controller_exit_without_stop_cleans_up():
    proc, pids = _start_controller(1, "sys.exit(0)")
    proc.wait(20)
    assert _wait_gone(pids, 5.0) == []


@pytest.mark.unit
def test_bad_per_host_is_rejected():
    with pytest.raises(ValueError, match="positive int"):
        this_host().spawn_procs(per_host={"gpus": 0})
    # "hosts" is a dimension name like any other on one host (as in Monarch), but not
    # on a mesh of several hosts, which adds its own hosts dimension
    with pytest.raises(ValueError, match="must not contain 'hosts'"):
        host_mesh(hosts=2).spawn_procs(per_host={"hosts": 2, "gpus": 1})


@pytest.mark.unit
def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'nope'.*local"):
        get_launcher("nope")


def test_start_timeout_is_reported_and_cleaned_up():
    with pytest.raises(MeshStartError, match="not ready in time"):
        this_host().spawn_procs(per_host={"gpus": 2}, timeout=0.05)


def test_launcher_works_after_shutdown():
    launcher = get_launcher("local")
    assert isinstance(launcher, LocalLauncher)
    launcher.prewarm(1)
    launcher.shutdown()  # e.g. a kernel's shutdown path; the shared launcher is reused after
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    procs.stop()


def test_prewarmed_host_agent_is_used():
    launcher = get_launcher("local")
    assert isinstance(launcher, LocalLauncher)
    launcher.prewarm(1)
    assert launcher.pooled() == 1
    t0 = time.monotonic()
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        assert launcher.pooled() == 0
        assert time.monotonic() - t0 < 30
    finally:
        procs.stop()
