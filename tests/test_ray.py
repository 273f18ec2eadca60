"""The ``ray`` backend on a real two-node Ray cluster (``ray_cluster.py``): the head on
this namespace's bridge address, a second raylet inside a network-namespace host.

Ray only places one bundle per host (a group each) and runs the join command in an
actor; everything
after is the join code path. After a stop no placement group of ours and no agent or
rank is left. The node-kill test is last (it ends the cluster's second node).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from helpers import wait_until
from kernel_client import notebook_client
from notebook_outputs import keep_outputs
from ray_cluster import RayCluster, as_driver
from test_join import Probe, Trainer, one_process_ddp_losses

from monarch_kernel import config
from monarch_kernel.actor import host_mesh
from monarch_kernel.launchers.ray_engine import NODE_ID_LABEL

pytestmark = pytest.mark.cluster

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def cluster(ray_session_cluster: RayCluster):
    # This process is the Ray driver (the controller), as a kernel would be; the kernels
    # the notebook test starts inherit the address and the token.
    with as_driver(ray_session_cluster) as c:
        yield c


def _our_groups() -> list[dict]:
    import ray

    table = ray.util.placement_group_table()
    return [g for g in table.values() if g["name"].startswith("mk-") and g["state"] != "REMOVED"]


def _pids(procs) -> list[int]:
    rt = procs.runtime
    return [p for p in [h.pid for h in rt.hosts] + [r.pid for r in rt.ranks] if p]


def _gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and _running(p)]
        if not left:
            return []
        time.sleep(0.2)
    return left


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_host_mesh_runs_ddp_across_ray_nodes(cluster: RayCluster):
    """A placement group of one bundle per host, each on a Ray node of its own, a host
    agent in each; DDP over gloo
    across the two nodes gives the losses of one process averaging the 4 ranks."""
    t0 = time.monotonic()
    procs = host_mesh(hosts=2, backend="ray").spawn_procs({"gpus": 2}, name="ray2", timeout=90)
    ready = time.monotonic() - t0
    pids = _pids(procs)
    try:
        rt = procs.runtime
        # advertise defaulted to the address we reach the head node from (the bridge)
        assert rt.transport.send_addr.startswith("tcp://")
        assert {h.addr for h in rt.hosts} == {cluster.head_ip, cluster.worker_ip}, ready
        groups = _our_groups()
        assert [len(g["bundles_to_node_id"]) for g in groups] == [1, 1], groups
        nodes = {n for g in groups for n in g["bundles_to_node_id"].values()}
        assert len(nodes) == 2, groups  # one host per node
        info = procs.spawn("probe", Probe).info.call().get(timeout=30).values()
        hostnames = [i["hostname"] for i in info]
        assert len(set(hostnames)) == 2 and hostnames[0] == hostnames[1], hostnames
        master = rt.hosts[0].addr
        assert all(i["MASTER_ADDR"] == master for i in info)
        assert [i["NODE_RANK"] for i in info] == ["0", "0", "1", "1"]

        steps = 3
        got = procs.spawn("ddp", Trainer).train.call(steps).get(timeout=60).values()
        expected = one_process_ddp_losses(4, steps)
        for r in range(4):
            assert got[r] == pytest.approx(expected[r], rel=1e-5, abs=1e-6), r
    finally:
        procs.stop()
    assert not _our_groups(), "a placement group was left behind"
    assert not _gone(pids), "agents or ranks were left behind"


def test_dashboard_status_names_the_ray_node(cluster: RayCluster):
    """Before a host joins, its handle says what Ray is doing; afterwards, where it
    joined from."""
    procs = host_mesh(hosts=1, backend="ray").spawn_procs({"gpus": 1}, name="ray1", timeout=90)
    try:
        (group,) = _our_groups()
        assert group["strategy"] == "PACK"
        handle = procs.runtime.hosts[0].handle
        assert handle is not None and "joined from" in handle.status()  # type: ignore[attr-defined]
    finally:
        procs.stop()
    assert not _our_groups()


def test_bad_input_is_one_clear_error(cluster: RayCluster):
    with pytest.raises(ValueError, match=r"--hosts 3 needs 3 Ray nodes .* has 2 alive"):
        host_mesh(hosts=3, backend="ray").spawn_procs({"gpus": 1}, name="ray3")
    assert not _our_groups()
    with pytest.raises(ValueError, match="connected to the Ray cluster at .* cannot also use"):
        host_mesh(hosts=1, backend="ray", address="10.255.255.1:6379")
    # No cluster at all (a fresh process, so this one's connection does not count).
    code = (
        "from monarch_kernel.actor import host_mesh\n"
        "try:\n    host_mesh(hosts=1, backend='ray', address='127.0.0.1:1')\n"
        "except ValueError as e:\n    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "ERR no Ray cluster at '127.0.0.1:1'" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "ray start --head" in out.stdout
    print(f"no-cluster error after {time.monotonic() - t0:.1f}s")


def test_start_that_cannot_be_placed_leaves_nothing_reserved(cluster: RayCluster):
    """Another driver holds the second node's CPU: host 0's group is placed on the head,
    host 1's finds no other node. After the placement timeout (6 s here, 30 s by
    default) the start fails in one line naming what is free, and host 0's group is
    removed again."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    mesh = host_mesh(hosts=2, backend="ray")  # connects this process (the driver)
    (worker,) = [n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == cluster.worker_ip]
    blocker = placement_group([{"CPU": 1.0}], bundle_label_selector=[{NODE_ID_LABEL: worker}])
    try:
        ready, _ = ray.wait([blocker.ready()], timeout=60)
        assert ready, "the blocking group was not placed"
        t0 = time.monotonic()
        with (
            config.configured(ray_placement_timeout="6s"),
            pytest.raises(ValueError, match=r"could not place 2 x .* within 6s: 1 placed.*CPU=1\b"),
        ):
            mesh.spawn_procs({"gpus": 1}, name="rayfull", timeout=90)
        print(f"\nunplaceable start failed after {time.monotonic() - t0:.1f}s")
        wait_until(lambda: not _our_groups(), timeout=30, what="host 0's group to be removed")
    finally:
        remove_placement_group(blocker)
    wait_until(
        lambda: ray.available_resources().get("CPU") == 2,
        timeout=30,
        what="both nodes' CPU to be free",
        detail=ray.available_resources,
    )


def test_ray_notebook_runs_against_the_test_cluster(cluster: RayCluster):
    nb = nbformat.read(NOTEBOOKS / "06-ray-cluster.ipynb", as_version=4)
    client = notebook_client(
        nb, kernel_name="monarch", timeout=180, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    text = "\n".join(
        o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "(ray) ready in" in text, text[-3000:]
    assert "node0-" in text  # a rank printed the namespace host's hostname
    assert "placement groups left: 0" in text, text[-3000:]
    assert not _our_groups()
    keep_outputs(nb, NOTEBOOKS / "06-ray-cluster.ipynb")


def test_killed_kernel_leaves_no_group_and_no_process(cluster: RayCluster):
    """A kernel SIGKILLed with a live Ray mesh: Ray removes the placement group and the
    actors its driver owned, and the agents and ranks go with them."""
    import json

    from kernel_client import Kernel

    k = Kernel()
    try:
        r = k.run("%mesh rk --backend ray --hosts 2 --gpus 1", timeout=120)
        assert "(ray) ready" in r.stdout, r.stdout + r.stderr + r.error_text
        code = "import json; rt = rk.runtime\n"
        code += "print(json.dumps([h.pid for h in rt.hosts] + [x.pid for x in rt.ranks]))"
        pids = json.loads(k.run(code).stdout.strip().splitlines()[-1])
        assert len(pids) == 4 and all(pids), pids
        assert len(_our_groups()) == 2  # one per host
        os.kill(k.pids()[0], 9)  # the kernel dies without any clean-up of its own
        wait_until(lambda: not _our_groups(), timeout=30, what="Ray to remove the group")
        left = _gone(pids, timeout=20)
        assert not left, f"agents or ranks left after the kernel died: {left}"
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_killed_ray_node_loses_its_host_naming_it(cluster: RayCluster):
    """Last: stop the second Ray node. Its host is declared lost within 3 s, its ranks
    dead with the host named; with on_failure="stop" the mesh then stops. (A module that
    uses the session's cluster after this one starts the node again first.)"""
    procs = host_mesh(hosts=2, backend="ray").spawn_procs(
        {"gpus": 1}, name="raykill", timeout=90, on_failure="stop"
    )
    pids = _pids(procs)
    try:
        rt = procs.runtime
        (lost,) = [h for h in rt.hosts if h.addr == cluster.worker_ip]
        mine = [r for r in rt.ranks if r.host == lost.index]
        t0 = time.monotonic()
        cluster.kill_worker()
        while any(r.alive for r in mine) and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert lost.lost, "the host on the killed node was never declared lost"
        text = rt.death_text(mine[0])
        assert f"host agent {lost.index} lost" in text, text
        assert f"{lost.hostname} at {cluster.worker_ip}" in text, text
        print(f"host on the killed Ray node reported after {took:.2f}s: {text}")
        assert took < 15, (took, text, lost.lost)
    finally:
        procs.stop()  # the failure policy may be stopping it in another thread already
    deadline = time.monotonic() + 15
    while _our_groups() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _our_groups()
    assert not _gone(pids), "agents or ranks were left behind"
