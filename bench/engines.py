"""Engine rows ("engines"): time from ``%mesh`` to a ready 2-host mesh on a real Ray
cluster and a real Slurm cluster, next to Ray's own two actors on the same cluster.

Ray: the test suite's two-node cluster (``tests/ray_cluster.py``: the head here, a second
raylet in a network namespace). "Ours" is ``host_mesh(hosts=2, backend="ray")
.spawn_procs({"gpus": 1})`` until an actor on every rank answered; "Ray's own" is what a
Ray user would do for the same thing: a ``STRICT_SPREAD`` placement group of two bundles
and one actor in each, until both answered a method call. Each sample is fresh (created,
answered, removed); rows are medians.

Slurm: :mod:`bench.slurm_start` (salloc + srun of the join command on two namespace
nodes). Needs root; otherwise every row says why.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from bench.common import Recorder, Settings, median

ROWS = ["ray_cluster_up", "ray_ready_2x1", "ray_actors_2", "ray_ready_ratio"]
REPS = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def ray_actors() -> float:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Echo:  # defined here: Ray ships it by value (bench/ is not installed)
        def ping(self) -> int:
            return os.getpid()

    t0 = time.perf_counter()
    pg = placement_group([{"CPU": 1.0}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    echo: Any = ray.remote(num_cpus=0)(Echo)  # an actor class (ray's types say otherwise)
    actors = [
        echo.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(2)
    ]
    ray.get([a.ping.remote() for a in actors], timeout=60)
    took = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    return took


def run(s: Settings, rec: Recorder) -> None:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from bench import slurm_start

    with rec.guard(*slurm_start.ROWS):
        slurm_start.run(s, rec)
    from netns import unavailable

    why = unavailable()
    if why:
        for key in ROWS:
            rec.note(key, f"n/a: {why}")
        return
    from helpers import patched_environ, pythonpath_with
    from ray_cluster import RAY_ENV, start_cluster, stop_cluster

    from bench.ours import mesh_ready_seconds

    t0 = time.perf_counter()
    cluster = start_cluster()
    rec.value("ray_cluster_up", time.perf_counter() - t0)
    env = {**RAY_ENV, "RAY_ADDRESS": cluster.address, "PYTHONPATH": pythonpath_with(REPO)}
    try:
        with patched_environ(env):
            import ray

            reps = 1 if s.quick else REPS
            with rec.guard("ray_ready_2x1"):
                xs = [mesh_ready_seconds("ray", 1) for _ in range(reps)]
                rec.value("ray_ready_2x1", median(xs), samples=xs)
            with rec.guard("ray_actors_2"):
                ys = [ray_actors() for _ in range(reps)]
                rec.value("ray_actors_2", median(ys), samples=ys)
            rec.ratio("ray_ready_ratio", "ray_ready_2x1", "ray_actors_2")
            ray.shutdown()
    finally:
        stop_cluster(cluster)


if __name__ == "__main__":
    run(Settings(), Recorder())
