"""Elastic meshes on a real Slurm cluster (``slurm_cluster.py``, two nodes):
``%mesh grow NAME --hosts +1`` has salloc reserve a job for the new host on the node the
mesh does not use yet, the new rank takes the replicas' state and trains with the first
one (gloo all_reduce over the re-formed group); ``%mesh shrink NAME --hosts 1`` cancels
that job and keeps the first.

A two-host start is one job with a step per node: ``%mesh shrink NAME --hosts 1`` ends
host 1's step and shrinks the job off its node (another job then runs there while the
kept host runs a cell); inside the user's own job only our step ends.

Errors: a grow whose job stays pending (another job holds the free node) ends at its
``--timeout`` and withdraws the job; a grow past the cluster's nodes is refused at once.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import patched_environ, pythonpath_with, wait_until
from kernel_client import Kernel
from slurm_cluster import SlurmCluster, slurm_cluster_fixture
from test_elastic import (
    BATCH,
    SETUP,
    TRAIN,
    reference_losses,
    usage_error,
    value,
    wait_progress,
)
from test_elastic_join import MESH as JOIN_MESH
from test_elastic_join import STOP_SETUP
from test_elastic_join import TRAIN as STOPPABLE
from test_slurm import REPO, assert_all_gone

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

MESH = "sg"
STEPS = 24
FIRST = 8  #: steps trained on one host, before the grow
#: ``test_elastic_join``'s ``--bg`` loop (ended by ``%push sg stop=True``) on this mesh.
BG_SETUP = STOP_SETUP.replace(f"%%remote {JOIN_MESH}", f"%%remote {MESH}")
BG_TRAIN = STOPPABLE.replace(f"%%remote {JOIN_MESH}", f"%%remote {MESH}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    for c in slurm_cluster_fixture(2, gpus=2):
        with patched_environ({"SLURM_CONF": c.conf, "PYTHONPATH": pythonpath_with(REPO)}):
            c.env = dict(os.environ)
            yield c


#: A batch script's python: a one-host mesh in its 2-node job grows by a host (a second
#: step of ours in that job, on the other node), then shrinks back.
INSIDE_JOB = """
import json, os, socket, subprocess, sys, time
from monarch_kernel.actor import host_mesh

def steps():
    out = subprocess.run(["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%j"],
                         capture_output=True, text=True).stdout
    return sorted(n for n in out.split() if n.startswith("mk-"))

def where(procs, ranks):
    code = "import socket\\nwhere = socket.gethostname()"
    failed = procs.runtime.restarter.run_cell(ranks, code, "[1]", [], time.monotonic() + 30)
    return failed or sorted(procs.pull("where").values())

out = {"controller": socket.gethostname()}
procs = host_mesh(hosts=1, backend="slurm").spawn_procs({"gpus": 1}, timeout=60)
try:
    out["before"] = where(procs, [0])
    out["grow"] = procs.grow(hosts="+1", timeout=60).describe()
    out["after"] = where(procs, [0, 1])
    out["steps"] = steps()
    try:
        procs.grow(hosts="+1")
    except Exception as exc:
        out["refused"] = str(exc)
    out["shrink"] = procs.shrink(hosts=1).describe()
    deadline = time.monotonic() + 20
    while len(steps()) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    out["steps_after"] = steps()
finally:
    procs.stop()
    procs.runtime.launcher.shutdown()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
"""


def _train(steps: int) -> str:
    """``test_elastic``'s loop as a foreground cell (a fresh ``TrainingState``: step 0)."""
    return TRAIN.format(mesh=MESH, steps=steps, batch=BATCH).replace(" --bg", "")


def _jobs(cluster: SlurmCluster) -> dict[str, tuple[str, str, str]]:
    """Every job of the cluster: id -> (name, state, nodes)."""

    def ask() -> str | None:  # a busy controller may fail a call: ask again
        got = cluster.run("squeue", "-h", "-o", "%i|%j|%T|%N", timeout=30)
        return got.stdout + " " if got.returncode == 0 else None

    out = wait_until(ask, timeout=60, what="squeue to answer")
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def test_grow_and_shrink_a_slurm_mesh_by_a_host(cluster: SlurmCluster):
    gw = cluster.net.gateway
    k = Kernel(env={"SLURM_CONF": cluster.conf, "PYTHONPATH": os.environ["PYTHONPATH"]})
    blocker = None
    try:
        r = k.run(
            f"%mesh {MESH} --backend slurm --hosts 1 --gpus 1 --dist --advertise {gw}",
            timeout=120,
        )
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        ((first, (_, _, used)),) = _jobs(cluster).items()
        free = next(n for n in cluster.nodes if n != used)
        r = k.run(SETUP.format(mesh=MESH, batch=BATCH), timeout=120)
        assert not r.errors, r.error_text
        r = k.run(f"%remote {MESH} __import__('os').getpid()")
        (before,) = [int(p) for p in re.findall(r": (\d+)", r.text)]
        r = k.run(_train(FIRST), timeout=120)
        assert not r.errors, r.error_text

        # Another job holds the free node: the grow's job pends until its --timeout,
        # then is withdrawn; the mesh is as it was.
        got = cluster.run(
            "salloc",
            "--no-shell",
            "--exclusive",
            f"--nodelist={free}",
            "--job-name=other",
            timeout=30,
        )
        assert got.returncode == 0, got.stderr
        (other,) = [j for j, (name, _, _) in _jobs(cluster).items() if name == "other"]
        blocker = other
        t0 = time.monotonic()
        text = usage_error(k, f"%mesh grow {MESH} --hosts +1 --timeout 5")
        took = time.monotonic() - t0
        assert "host 1 did not start within 5s" in text and "pending" in text, text
        assert "--timeout" in text and took < 30, (took, text)
        wait_until(
            lambda: sorted(_jobs(cluster)) == sorted([first, other]),
            timeout=15,
            what="the pending grow's job to be cancelled",
            detail=lambda: _jobs(cluster),
        )
        assert value(k, f"{MESH}.runtime.world, len({MESH}.runtime.hosts)") == (1, 1)
        cluster.run("scancel", other)
        wait_until(lambda: other not in _jobs(cluster), timeout=15, what="the other job")
        blocker = None

        t0 = time.monotonic()
        r = k.run(f"%mesh grow {MESH} --hosts +1", timeout=120)
        took = time.monotonic() - t0
        assert "world size 1 → 2; rank 1 started" in r.stdout, r.stdout + r.stderr + r.error_text
        assert "copied" in r.stdout, r.stdout
        print(f"\ngrow slurm 1 → 2 hosts between cells: {took:.1f}s ({r.stdout.strip()})")
        jobs = _jobs(cluster)
        assert len(jobs) == 2 and jobs[first][2] == used, jobs
        (grown,) = [j for j in jobs if j != first]
        assert jobs[grown][1:] == ("RUNNING", free), jobs
        r = k.run(f"%%remote {MESH}\nimport socket\nprint('on', socket.gethostname())")
        assert f"on {used}" in r.stdout and f"on {free}" in r.stdout, r.stdout + r.error_text

        # both nodes hold a host of the mesh now: one more is refused at once
        t0 = time.monotonic()
        text = usage_error(k, f"%mesh grow {MESH} --hosts +1")
        assert "need 1 Slurm node(s) this mesh does not use yet" in text, text
        assert time.monotonic() - t0 < 20 and len(_jobs(cluster)) == 2, text

        r = k.run(_train(STEPS), timeout=120)
        assert not r.errors, r.error_text
        outcome = value(
            k,
            f"_o = %remote {MESH} (state.step, losses, worlds, os.environ['WORLD_SIZE'], "
            "dist.get_world_size(), os.getpid())\nlist(_o.values())",
        )
        assert [o[0] for o in outcome] == [STEPS] * 2, outcome
        assert [o[3:5] for o in outcome] == [("2", 2)] * 2, outcome
        assert outcome[0][5] == before, "rank 0 was restarted"
        assert outcome[0][2] == [2] * STEPS and outcome[1][1] == outcome[0][1]
        expected = reference_losses([*range(FIRST), *range(STEPS)])[FIRST:]
        assert outcome[0][1] == pytest.approx(expected, rel=1e-5, abs=1e-6)

        t0 = time.monotonic()
        r = k.run(f"%mesh shrink {MESH} --hosts 1", timeout=120)
        assert "world size 2 → 1; rank 1 stopped" in r.stdout, r.stdout + r.stderr
        wait_until(
            lambda: sorted(_jobs(cluster)) == [first],
            timeout=20,
            what="the grown host's job to end (the first one stays)",
            detail=lambda: _jobs(cluster),
        )
        print(f"shrink slurm 2 → 1 hosts, its job gone: {time.monotonic() - t0:.1f}s")
        r = k.run(f"%remote {MESH} __import__('torch').distributed.get_world_size()")
        assert not r.errors and "1" in r.text, r.text + r.error_text

        # Again while a --bg loop trains: the new host's rank joins it at a step boundary
        # with rank 0's state, and the loop goes on at world size 2.
        assert not k.run(BG_SETUP).errors
        assert not k.run(BG_TRAIN, timeout=60).errors
        wait_progress(k, 5, MESH)
        t0 = time.monotonic()
        r = k.run(f"%mesh grow {MESH} --hosts +1", timeout=180)
        took = time.monotonic() - t0
        grown_at = re.search(r"world size 1 → 2 at step ([\d,]+); .*copied to rank 1", r.stdout)
        assert grown_at, r.stdout + r.stderr + r.error_text
        paused = re.search(r"paused ([\d.]+) s", r.stdout)
        print(
            f"grow slurm 1 → 2 hosts during a --bg loop: {took:.1f}s, training paused "
            f"{paused.group(1) if paused else '?'} s"
        )
        at = int(grown_at.group(1).replace(",", ""))
        assert len(_jobs(cluster)) == 2
        wait_progress(k, at + 5, MESH)
        assert not k.run(f"%push {MESH} stop=True").errors
        outcome = value(
            k,
            f"_o = %remote {MESH} (state.step, losses, worlds, dist.get_world_size())\n"
            "list(_o.values())",
            timeout=120,
        )
        steps, losses, worlds, _ = outcome[0]
        assert outcome[1] == outcome[0] and outcome[0][3] == 2, outcome
        assert worlds == [1] * at + [2] * (steps - at), worlds
        seeds = [*range(FIRST), *range(STEPS), *range(steps)]
        expected = reference_losses(seeds)[FIRST + STEPS :]
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert "stopped" in k.run(f"%mesh stop {MESH}", timeout=60).stdout
    finally:
        if blocker is not None:
            cluster.run("scancel", blocker)
        k.shutdown_and_check(timeout=30)
    assert_all_gone(cluster)


def test_grow_inside_the_users_job(cluster: SlurmCluster, tmp_path):
    """Inside a 2-node batch job (``$SLURM_JOB_ID``): the grown host is a second step of
    ours in that job on its other node; the shrink ends that step, never the job."""
    result = tmp_path / "result.json"
    job = cluster.submit_python(tmp_path, INSIDE_JOB)
    wait_until(lambda: job not in _jobs(cluster), timeout=120, what=f"batch job {job} to end")
    logs = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert result.exists(), logs
    data = json.loads(result.read_text())
    print(f"\ninside a job: {data.get('grow')}")
    assert data["before"] == [data["controller"]], data
    assert "world size 1 → 2; rank 1 started" in data["grow"], (data, logs)
    assert data["after"] == sorted(cluster.nodes), data
    assert len(data["steps"]) == 2, data  # the first host's step and the grown one's
    assert "this mesh does not use yet" in data["refused"], data
    assert "world size 2 → 1; rank 1 stopped" in data["shrink"], data
    assert len(data["steps_after"]) == 1, data
    state = cluster.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in state or not state, state + logs
    assert_all_gone(cluster)


SHRUNK = "sk"
HOSTNAME = "__import__('socket').gethostname()"
PID = "__import__('os').getpid()"
#: A cell on the remaining host that runs until the test writes the flag file ``{flag}``.
WAIT_FOR_FLAG = """%%remote {mesh}
import os, socket, time
print('waiting on', socket.gethostname(), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists({flag!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
print('done on', socket.gethostname(), os.path.exists({flag!r}))
"""


def _steps(cluster: SlurmCluster) -> dict[str, str]:
    """Every running step of the cluster: step name -> node list."""
    out = cluster.run("squeue", "-h", "-s", "-o", "%j|%N", timeout=30).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {r[0]: r[1] for r in rows}


def _on_each_rank(k: Kernel, expr: str) -> list[Any]:
    """``expr`` evaluated on every rank of the mesh :data:`SHRUNK`, in rank order."""
    return value(k, f"_v = %remote {SHRUNK} {expr}\nlist(_v.values())")


def _node_state(cluster: SlurmCluster, node: str) -> str:
    return cluster.run("sinfo", "-h", "-n", node, "-o", "%t", timeout=30).stdout.strip()


def test_shrinking_a_two_host_slurm_mesh_frees_the_removed_node(cluster: SlurmCluster, tmp_path):
    """``%mesh NAME --hosts 2`` is one salloc job with a step per node; ``%mesh shrink
    NAME --hosts 1`` ends host 1's step and shrinks the job off its node: another job
    runs there while the remaining host runs a cell; a grow takes a node again; stop
    leaves no job and no step."""
    gw = cluster.net.gateway
    k = Kernel(env={"SLURM_CONF": cluster.conf, "PYTHONPATH": os.environ["PYTHONPATH"]})
    try:
        r = k.run(
            f"%mesh {SHRUNK} --backend slurm --hosts 2 --gpus 1 --advertise {gw}", timeout=120
        )
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        ((job, (_, _, nodes)),) = _jobs(cluster).items()
        steps = _steps(cluster)
        assert sorted(steps.values()) == sorted(cluster.nodes), steps  # a step per node
        where = _on_each_rank(k, HOSTNAME)
        kept, removed = where[0], where[1]
        assert sorted(where) == sorted(cluster.nodes), where
        pid = _on_each_rank(k, PID)[0]

        t0 = time.monotonic()
        r = k.run(f"%mesh shrink {SHRUNK} --hosts 1", timeout=120)
        shrink_s = time.monotonic() - t0
        assert "world size 2 → 1; rank 1 stopped" in r.stdout, r.stdout + r.stderr
        # Slurm shows our job on the kept node only, and the removed node idle.
        wait_until(
            lambda: (
                _jobs(cluster).get(job, ("", "", ""))[1:] == ("RUNNING", kept)
                and _node_state(cluster, removed) == "idle"
            ),
            timeout=30,
            what=f"job {job} to be shrunk to {kept} and {removed} to be idle",
            detail=lambda: (_jobs(cluster), _node_state(cluster, removed)),
        )
        free_s = time.monotonic() - t0
        print(
            f"\nshrink slurm 2 → 1 hosts in one job: {shrink_s:.1f}s; "
            f"job on one node and {removed} idle after {free_s:.1f}s (was {nodes})"
        )
        assert list(_steps(cluster).values()) == [kept], _steps(cluster)

        # Another job runs on the freed node while the remaining host runs a cell.
        flag = tmp_path / "flag"
        cell = k.submit(WAIT_FOR_FLAG.format(mesh=SHRUNK, flag=str(flag)))
        k.wait_for_output(cell, f"waiting on {kept}", timeout=60)
        t0 = time.monotonic()
        # --exclusive: the whole node (our job held a CPU and a GPU of it before).
        other = cluster.run(
            "srun",
            "--exclusive",
            "--immediate=30",
            f"--nodelist={removed}",
            "--job-name=other",
            "hostname",
            timeout=60,
        )
        print(f"another job's srun on the freed node: {time.monotonic() - t0:.2f}s")
        assert other.returncode == 0 and other.stdout.strip() == removed, other
        flag.write_text("")
        r = k.collect(cell, timeout=60)
        assert not r.errors and f"done on {kept} True" in r.stdout, r.stdout + r.error_text
        assert _on_each_rank(k, PID) == [pid]

        r = k.run(f"%mesh grow {SHRUNK} --hosts +1", timeout=120)
        assert "world size 1 → 2; rank 1 started" in r.stdout, r.stdout + r.stderr + r.error_text
        jobs = _jobs(cluster)
        (grown,) = [j for j in jobs if j != job]
        assert jobs[job][2] == kept and jobs[grown][1:] == ("RUNNING", removed), jobs
        where = _on_each_rank(k, HOSTNAME)
        assert where == [kept, removed], where

        assert "stopped" in k.run(f"%mesh stop {SHRUNK}", timeout=60).stdout
        wait_until(
            lambda: not _jobs(cluster) and not _steps(cluster),
            timeout=30,
            what="no job and no step after stop",
            detail=lambda: (_jobs(cluster), _steps(cluster)),
        )
    finally:
        k.shutdown_and_check(timeout=30)
    assert_all_gone(cluster)


#: A batch script's python: a two-host mesh in its 2-node job (a step of ours per node)
#: shrinks to one host: our step on the other node ends, the job keeps both nodes.
INSIDE_JOB_SHRINK = """
import json, os, subprocess, sys, time
from monarch_kernel.actor import host_mesh

def squeue(*args):
    argv = ["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], *args]
    return subprocess.run(argv, capture_output=True, text=True).stdout.split()

def steps():
    return sorted(s for s in squeue("-s", "-o", "%j|%N") if s.startswith("mk-"))

out = {}
procs = host_mesh(hosts=2, backend="slurm").spawn_procs({"gpus": 1}, timeout=60)
try:
    out["steps"] = steps()
    out["shrink"] = procs.shrink(hosts=1).describe()
    deadline = time.monotonic() + 20
    while len(steps()) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    out["steps_after"] = steps()
    out["job_nodes"] = squeue("-o", "%D")
finally:
    procs.stop()
    procs.runtime.launcher.shutdown()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
"""


def test_shrink_inside_the_users_job_ends_our_step_only(cluster: SlurmCluster, tmp_path):
    """Inside a 2-node batch job, a 2-host mesh has a step per node; shrinking it to
    one host ends our step on the other node and never shrinks the user's job."""
    result = tmp_path / "result.json"
    job = cluster.submit_python(tmp_path, INSIDE_JOB_SHRINK)
    wait_until(lambda: job not in _jobs(cluster), timeout=120, what=f"batch job {job} to end")
    logs = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert result.exists(), logs
    data = json.loads(result.read_text())
    assert sorted(s.split("|")[1] for s in data["steps"]) == sorted(cluster.nodes), data
    assert "world size 2 → 1; rank 1 stopped" in data["shrink"], (data, logs)
    assert len(data["steps_after"]) == 1, data
    assert data["job_nodes"] == ["2"], data  # the user's job still has both nodes
    state = cluster.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in state or not state, state + logs
    assert_all_gone(cluster)
