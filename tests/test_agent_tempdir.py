"""A host agent that Ray, Slurm or a join command started makes its own private
directory (``mk-host-*``); killed outright, it cannot remove it, and the next agent on
the machine does (its owner mark names a process that is gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import wait_until

from monarch_kernel.actor import Actor, endpoint, this_host

pytestmark = pytest.mark.local

#: An agent as a launcher's command starts one (no MONARCH_KERNEL_HOST_DIR), that says
#: its directory and its template's pid, then waits to be killed.
AGENT = """
import sys, time
from monarch_kernel.host.agent import HostAgent
agent = HostAgent()
print(agent.private_dir, agent.template.proc.pid, flush=True)
time.sleep(120)
"""


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    path, template = proc.stdout.readline().split()
    return proc, path, int(template)


def _kill(proc: subprocess.Popen[str], template: int) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # the template dies with its agent (parent-death signal)
    wait_until(
        lambda: (
            not psutil.pid_exists(template)
            or psutil.Process(template).status() == psutil.STATUS_ZOMBIE
        ),
        timeout=30,
        what="the killed agent's template to exit",
    )


def test_a_killed_agents_directory_is_swept_by_the_next_agent(short_tmp):
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    env.pop("MONARCH_KERNEL_HOST_DIR", None)
    first, first_dir, first_template = _start(env)
    try:
        assert os.path.basename(first_dir).startswith("mk-host-")
        assert os.path.dirname(first_dir) == str(short_tmp)
    finally:
        _kill(first, first_template)
    assert os.path.isdir(first_dir)  # killed outright: nothing removed it
    second, second_dir, second_template = _start(env)
    try:
        assert not os.path.exists(first_dir)  # swept by the next agent
        assert os.path.isdir(second_dir)  # and its own kept
    finally:
        _kill(second, second_template)
    # the second one's directory goes with the next sweep too
    from monarch_kernel.wire import tempdirs

    assert tempdirs.sweep(str(short_tmp)) == [second_dir]


#: A program that starts a mesh, shuts its launcher down (its directory goes), starts
#: another (a new directory), stops it and exits normally, printing that directory.
RESTARTED_LAUNCHER = """
from monarch_kernel.actor import this_host
procs = this_host().spawn_procs(per_host={"gpus": 1})
procs.stop()
launcher = procs.runtime.launcher
launcher.shutdown()
procs = this_host().spawn_procs(per_host={"gpus": 1})
print(launcher._dir, flush=True)
procs.stop()
"""


def test_the_launchers_directory_made_after_a_shutdown_goes_at_exit(short_tmp):
    env = {**os.environ, "TMPDIR": str(short_tmp), "MONARCH_KERNEL_PREWARM": "0"}
    out = subprocess.run(
        [sys.executable, "-c", RESTARTED_LAUNCHER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    second = out.stdout.split()[-1]
    assert os.path.basename(second).startswith("mk-launch-"), out.stdout
    assert not os.path.exists(second), os.listdir(second)
    assert not [n for n in os.listdir(short_tmp) if n.startswith("mk-launch-")]


#: A program that starts a mesh, has rank 1 fetch a tensor rank 0 shares (the ranks'
#: data-plane sockets) and stops it, printing the launcher's directory, the controller's
#: socket directory and the address its ranks send to.
A_MESH = """
import torch
import monarch_kernel
from monarch_kernel.actor import Actor, endpoint, this_host

class Sharer(Actor):
    @endpoint
    def share(self):
        return monarch_kernel.share(torch.arange(4.0))

    @endpoint
    def fetch(self, ref):
        return ref.get().tolist()

procs = this_host().spawn_procs(per_host={"gpus": 2})
actors = procs.spawn("sharer", Sharer)
ref = actors.slice(gpus=0).share.call_one().get()
assert actors.slice(gpus=1).fetch.call_one(ref).get() == [0.0, 1.0, 2.0, 3.0]
rt = procs.runtime
print(rt.launcher._dir, rt.transport.ipc_dir, rt.transport.recv_addr, flush=True)
procs.stop()
"""


def test_a_temporary_directory_too_long_for_sockets_moves_them_to_tmp(tmp_path):
    """A ``$TMPDIR`` whose path leaves no room for a unix socket's (107 bytes): the
    agent exited with zmq's "ipc path is longer than 107 characters", and the controller
    fell back to tcp. The launcher's and the controller's directories go to /tmp
    instead; the mesh starts on unix sockets, its ranks reach each other, and the
    directories go at exit."""
    deep = tmp_path / ("t" * max(1, 90 - len(str(tmp_path))))
    deep.mkdir()
    assert len(str(deep)) >= 90
    env = {**os.environ, "TMPDIR": str(deep), "MONARCH_KERNEL_PREWARM": "0"}
    out = subprocess.run(
        [sys.executable, "-c", A_MESH], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    made, controller, recv = out.stdout.split()[-3:]
    assert os.path.dirname(made) == "/tmp" and os.path.basename(made).startswith("mk-launch-")
    assert os.path.dirname(controller) == "/tmp", controller
    assert os.path.basename(controller).startswith("mk-mesh-")
    assert recv == f"ipc://{controller}/recv"
    assert not os.path.exists(made) and not os.path.exists(controller)
    assert not os.listdir(deep)


class _Environ(Actor):
    @endpoint
    def agent_only(self) -> list[str]:
        from monarch_kernel.host.template_handle import AGENT_ONLY_ENV

        return sorted(k for k in AGENT_ONLY_ENV if k in os.environ)


def test_ranks_never_see_their_agents_own_variables():
    """The local launcher gives its agent MONARCH_KERNEL_HOST_DIR; the agent starts its
    template before it reads it, and the template (so every rank) goes without it: a
    rank that started a mesh of its own would otherwise take its agent's directory."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        got = procs.spawn("env", _Environ).agent_only.call().get(timeout=60)
        assert list(got.values()) == [[], []]
    finally:
        procs.stop()
