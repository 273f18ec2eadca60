"""monarch_kernel: the actor API (``from monarch_kernel.actor import ...``), local backend.

Settings: defaults (local launcher, unix sockets in a private directory, signed (keyed BLAKE2b)
messages). Ranks are forked from the host agent's warm template, which imports torch once. The
cross-host rows use the ``join`` backend across network namespaces (bench/crosshost.py).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable

import psutil

from bench import call_floor
from bench.common import (
    FANOUT_MIB,
    FANOUT_RANKS,
    FANOUT_ROW,
    NotWithin,
    Recorder,
    Settings,
    back_sizes,
    measure_calls,
    measure_pipelined,
    median,
    p99,
    repeat_ready,
    settle,
    tensor_iters,
    tensor_of,
    timed,
)
from bench.floor import RawFloor, alternating
from monarch_kernel.actor import Actor, ActorMesh, ProcMesh, RankDiedError, endpoint, this_host
from monarch_kernel.wire.spin import spin_seconds


class Bench(Actor):
    def __init__(self) -> None:
        self.count = 0
        self.given: dict[int, object] = {}  # MiB -> the tensor ``give`` returns

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
    def nbytes(self, t) -> int:
        return t.numel() * t.element_size()

    @endpoint
    def give(self, mib: int):
        """A tensor of ``mib`` MiB (made once per size): a call's large result."""
        if mib not in self.given:
            self.given[mib] = tensor_of(mib)
        return self.given[mib]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


def mesh_ready_seconds(backend: str, per_host: int, **options: object) -> float:
    """Seconds from ``spawn_procs`` on 2 hosts of ``backend`` to every rank having
    answered :meth:`Bench.ready` (torch imported); the mesh and launcher are stopped."""
    from monarch_kernel.actor import host_mesh

    t0 = time.perf_counter()
    procs = host_mesh(hosts=2, backend=backend, **options).spawn_procs(
        {"gpus": per_host}, timeout=90
    )
    try:
        assert all(procs.spawn("bench", Bench).ready.call().get(timeout=60).values())
        return time.perf_counter() - t0
    finally:
        procs.stop()
        procs.runtime.launcher.shutdown()


def ready_mesh(n: int) -> tuple[ProcMesh, ActorMesh]:
    """A mesh of ``n`` ranks with an actor on each that has answered with torch imported."""
    procs = this_host().spawn_procs(per_host={"gpus": n})
    actors = procs.spawn("bench", Bench)
    assert all(actors.ready.call().get().values())
    return procs, actors


def time_ready(n: int) -> tuple[float, ProcMesh]:
    t0 = time.perf_counter()
    procs, _ = ready_mesh(n)
    return time.perf_counter() - t0, procs


def run(s: Settings, rec: Recorder) -> None:
    if s.wants("ready"):  # first, while this process has started nothing: really cold
        with rec.guard("ready_4_cold", "stop_4"):
            stop: list[float] = []

            def start() -> float:
                t, procs = time_ready(4)
                stop.append(timed(procs.stop))
                return t

            ready = repeat_ready(start, s.ready_reps)
            rec.value("ready_4_cold", median(ready), samples=ready)
            rec.value("stop_4", median(stop), samples=stop)
    rec.note("init", "n/a: no separate cluster start (spawn_procs starts everything)")
    procs, actors = ready_mesh(s.max_n)
    settle()  # the template's late import done: calls timed on a quiet machine
    try:
        micro(s, rec, actors)
        if s.wants("fault"):
            with rec.guard("interrupt"):
                rec.value("interrupt", interrupt_time(procs, actors))
            with rec.guard("death"):
                rec.value("death", death_time(actors, s.death_timeout_s))
    finally:
        procs.stop()
    if s.wants("calln") and s.big_ns:
        procs = this_host().spawn_procs(per_host={"gpus": max(s.big_ns)})
        try:
            actors = procs.spawn("bench", Bench)
            assert all(actors.ready.call().get().values())
            settle()
            measure_calls(s, rec, s.big_ns, lambda n: gathered(actors, n))
            call_floor.gathered_vs_floor(s, rec, s.big_ns, lambda n: gathered(actors, n))
        finally:
            procs.stop()
    if s.wants("ready"):
        ready_rows(s, rec)
    if s.wants("r2r"):
        from bench import r2r

        r2r.ours(s, rec)
    if s.wants("a2a"):
        from bench import a2a

        a2a.run(s, rec, Actor, endpoint, this_host, lambda p: p.stop())
    if s.wants("dap"):
        from bench import dap_panel

        dap_panel.ours(s, rec)
    if s.wants("cells"):
        from bench import notebook

        with rec.guard("plain_cell", "remote_4", "remote_1", "print_delay"):
            notebook.ours(s, rec)
    if s.wants("fault"):
        from bench import faults

        faults.ours(s, rec)
    if s.wants("peerstate"):
        from bench import peer_state

        peer_state.ours(s, rec)
    if s.wants("elastic"):
        from bench import elastic

        elastic.ours(s, rec)
    if s.wants("xhost"):
        from bench import crosshost

        with rec.guard(*crosshost.ROWS):
            crosshost.run(s, rec)
    if s.wants("engines"):
        from bench import engines

        engines.run(s, rec)
    if s.wants("detach"):
        from bench import detach

        detach.ours(s, rec)
    if s.wants("ddp"):
        from bench import ddp

        with rec.guard("ddp_mesh_sps", "ddp_torchrun_sps", "ddp_ratio"):
            ddp.ours(s, rec)
    if s.wants("ddpfault"):
        from bench import ddp_faults

        ddp_faults.ours(s, rec)


def gathered(actors: ActorMesh, n: int) -> Callable[[], object]:
    sub = actors.slice(gpus=slice(0, n))
    return lambda: sub.ping.call().get()


def micro(s: Settings, rec: Recorder, actors: ActorMesh) -> None:
    one = actors.slice(gpus=0)
    floor = RawFloor() if s.wants("rtt") or s.wants("tensor") else None
    try:
        if floor is not None and s.wants("rtt"):
            rtt_rows(s, rec, lambda: one.ping.call_one().get(), floor)
        calls_and_broadcast(s, rec, actors)
        if floor is not None and s.wants("tensor"):
            for mib in s.tensor_mib:
                with rec.guard(f"tensor_{mib}", f"tensor_{mib}_floor"):
                    tensor_rows(rec, mib, one, floor)
            for mib in back_sizes(s):
                with rec.guard(*(f"tensor_back_{mib}{x}" for x in ("", "_floor", "_vs_floor"))):
                    tensor_back_rows(rec, mib, one, floor)
            with rec.guard(*(f"{FANOUT_ROW}{x}" for x in ("", "_floor", "_vs_floor"))):
                tensor_to_ranks_rows(rec, actors.slice(gpus=slice(0, FANOUT_RANKS)))
    finally:
        if floor is not None:
            floor.close()


def rtt_rows(s: Settings, rec: Recorder, call: Callable[[], object], floor: RawFloor) -> None:
    """Row 1, and the raw floor measured in blocks alternating with it (bench.floor)."""
    with rec.guard("rtt", "rtt_p99", "rtt_floor", "rtt_floor_p99"):
        got = alternating(call, floor.ping, s.rtt_iters, s.warmup, 2 * s.loop_budget_s)
        rec.value("rtt", median(got.ours), samples=len(got.ours))
        rec.value("rtt_p99", p99(got.ours))
        rec.value("rtt_floor", median(got.floor), samples=len(got.floor))
        rec.value("rtt_floor_p99", p99(got.floor))
        rec.ratio("rtt_vs_floor", "rtt", "rtt_floor")
        rec.ratio("rtt_p99_vs_floor", "rtt_p99", "rtt_floor_p99")
    # Our controller and ranks spin briefly before a receive blocks (wire.spin); raw
    # ZeroMQ whose both ends spin the same way is the floor of that waiting policy.
    spin = spin_seconds()
    if not spin:
        return
    with rec.guard("rtt_floor_spin", "rtt_vs_floor_spin"):
        spinning = RawFloor(spin=spin)
        try:
            got = alternating(call, spinning.ping, s.rtt_iters, s.warmup, 2 * s.loop_budget_s)
        finally:
            spinning.close()
        rec.value("rtt_spin_beside", median(got.ours), samples=len(got.ours))
        rec.value("rtt_floor_spin", median(got.floor), samples=len(got.floor))
        rec.ratio("rtt_vs_floor_spin", "rtt_spin_beside", "rtt_floor_spin")


def tensor_rows(rec: Recorder, mib: int, one: ActorMesh, floor: RawFloor) -> None:
    """Row 4 (controller -> rank), alternating with the raw floor for the same bytes."""
    t = tensor_of(mib)
    iters, warmup = tensor_iters(mib)
    send = lambda: one.nbytes.call_one(t).get()
    blocks = 3 if iters < 12 else 4
    got = alternating(send, floor.sender(mib), iters * 2, warmup, 60.0, blocks)
    rec.value(f"tensor_{mib}", mib / median(got.ours), samples=len(got.ours))
    rec.value(f"tensor_{mib}_floor", mib / median(got.floor), samples=len(got.floor))
    rec.ratio(f"tensor_{mib}_vs_floor", f"tensor_{mib}", f"tensor_{mib}_floor")
    if mib == 1:  # the same over unix sockets, a local mesh's transport (bench.floor)
        ipc = RawFloor(ipc=True)
        try:
            got = alternating(send, ipc.sender(mib), iters * 2, warmup, 60.0, blocks)
        finally:
            ipc.close()
        rec.value(f"tensor_{mib}_ipc", mib / median(got.ours), samples=len(got.ours))
        rec.value(f"tensor_{mib}_ipc_floor", mib / median(got.floor), samples=len(got.floor))
        rec.ratio(f"tensor_{mib}_vs_ipc_floor", f"tensor_{mib}_ipc", f"tensor_{mib}_ipc_floor")


def tensor_back_rows(rec: Recorder, mib: int, one: ActorMesh, floor: RawFloor) -> None:
    """Row 4 (rank -> controller: a call whose result is a ``mib`` MiB tensor),
    alternating with the raw floor for the same bytes the other way."""
    iters, warmup = tensor_iters(mib)
    fetch = lambda: one.give.call_one(mib).get()
    blocks = 3 if iters < 12 else 4
    got = alternating(fetch, floor.fetcher(mib), iters * 2, warmup, 60.0, blocks)
    key = f"tensor_back_{mib}"
    rec.value(key, mib / median(got.ours), samples=len(got.ours))
    rec.value(f"{key}_floor", mib / median(got.floor), samples=len(got.floor))
    rec.ratio(f"{key}_vs_floor", key, f"{key}_floor")


def tensor_to_ranks_rows(rec: Recorder, ranks: ActorMesh) -> None:
    """Row 4, one tensor to several ranks (a gathered call), alternating with raw ZeroMQ
    sending the same bytes to as many server processes; rate: bytes delivered (to every
    rank) per second."""
    t = tensor_of(FANOUT_MIB)
    iters, warmup = tensor_iters(FANOUT_MIB)
    floor = RawFloor(servers=FANOUT_RANKS)
    try:
        send = lambda: ranks.nbytes.call(t).get()
        got = alternating(send, floor.sender(FANOUT_MIB, to_all=True), iters * 2, warmup, 60.0, 3)
    finally:
        floor.close()
    delivered = FANOUT_MIB * FANOUT_RANKS
    rec.value(FANOUT_ROW, delivered / median(got.ours), samples=len(got.ours))
    rec.value(f"{FANOUT_ROW}_floor", delivered / median(got.floor), samples=len(got.floor))
    rec.ratio(f"{FANOUT_ROW}_vs_floor", FANOUT_ROW, f"{FANOUT_ROW}_floor")


def calls_and_broadcast(s: Settings, rec: Recorder, actors: ActorMesh) -> None:
    one = actors.slice(gpus=0)
    if s.wants("calln"):
        measure_calls(s, rec, s.small_ns, lambda n: gathered(actors, n))
        call_floor.gathered_vs_floor(s, rec, s.small_ns, lambda n: gathered(actors, n))
    if s.wants("bcast"):
        with rec.guard("bcast"):
            sub = actors.slice(gpus=slice(0, s.bcast_ranks))
            sub.take_count.call().get()
            t0 = time.perf_counter()
            for _ in range(s.bcast_k):
                sub.bump.broadcast()
            counts = sub.take_count.call().get().values()
            dt = time.perf_counter() - t0
            assert counts == [s.bcast_k] * s.bcast_ranks, counts
            rec.value("bcast", s.bcast_k * s.bcast_ranks / dt)
    if s.wants("pipe"):
        measure_pipelined(
            s, rec, lambda n: [f.get() for f in [one.ping.call_one() for _ in range(n)]]
        )


def interrupt_time(procs: ProcMesh, actors: ActorMesh) -> float:
    """``procs.interrupt()`` while rank 0 sleeps in an endpoint: seconds until the future raises."""
    fut = actors.slice(gpus=0).sleep.call_one(30)
    time.sleep(0.5)  # let the endpoint start sleeping
    t0 = time.perf_counter()
    procs.interrupt()
    try:
        fut.get(timeout=30)
    except Exception:  # ActorError(KeyboardInterrupt) expected
        return time.perf_counter() - t0
    raise RuntimeError("the sleeping endpoint finished: interrupt did not stop it")


def death_time(actors: ActorMesh, timeout: float) -> float:
    """SIGKILL a rank while a call waits on it: seconds until the future raises RankDiedError."""
    victim = actors.slice(gpus=1)
    pid = victim.pid.call_one().get()
    fut = victim.sleep.call_one(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.get(timeout=timeout)
    except RankDiedError:
        return time.perf_counter() - t0
    except TimeoutError:
        raise NotWithin(f"> {timeout:.0f} s: not noticed") from None
    raise RuntimeError("the call on the killed rank returned a value")


def ready_rows(s: Settings, rec: Recorder) -> None:
    from monarch_kernel.launchers import get_launcher
    from monarch_kernel.launchers.local import LocalLauncher

    launcher = get_launcher("local")
    assert isinstance(launcher, LocalLauncher)

    def cold(n: int) -> float:
        t, procs = time_ready(n)
        procs.stop()
        return t

    def warm(n: int) -> float:
        launcher.prewarm(1)
        wait_template_idle(s.prewarm_wait_s)
        return cold(n)  # the same spawn, now served by the pre-warmed agent

    for n in s.ready_sizes:
        if n != 4:
            with rec.guard(f"ready_{n}_cold"):
                rec.value(f"ready_{n}_cold", cold(n))
        with rec.guard(f"ready_{n}_warm"):
            xs = repeat_ready(functools.partial(warm, n), s.ready_reps, budget_s=20.0)
            rec.value(f"ready_{n}_warm", median(xs), samples=xs)
    launcher.shutdown()


def wait_template_idle(min_wait: float, max_wait: float = 20.0) -> None:
    """Sleep ``min_wait``, then until the pre-warmed template stops using CPU (torch imported)."""
    time.sleep(min_wait)
    deadline = time.monotonic() + max_wait
    templates = [
        p
        for p in psutil.Process().children(recursive=True)
        if "monarch_kernel.host.template" in " ".join(p.cmdline())
    ]
    for p in templates:
        last = sum(p.cpu_times()[:2])
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = sum(p.cpu_times()[:2])
            if now - last < 0.01:
                break
            last = now
