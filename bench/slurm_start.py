"""Slurm rows ("slurm"): how long ``host_mesh(hosts=2, backend="slurm").spawn_procs`` takes
to a ready mesh on a real Slurm cluster: slurmctld here, one slurmd per emulated machine
(network namespaces), the cluster of the test suite (``tests/slurm_cluster.py``, imported,
not copied, so bench and tests share one builder).

"Ready" is as in the local ``ready_*`` rows: an actor on every rank has answered with torch
imported. Each sample is a fresh allocation (salloc, then the srun step), stopped before
the next; the row is the median of :data:`REPS` samples.

Needs root (namespaces) and Slurm (``apt-get install slurmctld slurmd slurm-client
munge``); otherwise every row says so. Everything started here is removed here:
:meth:`SlurmCluster.close` cancels the jobs, stops the daemons it started by PID and
removes the namespaces.
"""

from __future__ import annotations

import os
import sys
import time

from bench.common import Recorder, Settings, median

ROWS = ["slurm_cluster_up", "slurm_ready_2x1", "slurm_ready_2x2"]
REPS = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def unavailable() -> str | None:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from slurm_cluster import unavailable as why

    reason = why()
    return f"n/a: {reason}" if reason else None


def time_slurm_ready(advertise: str, per_host: int) -> float:
    """Seconds from the ``spawn_procs`` call to a ready 2-host mesh (then stopped)."""
    from bench.ours import mesh_ready_seconds

    return mesh_ready_seconds("slurm", per_host, advertise=advertise)


def run(s: Settings, rec: Recorder) -> None:
    """The Slurm rows: cluster start-up (once), then mesh start-up medians."""
    why = unavailable()
    if why:
        for key in ROWS:
            rec.note(key, why)
        return
    from slurm_cluster import start_cluster

    t0 = time.perf_counter()
    cluster = start_cluster(2, gpus=2)  # as the tests: 2 counted GPUs per node
    rec.value("slurm_cluster_up", time.perf_counter() - t0)
    from helpers import patched_environ, pythonpath_with

    # The launcher and the agents srun starts read these from this process's environment.
    env = {"SLURM_CONF": cluster.conf, "PYTHONPATH": pythonpath_with(REPO)}
    try:
        with patched_environ(env):
            for per_host in (1, 2):
                key = f"slurm_ready_2x{per_host}"
                with rec.guard(key):
                    reps = 1 if s.quick else REPS
                    xs = [time_slurm_ready(cluster.net.gateway, per_host) for _ in range(reps)]
                    rec.value(key, median(xs), samples=xs)
    finally:
        cluster.close()


if __name__ == "__main__":
    run(Settings(), Recorder())
