"""Shared pieces: run settings, the result recorder and timing helpers."""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 1024 * 1024
#: The main mesh has at most this many ranks; bigger calls get a mesh of their own.
SMALL_MESH = 8


@dataclass
class Settings:
    """How much work each benchmark does; ``quick`` trades precision for time."""

    quick: bool = False
    benches: list[str] = field(default_factory=list)  # empty: all
    rtt_iters: int = 2000
    warmup: int = 200
    call_ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    call_iters: int = 300
    bcast_ranks: int = 4
    bcast_k: int = 2000
    tensor_mib: list[int] = field(default_factory=lambda: [1, 64, 256])
    ready_sizes: list[int] = field(default_factory=lambda: [4, 16])
    #: Samples of the cheap start-up figures (ours, Monarch); Ray and ipyparallel take 10 s+
    #: per cluster start here, so they are sampled once.
    ready_reps: int = 3
    #: A peer that starts one interpreter per rank skips the 16-rank mesh when four times
    #: its 4-rank time exceeds this (the brief: "16 if under ~10 s").
    ready_budget_s: float = 10.0
    #: Seconds to let a pre-warmed host agent import torch before timing spawn_procs.
    prewarm_wait_s: float = 3.0
    death_timeout_s: float = 20.0
    loop_budget_s: float = 8.0  # cap on one timing loop (slow peers do fewer iterations)

    @classmethod
    def make(cls, quick: bool, benches: list[str]) -> Settings:
        if not quick:
            return cls(benches=benches)
        return cls(
            quick=True,
            benches=benches,
            rtt_iters=400,
            warmup=50,
            call_ns=[1, 4],
            call_iters=100,
            bcast_k=300,
            tensor_mib=[1, 64],
            ready_sizes=[4],
            ready_reps=1,
            death_timeout_s=12.0,
            loop_budget_s=3.0,
        )

    def wants(self, bench: str) -> bool:
        return not self.benches or bench in self.benches

    @property
    def small_ns(self) -> list[int]:
        """Call sizes measured on the main mesh (every peer)."""
        return [n for n in self.call_ns if n <= SMALL_MESH]

    @property
    def big_ns(self) -> list[int]:
        """Call sizes measured on a second, bigger mesh (peers that start ranks quickly)."""
        return [n for n in self.call_ns if n > SMALL_MESH]

    @property
    def max_n(self) -> int:
        """Ranks of the main mesh."""
        return max([*self.small_ns, self.bcast_ranks])

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls(**json.loads(text))


class NotWithin(Exception):
    """A benchmark's event did not happen within its time limit (a result, not a failure)."""


class Recorder:
    """Collects one peer's figures; rewrites its JSON file after every entry, so a
    worker that is killed on timeout still leaves what it measured."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.data: dict[str, dict[str, Any]] = {}

    def _flush(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)

    def value(self, key: str, value: float, **extra: Any) -> None:
        self.data[key] = {"value": float(value), **extra}
        self._flush()
        print(f"  {key:<18} {value:.6g}", flush=True)

    def note(self, key: str, text: str) -> None:
        self.data[key] = {"note": text}
        self._flush()
        print(f"  {key:<18} {text}", flush=True)

    def has(self, key: str) -> bool:
        return key in self.data

    def ratio(self, key: str, num: str, den: str) -> None:
        """Record ``num ÷ den`` as ``key`` when both were measured (and ``den`` > 0)."""
        a, b = self.data.get(num, {}), self.data.get(den, {})
        if "value" in a and "value" in b and b["value"] > 0:
            self.value(key, a["value"] / b["value"])

    @contextmanager
    def guard(self, *keys: str) -> Iterator[None]:
        """Run a benchmark; on failure, note the error on every key it did not fill."""
        try:
            yield
        except NotWithin as exc:
            for key in keys:
                if not self.has(key):
                    self.note(key, str(exc))
        except Exception as exc:  # one failing benchmark must not stop the rest
            traceback.print_exc()
            first = (str(exc).splitlines() or [""])[0][:120]
            text = f"failed: {type(exc).__name__}: {first}"
            for key in keys:
                if not self.has(key):
                    self.note(key, text)


def sample(fn: Callable[[], object], iters: int, warmup: int, budget_s: float) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` calls; stops early past ``budget_s``
    (keeping at least 20 samples) so slow peers do not blow the run time."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    clock = time.perf_counter
    end = clock() + budget_s
    for _ in range(iters):
        t0 = clock()
        fn()
        t1 = clock()
        out.append(t1 - t0)
        if t1 > end and len(out) >= 20:
            break
    return out


def measure_calls(
    s: Settings, rec: Recorder, ns: list[int], call_on: Callable[[int], Callable[[], object]]
) -> None:
    """Row 2: median time of ``call_on(n)()``, a call gathered from the first n ranks."""
    for n in ns:
        with rec.guard(f"call_{n}"):
            xs = sample(call_on(n), s.call_iters, s.warmup // 4, s.loop_budget_s)
            rec.value(f"call_{n}", median(xs))


#: Row 3b: calls kept in flight to one rank (all issued, then all awaited).
PIPELINED = 1000


def measure_pipelined(s: Settings, rec: Recorder, run_batch: Callable[[int], object]) -> None:
    """Row 3b: calls/s with :data:`PIPELINED` calls to one rank in flight at once
    (``run_batch(n)`` issues n no-op calls without waiting, then waits for all)."""
    with rec.guard("pipe"):
        run_batch(100)  # warm-up
        times = []
        for _ in range(3 if s.quick else 7):
            t0 = time.perf_counter()
            run_batch(PIPELINED)
            times.append(time.perf_counter() - t0)
        rec.value("pipe", PIPELINED / median(times))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def repeat_ready(start: Callable[[], float], reps: int, budget_s: float = 12.0) -> list[float]:
    """Up to ``reps`` start-up samples, fewer when the first ones already took ``budget_s``."""
    xs: list[float] = []
    t0 = time.perf_counter()
    while len(xs) < reps and (not xs or time.perf_counter() - t0 < budget_s):
        xs.append(start())
    return xs


#: Row 4's tensor to several ranks (a gathered call): its size, how many ranks, its key.
FANOUT_MIB = 16
FANOUT_RANKS = 4
FANOUT_ROW = f"tensor_{FANOUT_MIB}_to_{FANOUT_RANKS}"


def tensor_iters(mib: int) -> tuple[int, int]:
    """(iterations, warm-up) for one tensor size."""
    if mib <= 4:
        return 30, 5
    if mib <= 64:
        return 9, 1
    return 5, 1


def measure_tensor(
    rec: Recorder, key: str, mib: int, send: Callable[[Any], object], data: Any
) -> None:
    """Row 4: MiB/s of ``send(data)`` for a ``mib`` MiB payload, median after warm-up."""
    iters, warmup = tensor_iters(mib)
    xs = sample(lambda: send(data), iters, warmup, 30.0)
    rec.value(key, mib / median(xs))


def back_sizes(s: Settings) -> list[int]:
    """Sizes of the rank -> controller tensor rows: the tensor rows' up to 64 MiB."""
    return [mib for mib in s.tensor_mib if mib <= 64]


def tensor_of(mib: int) -> Any:
    """A float32 torch tensor of ``mib`` MiB."""
    import torch

    return torch.ones(mib * MiB // 4)


def settle(
    quiet: float = 0.05,
    window_s: float = 0.25,
    hold_s: float | None = None,
    timeout_s: float = 30.0,
) -> float:
    """Wait until this process's descendants (a mesh's host agent, template and ranks)
    together used under ``quiet`` of a core in every ``window_s`` for ``hold_s`` in a row;
    return the seconds waited (at most ``timeout_s``). A fresh mesh is not quiet at once:
    its warm template imports ``torch._dynamo`` once it has been idle a few seconds
    (``host.template.LATE_IDLE`` times ``LATE_IDLE_STREAK``; about 1.7 s of one core
    here), and calls timed meanwhile share the machine's two cores with that import. The
    default ``hold_s`` is a second longer than that wait, so the import is waited for."""
    import psutil

    if hold_s is None:
        from monarch_kernel.host.template import LATE_IDLE, LATE_IDLE_STREAK

        hold_s = LATE_IDLE * LATE_IDLE_STREAK + 1.0

    me = psutil.Process()
    t0 = time.monotonic()

    def cpu(procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:  # gone meanwhile
                continue
            total += t.user + t.system
        return total

    quiet_since = t0
    while time.monotonic() - t0 < timeout_s:
        procs = me.children(recursive=True)
        before = cpu(procs)
        time.sleep(window_s)
        now = time.monotonic()
        if cpu(procs) - before >= quiet * window_s:
            quiet_since = now
        elif now - quiet_since >= hold_s:
            break
    return time.monotonic() - t0


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def big_skip(peer: str, n: int, t_main: float, main_n: int) -> str:
    """Why a peer that starts a full interpreter per worker skips the calls to ``n`` ranks."""
    return (
        f"skipped: starting {n} {peer} workers on this 2-core box would take about "
        f"{t_main * n / main_n:.0f} s ({main_n} took {t_main:.1f} s)"
    )


def no_prewarm_ready_rows(
    s: Settings, rec: Recorder, t4: float | None, warm_note: str, start_stop: Callable[[int], float]
) -> None:
    """Row 5 for a peer with no pre-warm: ``warm_note`` on the warm rows, and the cold start
    of each mesh bigger than 4 (``start_stop(n)`` returns the time until ready, then stops),
    skipped when 4 × the 4-rank time ``t4`` is over budget."""
    for n in s.ready_sizes:
        rec.note(f"ready_{n}_warm", warm_note)
        if n == 4:
            continue
        skip = ready_16_skip(t4, s) if t4 is not None else None
        if skip:
            rec.note(f"ready_{n}_cold", skip)
            continue
        with rec.guard(f"ready_{n}_cold"):
            rec.value(f"ready_{n}_cold", start_stop(n))


def ready_16_skip(t4: float, s: Settings) -> str | None:
    """Why a one-interpreter-per-rank peer skips the 16-rank mesh (or None to run it)."""
    estimate = 4 * t4
    if estimate > s.ready_budget_s:
        return (
            f"skipped: estimated 4 x 4-rank time = {estimate:.1f} s > {s.ready_budget_s:.0f} s "
            "budget on this 2-core box"
        )
    return None


#: Where the benchmarks write their Markdown (``bench/results/``).
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def command_line(name: str, argv: list[str]) -> str:
    """How a standalone benchmark was run, for its results file:
    ``python -m bench NAME ARGS``."""
    import shlex

    return shlex.join(["python", "-m", "bench", name, *argv])


def write_results(filename: str, text: str) -> str:
    """Print a standalone benchmark's Markdown and write it to ``bench/results/FILENAME``;
    the path written."""
    print(text)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    out = os.path.join(RESULTS_DIR, filename)
    with open(out, "w") as f:
        f.write(text)
    print(f"written to {out}")
    return out
