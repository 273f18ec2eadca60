"""Per-rank GPU telemetry on a real GPU: the host agent samples its GPUs through NVML
(``host.gpu_stats``; ``nvidia-ml-py`` must be installed) and each rank's stats, tiles and
the dashboard's GPU charts carry its GPU's utilisation, memory and power. Ranks that
allocate CUDA memory make the memory in use grow; ranks running matmuls make the
utilisation rise above 0.

Needs CUDA (the ``gpu`` marker skips it elsewhere) and pynvml. On the GPU machine:
``python -m pytest -p no:randomly tests/test_gpu_telemetry.py``."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from helpers import wait_until

from monarch_kernel.actor import Actor, endpoint, this_host

pytestmark = [pytest.mark.local, pytest.mark.gpu]

RANKS = 2
GIB = 2**30
ALLOC_GIB = 2


class Worker(Actor):
    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    @endpoint
    def alloc(self, gib: int) -> int:
        """Keep ``gib`` GiB on this rank's GPU; returns the bytes torch has allocated."""
        self.kept.append(torch.empty(gib * GIB, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    @endpoint
    def matmuls(self, seconds: float) -> int:
        """Keep the GPU busy with matmuls for ``seconds``; returns how many ran."""
        a = torch.randn(4096, 4096, device="cuda")
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            n += 8
        return n


def _nvml_pids(pynvml: Any) -> set[int]:
    """The pids NVML lists as compute processes (in a container's own pid namespace
    they may be the host's pids: then none of the ranks' is among them)."""
    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()


def test_ranks_gpu_fields_are_present_and_follow_the_work(monkeypatch):
    pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (pip install nvidia-ml-py)")
    from monarch_kernel.widgets import live_chart
    from monarch_kernel.widgets.dashboard import Dashboard

    monkeypatch.setenv("MONARCH_KERNEL_FANIN", "1")
    monkeypatch.delenv("MONARCH_KERNEL_GPU_STATS", raising=False)
    procs = this_host().spawn_procs(per_host={"gpus": RANKS}, name="gputele")
    try:
        rt = procs.runtime
        # every rank has its GPU's fields before it touches CUDA (the GPU it binds to)
        wait_until(
            lambda: all("gpu_used" in info.stats and "gpu_util" in info.stats for info in rt.ranks),
            timeout=60,
            what="every rank's GPU fields",
            detail=lambda: [info.stats for info in rt.ranks],
        )
        if "CUDA_VISIBLE_DEVICES" not in os.environ:  # CUDA's numbers are NVML's
            count = torch.cuda.device_count()
            assert [info.stats["gpu"] for info in rt.ranks] == [r % count for r in range(RANKS)]
        for info in rt.ranks:
            assert info.stats["gpu_total"] > 0 and info.stats["gpu_used"] <= info.stats["gpu_total"]
        before = {info.rank: info.stats["gpu_used"] for info in rt.ranks}
        t_before = {info.rank: info.stats["time"] for info in rt.ranks}

        workers = procs.spawn("workers", Worker)
        allocated = list(workers.alloc.call(ALLOC_GIB).get(timeout=120).values())
        assert all(a >= ALLOC_GIB * GIB for a in allocated), allocated

        def grown() -> bool:  # a stats report taken after the allocations
            return all(
                info.stats["time"] > t_before[info.rank] + 1.0
                and info.stats.get("gpu_used", 0) >= before[info.rank] + ALLOC_GIB * GIB
                for info in rt.ranks
            )

        wait_until(
            grown,
            timeout=30,
            what="the GPUs' memory in use to grow by the allocations",
            detail=lambda: [(before, info.stats) for info in rt.ranks],
        )
        # a rank whose pid NVML lists gets its own memory there (not in a container
        # whose pid namespace hides the ranks' pids from NVML)
        listed = _nvml_pids(pynvml)
        ranks_listed = [info for info in rt.ranks if info.pid in listed]

        def own_memory() -> bool:
            return all(i.stats.get("gpu_proc", 0) >= ALLOC_GIB * GIB for i in ranks_listed)

        wait_until(
            own_memory,
            timeout=30,
            what="the ranks' own GPU memory (those NVML lists)",
            detail=lambda: [i.stats for i in ranks_listed],
        )

        dash = Dashboard(rt, start=False)
        try:
            job = workers.matmuls.call(12.0)
            busy: list[float] = []

            def utilised() -> bool:
                dash.update()
                busy.extend(float(info.stats.get("gpu_util", 0)) for info in rt.ranks)
                return any(u > 0 for u in busy)

            wait_until(utilised, timeout=15, interval=0.25, what="GPU utilisation above 0")
            assert sum(job.get(timeout=60).values()) > 0

            def sampled() -> bool:
                dash.update()
                return dash.state.gpu.samples >= 3

            wait_until(sampled, timeout=30, what="three GPU samples on the dashboard")
            for r in range(RANKS):
                tile = dash.state.tile(r)
                assert "%" in tile.gpu and "G" in tile.gpu, tile
                assert tile.gpu_tip.startswith(f"GPU {rt.ranks[r].stats['gpu']}:"), tile
                assert tile.gpu in dash.tiles[r].description
            if "gpu_power" in rt.ranks[0].stats:
                assert dash.state.tile(0).gpu.endswith("W")
            util_seen = [
                u for s in dash.state.gpu.history for (u, _) in s.per_rank.values() if u is not None
            ]
            assert any(u > 0 for u in util_seen) or any(u > 0 for u in busy), util_seen
            if live_chart.AVAILABLE:
                assert {"gpu:util", "gpu:mem"} <= set(dash.live_charts)
            assert 'data-chart="gpu:util"' in dash.snapshot()[0]
        finally:
            dash.close()
    finally:
        procs.stop()
