"""PyTorch Monarch (``torchmonarch==0.7.0``, ``monarch.actor``) on this host.

Settings: defaults. ``this_host().spawn_procs(per_host={"gpus": n})`` (processes started
by Monarch's local allocator), actor arguments sent as ordinary endpoint arguments (its
pickled message path) and, in an extra row, through Monarch's ``RDMABuffer`` (TCP fallback
here: no RDMA NIC; ``rdma_send``). The unhandled-fault hook is replaced by one that returns, so a
killed process fails the waiting call instead of raising KeyboardInterrupt in this process.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from monarch.actor import Actor, endpoint, this_host

from bench.common import (
    NotWithin,
    Recorder,
    Settings,
    measure_calls,
    measure_pipelined,
    measure_tensor,
    median,
    no_prewarm_ready_rows,
    p99,
    repeat_ready,
    sample,
    settle,
    tensor_of,
    timed,
)


class Bench(Actor):
    def __init__(self) -> None:
        self.count = 0

    @endpoint
    def ping(self) -> int:
        return 0

    @endpoint
    def ready(self) -> bool:
        import torch  # noqa: F401 - "ready" means torch is imported in this rank

        return True

    @endpoint
    def bump(self) -> None:
        self.count += 1

    @endpoint
    def take_count(self) -> int:
        n, self.count = self.count, 0
        return n

    @endpoint
    def nbytes(self, t: Any) -> int:
        return t.numel() * t.element_size()

    @endpoint
    def pull(self, buf: Any) -> int:
        import torch

        dst = torch.empty(buf.size(), dtype=torch.uint8)
        buf.read_into(dst).get()
        return dst.numel()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


def ready_mesh(n: int) -> tuple[Any, Any]:
    procs = this_host().spawn_procs(per_host={"gpus": n})
    actors = procs.spawn("bench", Bench)
    assert all(actors.ready.call().get().values())
    return procs, actors


def time_ready(n: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    procs, _ = ready_mesh(n)
    return time.perf_counter() - t0, procs


def run(s: Settings, rec: Recorder) -> None:
    import monarch.actor

    monarch.actor.unhandled_fault_hook = lambda failure: None
    t4 = None
    if s.wants("ready"):
        with rec.guard("ready_4_cold", "stop_4"):
            stop: list[float] = []

            def start() -> float:
                t, procs = time_ready(4)
                stop.append(timed(lambda: procs.stop().get()))
                return t

            ready = repeat_ready(start, s.ready_reps)
            t4 = median(ready)
            rec.value("ready_4_cold", t4, samples=ready)
            rec.value("stop_4", median(stop), samples=stop)
    rec.note("init", "n/a: no separate cluster start (procs start lazily on first use)")
    procs = this_host().spawn_procs(per_host={"gpus": s.max_n})
    actors = procs.spawn("bench", Bench)
    actors.ready.call().get()
    settle()  # as for ours: the calls are timed on a quiet machine
    try:
        micro(s, rec, actors)
        if s.wants("fault"):
            rec.note("interrupt", "n/a: Monarch 0.7 has no way to interrupt a running endpoint")
            with rec.guard("death"):
                rec.value("death", death_time(actors, s.death_timeout_s))
    finally:
        procs.stop().get()
    if s.wants("calln") and s.big_ns:
        procs = this_host().spawn_procs(per_host={"gpus": max(s.big_ns)})
        try:
            actors = procs.spawn("bench", Bench)
            actors.ready.call().get()
            settle()
            measure_calls(s, rec, s.big_ns, lambda n: gathered(actors, n))
        finally:
            procs.stop().get()
    if s.wants("a2a"):
        from bench import a2a

        a2a.run(s, rec, Actor, endpoint, this_host, lambda p: p.stop().get())
    if s.wants("ready"):

        def start_stop(n: int) -> float:
            t, procs = time_ready(n)
            procs.stop().get()
            return t

        warm = "n/a: no pre-warm in Monarch (each proc imports torch)"
        no_prewarm_ready_rows(s, rec, t4, warm, start_stop)


def micro(s: Settings, rec: Recorder, actors: Any) -> None:
    one = actors.slice(gpus=0)
    if s.wants("rtt"):
        with rec.guard("rtt", "rtt_p99"):
            xs = sample(lambda: one.ping.call_one().get(), s.rtt_iters, s.warmup, s.loop_budget_s)
            rec.value("rtt", median(xs))
            rec.value("rtt_p99", p99(xs))
    if s.wants("calln"):
        measure_calls(s, rec, s.small_ns, lambda n: gathered(actors, n))
    if s.wants("bcast"):
        with rec.guard("bcast"):
            sub = actors.slice(gpus=slice(0, s.bcast_ranks))
            sub.take_count.call().get()
            t0 = time.perf_counter()
            for _ in range(s.bcast_k):
                sub.bump.broadcast()
            counts = list(sub.take_count.call().get().values())
            dt = time.perf_counter() - t0
            assert counts == [s.bcast_k] * s.bcast_ranks, counts
            rec.value("bcast", s.bcast_k * s.bcast_ranks / dt)
    if s.wants("pipe"):
        measure_pipelined(
            s, rec, lambda n: [f.get() for f in [one.ping.call_one() for _ in range(n)]]
        )
    if s.wants("tensor"):
        for mib in s.tensor_mib:
            t = tensor_of(mib)
            with rec.guard(f"tensor_{mib}"):
                send = lambda t: one.nbytes.call_one(t).get()
                measure_tensor(rec, f"tensor_{mib}", mib, send, t)
            with rec.guard(f"tensor_rdma_{mib}"):
                measure_tensor(rec, f"tensor_rdma_{mib}", mib, lambda t: rdma_send(one, t), t)


def gathered(actors: Any, n: int) -> Callable[[], object]:
    sub = actors.slice(gpus=slice(0, n))
    return lambda: sub.ping.call().get()


def rdma_send(one: Any, t: Any) -> None:
    """Monarch's large-tensor path: register an RDMABuffer, the rank reads it."""
    import torch
    from monarch.rdma import RDMABuffer

    buf = RDMABuffer(t.view(torch.uint8))
    assert one.pull.call_one(buf).get() == t.numel() * t.element_size()


def death_time(actors: Any, timeout: float) -> float:
    """SIGKILL a proc while a call waits on it: seconds until the future raises."""
    victim = actors.slice(gpus=1)
    pid = victim.pid.call_one().get()
    fut = victim.sleep.call_one(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.get(timeout=timeout)
    except TimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not noticed") from None
    except Exception:  # SupervisionError expected
        return time.perf_counter() - t0
    raise RuntimeError("the call on the killed proc returned a value")
