"""The ``slurm`` backend on a real Slurm cluster (``slurm_cluster.py``): slurmctld in this
namespace, one slurmd per emulated machine, real salloc/srun/sbatch; nothing is mocked.

* a mesh allocated with salloc from outside any job: ranks on both nodes, calls and a
  gloo all_reduce across them; after stop no job, agent or rank is left;
* a mesh made inside an ``sbatch`` job (``$SLURM_JOB_ID`` set: srun in that job);
* bad input fails fast with a clear message (no Slurm, dead controller, too many
  nodes or GPUs, salloc refusing);
* the kernel: ``%mesh --backend slurm`` then ``%%remote`` across the nodes.

The cluster (2 nodes with 2 counted GPUs each: gpu GRES backed by device files, no
driver) starts once per module (about 1.5 s); skipped when not root or Slurm is not
installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest
from conftest import wait_no_orphans
from helpers import patched_environ, pythonpath_with, wait_until
from slurm_cluster import SlurmCluster, slurm_cluster_fixture

import monarch_kernel
from monarch_kernel.actor import Actor, endpoint, host_mesh
from monarch_kernel.calls.errors import MonarchError

pytestmark = pytest.mark.cluster

#: Counted GPUs per node (device files without a driver): the launcher asks a cluster
#: with gpu GRES for ``--gpus-per-node``, and refuses more than the nodes have.
GPUS = 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(monarch_kernel.__file__)))


class Probe(Actor):
    @endpoint
    def info(self) -> dict[str, str]:
        import socket

        return {"hostname": socket.gethostname(), "node": os.environ.get("NODE_RANK", "")}

    @endpoint
    def all_reduce(self) -> float:
        import datetime

        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return float(t.item())


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """The cluster, and this process's environment pointing at it (the launcher reads
    ``$SLURM_CONF``; the agents srun starts import this checkout)."""
    for c in slurm_cluster_fixture(2, gpus=GPUS):
        with patched_environ({"SLURM_CONF": c.conf, "PYTHONPATH": pythonpath_with(REPO)}):
            c.env = dict(os.environ)
            yield c


def agents_on_nodes(cluster: SlurmCluster) -> list[psutil.Process]:
    """Our processes (agents, ranks) inside the namespace hosts: slurmstepd re-parents
    them away from this process, so conftest's descendant check cannot see them."""
    out = []
    for h in cluster.net.hosts:
        pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                p = psutil.Process(int(pid))
                if "monarch_kernel" in " ".join(p.cmdline()) and p.status() != "zombie":
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return out


def assert_all_gone(cluster: SlurmCluster) -> None:
    wait_until(lambda: not cluster.jobs(), timeout=15, what="the Slurm job to end")
    wait_until(lambda: not agents_on_nodes(cluster), timeout=10, what="the agents to exit")
    left = wait_no_orphans()
    assert not left, [" ".join(p.cmdline())[:80] for p in left]
    slurm_clients = []
    for p in psutil.Process().children(recursive=True):
        try:  # (a child of another fixture may be a zombie meanwhile: not ours to judge)
            line = " ".join(p.cmdline())
            if p.name() in ("srun", "salloc") or "scancel" in line:  # watchdog
                slurm_clients.append(line)
        except psutil.Error:
            continue
    assert not slurm_clients, slurm_clients


def test_salloc_mesh_across_two_nodes(cluster):
    t0 = time.monotonic()
    mesh = host_mesh(hosts=2, backend="slurm", advertise=cluster.net.gateway)
    procs = mesh.spawn_procs({"gpus": 2}, timeout=60)
    print(f"\n2 Slurm nodes x 2 ranks up in {time.monotonic() - t0:.1f}s")
    try:
        # Our job holds both nodes while the mesh lives.
        squeue = cluster.run("squeue", "-h", "-o", "%j %D %T %b").stdout.split()
        assert len(squeue) == 4 and squeue[0] == f"mk-{procs.name}", squeue
        assert squeue[1:] == ["2", "RUNNING", "gres:gpu:2"], squeue
        # The token is in srun's environment, on no command line.
        for p in psutil.Process().children(recursive=True):
            if p.name() == "srun":
                assert "--token" not in p.cmdline()
                assert p.cmdline()[-3:-1] == ["monarch_kernel.host", "--join"]

        infos = procs.spawn("probe", Probe).info.call().get(timeout=30)
        by_host: dict[int, set[str]] = {}
        for point, info in infos.items():
            by_host.setdefault(point["hosts"], set()).add(info["hostname"])
        # Each host's ranks share a node; the two hosts are the two nodes.
        assert all(len(names) == 1 for names in by_host.values()), by_host
        assert {n for names in by_host.values() for n in names} == set(cluster.nodes)

        probes = procs.spawn("reduce", Probe)
        assert probes.all_reduce.call().get(timeout=60).values() == [10.0] * 4
    finally:
        procs.stop()
        procs.runtime.launcher.shutdown()
    assert_all_gone(cluster)


BATCH_SNIPPET = """
import json, socket, sys
from monarch_kernel.actor import host_mesh

procs = host_mesh(hosts=2, backend="slurm").spawn_procs({"gpus": 1}, timeout=60)
try:
    names = procs.ping().get(timeout=30)
    code = "import socket\\nwhere = socket.gethostname()"
    deadline = __import__("time").monotonic() + 30
    failed = procs.runtime.restarter.run_cell([0, 1], code, "[1]", [], deadline)
    where = list(procs.pull("where").values())
    with open(sys.argv[1], "w") as f:
        json.dump({"where": where, "failed": failed, "controller": socket.gethostname()}, f)
finally:
    procs.stop()
    procs.runtime.launcher.shutdown()
"""


def test_mesh_inside_an_sbatch_job(cluster, tmp_path):
    """The batch script's python makes a slurm mesh: $SLURM_JOB_ID is set, so the
    agents run as a step of that job (no second allocation)."""
    result = tmp_path / "result.json"
    job = cluster.submit_python(tmp_path, BATCH_SNIPPET)
    # sbatch --wait polls slowly; squeue every 0.1 s ends the test sooner.
    wait_until(lambda: job not in cluster.jobs(), timeout=60, what=f"batch job {job} to end")
    logs = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    state = cluster.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in state or not state, state + logs
    data = json.loads(result.read_text())
    assert data["failed"] == "", logs
    assert sorted(data["where"]) == sorted(cluster.nodes), data
    assert data["controller"] in cluster.nodes  # the batch script ran on a node
    assert_all_gone(cluster)


def test_too_many_nodes_is_a_clear_error(cluster):
    t0 = time.monotonic()
    with pytest.raises((ValueError, MonarchError), match=r"asks for 3 hosts but .* has 2 nodes"):
        host_mesh(hosts=3, backend="slurm", advertise=cluster.net.gateway).spawn_procs(
            {"gpus": 1}, timeout=30
        )
    assert time.monotonic() - t0 < 10
    assert not cluster.jobs()


def test_more_gpus_than_the_nodes_have_is_a_clear_error(cluster):
    match = r"asks for 3 GPUs per host but the nodes of .* have at most 2 GPUs"
    with pytest.raises((ValueError, MonarchError), match=match):
        host_mesh(hosts=2, backend="slurm", advertise=cluster.net.gateway).spawn_procs(
            {"gpus": GPUS + 1}, timeout=30
        )
    assert not cluster.jobs()


def test_salloc_refusal_shows_its_error(cluster):
    with pytest.raises(
        (ValueError, MonarchError), match=r"(?s)salloc refused the allocation.*Invalid --time"
    ):
        host_mesh(
            hosts=2, backend="slurm", advertise=cluster.net.gateway, time="not-a-time"
        ).spawn_procs({"gpus": 1}, timeout=30)
    assert not cluster.jobs()
    assert_all_gone(cluster)


def test_unknown_partition_is_a_clear_error(cluster):
    with pytest.raises((ValueError, MonarchError), match=r"partition 'nope' has no nodes"):
        host_mesh(
            hosts=2, backend="slurm", advertise=cluster.net.gateway, partition="nope"
        ).spawn_procs({"gpus": 1}, timeout=30)


def test_no_slurm_on_path_is_a_clear_error(cluster, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    t0 = time.monotonic()
    with pytest.raises((ValueError, MonarchError), match=r"needs Slurm's client commands"):
        host_mesh(hosts=2, backend="slurm", advertise=cluster.net.gateway).spawn_procs(
            {"gpus": 1}, timeout=30
        )
    assert time.monotonic() - t0 < 10


def test_dead_controller_is_a_clear_error(cluster, monkeypatch, tmp_path):
    """A conf whose controller port nobody listens on: sinfo's own error, at once (this
    conf asks the client to retry for 2 s, as a short MessageTimeout does)."""
    with open(cluster.conf) as f:
        conf = f.read()
    conf = re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=9", conf)
    conf = re.sub(r"MessageTimeout=\d+", "MessageTimeout=2", conf)
    dead = tmp_path / "slurm.conf"
    dead.write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(dead))
    t0 = time.monotonic()
    with pytest.raises((ValueError, MonarchError), match=r"(?s)cannot reach Slurm.*contact"):
        host_mesh(hosts=2, backend="slurm", advertise=cluster.net.gateway).spawn_procs(
            {"gpus": 1}, timeout=30
        )
    took = time.monotonic() - t0
    print(f"\ndead controller reported in {took:.1f}s")
    assert took < 15


def test_kernel_mesh_on_slurm_and_a_killed_kernel_frees_its_job(cluster):
    """``%mesh --backend slurm`` in a real kernel; ``%mesh stop`` ends the job; a kernel
    killed with SIGKILL frees its job too (salloc's holder reads a pipe from the kernel)."""
    from kernel_client import Kernel

    gw = cluster.net.gateway
    k = Kernel(env={"SLURM_CONF": cluster.conf, "PYTHONPATH": os.environ["PYTHONPATH"]})
    try:
        r = k.run(f"%mesh m --backend slurm --hosts 2 --gpus 1 --advertise {gw}", timeout=90)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        assert cluster.run("squeue", "-h", "-o", "%T %D").stdout.split() == ["RUNNING", "2"]
        r = k.run("%%remote m\nimport socket\nprint('on', socket.gethostname())", timeout=60)
        assert not r.errors, r.error_text
        for node in cluster.nodes:
            assert f"on {node}" in r.stdout, r.stdout
        r = k.run("%mesh stop m", timeout=60)
        assert not r.errors, r.error_text
        wait_until(lambda: not cluster.jobs(), timeout=15, what="the job to end after stop")

        r = k.run(f"%mesh m2 --backend slurm --hosts 2 --gpus 1 --advertise {gw}", timeout=90)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        assert len(cluster.jobs()) == 1
        pids = k.pids()
        os.kill(pids[0], 9)  # the kernel dies without any clean-up of its own
        wait_until(lambda: not cluster.jobs(), timeout=20, what="the killed kernel's job to end")
        wait_until(lambda: not agents_on_nodes(cluster), timeout=15, what="the agents to exit")
        from conftest import pid_alive

        def alive() -> list[str]:
            out = []
            for p in pids:
                if pid_alive(p):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        out.append(" ".join(psutil.Process(p).cmdline())[:100])
            return out

        wait_until(lambda: not alive(), timeout=15, what="the kernel's processes", detail=alive)
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)
    assert_all_gone(cluster)
