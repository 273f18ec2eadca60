"""``--detachable`` meshes on the ray and slurm backends: the engine's reservation
outlives a killed kernel, a new kernel attaches, and the reservation is released on
stop and when ``--keep`` runs out.

* Ray (the session's two-node cluster, ``ray_cluster.py``): each host's placement
  group and agent actor are detached; after ``%mesh stop`` from the kernel that
  attached, every group is REMOVED and no actor of ours is left;
* Slurm (the real cluster of ``slurm_cluster.py``): a keeper runs the srun step; after
  the stop the job is gone (CANCELLED/COMPLETED), and no keeper or srun is left.

One mesh per test; each test kills a kernel with SIGKILL (as the OOM killer would).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from conftest import pid_alive
from detach_place import Place, log_has, ok, steps
from helpers import patched_environ, pythonpath_with, wait_until
from ray_cluster import RAY_ENV, RayCluster, as_driver
from slurm_cluster import SlurmCluster, slurm_cluster_fixture
from test_detach import LOOP_BODY

import monarch_kernel

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(monarch_kernel.__file__)))
NAMESPACE = "monarch_kernel"  # launchers.ray_engine.NAMESPACE

SETUP = """%%remote {m} --setup
import torch, torch.distributed as dist
lr, stop, step = 0.1, False, 0
"""
MODEL = """%%remote {m}
import datetime
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


# -- the clusters ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster(ray_session_cluster: RayCluster) -> Iterator[RayCluster]:
    """The session's Ray cluster; this process is a driver too (to read its tables)."""
    with as_driver(ray_session_cluster) as c:
        yield c


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    for c in slurm_cluster_fixture(2, gpus=2):
        with patched_environ({"SLURM_CONF": c.conf, "PYTHONPATH": pythonpath_with(REPO)}):
            c.env = dict(os.environ)
            yield c


# -- Ray -----------------------------------------------------------------------------------
def _groups(name: str) -> dict[str, str]:
    """Our placement groups of mesh ``name``: name -> state."""
    import ray

    table = ray.util.placement_group_table()
    return {g["name"]: g["state"] for g in table.values() if g["name"].startswith(f"mk-{name}-")}


def _actors_alive(names: list[str]) -> list[str]:
    import ray

    alive = []
    for n in names:
        try:
            ray.get_actor(n, namespace=NAMESPACE)
            alive.append(n)
        except ValueError:
            pass
    return alive


class RayCheck:
    """What the Ray tests check of the reservation of mesh ``name``."""

    def __init__(self, name: str):
        self.name = name
        self.groups: list[str] = []
        self.actors: list[str] = []

    def held(self, file: dict[str, Any]) -> str:
        """Each host has a group and an actor of its own, all recorded and alive."""
        self.groups = [h["reservation"]["name"] for h in file["hosts"]]
        self.actors = [a for h in file["hosts"] for a in h["reservation"]["members"]]
        assert len(set(self.groups)) == len(self.actors) == len(file["hosts"]), file["hosts"]
        # (removed groups of an earlier mesh of the same name may still be listed)
        live = {g: state for g, state in _groups(self.name).items() if state != "REMOVED"}
        assert live == dict.fromkeys(self.groups, "CREATED"), _groups(self.name)
        assert _actors_alive(self.actors) == self.actors
        return ", ".join(f"ray pg {g}" for g in self.groups)

    def released(self) -> None:
        wait_until(
            lambda: all(_groups(self.name).get(g) == "REMOVED" for g in self.groups),
            timeout=30,
            what="the placement groups to be removed",
            detail=lambda: _groups(self.name),
        )
        wait_until(lambda: not _actors_alive(self.actors), timeout=30, what="our actors to end")


def _ray_env(place: Place, c: RayCluster) -> dict[str, str]:
    return dict(place.env, **RAY_ENV, RAY_ADDRESS=c.address)


@pytest.mark.timeout(420)
def test_ray_detached_mesh_outlives_its_kernel_and_is_released_on_stop(ray_cluster, place):
    check = RayCheck("rd")
    _takeover(place, _ray_env(place, ray_cluster), "rd", "--backend ray --hosts 2", check)


@pytest.mark.timeout(240)
def test_ray_keep_expiry_releases_the_placement_group(ray_cluster, place):
    check = RayCheck("rk")
    _expiry(place, _ray_env(place, ray_cluster), "rk", "--backend ray --hosts 1", check)


# -- Slurm ---------------------------------------------------------------------------------
class SlurmCheck:
    """What the Slurm tests check of the job of mesh ``name``."""

    def __init__(self, name: str, cluster: SlurmCluster):
        self.name = name
        self.cluster = cluster
        self.job = ""

    def held(self, file: dict[str, Any]) -> str:
        (job,) = {h["reservation"]["name"] for h in file["hosts"]}
        self.job = job
        assert self.cluster.jobs() == [job], self.cluster.jobs()
        state = self.cluster.run("squeue", "-h", "-j", job, "-o", "%T %j").stdout.split()
        assert state == ["RUNNING", f"mk-{self.name}"], state
        return f"slurm job {job}"

    def released(self) -> None:
        wait_until(lambda: not self.cluster.jobs(), timeout=30, what="the Slurm job to end")
        state = self.cluster.run("scontrol", "show", "job", self.job).stdout
        assert not state or re.search(r"JobState=(CANCELLED|COMPLETED)", state), state


def _slurm_env(place: Place, c: SlurmCluster) -> dict[str, str]:
    return dict(place.env, SLURM_CONF=c.conf, PYTHONPATH=os.environ["PYTHONPATH"])


@pytest.mark.timeout(420)
def test_slurm_detached_mesh_outlives_its_kernel_and_is_released_on_stop(slurm, place):
    line = f"--backend slurm --hosts 2 --advertise {slurm.net.gateway}"
    _takeover(place, _slurm_env(place, slurm), "sd", line, SlurmCheck("sd", slurm))


@pytest.mark.timeout(240)
def test_slurm_keep_expiry_cancels_the_job(slurm, place):
    line = f"--backend slurm --hosts 1 --advertise {slurm.net.gateway}"
    _expiry(place, _slurm_env(place, slurm), "sk", line, SlurmCheck("sk", slurm))


# -- the two scenarios ---------------------------------------------------------------------
def _agents_gone(place: Place, file: dict[str, Any]) -> None:
    pids = [r["pid"] for r in file["ranks"]]
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="the ranks to end")
    dirs = [h["dir"] for h in file["hosts"]]
    wait_until(lambda: not any(map(os.path.exists, dirs)), timeout=15, what="the agents' dirs")
    wait_until(
        lambda: not os.path.exists(place.attach_path(file["name"])),
        timeout=15,
        what="the attach file to be removed",
    )


def _keepers() -> list[str]:
    out = []
    for p in psutil.process_iter():
        try:
            line = " ".join(p.cmdline())
            if "slurm_keeper" in line and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {line}")
        except psutil.Error:
            continue
    return out


def _takeover(place: Place, env: dict[str, str], m: str, backend: str, check: Any) -> None:
    """A detachable mesh with a DDP ``--bg`` loop; SIGKILL its kernel; the ranks train
    on in the reservation; a new kernel attaches, pushes and pulls, and stops it: the
    reservation is released and nothing is left."""
    k1 = place.kernel_with(env)
    t0 = time.monotonic()
    r = k1.run(f"%mesh {m} {backend} --gpus 1 --detachable --keep 10m", timeout=180)
    assert "is detachable" in r.stdout, r.stdout + r.stderr + r.error_text
    print(f"\n{backend.split()[1]} detachable mesh ready in {time.monotonic() - t0:.1f}s")
    ok(k1, SETUP.format(m=m))
    ok(k1, MODEL.format(m=m))
    job = k1.submit(f"%%remote {m} --bg\n" + LOOP_BODY)
    k1.wait_for_output(job, "step 3 lr 0.1", timeout=60)
    wait_until(lambda: place.attach_file(m)["jobs"], timeout=10, what="the job in the file")
    file = place.attach_file(m)
    reserved = check.held(file)

    place.kill(k1)
    log = place.rank_log(m, 1)
    at_kill = steps(log)
    wait_until(lambda: steps(log) >= at_kill + 10, timeout=60, what="steps with no kernel")
    assert check.held(place.attach_file(m)) == reserved  # kept while detached

    k2 = place.kernel_with(env)
    listed = ok(k2, "%mesh").text
    assert re.search(rf"{m}\s+hosts=2 × gpus=1\s+2\s+2/2.*{reserved}", listed), listed
    t0 = time.monotonic()
    attach = k2.submit(f"jobs = %mesh attach {m}")
    k2.wait_for_output(attach, f"attached mesh '{m}'", timeout=90)
    print(f"%mesh attach ({reserved}): attached after {time.monotonic() - t0:.2f}s")
    r = k2.collect(attach, timeout=90)
    assert not r.errors and "2/2 ranks running" in r.stdout, r.stdout + r.error_text
    pulled = [int(v) for v in re.findall(r"}: (\d+)", ok(k2, f"%pull {m} step").text)]
    assert len(pulled) == 2 and min(pulled) >= at_kill + 10, pulled
    ok(k2, f"%push {m} lr=0.5")
    wait_until(lambda: log_has(log, "lr 0.5"), timeout=30, what="the pushed lr in use")
    ok(k2, f"%push {m} stop=True")
    ok(k2, "jobs[0].wait(60)")

    t0 = time.monotonic()
    assert "stopped" in ok(k2, f"%mesh stop {m}").stdout
    took = time.monotonic() - t0
    check.released()
    print(f"%mesh stop: {took:.2f}s; {reserved} released {time.monotonic() - t0:.2f}s after")
    _agents_gone(place, file)
    wait_until(lambda: not _keepers(), timeout=15, what="no keeper left", detail=_keepers)


def _expiry(place: Place, env: dict[str, str], m: str, backend: str, check: Any) -> None:
    """A detachable mesh with ``--keep 3s`` whose kernel is killed stops by itself: its
    ranks and agents end, its files go, and its reservation is released."""
    k1 = place.kernel_with(env)
    r = k1.run(f"%mesh {m} {backend} --gpus 1 --detachable --keep 3s", timeout=180)
    assert "is detachable" in r.stdout, r.stdout + r.stderr + r.error_text
    file = place.attach_file(m)
    check.held(file)
    place.kill(k1)
    t0 = time.monotonic()
    check.released()
    took = time.monotonic() - t0
    print(f"\n--keep 3s: the reservation was released {took:.1f}s after the kill")
    assert took > 1.5, "the reservation went long before --keep ran out"
    _agents_gone(place, file)
    wait_until(lambda: not _keepers(), timeout=15, what="no keeper left", detail=_keepers)
