"""A real two-node Ray cluster for tests: the head on this namespace's bridge address,
a second raylet inside a network-namespace host (``tests/netns.py``).

Both run ``ray start ... --block`` as processes this module starts, so teardown stops
exactly those (never ``ray stop``, which stops every Ray process of the machine).
Starting takes 15 s to minutes on a loaded machine: one cluster per test session, the
``ray_session_cluster`` fixture of ``conftest.py`` (:func:`ray_cluster_fixture`); a test
that kills the second node leaves it to the next module to start it again
(:meth:`RayCluster.ensure_two_nodes`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest
from helpers import patched_environ
from netns import NetHosts, make_hosts, unavailable

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
#: How long the session's cluster gets to stop by itself before it is killed.
STOP_GRACE = 3.0
#: Ray reads these in every process it starts: no usage stats, and token authentication
#: with a token made for this test session (Ray 2.59+ turns token auth on by default for
#: some clusters; one explicit setting on every node and driver avoids a mismatch, and
#: leaves ~/.ray alone). The driver (this process) must carry them too: see ``driver_env``.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}


@dataclass
class RayCluster:
    """A running cluster: ``address`` is the head's GCS (``IP:PORT``)."""

    net: NetHosts
    address: str
    head_ip: str
    worker_ip: str
    head: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    temp_dir: str
    worker_killed: bool = False

    def ensure_two_nodes(self) -> None:
        """Start the second node again if a test killed it (:meth:`kill_worker`): the
        cluster is shared by the test session; a module that uses it calls this first."""
        if self.worker_killed:
            self.restart_worker()
            self.worker_killed = False

    def restart_worker(self) -> None:
        """Start the second node again after :meth:`kill_worker`."""
        _stop(self.worker)  # reap it (its processes were killed)
        deadline = time.monotonic() + 120
        while alive_nodes(self.address) > 1:  # the head declares the killed node dead
            if time.monotonic() > deadline:
                raise RuntimeError("the killed Ray node was not declared dead in 120 s")
            time.sleep(0.5)
        self.worker = _start_worker(self.net, self.address, self.worker_ip, self.temp_dir, 2)

    def kill_worker(self) -> None:
        """The namespace node crashes: SIGKILL to every process in its namespace at
        once (raylet, Ray workers, our host agent and ranks)."""
        self.worker_killed = True
        ns = self.net.hosts[0].ns
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in out.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        # reap it now: the cluster lives for the whole session, and a zombie child of
        # this process would be seen by other tests' process checks
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.worker.wait(30)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _common(ip: str) -> list[str]:
    return [
        f"--node-ip-address={ip}",
        "--num-cpus=1",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
        "--block",
    ]


def _stop(*procs: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Stop Ray nodes (``ray start --block`` processes): SIGTERM to all at once, up to
    ``timeout`` for them to end, then SIGKILL to each node's process group and to every
    process it started (Ray's workers leave the group with setsid)."""
    started: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            started += psutil.Process(proc.pid).children(recursive=True)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the node's processes share its group
    for child in started:  # by PID, only if it is still the process we saw
        with contextlib.suppress(psutil.Error):
            child.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    psutil.wait_procs(started, timeout=5)


def start_cluster() -> RayCluster:
    net = make_hosts(1)
    head_ip = net.gateway
    temp_dir = tempfile.mkdtemp(prefix="mk-ray-")
    worker_ip = net.hosts[0].addr
    head = worker = None
    try:
        head, address = _start_head(head_ip, temp_dir)
        worker = _start_worker(net, address, worker_ip, temp_dir, nodes=2)
    except BaseException:
        for p in (worker, head):
            if p is not None:
                _stop(p)
        net.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return RayCluster(net, address, head_ip, worker_ip, head, worker, temp_dir)


def _start_head(head_ip: str, temp_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    """The head node (``ray start --head --block``) and its address, once it is alive.
    On a loaded machine Ray's own start can give up (its raylet must register within a
    fixed 30 s: "timed out during startup"): up to three tries, then fail with the end
    of its output."""
    log = os.path.join(temp_dir, "head-start.log")
    for attempt in (1, 2, 3):
        port = _free_port(head_ip)
        with open(log, "wb") as out:
            head = subprocess.Popen(
                [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false"]
                + [f"--temp-dir={temp_dir}"]
                + _common(head_ip),
                env={**os.environ, **RAY_ENV},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        address = f"{head_ip}:{port}"
        try:
            _wait_nodes(address, 1, head)
            return head, address
        except BaseException as exc:
            _stop(head)  # what the failed try left in its session
            if attempt == 3 or not isinstance(exc, RuntimeError):
                if not isinstance(exc, RuntimeError):
                    raise
                with open(log, errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
                raise RuntimeError(f"the Ray head: {exc}; its output ended:\n{tail}") from None
    raise AssertionError("unreachable")


def _start_worker(
    net: NetHosts, address: str, worker_ip: str, temp_dir: str, nodes: int
) -> subprocess.Popen[bytes]:
    """Start the second node in the namespace host; wait until ``nodes`` are alive."""
    script = 'hostname "$0"; exec "$@"'
    argv = ["ip", "netns", "exec", net.hosts[0].ns, "unshare", "--uts", "sh", "-c", script]
    log = os.path.join(temp_dir, "worker-start.log")
    env = {**os.environ, **RAY_ENV}
    for attempt in (1, 2, 3):
        # On a loaded machine the worker's `ray start` can give up on a slow head
        # (exit 1, "timed out during startup": 30 s, fixed in Ray): up to three
        # tries, then fail with the end of its output.
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [*argv, net.hosts[0].name, RAY, "start", f"--address={address}"]
                + _common(worker_ip),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_nodes(address, nodes, worker)
            return worker
        except BaseException as exc:
            if attempt == 3 or worker.poll() is None or not isinstance(exc, RuntimeError):
                _stop(worker)
                if not isinstance(exc, RuntimeError):
                    raise
                with open(log, errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
                raise RuntimeError(f"{exc}; its output ended:\n{tail}") from None
            _stop(worker)  # what the failed try left in its session
    raise AssertionError("unreachable")


def alive_nodes(address: str) -> int:
    """Alive nodes, asked in a subprocess (this process's own ``ray.init`` stays free)."""
    code = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
    code += "print(sum(n['Alive'] for n in ray.nodes()))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **RAY_ENV},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:  # a loaded machine: the caller asks again
        return 0
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def _wait_nodes(address: str, n: int, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with code {proc.returncode}")
        if alive_nodes(address) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Ray cluster at {address} did not reach {n} nodes in {timeout}s")


def stop_cluster(cluster: RayCluster) -> None:
    # A node's graceful stop takes 15-30 s here (it waits for its workers); nothing of
    # it is worth waiting for at the end of the session.
    _stop(cluster.worker, cluster.head, timeout=STOP_GRACE)
    cluster.net.close()
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def as_driver(cluster: RayCluster) -> Iterator[RayCluster]:
    """``cluster`` with both nodes up and this process a Ray driver of it (``RAY_ENV``
    and ``RAY_ADDRESS`` set; the kernels a test starts inherit them) until the block
    ends: the body of a test module's fixture over the session's cluster."""
    cluster.ensure_two_nodes()
    with patched_environ({**RAY_ENV, "RAY_ADDRESS": cluster.address}):
        try:
            yield cluster
        finally:
            import ray

            ray.shutdown()


def ray_cluster_fixture() -> Iterator[RayCluster]:
    """Body of a session fixture; skips (with the reason printed) without root or Ray."""
    why = unavailable()
    if why is None and not os.path.exists(RAY):
        why = "Ray is not installed (pip install 'monarch_kernel[ray]')"
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(why)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
