"""Dask (``dask.distributed``): a ``LocalCluster`` of worker processes on this host.

Settings: ``LocalCluster(n_workers=N, threads_per_worker=1, processes=True)`` (each worker
with its nanny, tcp on loopback, the scheduler in this process), ``Client(cluster)``;
everything else default. One-rank calls go to a Dask actor (``client.submit(Bench,
actor=True, workers=[w])``: a method call goes from the client straight to the actor's
worker); gathered calls are ``client.run(f, workers=[...])`` (a function run on those
workers, outside the task graph, replies gathered); the broadcast is fire-and-forget
actor calls; tensors are ``client.scatter(t, workers=[w])`` then a task that returns the
byte count (scatter is Dask's way to put data on a worker).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

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


def available() -> str | None:
    import dask.distributed  # noqa: F401

    return None


class Bench:
    """The actor: a counter for the broadcast and a few no-ops."""

    def __init__(self) -> None:
        self.count = 0

    def ping(self) -> int:
        return 0

    def bump(self) -> None:
        self.count += 1

    def take_count(self) -> int:
        n, self.count = self.count, 0
        return n

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


def ping() -> int:
    return 0


def ready() -> bool:
    import torch  # noqa: F401 - "ready" means torch is imported in this worker

    return True


def nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def start(n: int) -> tuple[Any, Any, list[str]]:
    """A cluster of ``n`` workers, its client, and the workers' addresses (sorted)."""
    from dask.distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=n,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    client = Client(cluster)
    client.wait_for_workers(n, timeout=120)
    return cluster, client, sorted(client.scheduler_info()["workers"])


def ready_seconds(n: int) -> tuple[float, Any, Any, list[str]]:
    t0 = time.perf_counter()
    cluster, client, workers = start(n)
    assert all(client.run(ready).values())
    return time.perf_counter() - t0, cluster, client, workers


def stop(cluster: Any, client: Any) -> None:
    client.close()
    cluster.close()


def run(s: Settings, rec: Recorder) -> None:
    t4 = None
    if s.wants("ready"):
        with rec.guard("ready_4_cold", "stop_4"):
            t4, cluster, client, _ = ready_seconds(4)
            rec.value("ready_4_cold", t4)
            rec.value("stop_4", timed(lambda: stop(cluster, client)))
    t0 = time.perf_counter()
    cluster, client, workers = start(s.max_n)
    try:
        actors = [
            client.submit(Bench, actor=True, workers=[w], pure=False).result() for w in workers
        ]
        t_main = time.perf_counter() - t0
        for n in s.big_ns:
            rec.note(f"call_{n}", big_skip("Dask", n, t_main, s.max_n))
        micro(s, rec, client, workers, actors)
        if s.wants("fault"):
            rec.note("interrupt", "n/a: Dask cannot stop a running task (cancel leaves it running)")
            with rec.guard("death"):
                rec.value("death", death_time(actors[1], s.death_timeout_s))
    finally:
        stop(cluster, client)
    if s.wants("ready"):

        def start_stop(n: int) -> float:
            t, cl, c, _ = ready_seconds(n)
            stop(cl, c)
            return t

        warm = "n/a: no pre-warm (each worker imports torch on first use)"
        no_prewarm_ready_rows(s, rec, t4, warm, start_stop)


def micro(s: Settings, rec: Recorder, client: Any, workers: list[str], actors: list[Any]) -> None:
    one = actors[0]
    if s.wants("rtt"):
        with rec.guard("rtt", "rtt_p99"):
            xs = sample(lambda: one.ping().result(), s.rtt_iters, s.warmup, s.loop_budget_s)
            rec.value("rtt", median(xs))
            rec.value("rtt_p99", p99(xs))
    if s.wants("calln"):
        measure_calls(s, rec, s.small_ns, lambda n: lambda: client.run(ping, workers=workers[:n]))
    if s.wants("bcast"):
        with rec.guard("bcast"):
            sub = actors[: s.bcast_ranks]
            [a.take_count().result() for a in sub]
            t0 = time.perf_counter()
            for _ in range(s.bcast_k):
                for a in sub:
                    a.bump()
            counts = [a.take_count().result() for a in sub]
            dt = time.perf_counter() - t0
            # Each actor runs its calls in order, so take_count follows every bump.
            assert counts == [s.bcast_k] * s.bcast_ranks, counts
            rec.value("bcast", s.bcast_k * s.bcast_ranks / dt)
    if s.wants("pipe"):

        def batch(n: int) -> None:
            futures = [one.ping() for _ in range(n)]
            for f in futures:
                f.result()

        measure_pipelined(s, rec, batch)
    if s.wants("tensor"):
        for mib in s.tensor_mib:
            with rec.guard(f"tensor_{mib}"):

                def send(t: Any) -> int:
                    [ref] = client.scatter([t], workers=workers[:1], direct=True, hash=False)
                    got: int = client.submit(nbytes, ref, workers=workers[:1]).result()
                    return got

                measure_tensor(rec, f"tensor_{mib}", mib, send, tensor_of(mib))


def death_time(actor: Any, timeout: float) -> float:
    """SIGKILL an actor's worker process while a call waits on it: seconds until the
    call's future raises."""
    pid = actor.pid().result()
    fut = actor.sleep(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.result(timeout=timeout)
    except TimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not noticed") from None
    except Exception:
        return time.perf_counter() - t0
    raise RuntimeError("the call on the killed worker returned a value")
