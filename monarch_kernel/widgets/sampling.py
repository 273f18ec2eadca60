"""What the dashboard samples about once a second rather than learns from events: transfer
rates (from the controller's byte counters) and, for local ranks that report no stats,
their memory (through psutil)."""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from monarch_kernel.controller.state.records import RankInfo
from monarch_kernel.wire.reports import RankStats

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

RATE_SAMPLES = 120  # throughput history, one sample a second

#: ``(bytes/s in, bytes/s out)``, as seen from the controller.
Rate = tuple[float, float]


class RateSample(NamedTuple):
    """One second of transfer rates."""

    time: float  #: ``time.time()`` when it was taken
    per_rank: dict[int, Rate]  #: rank -> its rates (ranks seen in both samples)
    total: Rate  #: the mesh's totals


class Throughput:
    """Transfer rates between the controller and the ranks, and their recent history."""

    def __init__(self) -> None:
        self.rates: dict[int, Rate] = {}  #: the latest sample's rates, per rank
        self.total: Rate = (0.0, 0.0)  #: the latest sample's mesh totals
        self.history: deque[RateSample] = deque(maxlen=RATE_SAMPLES)
        self.per_rank_bytes = True  # the controller counts bytes per rank
        self.samples = 0  #: samples taken (the history keeps the newest)
        self._last: tuple[float, dict[int, tuple[int, int]], tuple[int, int]] | None = None

    def sample(self, rt: MeshRuntime, now: float) -> None:
        """Read the byte counters; from the second call on, record the rates since the
        previous call (``now``: ``time.monotonic()``)."""
        per = {info.rank: (info.bytes_in, info.bytes_out) for info in rt.ranks}
        totals = (rt.codec.bytes_in, rt.codec.bytes_out)
        last = self._last
        self._last = (now, per, totals)
        if last is None:
            return
        dt = max(1e-3, now - last[0])
        rates = {}
        for r, (b_in, b_out) in per.items():
            prev = last[1].get(r)
            if prev is not None:
                rates[r] = (max(0, b_in - prev[0]) / dt, max(0, b_out - prev[1]) / dt)
        self.rates = rates
        self.total = (
            max(0, totals[0] - last[2][0]) / dt,
            max(0, totals[1] - last[2][1]) / dt,
        )
        self.history.append(RateSample(time.time(), rates, self.total))
        self.samples += 1


class LocalMemory:
    """RSS of local ranks via psutil, for ranks that sent no stats yet (every second;
    every few seconds for big meshes, memory moves slowly)."""

    def __init__(self) -> None:
        self.stats: dict[int, RankStats] = {}  #: rank -> its psutil stats
        self._host = socket.gethostname()
        self._procs: dict[int, Any] = {}  # rank -> psutil.Process (psutil has no types)
        self._next = 0.0

    def sample(self, ranks: Sequence[RankInfo]) -> None:
        """Measure the local ranks' memory, if it is time to."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + max(1.0, len(ranks) / 16) - 0.05
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        for info in ranks:
            if info.stats:
                continue
            if not info.alive or not info.pid or info.hostname != self._host:
                self._forget(info.rank)
                continue
            proc = self._procs.get(info.rank)
            try:
                if proc is None or proc.pid != info.pid:
                    proc = self._procs[info.rank] = psutil.Process(info.pid)
                rss = proc.memory_info().rss
            except (psutil.Error, OSError):
                self._forget(info.rank)
                continue
            self.stats[info.rank] = {"rss": rss, "gpu_mem": None, "time": time.time()}

    def _forget(self, rank: int) -> None:
        self._procs.pop(rank, None)
        self.stats.pop(rank, None)
