"""Elastic meshes on a real two-node Ray cluster (``ray_cluster.py``): ``%mesh grow NAME
--hosts +1`` reserves a placement group for the new host on a node none of the mesh's
hosts is on, and the new rank takes the replicas' state; a grow past the cluster's
nodes is one clear line at once. Every host has a group of its own: ``%mesh shrink``
removes the dropped host's group at once, its node's CPU is free for any other user of
the cluster (this test process places a group there), and a grow takes it back, also
while a ``--bg`` loop trains.

The training cells are ``test_elastic``'s loop (a global batch split by
``rank::world_size``): their losses at world sizes 1, then 2 are those of one process.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from helpers import wait_until
from kernel_client import Kernel
from ray_cluster import RAY_ENV, RayCluster, as_driver
from test_elastic import BATCH, SETUP, TRAIN, reference_losses, usage_error, value, wait_progress
from test_elastic_join import MESH as JOIN_MESH
from test_elastic_join import STOP_SETUP
from test_elastic_join import TRAIN as STOPPABLE
from test_ray import _gone

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

MESH = "rg"
STEPS = 30
FIRST = 10  #: steps trained on one host, before the grow


def _train(steps: int) -> str:
    """``test_elastic``'s loop as a foreground cell (a fresh ``TrainingState``: step 0)."""
    return TRAIN.format(mesh=MESH, steps=steps, batch=BATCH).replace(" --bg", "")


@pytest.fixture(scope="module")
def cluster(ray_session_cluster: RayCluster) -> Iterator[RayCluster]:
    """The session's Ray cluster; this process is a driver too (Ray's own tables, and
    another user of the cluster's nodes)."""
    with as_driver(ray_session_cluster) as c:
        yield c


#: The kernel's (the Ray driver's) placement groups of ours not removed yet.
GROUPS = (
    "import ray\nlen([g for g in ray.util.placement_group_table().values() "
    "if g['name'].startswith('mk-') and g['state'] != 'REMOVED'])"
)


def test_grow_ray_mesh_by_a_host_between_cells(cluster: RayCluster):
    k = Kernel(env={**RAY_ENV, "RAY_ADDRESS": cluster.address})
    pids: list[int] = []
    try:
        r = k.run(f"%mesh {MESH} --backend ray --hosts 1 --gpus 1 --dist", timeout=180)
        assert "(ray) ready" in r.stdout, r.stdout + r.stderr + r.error_text
        r = k.run(SETUP.format(mesh=MESH, batch=BATCH), timeout=120)
        assert not r.errors, r.error_text
        r = k.run(f"%remote {MESH} __import__('os').getpid()")
        (before,) = [int(p) for p in re.findall(r": (\d+)", r.text)]
        # a few steps on one host: the new host's rank must take this state (not the
        # setup cell's fresh model)
        r = k.run(_train(FIRST), timeout=180)
        assert not r.errors, r.error_text

        t0 = time.monotonic()
        r = k.run(f"%mesh grow {MESH} --hosts +1", timeout=180)
        took = time.monotonic() - t0
        assert "world size 1 → 2; rank 1 started" in r.stdout, r.stdout + r.stderr + r.error_text
        assert "copied" in r.stdout, r.stdout
        print(f"\ngrow ray 1 → 2 hosts between cells: {took:.1f}s ({r.stdout.strip()})")
        hosts = value(k, f"[h.addr for h in {MESH}.runtime.hosts]")
        assert sorted(hosts) == sorted([cluster.head_ip, cluster.worker_ip]), hosts
        pids = value(
            k,
            f"[p for p in [h.pid for h in {MESH}.runtime.hosts] + "
            f"[x.pid for x in {MESH}.runtime.ranks] if p]",
        )

        # both nodes hold a host of the mesh now: one more is refused at once
        t0 = time.monotonic()
        text = usage_error(k, f"%mesh grow {MESH} --hosts +1")
        assert "need 1 Ray node(s) this mesh does not use yet" in text, text
        assert "ray start --address" in text and time.monotonic() - t0 < 20, text
        assert value(k, f"{MESH}.runtime.world, len({MESH}.runtime.hosts)") == (2, 2)

        r = k.run(_train(STEPS), timeout=180)
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
        digests = value(
            k,
            f"_d = %remote {MESH} __import__('monarch_kernel.rank.replicas.replicas', "
            "fromlist=['_']).digest_namespace(globals())\n"
            "[sorted((o.name, o.digest) for o in d.objects) for d in _d.values()]",
        )
        assert len(digests[0]) >= 2 and all(d == digests[0] for d in digests), digests

        assert value(k, GROUPS) == 2  # the first host's and the grown one's
        r = k.run(f"%mesh shrink {MESH} --hosts 1", timeout=120)
        assert "world size 2 → 1; rank 1 stopped" in r.stdout, r.stdout + r.stderr
        # the grown host's group goes with it
        wait_until(lambda: value(k, GROUPS) == 1, timeout=30, what="its placement group to go")
        assert "stopped" in k.run(f"%mesh stop {MESH}", timeout=60).stdout
        wait_until(lambda: value(k, GROUPS) == 0, timeout=30, what="the placement groups to go")
    finally:
        k.shutdown_and_check(timeout=30)
    assert not _gone(pids), "agents or ranks were left behind"


SHRUNK = "rs"  #: the mesh of the shrink test
#: ``test_elastic_join``'s ``--bg`` loop (ended by ``%push rs stop=True``) on that mesh.
BG_SETUP = STOP_SETUP.replace(f"%%remote {JOIN_MESH}", f"%%remote {SHRUNK}")
BG_TRAIN = STOPPABLE.replace(f"%%remote {JOIN_MESH}", f"%%remote {SHRUNK}")
NODE_ID = "ray.io/node-id"  # the label every Ray node has (launchers.ray_engine)


def _driver():
    """Ray, with this process connected to the test cluster as a driver of its own."""
    import logging
    import os

    import ray

    if not ray.is_initialized():
        address = os.environ["RAY_ADDRESS"]
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    return ray


def _groups(mesh: str) -> list[tuple[str, str, list[str]]]:
    """Ray's placement groups of ``mesh`` (removed ones too: a name can come back):
    (name, state, the nodes of its bundles)."""
    table = _driver().util.placement_group_table()
    return sorted(
        (g["name"], g["state"], sorted(set(g["bundles_to_node_id"].values())))
        for g in table.values()
        if g["name"].startswith(f"mk-{mesh}-")
    )


def _live_groups(mesh: str) -> dict[str, list[str]]:
    """The groups of ``mesh`` not removed: name -> nodes."""
    return {name: nodes for name, state, nodes in _groups(mesh) if state != "REMOVED"}


def _actors(mesh: str) -> list[str]:
    """The live named actors of ``mesh`` (our agent actors), in any namespace."""
    names = _driver().util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names if a["name"].startswith(f"mk-{mesh}-"))


def _free_cpus() -> float:
    return float(_driver().available_resources().get("CPU", 0.0))


def test_shrink_frees_the_removed_hosts_node_and_a_bg_grow_takes_it_back(cluster: RayCluster):
    """A mesh started on both nodes holds both nodes' CPU (one each), a group per host.
    ``%mesh shrink --hosts 1`` removes host 1's group and actor: its node's CPU is free
    (another driver places a group there), host 0 runs on; a grow during a ``--bg`` loop
    lands on that node again and the loop's losses are one process's; a stop leaves no
    group, no actor, no process."""
    ray = _driver()
    k = Kernel(env={**RAY_ENV, "RAY_ADDRESS": cluster.address})
    pids: list[int] = []
    try:
        r = k.run(f"%mesh {SHRUNK} --backend ray --hosts 2 --gpus 1 --dist", timeout=180)
        assert "(ray) ready" in r.stdout, r.stdout + r.stderr + r.error_text
        groups = _live_groups(SHRUNK)
        assert sorted(groups) == [f"mk-{SHRUNK}-0", f"mk-{SHRUNK}-1"], groups
        assert all(len(nodes) == 1 for nodes in groups.values()), groups
        (freed,) = groups[f"mk-{SHRUNK}-1"]
        assert groups[f"mk-{SHRUNK}-0"] != [freed], groups  # one host per node
        assert _free_cpus() == 0, ray.available_resources()  # each node's 1 CPU is ours
        assert len(_actors(SHRUNK)) == 2, _actors(SHRUNK)
        pids = value(
            k,
            f"[p for p in [h.pid for h in {SHRUNK}.runtime.hosts] + "
            f"[x.pid for x in {SHRUNK}.runtime.ranks] if p]",
        )

        t0 = time.monotonic()
        r = k.run(f"%mesh shrink {SHRUNK} --hosts 1", timeout=120)
        shrink_took = time.monotonic() - t0
        assert "world size 2 → 1; rank 1 stopped" in r.stdout, r.stdout + r.stderr
        wait_until(
            lambda: _free_cpus() == 1,
            timeout=30,
            what="host 1's node CPU to be free",
            detail=lambda: (ray.available_resources(), _groups(SHRUNK)),
        )
        free_took = time.monotonic() - t0
        state = [(name, state) for name, state, _ in _groups(SHRUNK)]
        assert state == [(f"mk-{SHRUNK}-0", "CREATED"), (f"mk-{SHRUNK}-1", "REMOVED")], state
        (kept,) = _actors(SHRUNK)
        assert kept.startswith(f"mk-{SHRUNK}-0-"), kept
        print(
            f"\nshrink ray 2 → 1 hosts: {shrink_took:.1f}s; the node's CPU free in Ray "
            f"{free_took:.1f}s after the shrink began"
        )

        # another user of the cluster takes the freed node, then gives it back
        from ray.util.placement_group import placement_group, remove_placement_group

        other = placement_group([{"CPU": 1.0}], bundle_label_selector=[{NODE_ID: freed}])
        try:
            ready, _ = ray.wait([other.ready()], timeout=60)
            assert ready, "another driver could not place a group on the freed node"
        finally:
            remove_placement_group(other)
        wait_until(lambda: _free_cpus() == 1, timeout=30, what="the other group to go")

        # host 0 runs on
        r = k.run(f"%remote {SHRUNK} __import__('torch').distributed.get_world_size()")
        assert not r.errors and re.findall(r": (\d+)", r.text) == ["1"], r.text + r.error_text

        # a grow during a --bg loop: the new host is on the freed node again
        assert not k.run(SETUP.format(mesh=SHRUNK, batch=BATCH), timeout=120).errors
        assert not k.run(BG_SETUP).errors
        assert not k.run(BG_TRAIN, timeout=60).errors
        wait_progress(k, 5, SHRUNK)
        t0 = time.monotonic()
        r = k.run(f"%mesh grow {SHRUNK} --hosts +1", timeout=180)
        grow_took = time.monotonic() - t0
        grown_at = re.search(r"world size 1 → 2 at step ([\d,]+); .*copied to rank 1", r.stdout)
        assert grown_at, r.stdout + r.stderr + r.error_text
        paused = re.search(r"paused ([\d.]+) s", r.stdout)
        print(
            f"grow ray 1 → 2 hosts during a --bg loop: {grow_took:.1f}s, training paused "
            f"{paused.group(1) if paused else '?'} s"
        )
        # (its group is named by the new host's slot: slots are never reused in a mesh)
        grown = [n for name, n in _live_groups(SHRUNK).items() if name != f"mk-{SHRUNK}-0"]
        assert grown == [[freed]], _groups(SHRUNK)
        hosts = value(k, f"[h.addr for h in {SHRUNK}.runtime.hosts]")
        assert sorted(hosts) == sorted([cluster.head_ip, cluster.worker_ip]), hosts
        pids += value(
            k,
            f"[p for p in [h.pid for h in {SHRUNK}.runtime.hosts] + "
            f"[x.pid for x in {SHRUNK}.runtime.ranks] if p]",
        )
        at = int(grown_at.group(1).replace(",", ""))
        wait_progress(k, at + 5, SHRUNK)
        assert not k.run(f"%push {SHRUNK} stop=True").errors
        outcome = value(
            k,
            f"_o = %remote {SHRUNK} (state.step, losses, worlds, dist.get_world_size())\n"
            "list(_o.values())",
            timeout=120,
        )
        steps, losses, worlds, _ = outcome[0]
        assert outcome[1] == outcome[0] and outcome[0][3] == 2, outcome
        assert worlds == [1] * at + [2] * (steps - at), worlds
        assert losses == pytest.approx(reference_losses(range(steps)), rel=1e-5, abs=1e-6)

        assert "stopped" in k.run(f"%mesh stop {SHRUNK}", timeout=60).stdout
        wait_until(
            lambda: not _live_groups(SHRUNK) and not _actors(SHRUNK),
            timeout=30,
            what="no group and no actor of the mesh left",
            detail=lambda: (_groups(SHRUNK), _actors(SHRUNK)),
        )
        wait_until(lambda: _free_cpus() == 2, timeout=30, what="both nodes' CPU to be free")
    finally:
        k.shutdown_and_check(timeout=30)
    assert not _gone(pids), "agents or ranks were left behind"
