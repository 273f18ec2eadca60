"""Emulated machines for tests: Linux network namespaces on one box.

:func:`make_hosts` creates a bridge (``10.77.X.1/24``, X random) and, per host, a
network namespace with a veth into the bridge, its own address (``10.77.X.(10+i)``), an
``/etc/netns/<ns>/hosts`` file and, for the processes it starts, its own hostname
(``unshare --uts``). :meth:`NetHosts.close` kills only the processes it started, then
deletes the veths (synchronous), the namespaces, the bridge and the ``/etc/netns`` dirs.

Needs root and iproute2; :func:`netns_hosts_fixture` skips (with the reason printed)
otherwise. Traffic stays between the namespaces it created and the bridge.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need `{tool}` (iproute2 / util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class NetHost:
    index: int
    ns: str
    name: str  #: its hostname (inside its UTS namespace)
    addr: str
    veth: str


@dataclass
class NetHosts:
    """The emulated machines; :meth:`popen` starts a process on one of them."""

    bridge: str
    gateway: str  #: the bridge's address (this process's address as the hosts see it)
    hosts: list[NetHost]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: The hosts' temporary directory (``$TMPDIR`` of what :meth:`popen` starts), as
    #: another machine's /tmp: what a killed agent leaves there goes with :meth:`close`.
    tmp: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mk-netns-tmp-"))

    def _env(self, kw: dict[str, object]) -> None:
        env = dict(kw.get("env") or os.environ)  # type: ignore[call-overload]
        env.setdefault("TMPDIR", self.tmp)
        kw["env"] = env

    def popen(self, host: int, cmd: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        """Run ``cmd`` on host ``host`` (its netns, its own hostname)."""
        h = self.hosts[host]
        script = 'hostname "$0"; exec "$@"'
        argv = ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c", script, h.name]
        self._env(kw)
        proc = subprocess.Popen([*argv, *cmd], **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def popen_nsenter(self, host: int, cmd: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        """Like :meth:`popen`, but enters the namespace with ``nsenter --net`` instead of
        ``ip netns exec``: the latter also remounts ``/sys``, which hides the cgroup
        hierarchy (slurmd then fails with "Unable to initialize cgroup plugin")."""
        h = self.hosts[host]
        script = 'hostname "$0"; exec "$@"'
        argv = ["nsenter", f"--net=/run/netns/{h.ns}", "unshare", "--uts", "sh", "-c", script]
        proc = subprocess.Popen([*argv, h.name, *cmd], **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:  # only what we started
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for h in self.hosts:
            subprocess.run(["ip", "link", "del", h.veth], capture_output=True)
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def make_hosts(n: int) -> NetHosts:
    """Create ``n`` emulated machines (see the module docstring)."""
    # a subnet no other emulated network of this machine uses (the session's Ray
    # cluster keeps one for the whole run; another run may be beside this one)
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    free = [x for x in range(2, 250) if f"10.77.{x}." not in used]
    x = random.choice(free)
    tag = f"mk{x}{os.getpid() % 10000}"
    bridge = f"{tag}br"[:15]
    net = NetHosts(bridge, f"10.77.{x}.1", [])
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(n):
            ns, veth, peer = f"{tag}h{i}", f"{tag}v{i}"[:15], f"{tag}p{i}"[:15]
            h = NetHost(i, ns, f"node{i}-{x}", f"10.77.{x}.{10 + i}", veth)
            net.hosts.append(h)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # Every host knows every other by name (and back: reverse lookups work).
        table = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in net.hosts)
        for h in net.hosts:
            os.makedirs(f"/etc/netns/{h.ns}", exist_ok=True)
            with open(f"/etc/netns/{h.ns}/hosts", "w") as f:
                f.write(table)
    except BaseException:
        net.close()
        raise
    return net


def netns_hosts_fixture(n: int) -> Iterator[NetHosts]:
    """Body of a pytest fixture: ``n`` hosts, removed afterwards; skips with a reason."""
    why = unavailable()
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(why)
    try:
        net = make_hosts(n)
    except subprocess.CalledProcessError as exc:
        reason = f"cannot create network namespaces: {exc.stderr.decode(errors='replace')}"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    try:
        yield net
    finally:
        net.close()


#: This repository (the agents that :class:`Joiner` starts import monarch_kernel from it).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The command the join launcher shows for each host.
COMMAND = re.compile(r"python -m monarch_kernel\.host --join (\S+) --token (\S+)")


def agent_env(*first: str) -> dict[str, str]:
    """This environment with ``first`` (paths) and this repository on ``$PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*first, REPO, *([path] if path else [])]))


class Joiner:
    """Plays the people who run the command the join launcher shows on each machine:
    pass :meth:`progress` as the launcher's ``on_progress``; host ``i`` of the mesh then
    runs on namespace host ``first + i``, with ``env`` (default: :func:`agent_env`), its
    output in a log under ``net.tmp``."""

    def __init__(self, net: NetHosts, first: int = 0, env: dict[str, str] | None = None):
        self.net = net
        self.first = first
        self.env = env or agent_env()
        self.lines: list[str] = []
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, str] = {}
        self.cv = threading.Condition()

    def progress(self, text: str) -> None:
        with self.cv:
            self.lines.append(text)
            for line in text.splitlines():
                m = re.match(r"\s*host (\d+): (python .*)", line)
                if m:
                    threading.Thread(
                        target=self.run, args=(int(m.group(1)), m.group(2)), daemon=True
                    ).start()

    def run(self, host: int, command: str) -> None:
        url, token = COMMAND.search(command).groups()  # type: ignore[union-attr]
        fd, log = tempfile.mkstemp(prefix=f"join-host{host}-", suffix=".log", dir=self.net.tmp)
        proc = self.net.popen(
            self.first + host,
            [sys.executable, "-m", "monarch_kernel.host", "--join", url, "--token", token],
            stdout=fd,
            stderr=fd,
            env=self.env,
            cwd=os.getcwd(),
        )
        os.close(fd)
        with self.cv:
            self.agents[host], self.logs[host] = proc, log

    def stop(self, procs: Any) -> None:
        """Stop the mesh ``procs`` and its launcher, then give the agents time to exit by
        themselves (removing their temporary dirs) before :meth:`NetHosts.close` kills
        what is left."""
        try:
            procs.stop()
            procs.runtime.launcher.shutdown()
        finally:
            for agent in list(self.agents.values()):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(10)
