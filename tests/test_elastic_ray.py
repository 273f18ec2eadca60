"""Elastic meshes on a real two-node Ray cluster (``ray_cluster.py``): ``%mesh grow NAME
--hosts +1`` reserves a placement group for the new host on a node none of the mesh's
hosts is on, and the new rank takes the replicas' state; a grow past the cluster's
nodes is one clear line at once.

The training cells are ``test_elastic``'s loop (a global batch split by
``rank::world_size``): their losses at world sizes 1, then 2 are those of one process.
"""

from __future__ import annotations

import re
import time

import pytest
from helpers import wait_until
from kernel_client import Kernel
from ray_cluster import RAY_ENV, RayCluster
from test_elastic import BATCH, SETUP, TRAIN, reference_losses, usage_error, value
from test_ray import _gone

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

MESH = "rg"
STEPS = 30
FIRST = 10  #: steps trained on one host, before the grow


def _train(steps: int) -> str:
    """``test_elastic``'s loop as a foreground cell (a fresh ``TrainingState``: step 0)."""
    return TRAIN.format(mesh=MESH, steps=steps, batch=BATCH).replace(" --bg", "")


@pytest.fixture(scope="module")
def cluster(ray_session_cluster: RayCluster) -> RayCluster:
    ray_session_cluster.ensure_two_nodes()
    return ray_session_cluster


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
            f"_d = %remote {MESH} __import__('monarch_kernel.rank.replicas', "
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
