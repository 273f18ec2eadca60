"""The ranks' GPU fields, end to end on a machine without a GPU: real host agents and
ranks, with NVML (the one external library, which needs a GPU) replaced by a stand-in
``pynvml`` module on the agents' ``PYTHONPATH``. Its GPU reaches each rank's stats through
the agent's ``host_stats``, the tiles and the GPU charts; with a driver that does not
load, no GPU field goes anywhere and the dashboard shows nothing of GPUs."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from helpers import wait_until

from monarch_kernel.actor import this_host
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.local

GPU_KEYS = ("gpu", "gpu_util", "gpu_used", "gpu_total", "gpu_power", "gpu_proc")

FAKE_PYNVML = textwrap.dedent(
    '''
    """A stand-in for nvidia-ml-py: one GPU, busy 0-99% by the clock, 8 of 80 GB used,
    no power reading; the compute processes are the lines ``pid bytes`` of the file
    $FAKE_NVML_PROCS; ``FAKE_NVML_FAIL=1``: the driver does not load."""
    import os
    import time
    from types import SimpleNamespace

    NVML_SUCCESS = 0


    class NVMLError(Exception):
        pass


    def nvmlInit():
        if os.environ.get("FAKE_NVML_FAIL") == "1":
            raise NVMLError("Driver Not Loaded")


    def nvmlShutdown():
        pass


    def nvmlDeviceGetCount():
        return 1


    def nvmlDeviceGetHandleByIndex(index):
        return ("fake", index)


    def nvmlDeviceGetUUID(handle):
        return "GPU-fake-0"


    def nvmlDeviceGetUtilizationRates(handle):
        return SimpleNamespace(gpu=int(time.time() * 10) % 100, memory=0)


    def nvmlDeviceGetMemoryInfo(handle):
        return SimpleNamespace(used=8 * 10**9, total=80 * 10**9, free=72 * 10**9)


    def nvmlDeviceGetPowerUsage(handle):
        raise NVMLError("Not Supported")


    def nvmlDeviceGetComputeRunningProcesses(handle):
        path = os.environ.get("FAKE_NVML_PROCS", "")
        if not path or not os.path.exists(path):
            return []
        out = []
        for line in open(path).read().split("\\n"):
            if line.strip():
                pid, used = line.split()
                out.append(SimpleNamespace(pid=int(pid), usedGpuMemory=int(used)))
        return out
    '''
)


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in ``pynvml`` first on the path of the host agents started from now on;
    returns the file its process list is read from."""
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    procs = tmp_path / "procs.txt"
    path = [str(tmp_path), str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv("FAKE_NVML_PROCS", str(procs))
    monkeypatch.setenv("MONARCH_KERNEL_FANIN", "1")
    monkeypatch.delenv("MONARCH_KERNEL_GPU_STATS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return procs


def test_gpu_fields_reach_the_stats_tiles_and_charts(fake_nvml: Path) -> None:
    from monarch_kernel.widgets import live_chart
    from monarch_kernel.widgets.dashboard import Dashboard

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="gpufake")
    try:
        rt = procs.runtime
        wait_until(
            lambda: all("gpu_util" in info.stats for info in rt.ranks),
            timeout=60,
            what="every rank's GPU fields",
            detail=lambda: [info.stats for info in rt.ranks],
        )
        assert rt.inbound.kinds.get(K.HOST_STATS, 0) >= 1
        for info in rt.ranks:
            stats = info.stats
            assert stats["gpu"] == 0 and stats["gpu_total"] == 80 * 10**9, stats
            assert stats["gpu_used"] == 8 * 10**9 and 0 <= stats["gpu_util"] < 100
            assert "gpu_power" not in stats and "gpu_proc" not in stats  # not supported
            assert stats["rss"] > 10 * 2**20  # the rank's own stats are all there still
        # NVML lists rank 1's process: it gets its own memory on the GPU too
        pid = rt.ranks[1].pid
        fake_nvml.write_text(f"{pid} {5 * 10**9}\n")
        wait_until(
            lambda: rt.ranks[1].stats.get("gpu_proc") == 5 * 10**9,
            timeout=30,
            what="rank 1's own GPU memory",
        )
        assert "gpu_proc" not in rt.ranks[0].stats
        dash = Dashboard(rt, start=False)
        try:

            def sampled() -> bool:
                dash.update()
                return dash.state.gpu.samples >= 2

            wait_until(sampled, timeout=30, what="two GPU samples on the dashboard")
            dash.update()
            tile = dash.state.tile(1)
            assert tile.gpu.endswith("8.0/80G") and "%" in tile.gpu, tile
            assert "GPU 0:" in tile.gpu_tip and "this rank 4.7 GB" in tile.gpu_tip
            assert tile.gpu in dash.tiles[1].description
            assert "GPU 0:" in dash.tiles[1].tooltip
            if live_chart.AVAILABLE:
                assert {"gpu:util", "gpu:mem"} <= set(dash.live_charts)
            assert 'data-chart="gpu:util"' in dash.snapshot()[0]
        finally:
            dash.close()
    finally:
        procs.stop()


def test_without_a_gpu_nothing_gpu_goes_anywhere(
    fake_nvml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from monarch_kernel.widgets.dashboard import Dashboard

    monkeypatch.setenv("FAKE_NVML_FAIL", "1")  # as on a host whose driver is not loaded
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="nogpu")
    try:
        rt = procs.runtime
        wait_until(
            lambda: all(info.stats.get("time") for info in rt.ranks),
            timeout=60,
            what="every rank's stats",
        )
        first = [info.stats["time"] for info in rt.ranks]
        wait_until(
            lambda: all(info.stats["time"] > t for info, t in zip(rt.ranks, first, strict=True)),
            timeout=60,
            what="newer stats",
        )
        for info in rt.ranks:
            assert not set(GPU_KEYS) & set(info.stats), info.stats
        dash = Dashboard(rt, start=False)
        try:
            for _ in range(3):
                dash.update()
            assert dash.state.gpu.samples == 0
            assert all(dash.state.tile(r).gpu == "" for r in range(rt.world))
            assert not any(c.startswith("gpu:") for c in dash.live_charts)
            html = dash.snapshot()[0]
            assert 'data-chart="gpu:' not in html and "GPU 0:" not in html
        finally:
            dash.close()
    finally:
        procs.stop()
