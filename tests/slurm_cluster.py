"""A real Slurm cluster on one box, for tests and benchmarks: slurmctld in this (root)
network namespace and one slurmd per emulated machine (``netns.py``).

:func:`start_cluster` makes ``n`` namespace hosts, writes a ``slurm.conf`` in a temp dir
(its own ports, state, spool, pid and log files there), starts ``munged`` unless one is
already running (one it did not start it never stops), ``slurmctld`` and one ``slurmd`` per
host (entered with ``nsenter --net`` + ``unshare --uts``, so the node has its own address
and hostname), and waits until ``sinfo`` shows every node idle. :meth:`SlurmCluster.close`
cancels the jobs left in this cluster, stops only the daemons it started (by PID), and
removes the temp dir and the namespaces.

Clients find the cluster through ``$SLURM_CONF`` (:attr:`SlurmCluster.env`).
:func:`slurm_cluster_fixture` skips with the reason printed when not root or Slurm is
not installed (``apt-get install slurmctld slurmd slurm-client munge``).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from netns import NetHosts, make_hosts
from netns import unavailable as netns_unavailable

MUNGE_SOCKET = "/run/munge/munge.socket.2"
DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "salloc", "sbatch", "squeue", "sinfo")
#: Where Debian puts the daemons (not on a non-root PATH).
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here (None: it can)."""
    why = netns_unavailable()
    if why is not None:
        return why
    for tool in DAEMONS:
        if _which(tool) is None:
            return (
                f"Slurm is not installed (no `{tool}`): apt-get install slurmctld slurmd "
                "slurm-client munge"
            )
    if shutil.which("nsenter") is None:
        return "a Slurm cluster on namespace hosts needs `nsenter` (util-linux)"
    return None


@dataclass
class SlurmCluster:
    net: NetHosts
    dir: str
    conf: str
    partition: str
    #: This process's environment plus ``SLURM_CONF``: what every client needs.
    env: dict[str, str]
    #: Daemons started here (slurmctld, munged); the slurmds are in ``net.procs``.
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.net.hosts]

    def run(self, *argv: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (output captured, not checked)."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs this cluster still has (pending, running or completing)."""
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return out.split()

    def submit_python(self, folder: Path, source: str, nodes: int = 2) -> str:
        """``sbatch`` a job of ``nodes`` nodes whose script runs ``source`` with this
        interpreter (its first argument: ``folder/result.json``; its output in
        ``folder/job-ID.out``); the job id."""
        snippet = folder / "snippet.py"
        snippet.write_text(source)
        script = folder / "job.sh"
        script.write_text(f"#!/bin/sh\nexec {sys.executable} {snippet} {folder / 'result.json'}\n")
        folder.chmod(0o755)
        out = self.run(
            "sbatch",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            "--job-name=mk-batch",
            f"--output={folder}/job-%j.out",
            str(script),
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        (job,) = re.findall(r"Submitted batch job (\d+)", out.stdout)
        return str(job)

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def close(self) -> None:
        try:
            for job in self.jobs():
                self.run("scancel", job)
        except (OSError, subprocess.SubprocessError):
            pass  # the controller is gone already: there is nothing to cancel
        # A daemon of ours that ended before we stopped it made the tests fail in ways
        # that do not name it ("Munge encode failed"): say which, and how it ended.
        for p in [*self.procs, *self.net.procs]:
            if p.poll() is not None:
                name = p.args[0] if isinstance(p.args, list) else p.args
                warnings.warn(
                    f"Slurm test cluster: {os.path.basename(str(name))} (pid {p.pid}) "
                    f"ended before the cluster was stopped, with status {p.returncode}",
                    stacklevel=1,
                )
        # slurmds first (they may still be reporting to the controller), then the rest.
        _stop(self.net.procs)
        _stop(self.procs)
        self.net.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the processes we started, SIGKILL the ones still there after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _free_port_pair() -> int:
    """A port P such that P and P+1 look free on every interface (slurmctld, slurmd)."""
    for _ in range(50):
        port = random.randrange(20000, 29000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return port
        except OSError:
            continue
    raise RuntimeError("found no two free consecutive ports")


def _conf(d: str, net: NetHosts, port: int, partition: str, cpus: int, gpus: int) -> str:
    """slurm.conf for the namespace hosts (see docs/REFERENCE "More than one machine")."""
    ctl = socket.gethostname()
    lines = [
        "ClusterName=mk",
        # slurmctld checks that its own hostname is this name; it listens on the bridge.
        f"SlurmctldHost={ctl}({net.gateway})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # No cgroups: the namespace hosts share this box's cgroup tree.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        # Short timeouts: a test waits for nodes and for steps to be cleaned up.
        "SlurmdTimeout=30",
        "KillWait=2",
        "MessageTimeout=5",
        f"SlurmctldPort={port}",
        f"SlurmdPort={port + 1}",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log",
    ]
    gres = ""
    if gpus:
        # Counted GPUs without device files (gres.conf: Name=gpu Count=N): Slurm schedules
        # and checks them like real ones; nothing here touches a device.
        lines.append("GresTypes=gpu")
        gres = f" Gres=gpu:{gpus}"
    for h in net.hosts:
        lines.append(
            f"NodeName={h.name} NodeAddr={h.addr} CPUs={cpus} RealMemory=2000{gres} State=UNKNOWN"
        )
    lines.append(f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _munge_running(env: dict[str, str]) -> bool:
    """Whether a munged answers on the standard socket (then it is reused, not ours)."""
    if not os.path.exists(MUNGE_SOCKET):
        return False
    munge, unmunge = _which("munge"), _which("unmunge")
    if munge is None or unmunge is None:
        return True  # the socket is there; trust it
    cred = subprocess.run([munge, "-n"], capture_output=True, timeout=5, env=env)
    if cred.returncode != 0:
        return False
    check = subprocess.run([unmunge], input=cred.stdout, capture_output=True, timeout=5)
    return check.returncode == 0


def _wait(what: str, ok: object, timeout: float, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():  # type: ignore[operator]
            return
        for p in [*cluster.procs, *cluster.net.procs]:
            if p.poll() is not None:
                raise RuntimeError(
                    f"a Slurm daemon exited ({p.args!r}, code {p.returncode}) while waiting "
                    f"for {what}\n{cluster.log('slurmctld.log')[-2000:]}"
                )
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}\n{cluster.log('slurmctld.log')[-2000:]}")


def start_cluster(n: int = 2, cpus: int = 2, gpus: int = 0) -> SlurmCluster:
    """Start a cluster of ``n`` namespace nodes (see the module docstring), each with
    ``gpus`` counted gpu GRES (0: a CPU cluster, no GRES)."""
    net = make_hosts(n)
    d = tempfile.mkdtemp(prefix="mk-slurm-")
    os.chmod(d, 0o755)  # slurmstepd and the jobs read the conf as root, but be plain
    partition = "mk"
    conf = os.path.join(d, "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)
    cluster = SlurmCluster(net, d, conf, partition, env)
    try:
        os.makedirs(os.path.join(d, "state"))
        for h in net.hosts:  # slurmd does not create its %n spool dir
            os.makedirs(os.path.join(d, "spool", h.name))
        with open(conf, "w") as f:
            f.write(_conf(d, net, _free_port_pair(), partition, cpus, gpus))
        if gpus:  # slurmd reads gres.conf from the directory of slurm.conf
            # slurmd counts a node's GPUs by their device files: character devices with
            # the NVIDIA major number, made here and never opened (no driver needed).
            for g in range(gpus):
                os.mknod(os.path.join(d, f"nvidia{g}"), 0o600 | stat.S_IFCHR, os.makedev(195, g))
            with open(os.path.join(d, "gres.conf"), "w") as f:
                f.write(f"AutoDetect=off\nName=gpu File={d}/nvidia[0-{gpus - 1}]\n")
        if not _munge_running(env):
            subprocess.run(
                ["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"], check=True
            )
            munged = _which("munged") or "munged"
            # As the munge user, in the foreground, started directly (not through
            # runuser, which forks): the PID we keep is munged's, and we reap it.
            cluster.procs.append(
                subprocess.Popen(
                    [munged, "-F"],
                    user="munge",
                    group="munge",
                    extra_groups=[],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            _wait("munged", lambda: _munge_running(env), 10, cluster)
        slurmctld = _which("slurmctld") or "slurmctld"
        cluster.procs.append(
            subprocess.Popen(
                [slurmctld, "-D", "-i", "-f", conf],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait("slurmctld", lambda: cluster.run("sinfo", "-h").returncode == 0, 20, cluster)
        slurmd = _which("slurmd") or "slurmd"
        for h in net.hosts:
            net.popen_nsenter(
                h.index,
                [slurmd, "-D", "-f", conf, "-N", h.name],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            return all(states.get(name) == "idle" for name in cluster.nodes)

        _wait("the nodes to be idle", idle, 30, cluster)
    except BaseException:
        cluster.close()
        raise
    return cluster


def slurm_cluster_fixture(n: int = 2, gpus: int = 0) -> Iterator[SlurmCluster]:
    """Body of a pytest fixture: a cluster of ``n`` nodes, removed afterwards; skips
    with the reason printed when it cannot be made here."""
    why = unavailable()
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(why)
    try:
        cluster = start_cluster(n, gpus=gpus)
    except subprocess.CalledProcessError as exc:
        reason = f"cannot start a Slurm cluster here: {exc}"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    try:
        yield cluster
    finally:
        cluster.close()
