"""ipyparallel: a local cluster (``ipp.Cluster(n=...)``: one controller, engines each with
its nanny), driven through ``DirectView.apply_sync``.

Settings: defaults of ``ipp.Cluster`` (local launchers, tcp on loopback, signed messages),
``log_level=40`` only to keep its start-up chatter out of the benchmark output. There are
no actors: the per-engine state for the broadcast count lives in the engine's namespace.
Tensors are sent as ``t.numpy()`` (ipyparallel's zero-copy path for arrays; a torch tensor
would be pickled with a copy) and wrapped with ``torch.from_numpy`` on the engine.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import ipyparallel as ipp

from bench.common import (
    NotWithin,
    Recorder,
    Settings,
    big_skip,
    measure_calls,
    measure_tensor,
    median,
    no_prewarm_ready_rows,
    p99,
    sample,
    tensor_of,
)


def ping() -> int:
    return 0


def ready() -> bool:
    import torch  # noqa: F401 - "ready" means torch is imported in this engine

    return True


#: An engine's call counter, in the engine's namespace (``ipp.interactive``); this copy
#: is never used.
_bench_count = 0


@ipp.interactive
def bump() -> None:
    global _bench_count
    _bench_count = globals().get("_bench_count", 0) + 1


@ipp.interactive
def take_count() -> int:
    global _bench_count
    n = globals().get("_bench_count", 0)
    _bench_count = 0
    return n


def nbytes(a: Any) -> int:
    import torch

    t = torch.from_numpy(a)  # zero-copy: the engine holds a torch tensor
    return t.numel() * t.element_size()


def pid() -> int:
    import os

    return os.getpid()


def sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "slept"


def start(n: int) -> tuple[ipp.Cluster, ipp.Client]:
    """A cluster of ``n`` engines that have all answered with torch imported."""
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(n, timeout=120)
    assert all(rc[:].apply_sync(ready))
    return cluster, rc


def stop(cluster: ipp.Cluster, rc: ipp.Client) -> None:
    rc.close()
    cluster.stop_cluster_sync()


def run(s: Settings, rec: Recorder) -> None:
    rec.note("init", "n/a: counted in the cluster start")
    t4 = None
    cluster = rc = None
    try:
        if s.wants("ready"):
            t0 = time.perf_counter()
            cluster, rc = start(4)
            t4 = time.perf_counter() - t0
            rec.value("ready_4_cold", t4)
            rec.note("stop_4", "n/a: the cluster of 4 is grown, not stopped, to save time")
            t0 = time.perf_counter()
            cluster.start_engines_sync(n=s.max_n - 4)  # grow to the size micro needs
            rc.wait_for_engines(s.max_n, timeout=120)
            t_main = t4 + time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            cluster, rc = start(s.max_n)
            t_main = time.perf_counter() - t0
        for n in s.big_ns:
            rec.note(f"call_{n}", big_skip("ipyparallel", n, t_main, s.max_n))
        micro(s, rec, rc)
        if s.wants("fault"):
            with rec.guard("interrupt"):
                rec.value("interrupt", interrupt_time(rc, s.death_timeout_s))
            with rec.guard("death"):
                rec.value("death", death_time(rc, s.death_timeout_s))
    finally:
        if cluster is not None and rc is not None:
            stop(cluster, rc)
    if s.wants("ready"):

        def start_stop(n: int) -> float:
            t0 = time.perf_counter()
            cluster, rc = start(n)
            t = time.perf_counter() - t0
            stop(cluster, rc)
            return t

        warm = "n/a: no pre-warm (each engine imports torch)"
        no_prewarm_ready_rows(s, rec, t4, warm, start_stop)
    if s.wants("cells"):
        from bench import notebook

        with rec.guard("plain_cell", "remote_4", "remote_1", "print_delay"):
            notebook.ipp(s, rec)


def micro(s: Settings, rec: Recorder, rc: ipp.Client) -> None:
    one = rc[0]
    if s.wants("rtt"):
        with rec.guard("rtt", "rtt_p99"):
            xs = sample(lambda: one.apply_sync(ping), s.rtt_iters, s.warmup, s.loop_budget_s)
            rec.value("rtt", median(xs))
            rec.value("rtt_p99", p99(xs))
    if s.wants("calln"):
        measure_calls(s, rec, s.small_ns, lambda n: lambda: rc[list(range(n))].apply_sync(ping))
    if s.wants("bcast"):
        with rec.guard("bcast"):
            view = rc[list(range(s.bcast_ranks))]
            view.apply_sync(take_count)
            t0 = time.perf_counter()
            for _ in range(s.bcast_k):
                view.apply_async(bump)
            counts = view.apply_sync(take_count)
            dt = time.perf_counter() - t0
            assert counts == [s.bcast_k] * s.bcast_ranks, counts
            rec.value("bcast", s.bcast_k * s.bcast_ranks / dt)
    if s.wants("tensor"):
        for mib in s.tensor_mib:
            with rec.guard(f"tensor_{mib}"):
                # ipyparallel sends numpy arrays zero-copy, tensors by pickle
                send = lambda a: one.apply_sync(nbytes, a)
                measure_tensor(rec, f"tensor_{mib}", mib, send, tensor_of(mib).numpy())


def interrupt_time(rc: ipp.Client, timeout: float) -> float:
    """``Client.send_signal(SIGINT)`` (through the engine's nanny) while it sleeps."""
    ar = rc[0].apply_async(sleep, 30)
    time.sleep(0.5)
    t0 = time.perf_counter()
    rc.send_signal(signal.SIGINT, targets=[0], block=True)
    try:
        ar.get(timeout=timeout)
    except ipp.error.TimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not stopped") from None
    except Exception:  # RemoteError(KeyboardInterrupt) expected
        return time.perf_counter() - t0
    raise RuntimeError("the sleeping task finished: the interrupt did not stop it")


def death_time(rc: ipp.Client, timeout: float) -> float:
    """SIGKILL an engine while a task waits on it: seconds until the result raises."""
    victim = rc[1]
    engine_pid = victim.apply_sync(pid)
    ar = victim.apply_async(sleep, 60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(engine_pid, signal.SIGKILL)
    try:
        ar.get(timeout=timeout)
    except ipp.error.TimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not noticed") from None
    except Exception:  # RemoteError(EngineError) expected
        return time.perf_counter() - t0
    raise RuntimeError("the task on the killed engine returned a value")
