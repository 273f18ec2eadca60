"""Ray actors on a local Ray instance.

Settings: ``ray.init(num_cpus=N, include_dashboard=False)`` with N = the most actors alive
at once (each actor keeps Ray's default of 1 logical CPU, so all N can be scheduled; Ray
does not start N workers up front); everything else default. Large arguments go through
Ray's shared-memory object store, as Ray does by itself for arguments over 100 KiB, with
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` (Ray's opt-in zero-copy tensor serializer; without
it a torch tensor is pickled through torch's own reducer, which copies).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import psutil

# Read by Ray when it is imported; Ray's processes inherit it.
os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
import ray

from bench.common import (
    NotWithin,
    Recorder,
    Settings,
    big_skip,
    measure_calls,
    measure_pipelined,
    measure_tensor,
    median,
    no_prewarm_ready_rows,
    p99,
    sample,
    tensor_of,
    timed,
)


@ray.remote
class Bench:
    def __init__(self) -> None:
        self.count = 0

    def ping(self) -> int:
        return 0

    def ready(self) -> bool:
        import torch  # noqa: F401 - "ready" means torch is imported in this rank

        return True

    def bump(self) -> None:
        self.count += 1

    def take_count(self) -> int:
        n, self.count = self.count, 0
        return n

    def nbytes(self, t: Any) -> int:
        return t.numel() * t.element_size()

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


def ready_actors(n: int) -> list[Any]:
    actors = [Bench.remote() for _ in range(n)]  # type: ignore[attr-defined]  # ray.remote
    assert all(ray.get([a.ready.remote() for a in actors]))
    return actors


def kill(actors: list[Any]) -> None:
    """Kill actors and wait until their processes have exited."""
    pids = ray.get([a.pid.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=10)


def run(s: Settings, rec: Recorder) -> None:
    num_cpus = max(s.max_n, *s.ready_sizes)  # every actor alive at once gets its 1 CPU
    try:
        rec.value("init", timed(lambda: ray.init(num_cpus=num_cpus, include_dashboard=False)))
        body(s, rec)
    finally:
        ray.shutdown()


def body(s: Settings, rec: Recorder) -> None:
    t4 = None
    if s.wants("ready"):
        with rec.guard("ready_4_cold", "stop_4"):
            t0 = time.perf_counter()
            four = ready_actors(4)
            t4 = time.perf_counter() - t0
            rec.value("ready_4_cold", t4)
            rec.value("stop_4", timed(lambda: kill(four)))
    t0 = time.perf_counter()
    actors = [Bench.remote() for _ in range(s.max_n)]  # type: ignore[attr-defined]  # ray.remote
    ray.get([a.ping.remote() for a in actors])
    t_main = time.perf_counter() - t0
    for n in s.big_ns:
        rec.note(f"call_{n}", big_skip("Ray", n, t_main, s.max_n))
    micro(s, rec, actors)
    if s.wants("fault"):
        with rec.guard("interrupt"):
            interrupt(rec, actors[0])
        with rec.guard("death"):
            rec.value("death", death_time(actors[1], s.death_timeout_s))
    kill(actors[2:])
    if s.wants("ready"):

        def start_stop(n: int) -> float:
            t0 = time.perf_counter()
            many = ready_actors(n)
            t = time.perf_counter() - t0
            kill(many)
            return t

        warm = "n/a: no pre-warm of torch (workers import it on use)"
        no_prewarm_ready_rows(s, rec, t4, warm, start_stop)


def micro(s: Settings, rec: Recorder, actors: list[Any]) -> None:
    one = actors[0]
    if s.wants("rtt"):
        with rec.guard("rtt", "rtt_p99"):
            xs = sample(lambda: ray.get(one.ping.remote()), s.rtt_iters, s.warmup, s.loop_budget_s)
            rec.value("rtt", median(xs))
            rec.value("rtt_p99", p99(xs))
    if s.wants("calln"):
        measure_calls(
            s, rec, s.small_ns, lambda n: lambda: ray.get([a.ping.remote() for a in actors[:n]])
        )
    if s.wants("bcast"):
        with rec.guard("bcast"):
            sub = actors[: s.bcast_ranks]
            ray.get([a.take_count.remote() for a in sub])
            t0 = time.perf_counter()
            for _ in range(s.bcast_k):
                for a in sub:
                    a.bump.remote()
            counts = ray.get([a.take_count.remote() for a in sub])
            dt = time.perf_counter() - t0
            assert counts == [s.bcast_k] * s.bcast_ranks, counts
            rec.value("bcast", s.bcast_k * s.bcast_ranks / dt)
    if s.wants("pipe"):
        measure_pipelined(s, rec, lambda n: ray.get([one.ping.remote() for _ in range(n)]))
    if s.wants("tensor"):
        for mib in s.tensor_mib:
            with rec.guard(f"tensor_{mib}"):
                send = lambda t: ray.get(one.nbytes.remote(t))
                measure_tensor(rec, f"tensor_{mib}", mib, send, tensor_of(mib))


def interrupt(rec: Recorder, actor: Any, wait_s: float = 5.0) -> None:
    """``ray.cancel`` on a running actor method; Ray documents that it cannot stop one."""
    ref = actor.sleep.remote(30)
    time.sleep(0.5)
    t0 = time.perf_counter()
    ray.cancel(ref)
    try:
        ray.get(ref, timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        rec.note(
            "interrupt", f"n/a: ray.cancel did not stop a running actor method in {wait_s:.0f} s"
        )
        return
    except Exception:  # TaskCancelledError
        rec.value("interrupt", time.perf_counter() - t0)
        return
    rec.note("interrupt", "n/a: ray.cancel let the running actor method finish")


def death_time(actor: Any, timeout: float) -> float:
    """SIGKILL an actor's process while a call waits on it: seconds until ray.get raises."""
    pid = ray.get(actor.pid.remote())
    ref = actor.sleep.remote(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not noticed") from None
    except ray.exceptions.RayActorError:
        return time.perf_counter() - t0
    raise RuntimeError("the call on the killed actor returned a value")
