"""A detachable mesh's attach file is written by two threads: the watcher (woken as a
cell starts) and a cell that registers a ``--setup`` cell. A snapshot the watcher took
before the registration must never be written after the one that has it: a kernel
killed right then left a file without the setup cell, so the ranks its host agent
restarted were re-formed without it (``NameError`` in the next cell on them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import wait_until

pytestmark = pytest.mark.local

#: The watcher's save is held between its snapshot and its write while another thread
#: registers a setup cell and saves; then the watcher goes on. Prints the setup cells
#: the file holds at the end.
RACE = """
import json, threading
from monarch_kernel.actor import this_host
from monarch_kernel.controller import attach_file
from monarch_kernel.controller.detach.release import detacher_of, recipe_changed
from monarch_kernel.controller.state.records import SetupCell

procs = this_host().spawn_procs(
    per_host={"gpus": 1}, name="race", detachable=True, keep="60s"
)
rt = procs.runtime
print(json.dumps([h.pid for h in rt.hosts] + [r.pid for r in rt.ranks]), flush=True)
detacher = detacher_of(rt)
snapped, go = threading.Event(), threading.Event()
snapshot = detacher.snapshot

def held_snapshot():
    snap = snapshot()
    if threading.current_thread().name == "stale":
        snapped.set()
        go.wait(60)
    return snap

detacher.snapshot = held_snapshot
stale = threading.Thread(target=detacher.save, kwargs={"force": True}, name="stale")
stale.start()
assert snapped.wait(60)

def register():
    rt.remember_setup(SetupCell("lr = 0.1", "[1]"))
    recipe_changed(rt)

setup = threading.Thread(target=register, name="setup")
setup.start()
# Before the fix the registration's save completes here, and the stale one is written
# after it. With it, the registration waits for the stale save and writes last: the
# file is right whether or not this wait runs out (it does then).
setup.join(1.0)
go.set()
stale.join(60)
setup.join(60)
assert not stale.is_alive() and not setup.is_alive()
cells = attach_file.read(attach_file.file_for("race")).setup_cells
print(json.dumps([c["code"] for c in cells]), flush=True)
procs.stop()
"""


def test_a_setup_cell_registered_during_a_save_is_in_the_file_at_the_end(short_tmp):
    runtime = short_tmp / "rt"
    runtime.mkdir(mode=0o700)
    env = {
        **os.environ,
        "TMPDIR": str(short_tmp),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "MONARCH_KERNEL_PREWARM": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", RACE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # its host agent's and rank's pids, once started
        if line:
            pids = [pid for pid in json.loads(line) if isinstance(pid, int) and pid > 1]
            assert len(pids) == 2, line  # the agent and the rank
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert json.loads(out.splitlines()[-1]) == ["lr = 0.1"]
        assert not os.listdir(runtime)  # the stopped mesh's file is gone
        # a detachable mesh outlives its controller: this one was stopped, so nothing
        wait_until(lambda: not _alive(pids), timeout=30, what="the mesh's processes to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in _alive(pids):  # started by this test's program: never left running
            os.kill(pid, signal.SIGKILL)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
