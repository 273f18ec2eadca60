"""References survive a host relaunched on another machine (network-namespace hosts, the
join backend): actors of mesh A (machine 0) hold a handle to an actor of mesh B
(machine 1). B's host agent is killed; the restart policy relaunches the host, which
joins from machine 2 this time, and re-creates the actor there. A's calls through the
old handle, made before the relaunch or never, reach it at its new TCP address (one
never connected waits out its first connection, then is sent again where the
controller says the rank is now)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import pytest
from helpers import wait_until
from netns import COMMAND, Joiner, NetHosts, netns_hosts_fixture

from monarch_kernel.actor import Actor, endpoint, host_mesh
from monarch_kernel.controller.state.records import MeshPhase

pytestmark = pytest.mark.cluster


class Target(Actor):
    @endpoint
    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


class Holder(Actor):
    def __init__(self, targets) -> None:
        self.targets = targets

    @endpoint
    def call_target(self) -> tuple[str, int]:
        return tuple(self.targets.where.call_one().get(timeout=60))


class Relocating(Joiner):
    """A Joiner whose host 0 joins from namespace host ``first`` the first time and from
    ``spare`` when it is relaunched (another machine)."""

    def __init__(self, net: NetHosts, first: int, spare: int):
        super().__init__(net, first)
        self.spare = spare
        self.joins = 0

    def run(self, host: int, command: str) -> None:
        url, token = COMMAND.search(command).groups()  # type: ignore[union-attr]
        machine = self.first + host if self.joins == 0 else self.spare
        self.joins += 1
        fd, log = tempfile.mkstemp(prefix=f"join-host{host}-", suffix=".log", dir=self.net.tmp)
        argv = [sys.executable, "-m", "monarch_kernel.host", "--join", url, "--token", token]
        proc = self.net.popen(machine, argv, stdout=fd, stderr=fd, env=self.env, cwd=os.getcwd())
        os.close(fd)
        with self.cv:
            self.agents[host], self.logs[host] = proc, log


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(3)


def test_old_handle_follows_a_host_relaunched_on_another_machine(net):
    ja, jb = Joiner(net, first=0), Relocating(net, first=1, spare=2)
    hosts_a = host_mesh(hosts=1, backend="join", bind=net.gateway, on_progress=ja.progress)
    a = hosts_a.spawn_procs({"gpus": 2}, timeout=60)
    try:
        hosts_b = host_mesh(hosts=1, backend="join", bind=net.gateway, on_progress=jb.progress)
        b = hosts_b.spawn_procs({"gpus": 1}, timeout=60)  # restarts what dies (the default)
        try:
            targets = b.spawn("targets", Target)
            talked = a.slice(gpus=0).spawn("talked", Holder, targets)
            # on another rank (process): it never called B before the relaunch
            silent = a.slice(gpus=1).spawn("silent", Holder, targets)
            before = talked.call_target.call_one().get(timeout=60)
            assert before[0] == net.hosts[1].name
            jb.agents[0].kill()
            wait_until(
                lambda: (
                    b.runtime.ranks[0].restarts >= 1
                    and b.runtime.ranks[0].alive
                    and b.runtime.state is MeshPhase.RUNNING
                ),
                timeout=90,
                what="B's host to be relaunched on machine 2 and its rank restarted",
                detail=lambda: (b.runtime.state, b.runtime.ranks[0], jb.lines[-1:]),
            )
            assert b.runtime.ranks[0].peer.tcp_host == net.hosts[2].addr
            now = tuple(targets.where.call_one().get(timeout=60))
            assert now[0] == net.hosts[2].name
            assert talked.call_target.call_one().get(timeout=60) == now
            assert silent.call_target.call_one().get(timeout=60) == now
        finally:
            jb.stop(b)
    finally:
        ja.stop(a)
