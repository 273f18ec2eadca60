"""The host agent's GPU sampler (``host.gpu_stats``) on a test double of NVML (the one
external library it calls, which cannot run without a GPU), and what the dashboard makes
of the fields it sends (``widgets.gpu_view``): each rank gets the GPU NVML lists its pid
on, else the one it binds to; unsupported calls leave their fields out; no NVML, no
fields; the wire header says when GPU stats come along."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import pytest
from helpers import wait_until

from monarch_kernel.host.gpu_stats import (
    GPM_NVLINK_TX,
    GPM_PCIE_RX,
    GPM_PCIE_TX,
    MIB,
    GpuSampler,
    Nvml,
    call_costs_us,
    sample_cost_us,
    visible_indices,
)
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.unit

GB = 10**9


class FakeNVMLError(Exception):
    """What pynvml raises (``NVMLError_NotSupported`` and kin)."""


class FakeNvml:
    """NVML with ``gpus`` devices: index -> (util %, used, total, power mW); calls named
    in ``unsupported`` raise; ``procs``: index -> [(pid, used or None)]."""

    error = FakeNVMLError

    def __init__(
        self,
        gpus: dict[int, tuple[float, int, int, int]],
        procs: dict[int, list[tuple[int, int | None]]] | None = None,
        unsupported: Sequence[str] = (),
        gpm: Sequence[int] = (),
        fail_init: bool = False,
    ) -> None:
        self.gpus = gpus
        self.procs = procs or {}
        self.unsupported = set(unsupported)
        self.gpm = set(gpm)
        self.fail_init = fail_init
        self.calls: dict[str, int] = {}
        self.live_gpm: set[int] = set()  # GPM samples not freed
        self.next_gpm = 0
        self.shut = False

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.unsupported:
            raise FakeNVMLError(f"{name}: Not Supported")

    def init(self) -> None:
        self._call("init")
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def device_count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> object:
        return ("handle", index)

    def uuid(self, handle: object) -> str:
        self._call("uuid")
        return f"GPU-{_index(handle)}aaa"

    def utilization(self, handle: object) -> float:
        self._call("utilization")
        return self.gpus[_index(handle)][0]

    def memory(self, handle: object) -> tuple[int, int]:
        self._call("memory")
        _, used, total, _ = self.gpus[_index(handle)]
        return used, total

    def power_mw(self, handle: object) -> int:
        self._call("power")
        return self.gpus[_index(handle)][3]

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        self._call("processes")
        return list(self.procs.get(_index(handle), []))

    def gpm_supported(self, handle: object) -> bool:
        self._call("gpm_supported")
        return _index(handle) in self.gpm

    def gpm_sample(self, handle: object) -> object:
        self._call("gpm_sample")
        self.next_gpm += 1
        self.live_gpm.add(self.next_gpm)
        return self.next_gpm

    def gpm_metrics(self, first: object, second: object, ids: Sequence[int]) -> list[float | None]:
        self._call("gpm_metrics")
        rates = {GPM_PCIE_TX: 100.0, GPM_PCIE_RX: 50.0, GPM_NVLINK_TX: 2000.0}
        return [rates.get(i) for i in ids]  # NVLink rx: that metric failed

    def gpm_free(self, sample: object) -> None:
        assert isinstance(sample, int)
        self.live_gpm.discard(sample)

    def shutdown(self) -> None:
        self.shut = True


def _index(handle: object) -> int:
    assert isinstance(handle, tuple)
    return int(handle[1])


TWO = {0: (10.0, 2 * GB, 80 * GB, 100_000), 1: (90.0, 30 * GB, 80 * GB, 650_500)}


def _sampler(nvml: FakeNvml, visible: str = "0,1") -> GpuSampler:
    def make() -> Nvml:
        return nvml

    return GpuSampler(make, period=0.01, cuda_visible=visible)


def test_each_rank_gets_the_gpu_nvml_lists_it_on_else_the_one_it_binds_to():
    nvml = FakeNvml(TWO, procs={1: [(100, 3 * GB), (999, None)], 0: [(101, None)]})
    sampler = _sampler(nvml)
    sample = sampler.sample()
    assert sample is not None and sampler.samples == 1
    assert sample.procs == {100: (1, 3 * GB), 999: (1, None), 101: (0, None)}
    # rank 0 (pid 100) is on GPU 1 by NVML's list though it would bind GPU 0; rank 1
    # (pid 200) is on no list: the GPU it binds to, local rank 3 -> 3 % 2 = GPU 1; rank 2
    # has no local rank known: nothing; rank 3 (pid 101) is listed, memory unknown
    got = sampler.attribute(sample, {0: 100, 1: 200, 2: 300, 3: 101}, {0: 0, 1: 3, 3: 1})
    assert sorted(got) == [0, 1, 3]
    assert (got[0].device.index, got[0].proc_mem) == (1, 3 * GB)
    assert (got[1].device.index, got[1].proc_mem) == (1, None)
    assert (got[3].device.index, got[3].proc_mem) == (0, None)
    fields = got[0].fields()
    assert fields == {
        "gpu": 1,
        "gpu_util": 90.0,
        "gpu_used": 30 * GB,
        "gpu_total": 80 * GB,
        "gpu_power": 650.5,
        "gpu_proc": 3 * GB,
    }
    assert "gpu_proc" not in got[1].fields()


def test_a_pid_on_no_gpu_with_no_visible_gpu_gets_nothing():
    nvml = FakeNvml(TWO, procs={0: [(100, GB)]})
    sampler = _sampler(nvml, visible="")  # CUDA_VISIBLE_DEVICES="": CUDA sees no GPU
    sample = sampler.sample()
    assert sample is not None
    got = sampler.attribute(sample, {0: 100, 1: 200}, {0: 0, 1: 1})
    assert sorted(got) == [0]  # the listed one still: NVML saw it use the GPU


def test_unsupported_calls_leave_their_fields_out():
    nvml = FakeNvml(TWO, unsupported=("power", "utilization", "processes", "uuid"))
    sampler = _sampler(nvml)
    sample = sampler.sample()
    assert sample is not None and sample.procs == {}
    dev = sample.devices[0]
    assert (dev.util, dev.power_w, dev.mem_used, dev.mem_total) == (None, None, 2 * GB, 80 * GB)
    assert sampler.visible == [0, 1]  # CUDA numbering by index, though no UUIDs
    fields = sampler.attribute(sample, {5: 500}, {5: 0})[5].fields()
    assert fields == {"gpu": 0, "gpu_used": 2 * GB, "gpu_total": 80 * GB}
    # a failing call is asked again next time (it may work again: a GPU reset)
    sampler.sample()
    assert nvml.calls["power"] == 4  # two GPUs, two samples


def test_gpm_gives_pcie_and_nvlink_from_the_second_sample_on():
    nvml = FakeNvml(TWO, gpm=[0])
    sampler = _sampler(nvml)
    first = sampler.sample()
    assert first is not None and first.devices[0].pcie_tx is None
    second = sampler.sample()
    assert second is not None
    dev, other = second.devices
    assert (dev.pcie_tx, dev.pcie_rx, dev.nvlink_tx, dev.nvlink_rx) == (
        100 * MIB,
        50 * MIB,
        2000 * MIB,
        None,  # that metric failed
    )
    assert other.pcie_tx is None and nvml.calls["gpm_sample"] == 2  # only GPU 0 has GPM
    assert len(nvml.live_gpm) == 1  # the previous sample is freed, the latest kept
    fields = sampler.attribute(second, {0: 1}, {0: 0})[0].fields()
    assert fields["pcie_tx"] == 100 * MIB and fields["nvlink_tx"] == 2000 * MIB
    assert "nvlink_rx" not in fields
    sampler.close()
    assert nvml.live_gpm == set() and nvml.shut


def test_gpm_that_stops_working_is_dropped():
    nvml = FakeNvml(TWO, gpm=[0])
    sampler = _sampler(nvml)
    sampler.sample()
    nvml.unsupported.add("gpm_sample")
    sampler.sample()
    sampler.sample()
    assert nvml.calls["gpm_sample"] == 2  # not asked again after it failed
    assert nvml.live_gpm == set()


def test_no_driver_or_no_pynvml_means_no_gpu_fields_and_no_thread():
    nvml = FakeNvml(TWO, fail_init=True)
    sampler = _sampler(nvml)
    assert sampler.for_ranks({0: 1}, {0: 0}) == {}
    wait_until(lambda: sampler.reason is not None, timeout=5, what="the reason")
    assert "Driver Not Loaded" in (sampler.reason or "")
    assert sampler.sample() is None and nvml.calls["init"] == 1  # tried once only

    def no_pynvml() -> Nvml:
        raise ImportError("No module named 'pynvml'")

    bare = GpuSampler(no_pynvml)
    assert not bare.open() and "nvidia-ml-py" in (bare.reason or "")
    assert bare.for_ranks({0: 1}, {0: 0}) == {}
    empty = _sampler(FakeNvml({}))
    assert not empty.open() and empty.reason == "NVML sees no GPU"


def test_the_thread_samples_until_closed():
    nvml = FakeNvml(TWO, procs={0: [(100, GB)]})
    sampler = _sampler(nvml)
    sampler.for_ranks({0: 100}, {0: 0})  # the first call starts the thread
    wait_until(lambda: sampler.samples >= 3, timeout=5, what="three samples")
    assert sampler.for_ranks({0: 100}, {0: 0})[0]["gpu_proc"] == GB
    sampler.close()
    n = sampler.samples
    time.sleep(0.05)
    assert sampler.samples == n and nvml.shut


def test_cuda_visible_devices_maps_cuda_numbers_to_nvml_indices():
    uuids = ["GPU-0aaa", "GPU-1bbb", "GPU-2ccc"]
    assert visible_indices(None, uuids) is None
    assert visible_indices("2,0", uuids) == [2, 0]
    assert visible_indices("GPU-1b,0", uuids) == [1, 0]
    assert visible_indices("", uuids) == []
    assert visible_indices("1,7,0", uuids) == [1]  # an unknown one ends the list
    assert visible_indices("MIG-abc", uuids) == []
    nvml = FakeNvml(TWO)
    sampler = _sampler(nvml, visible="1")
    sample = sampler.sample()
    assert sample is not None
    assert sampler.attribute(sample, {0: 1, 1: 2}, {0: 0, 1: 1})[1].device.index == 1


def test_costs_are_measured_per_sample_and_per_call():
    nvml = FakeNvml(TWO, gpm=[0])
    sampler = _sampler(nvml)
    assert sample_cost_us(sampler, 20) > 0
    costs = call_costs_us(nvml, 10)
    assert set(costs) == {"utilization", "memory", "power", "processes", "gpm_sample"}
    nvml.unsupported.add("power")
    assert "power" not in call_costs_us(nvml, 10)
    bare = _sampler(FakeNvml(TWO, fail_init=True))
    assert sample_cost_us(bare, 5) != sample_cost_us(bare, 5)  # NaN: nothing to measure


def test_host_stats_header_says_when_gpu_stats_come_along():
    plain = H.HostStats(host=2)
    assert plain.encode() == {"k": K.HOST_STATS, "h": 2}
    with_gpu = H.HostStats(host=2, gpu=True)
    assert with_gpu.encode() == {"k": K.HOST_STATS, "h": 2, "g": 1}
    assert H.HostStats.decode(with_gpu.encode()) == with_gpu
    assert H.HostStats.decode(plain.encode()) == plain
    with pytest.raises(H.HeaderError):
        H.HostStats.decode({"k": K.HOST_STATS, "h": 2, "g": "yes"})


# -- the dashboard's side ---------------------------------------------------------------


def test_tiles_show_util_memory_and_power_only_with_gpu_fields():
    from monarch_kernel.widgets import gpu_view, render
    from monarch_kernel.widgets.views import TileView
    from monarch_kernel.wire.reports import RankStats

    stats: RankStats = {
        "rss": 10,
        "gpu": 3,
        "gpu_util": 87.0,
        "gpu_used": 12_300_000_000,
        "gpu_total": 79_600_000_000,
        "gpu_power": 312.4,
        "gpu_proc": 10**9,
        "pcie_tx": 2e9,
        "nvlink_rx": 3e6,
    }
    assert gpu_view.tile_line(stats) == "87% 12/80G 312W"
    tip = gpu_view.tooltip_line(stats)
    assert tip.startswith("GPU 3: 87% busy, memory 11.5 GB / 74.1 GB (this rank 953.7 MB)")
    assert (
        "312 W" in tip and "PCIe tx 2.0 GB/s / rx —" in tip and "NVLink tx — / rx 3.0 MB/s" in tip
    )
    assert gpu_view.tile_line({"rss": 10}) == gpu_view.tooltip_line({"rss": 10}) == ""
    assert gpu_view.tile_line({"gpu": 0, "gpu_used": 5}) == ""  # no total: no fraction
    view = TileView(
        rank=3, state="busy", what="cell 4", coords="gpus=3", host="box", pid="123",
        device="cuda:3", mem="GPU 1.2 GB", step="", seen="<1s", rate_in=None,
        rate_out=None, restarts=0, gpu=gpu_view.tile_line(stats), gpu_tip=tip,
    )  # fmt: skip
    lines = render.tile_text(view, compact=False).split("\n")
    assert lines[3] == "cuda:3 87% 12/80G 312W"
    assert all(len(line) <= render.TILE_CHARS for line in lines), lines
    assert tip in render.tile_tooltip(view)
    plain = dataclasses.replace(view, gpu="", gpu_tip="")
    assert render.tile_text(plain, compact=False).split("\n")[3] == "cuda:3 · GPU 1.2 GB"
    assert "GPU 3" not in render.tile_tooltip(plain)


def test_gpu_history_and_charts():
    from monarch_kernel.controller.state.records import RankInfo, RankState
    from monarch_kernel.widgets import gpu_view
    from monarch_kernel.wire.reports import RankStats

    ranks = [
        RankInfo(rank=r, host=0, local_rank=r, coords=(r,), state=RankState.IDLE) for r in range(3)
    ]
    stats: dict[int, RankStats] = {
        0: {"gpu": 0, "gpu_util": 50.0, "gpu_used": 2 * GB},
        1: {"gpu": 0, "gpu_used": 3 * GB},  # no utilisation from this GPU
        2: {"rss": 5},  # a CPU-only rank
    }
    hist = gpu_view.GpuHistory()
    hist.sample(ranks, lambda r: {"rss": 1})
    assert hist.samples == 0 and gpu_view.svg_charts(hist) == []  # no GPU: no chart
    hist.sample(ranks, stats.__getitem__)
    stats[0] = {"gpu": 0, "gpu_util": 70.0, "gpu_used": 4 * GB}
    hist.sample(ranks, stats.__getitem__)
    assert hist.samples == 2 and sorted(hist.history[-1].per_rank) == [0, 1]
    rows = list(hist.history)
    t0 = rows[0].time
    util = gpu_view.lines(rows, t0, 0, aggregate=False)
    assert [(label, ys) for label, _, ys in util] == [("r0", [50.0, 70.0])]
    gaps = gpu_view.lines(rows, t0, 0, aggregate=False, gaps=True)
    assert [(label, ys) for label, _, ys in gaps] == [("r0", [50.0, 70.0]), ("r1", [None, None])]
    mem = gpu_view.lines(rows, t0, 1, aggregate=True)
    assert [(label, ys) for label, _, ys in mem] == [("mean", [2.5, 3.5]), ("max", [3.0, 4.0])]
    svg = "".join(gpu_view.svg_charts(hist))
    assert 'data-chart="gpu:util"' in svg and 'data-chart="gpu:mem"' in svg
    hist.rekey({1: 0}, {0})  # a shrink: rank 0 gone, rank 1 is rank 0 now
    assert sorted(hist.history[-1].per_rank) == [0]
    assert hist.history[-1].per_rank[0] == (None, 3.0)
