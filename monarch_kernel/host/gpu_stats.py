"""Per-rank GPU telemetry, sampled by the host agent through NVML (one sampler per host).

The agent's :class:`GpuSampler` reads each GPU once a :data:`PERIOD` on a thread of its
own (NVML calls release the GIL and never hold up the agent's loop): utilisation, memory
used and total, power, PCIe and NVLink throughput where the device gives them (GPM,
Hopper and later), and the compute processes on it. The fan-in (:mod:`~.fanin`) asks it
for its ranks' fields once a second and sends them with the ranks' own stats
(``host_stats``); each rank gets the fields of the GPU it has a CUDA context on (NVML's
process list, which also gives the rank's own memory there), else of the GPU it is bound
to (``local_rank % device_count``, :mod:`monarch_kernel.rank.device`).

NVML is ``nvidia-ml-py`` (``import pynvml``, the ``gpu`` extra), imported lazily: without
it, without a driver or without a GPU there are no GPU fields at all (one debug line says
why). Never ``torch.cuda.*`` here: it would initialise CUDA in the agent. The calls go
through the :class:`Nvml` protocol: :class:`PyNvml` on ``pynvml``, or a test double.

Cost: a sample is a handful of NVML calls per GPU; :func:`sample_cost_us` measures it
(``bench/gpu_nvml.py``). ``nvmlDeviceGetPcieThroughput`` is left out on purpose: it
blocks 20 ms per call (NVML samples the link over that window).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from monarch_kernel.wire.reports import GpuStats

log = logging.getLogger("monarch_kernel.host")

#: Seconds between two samples (the ranks' stats go once a second too).
PERIOD = 1.0
#: ``0`` turns the sampler off (no NVML in the agent at all).
GPU_STATS_ENV = "MONARCH_KERNEL_GPU_STATS"
MIB = 1 << 20

#: GPM metric ids (``pynvml.NVML_GPM_METRIC_*``): PCIe and NVLink MiB/s.
GPM_PCIE_TX, GPM_PCIE_RX = 20, 21
GPM_NVLINK_RX, GPM_NVLINK_TX = 60, 61
GPM_METRICS = (GPM_PCIE_TX, GPM_PCIE_RX, GPM_NVLINK_TX, GPM_NVLINK_RX)


class Nvml(Protocol):
    """The NVML calls the sampler makes. Each may raise :attr:`error` (NVML's error:
    not supported, no permission, GPU lost ...), which the sampler takes as "unknown"."""

    @property
    def error(self) -> type[Exception]:
        """The exception class the calls raise."""
        ...

    def init(self) -> None: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> object: ...
    def uuid(self, handle: object) -> str: ...
    def utilization(self, handle: object) -> float:
        """Percent of the last sample period a kernel ran on the GPU."""
        ...

    def memory(self, handle: object) -> tuple[int, int]:
        """``(used, total)`` bytes."""
        ...

    def power_mw(self, handle: object) -> int: ...
    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        """The compute processes on the GPU: ``(pid, used bytes or None)``."""
        ...

    def gpm_supported(self, handle: object) -> bool: ...
    def gpm_sample(self, handle: object) -> object:
        """A GPM sample of the GPU now (freed with :meth:`gpm_free`)."""
        ...

    def gpm_metrics(self, first: object, second: object, ids: Sequence[int]) -> list[float | None]:
        """The ``ids`` metrics between two samples (None: that metric failed)."""
        ...

    def gpm_free(self, sample: object) -> None: ...
    def shutdown(self) -> None: ...


class PyNvml:
    """:class:`Nvml` on ``pynvml`` (``nvidia-ml-py``)."""

    def __init__(self, module: Any = None) -> None:
        """``module``: ``pynvml`` (imported here when not given: ImportError if absent)."""
        self.nv = module if module is not None else importlib.import_module("pynvml")
        self.error: type[Exception] = self.nv.NVMLError

    def init(self) -> None:
        self.nv.nvmlInit()

    def device_count(self) -> int:
        return int(self.nv.nvmlDeviceGetCount())

    def handle(self, index: int) -> object:
        handle: object = self.nv.nvmlDeviceGetHandleByIndex(index)
        return handle

    def uuid(self, handle: object) -> str:
        value = self.nv.nvmlDeviceGetUUID(handle)
        return value.decode() if isinstance(value, bytes) else str(value)

    def utilization(self, handle: object) -> float:
        return float(self.nv.nvmlDeviceGetUtilizationRates(handle).gpu)

    def memory(self, handle: object) -> tuple[int, int]:
        info = self.nv.nvmlDeviceGetMemoryInfo(handle)
        return int(info.used), int(info.total)

    def power_mw(self, handle: object) -> int:
        return int(self.nv.nvmlDeviceGetPowerUsage(handle))

    def processes(self, handle: object) -> list[tuple[int, int | None]]:
        out: list[tuple[int, int | None]] = []
        for p in self.nv.nvmlDeviceGetComputeRunningProcesses(handle):
            used = p.usedGpuMemory  # None: NVML_VALUE_NOT_AVAILABLE (no permission, MIG)
            out.append((int(p.pid), int(used) if used is not None else None))
        return out

    def gpm_supported(self, handle: object) -> bool:
        if not hasattr(self.nv, "nvmlGpmQueryDeviceSupport"):
            return False
        return bool(self.nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)

    def gpm_sample(self, handle: object) -> object:
        sample = self.nv.nvmlGpmSampleAlloc()
        try:
            self.nv.nvmlGpmSampleGet(handle, sample)
        except Exception:
            self.nv.nvmlGpmSampleFree(sample)
            raise
        result: object = sample
        return result

    def gpm_metrics(self, first: object, second: object, ids: Sequence[int]) -> list[float | None]:
        nv = self.nv
        get = nv.c_nvmlGpmMetricsGet_t()
        get.version = nv.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(ids)
        get.sample1, get.sample2 = first, second
        for i, metric in enumerate(ids):
            get.metrics[i].metricId = metric
        nv.nvmlGpmMetricsGet(get)
        return [
            float(get.metrics[i].value) if get.metrics[i].nvmlReturn == nv.NVML_SUCCESS else None
            for i in range(len(ids))
        ]

    def gpm_free(self, sample: object) -> None:
        self.nv.nvmlGpmSampleFree(sample)

    def shutdown(self) -> None:
        self.nv.nvmlShutdown()


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One GPU at one moment (None: the device does not give it)."""

    index: int  #: NVML's index of the GPU
    util: float | None  #: percent of the time a kernel ran
    mem_used: int | None  #: bytes
    mem_total: int | None
    power_w: float | None
    pcie_tx: float | None = None  #: bytes/s (GPM)
    pcie_rx: float | None = None
    nvlink_tx: float | None = None
    nvlink_rx: float | None = None


@dataclass(frozen=True, slots=True)
class HostSample:
    """All of a host's GPUs at one moment, and which process is on which GPU."""

    time: float  #: ``time.time()``
    devices: tuple[DeviceSample, ...]
    #: pid -> ``(GPU index, its memory there in bytes or None)`` (NVML's process lists)
    procs: Mapping[int, tuple[int, int | None]]


@dataclass(frozen=True, slots=True)
class RankGpu:
    """What a rank's tile shows of its GPU: the device's numbers, and its own memory."""

    device: DeviceSample
    proc_mem: int | None  #: the rank's own memory on the GPU (None: not in NVML's list)

    def fields(self) -> GpuStats:
        """The wire form: the keys of :class:`~monarch_kernel.wire.reports.GpuStats`
        that are known (absent keys: the device does not give them)."""
        d = self.device
        out: GpuStats = {"gpu": d.index}
        if d.util is not None:
            out["gpu_util"] = d.util
        if d.mem_used is not None:
            out["gpu_used"] = d.mem_used
        if d.mem_total is not None:
            out["gpu_total"] = d.mem_total
        if d.power_w is not None:
            out["gpu_power"] = d.power_w
        if self.proc_mem is not None:
            out["gpu_proc"] = self.proc_mem
        if d.pcie_tx is not None:
            out["pcie_tx"] = d.pcie_tx
        if d.pcie_rx is not None:
            out["pcie_rx"] = d.pcie_rx
        if d.nvlink_tx is not None:
            out["nvlink_tx"] = d.nvlink_tx
        if d.nvlink_rx is not None:
            out["nvlink_rx"] = d.nvlink_rx
        return out


def load_nvml() -> Nvml:
    """The real NVML (ImportError without ``nvidia-ml-py``)."""
    return PyNvml()


def visible_indices(env: str | None, uuids: Sequence[str]) -> list[int] | None:
    """NVML indices of the GPUs CUDA numbers 0, 1, ... under ``CUDA_VISIBLE_DEVICES``
    ``env`` (None: unset, every GPU in order); ``uuids``: each NVML index's UUID. An entry
    it cannot place (a MIG device, a bad name) ends the list there, as CUDA does."""
    if env is None:
        return None
    out: list[int] = []
    for item in env.split(","):
        item = item.strip()
        if item.isdigit():
            index = int(item)
            if index >= len(uuids):
                break
        elif item.startswith("GPU-"):
            found = [i for i, u in enumerate(uuids) if u.startswith(item)]
            if len(found) != 1:
                break
            index = found[0]
        else:
            break
        if index in out:
            break
        out.append(index)
    return out


class GpuSampler:
    """The host's GPUs, sampled once a :data:`PERIOD` on a thread (see the module's
    docstring). :meth:`for_ranks` is all the agent calls; it starts the thread."""

    def __init__(
        self,
        nvml: Callable[[], Nvml] = load_nvml,
        period: float = PERIOD,
        cuda_visible: str | None = None,
    ) -> None:
        """``nvml``: makes the NVML seam (called on the sampler's thread);
        ``cuda_visible``: the ranks' ``CUDA_VISIBLE_DEVICES`` (default: ours)."""
        self._make = nvml
        self.period = period
        self._visible_env = (
            os.environ.get("CUDA_VISIBLE_DEVICES") if cuda_visible is None else cuda_visible
        )
        self.nvml: Nvml | None = None
        self.handles: list[object] = []
        #: CUDA device number -> NVML index (the GPU a rank binds to).
        self.visible: list[int] = []
        #: Why there are no GPU stats (None: there are, or it has not started yet).
        self.reason: str | None = None
        self.latest: HostSample | None = None
        self.samples = 0
        self._gpm: dict[int, object] = {}  # NVML index -> its previous GPM sample
        self._gpm_at: dict[int, float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- set up ----------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML and find the GPUs; False (and :attr:`reason`) without any."""
        if self.nvml is not None:
            return True
        if self.reason is not None:
            return False
        try:
            nvml = self._make()
        except ImportError as exc:
            return self._off(f"no pynvml (pip install nvidia-ml-py): {exc}")
        try:
            nvml.init()
            count = nvml.device_count()
            handles = [nvml.handle(i) for i in range(count)]
        except nvml.error as exc:  # no driver, no permission
            return self._off(f"NVML unavailable: {exc}")
        if not handles:
            self._shutdown(nvml)
            return self._off("NVML sees no GPU")
        uuids: list[str] = []
        for h in handles:
            try:
                uuids.append(nvml.uuid(h))
            except nvml.error:
                uuids.append("")
        shown = visible_indices(self._visible_env, uuids)
        self.visible = list(range(len(handles))) if shown is None else shown
        for i, h in enumerate(handles):
            try:
                if nvml.gpm_supported(h):
                    self._gpm[i] = None
            except nvml.error:
                pass
        self.nvml, self.handles = nvml, handles
        return True

    def _off(self, why: str) -> bool:
        self.reason = why
        log.debug("no GPU stats on this host: %s", why)
        return False

    @staticmethod
    def _shutdown(nvml: Nvml) -> None:
        try:
            nvml.shutdown()
        except nvml.error:
            pass

    # -- sampling --------------------------------------------------------------------
    def sample(self) -> HostSample | None:
        """Read every GPU now (:attr:`latest`); None without NVML."""
        if not self.open():
            return None
        nvml = self.nvml
        assert nvml is not None
        devices = []
        procs: dict[int, tuple[int, int | None]] = {}
        for i, h in enumerate(self.handles):
            devices.append(self._device(nvml, i, h))
            try:
                for pid, used in nvml.processes(h):
                    procs.setdefault(pid, (i, used))
            except nvml.error:
                pass
        sample = HostSample(time.time(), tuple(devices), procs)
        self.latest = sample
        self.samples += 1
        return sample

    def _device(self, nvml: Nvml, i: int, h: object) -> DeviceSample:
        err = nvml.error
        util = mem_used = mem_total = power = None
        try:
            util = nvml.utilization(h)
        except err:
            pass
        try:
            mem_used, mem_total = nvml.memory(h)
        except err:
            pass
        try:
            power = nvml.power_mw(h) / 1000.0
        except err:
            pass
        rates = self._gpm_rates(nvml, i, h) if i in self._gpm else None
        if rates is None:
            return DeviceSample(i, util, mem_used, mem_total, power)
        pcie_tx, pcie_rx, nv_tx, nv_rx = (None if r is None else r * MIB for r in rates)
        return DeviceSample(i, util, mem_used, mem_total, power, pcie_tx, pcie_rx, nv_tx, nv_rx)

    def _gpm_rates(self, nvml: Nvml, i: int, h: object) -> list[float | None] | None:
        """PCIe and NVLink MiB/s since the previous sample (GPM); None on the first."""
        try:
            now = nvml.gpm_sample(h)
        except nvml.error as exc:  # GPM stops working (MIG mode ...): no more tries
            log.debug("GPU %d: no GPM: %s", i, exc)
            self._drop_gpm(nvml, i)
            return None
        before = self._gpm.get(i)
        self._gpm[i] = now
        if before is None:
            return None
        try:
            return nvml.gpm_metrics(before, now, GPM_METRICS)
        except nvml.error:
            return None
        finally:
            try:
                nvml.gpm_free(before)
            except nvml.error:
                pass

    def _drop_gpm(self, nvml: Nvml, i: int) -> None:
        old = self._gpm.pop(i, None)
        if old is not None:
            try:
                nvml.gpm_free(old)
            except nvml.error:
                pass

    # -- per rank --------------------------------------------------------------------
    def for_ranks(
        self, pids: Mapping[int, int], local_ranks: Mapping[int, int]
    ) -> dict[int, GpuStats]:
        """rank -> the wire fields of its GPU from the latest sample, for the ranks of
        ``pids`` (rank -> pid); ``local_ranks`` (rank -> local rank) places a rank that
        is on no GPU's process list on the GPU it binds to. Starts the sampling thread;
        empty while there is no sample (yet, or ever: no GPU)."""
        if self._thread is None and self.reason is None:
            self.start()
        latest = self.latest
        if latest is None:
            return {}
        return {
            rank: gpu.fields() for rank, gpu in self.attribute(latest, pids, local_ranks).items()
        }

    def attribute(
        self, sample: HostSample, pids: Mapping[int, int], local_ranks: Mapping[int, int]
    ) -> dict[int, RankGpu]:
        """rank -> its GPU in ``sample``: the one NVML lists its pid on (with its memory
        there), else GPU ``local_rank % count`` of the visible ones (memory unknown), else
        none (no local rank known, or no GPU visible to CUDA)."""
        out: dict[int, RankGpu] = {}
        devices = {d.index: d for d in sample.devices}
        for rank, pid in pids.items():
            found = sample.procs.get(pid)
            if found is not None and found[0] in devices:
                out[rank] = RankGpu(devices[found[0]], found[1])
                continue
            local = local_ranks.get(rank)
            if local is None or not self.visible:
                continue
            index = self.visible[local % len(self.visible)]
            if index in devices:
                out[rank] = RankGpu(devices[index], None)
        return out

    # -- the thread ------------------------------------------------------------------
    def start(self) -> None:
        """Sample every :attr:`period` seconds on a daemon thread, until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mk-gpu-stats", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.sample() is None:
                    return  # no GPU here: the thread ends, the fields stay absent
            except Exception as exc:  # never take the agent down for telemetry
                self._off(f"sampling failed: {exc!r}")
                return
            self._stop.wait(self.period)

    def close(self) -> None:
        """Stop the thread and let NVML go."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)  # an NVML call stuck in the driver: go anyway
        nvml = self.nvml
        if nvml is not None:
            for i in list(self._gpm):
                self._drop_gpm(nvml, i)
            self._shutdown(nvml)
            self.nvml = None


def enabled() -> bool:
    """Whether the agent samples its GPUs (``MONARCH_KERNEL_GPU_STATS=0``: it does not)."""
    return os.environ.get(GPU_STATS_ENV, "1") != "0"


def sample_cost_us(sampler: GpuSampler, n: int = 1000) -> float:
    """Mean µs of one full host sample, over ``n`` samples (NaN without NVML)."""
    if not sampler.open():
        return float("nan")
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.sample()
    return (time.perf_counter() - t0) / n * 1e6


def call_costs_us(nvml: Nvml, n: int = 1000) -> dict[str, float]:
    """Mean µs of each kind of NVML call the sampler makes, on GPU 0, over ``n`` calls
    (a kind the device does not support: left out)."""
    h = nvml.handle(0)
    calls: dict[str, Callable[[], object]] = {
        "utilization": lambda: nvml.utilization(h),
        "memory": lambda: nvml.memory(h),
        "power": lambda: nvml.power_mw(h),
        "processes": lambda: nvml.processes(h),
    }
    try:
        gpm = nvml.gpm_supported(h)
    except nvml.error:
        gpm = False
    if gpm:
        calls["gpm_sample"] = lambda: nvml.gpm_free(nvml.gpm_sample(h))
    out: dict[str, float] = {}
    for name, call in calls.items():
        try:
            call()
        except nvml.error:
            continue
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


__all__ = [
    "PERIOD",
    "DeviceSample",
    "GpuSampler",
    "HostSample",
    "Nvml",
    "PyNvml",
    "RankGpu",
    "call_costs_us",
    "enabled",
    "load_nvml",
    "sample_cost_us",
    "visible_indices",
]
