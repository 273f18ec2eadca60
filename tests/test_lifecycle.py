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


#: How long the test waits for a dead controller's processes to end. A healthy teardown
#: takes about half a second here (agent: SIGTERM from its parent's death; template:
#: SIGTERM to each rank); the designed worst case is a rank that ignores SIGTERM, killed
#: after the stop's 3 s grace. A leak lasts forever: the margin costs nothing.
GONE_WAIT = 15.0


def _start_controller(
    hosts: int, tail: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[int]]:
    code = CONTROLLER.format(hosts=hosts, tail=tail)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
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
    _assert_gone(pids, "after the controller was killed")


def _assert_gone(pids: list[int], when: str) -> None:
    left = _wait_gone(pids, GONE_WAIT)
    for p in left:  # clean up before failing, so one bug does not leak into other tests
        os.kill(p, signal.SIGKILL)
    assert not left, f"still alive {when}: {left}"


def test_controller_exit_without_stop_cleans_up():
    proc, pids = _start_controller(1, "sys.exit(0)")
    proc.wait(20)
    _assert_gone(pids, "after the controller exited without a stop")


#: A module the templates import late (``MONARCH_KERNEL_PREIMPORT_LATE``) that says it
#: started and then takes a minute, as ``torch._dynamo`` takes seconds on a loaded host.
SLOW_LATE_IMPORT = """\
import os, pathlib, time
pathlib.Path(os.environ["MK_TEST_LATE_MARK"], str(os.getpid())).touch()
time.sleep(60)
"""

#: The controller's tail: every rank leaves a file when it ends cleanly (``atexit``);
#: wait until every template is in its late import, then end.
WAIT_FOR_LATE_IMPORT = """
    import pathlib
    from monarch_kernel.kernel.remote import RemoteJob
    RemoteJob(procs, {atexit!r}, "t", None).start().wait(60)
    while len(list(pathlib.Path(os.environ["MK_TEST_LATE_MARK"]).iterdir())) < {hosts}:
        time.sleep(0.05)
    {end}
"""

#: A cell: write ``<folder>/<rank>`` when the rank ends cleanly.
ATEXIT_MARK = """\
import atexit, pathlib
from monarch_kernel.actor import current_rank
atexit.register(pathlib.Path({folder!r}, str(current_rank().rank)).touch)
"""


@pytest.mark.parametrize("end", ["killed", "stopped"])
def test_a_template_in_its_late_import_stops_its_ranks_cleanly(tmp_path, end):
    """A template importing its late modules read no command: the stop waited for the
    import (a minute here), or for the host agent's patience (the grace and 5 s), which
    then killed the template, and so its ranks without their clean-up."""
    (tmp_path / "mk_slow_late_import.py").write_text(SLOW_LATE_IMPORT)
    marks, ended = tmp_path / "marks", tmp_path / "ended"
    marks.mkdir()
    ended.mkdir()
    env = {
        "MONARCH_KERNEL_PREIMPORT_LATE": "mk_slow_late_import",
        # (whatever else this machine runs meanwhile: the import waits for no idle core)
        "MONARCH_KERNEL_PREIMPORT_LATE_IDLE_CORES": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "MK_TEST_LATE_MARK": str(marks),
    }
    hosts = 2
    last = "time.sleep(60)" if end == "killed" else "procs.stop()"
    atexit = ATEXIT_MARK.format(folder=str(ended))
    tail = textwrap.dedent(WAIT_FOR_LATE_IMPORT).format(hosts=hosts, end=last, atexit=atexit)
    proc, pids = _start_controller(hosts, tail, env)
    try:
        if end == "killed":
            wait_until(lambda: len(list(marks.iterdir())) == hosts, timeout=60, what="imports")
            proc.send_signal(signal.SIGKILL)
        proc.wait(60)  # "stopped": the controller exits once the stop returns
    finally:
        proc.kill()
        proc.wait()
    _assert_gone(pids, f"after the controller was {end} during the templates' late import")
    ranks = len(pids) - hosts
    assert sorted(p.name for p in ended.iterdir()) == [str(r) for r in range(ranks)]


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
