"""``osutil.IdleCores``: how many of this process's CPUs were idle between two reads of
``/proc/stat`` (the host template's late import waits for a spare core with it)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

import pytest

from monarch_kernel.wire.osutil import CpuQuota, IdleCores, cpu_count, cpu_quota

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat"),
]


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _spin_until(started: Any, stop: Any) -> None:
    started.put(1)
    while not stop.is_set():
        _spin(0.01)


def test_a_figure_between_none_and_every_cpu():
    idle = IdleCores(cpu_quota())
    _spin(0.05)  # some ticks pass
    time.sleep(0.1)
    spare = idle.since_last()
    assert spare is not None and 0.0 <= spare <= cpu_count()


def test_every_cpu_busy_leaves_less_than_one_idle():
    """With a spinning process per CPU this process may use, less than one is idle."""
    ctx = multiprocessing.get_context("spawn")
    started, stop = ctx.Queue(), ctx.Event()
    spinners = [ctx.Process(target=_spin_until, args=(started, stop)) for _ in range(cpu_count())]
    for p in spinners:
        p.start()
    try:
        for _ in spinners:
            started.get(timeout=60)  # every spinner spins
        idle = IdleCores(cpu_quota())
        time.sleep(1.0)  # the span measured
        spare = idle.since_last()
    finally:
        stop.set()
        for p in spinners:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert spare is not None and spare < 0.9, spare


def _write(path: Any, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_is_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "max 100000\n")  # the root: no limit
    _write(root / "pod" / "cpu.max", "200000 100000\n")  # the pod: 2 CPUs
    _write(root / "pod" / "cpu.stat", "usage_usec 5000000\nuser_usec 1\n")
    _write(root / "pod" / "box" / "cpu.max", "max 100000\n")  # this process's group
    _write(tmp_path / "self", "0::/pod/box\n")
    quota = cpu_quota(str(root), str(tmp_path / "self"))
    assert quota is not None and quota.cores == 2.0
    assert quota.used_seconds() == 5.0


def test_a_cgroup_v1_quota_reads_its_cpu_time_from_cpuacct(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cpu" / "job" / "cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu" / "job" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpuacct" / "job" / "cpuacct.usage", "2500000000\n")
    _write(tmp_path / "self", "2:cpuacct:/job\n1:cpu:/job\n0::/\n")
    quota = cpu_quota(str(root), str(tmp_path / "self"))
    assert quota is not None and quota.cores == 1.5
    assert quota.used_seconds() == 2.5


def test_no_quota_where_none_is_set_or_readable(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "self", "1:cpu:/\n0::/\n")
    assert cpu_quota(str(root), str(tmp_path / "self")) is None
    assert cpu_quota(str(root), str(tmp_path / "missing")) is None


def test_idle_cpus_are_no_more_than_the_quota_leaves(tmp_path):
    """A group of 2 CPUs: when it used all of its time, none is spare, whatever
    /proc/stat says of the machine's other CPUs; when it used none, at most 2 are."""
    stat = tmp_path / "cpu.stat"
    stat.write_text("usage_usec 0\n")
    idle = IdleCores(CpuQuota(2.0, str(stat), 1e-6))
    _spin(0.05)  # some time passes
    stat.write_text("usage_usec 0\n")
    spare = idle.since_last()
    assert spare is not None and 0.0 <= spare <= 2.0, spare
    _spin(0.05)
    stat.write_text(f"usage_usec {10**9}\n")  # far more than 2 CPUs could use meanwhile
    assert idle.since_last() == 0.0
