"""Scale harness: meshes of 16 / 64 / 128 / 256 ranks on this machine (local host agents of
16 ranks each), beside the raw ZeroMQ floor for as many processes, in one run.

    python -m bench scale                 # every size; writes bench/results/scale.md
    python -m bench scale --sizes 16,64   # some sizes
    python -m bench scale --fanin 0       # with fan-in off (every rank replies itself)
    python -m bench scale --sizes 1024 --per-host 64 --out bench/results/scale-1024.md
                                          # as many ranks as this machine holds

This is a harness for the controller's scaling, not the product: the "hosts" are local
host agents on one (small) machine, so every row also pays for 16 ranks per host
sharing this machine's cores. Per size, with the mesh up and idle beside it:

* ``ready``: ``spawn_procs`` to every rank having answered a call (torch imported);
  ``hosts_ready``: to every host agent having said ready (read from the controller's
  host records as they fill in);
* ``gather``: median of a gathered no-op endpoint call to every rank;
* ``cell``: a trivial cell (``pass``) run on every rank: the very request ``%%remote``
  sends (an ``exec``), gathered, without the Jupyter front end;
* ``bcast``: fire-and-forget endpoint calls delivered per second to every rank;
* ``ctl_cpu``: the controller's own CPU time (this process, all its threads) per
  gathered call, over 50 calls: what the controller pays, apart from the ranks and
  agents that share this machine's cores with it; ``agents_cpu`` / ``ranks_cpu``: the
  host agents' and the ranks' CPU time (``/proc``, every process of each) over the
  same calls, per call: where the cores go;
* ``msgs``: messages the controller received per gathered call (its counters):
  ``reply_msgs`` only those carrying replies (``res`` and ``fan_in``: the target is one
  per host), ``all_msgs`` every message (heartbeats and once-a-second stats included);
* ``stacks``: what ``%mesh stacks`` does (collect every rank's stacks, group them,
  render the text and the HTML), median of 5, while the last rank sleeps in an endpoint
  and the others idle; the row's note quotes the view's summary (that rank named as the
  odd one out). The target is 1 s at 256 ranks;
* ``floor``: a raw ZeroMQ round trip gathered from as many raw server processes
  (``bench.raw_zmq``), measured in blocks alternating with ``gather`` while the mesh's
  ranks are alive beside it (same CPU state, same load), and ``floor_1`` / ``one``: the
  same for one process and one rank. Above ``--floor-max`` ranks (256) the floor is not
  measured: as many raw server processes (a Python interpreter each) would not fit
  beside the mesh in this machine's memory.

Then the controller's own cost per received message, measured in this process on the
16-rank mesh (the receiving code, ``Inbound.handle``, fed signed messages that complete
a real pending gathered request): one rank's ``res``, and one host's ``fan_in`` for 16
ranks. From those it computes (not measures) the controller's receive work per
gathered call at 1,024 and 8,192 ranks, with and without fan-in.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

PER_HOST = 16
SIZES = [16, 64, 128, 256]
#: Sizes above this get no raw floor (``--floor-max``).
FLOOR_MAX = 256
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def med(fn: Callable[[], object], iters: int, warmup: int = 3, budget: float = 20.0) -> float:
    from bench.common import median, sample

    return median(sample(fn, iters, warmup, budget))


def alternating(a: Callable[[], object], b: Callable[[], object], iters: int, blocks: int = 4):
    """Medians of ``a`` and ``b`` measured in ``blocks`` alternating blocks of ``iters``
    samples each (same conditions; :func:`bench.floor.alternating`)."""
    from bench.floor import alternating as alternate

    both = alternate(a, b, iters * blocks, warmup=2, budget_s=15.0 * blocks, blocks=blocks)
    return statistics.median(both.ours), statistics.median(both.floor)


def one_size(n: int, iters: int, per_host: int = PER_HOST, floor: bool = True) -> dict[str, Any]:
    from bench.ours import Bench
    from bench.raw_zmq import Servers
    from monarch_kernel.actor import host_mesh
    from monarch_kernel.calls.gather import Gather
    from monarch_kernel.wire import kinds as K

    hosts = max(1, n // per_host)
    row: dict[str, Any] = {"ranks": n, "hosts": hosts, "floor": None, "floor_1": None}
    t0 = time.perf_counter()
    hm = host_mesh(hosts=hosts, backend="local")
    procs = hm.spawn_procs({"gpus": n // hosts}, timeout=900)
    row["spawned"] = time.perf_counter() - t0
    actors = procs.spawn("bench", Bench)
    assert all(actors.ready.call().get(timeout=300).values())
    row["ready"] = time.perf_counter() - t0
    rt = procs.runtime
    row["hosts_ready"] = _hosts_ready_at(rt, t0)
    servers = Servers(n) if floor else None
    try:
        inbound = rt.inbound
        ranks = list(range(n))
        cell = pickle.dumps({"code": "pass", "cell": "<cell>", "header": []})

        def gather() -> None:
            actors.ping.call().get()

        def run_cell() -> None:
            g = Gather(ranks, None, rt.waiter)
            rt.request(ranks, {"k": K.EXEC}, cell, (), g)
            g.future.get()

        one = actors.slice(gpus=0, hosts=0) if hosts > 1 else actors.slice(gpus=0)
        for _ in range(3):
            gather()
        if servers is not None:
            raw = servers
            row["gather"], row["floor"] = alternating(gather, lambda: raw.ping(raw.socks), iters)
            row["one"], row["floor_1"] = alternating(
                lambda: one.ping.call_one().get(),
                lambda: raw.ping(raw.socks[:1]),
                iters * 4,
            )
        else:
            row["gather"] = med(gather, iters * 2, budget=60.0)
            row["one"] = med(lambda: one.ping.call_one().get(), iters * 4)
        row["cell"] = med(run_cell, iters)
        k = 50
        agent_pids = [h.pid for h in rt.hosts if h.pid is not None]
        rank_pids = list(actors.pid.call().get().values())
        kinds0, got0 = dict(inbound.kinds), inbound.received
        cpu0 = _cpu_seconds()
        agents0, ranks0 = _cpu_of(agent_pids), _cpu_of(rank_pids)
        for _ in range(k):
            gather()
        row["ctl_cpu"] = (_cpu_seconds() - cpu0) / k
        row["agents_cpu"] = (_cpu_of(agent_pids) - agents0) / k
        row["ranks_cpu"] = (_cpu_of(rank_pids) - ranks0) / k
        kinds1, got1 = dict(inbound.kinds), inbound.received
        replies = sum(kinds1.get(x, 0) - kinds0.get(x, 0) for x in (K.RESULT, K.FAN_IN))
        row["reply_msgs"] = replies / k
        row["all_msgs"] = (got1 - got0) / k
        row["bcast"] = _broadcast(actors, n)
        try:
            row["stacks"], row["stacks_odd"] = _stacks(procs, actors, n, hosts)
        except Exception as exc:  # the row's other columns stand; this one says why not
            row["stacks"], row["stacks_odd"] = None, f"failed: {type(exc).__name__}: {exc}"
    finally:
        if servers is not None:
            servers.close()
        procs.stop()
        procs.runtime.launcher.shutdown()
    return row


def _cpu_seconds() -> float:
    """CPU time (user + system, every thread) of this process: the controller. Unlike a
    call's wall time it does not count the ranks' and agents' work on the same cores, so
    it shows how the controller's own cost grows with ranks on a machine of 2 cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pids: list[int]) -> float:
    """CPU time (user + system) of the processes ``pids`` (the host agents, or the
    ranks), those that still run: with the controller's own (:func:`_cpu_seconds`), it
    says which side of a gathered call uses the machine's cores."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _hosts_ready_at(rt: Any, t0: float) -> float | None:
    """When the last host agent said ready (``HostInfo.ready_at``), relative to ``t0``
    (a ``perf_counter`` time: converted to the monotonic clock)."""
    seen = [h.ready_at for h in rt.hosts if h.ready_at is not None]
    if not seen:
        return None
    return max(seen) - (time.monotonic() - (time.perf_counter() - t0))


def _broadcast(actors: Any, n: int, k: int = 50) -> float:
    """Endpoint calls delivered per second: ``k`` broadcasts, then a gathered count."""
    actors.take_count.call().get()
    t = time.perf_counter()
    for _ in range(k):
        actors.bump.broadcast()
    counts = actors.take_count.call().get().values()
    dt = time.perf_counter() - t
    assert list(counts) == [k] * n, counts
    return k * n / dt


def _stacks(procs: Any, actors: Any, n: int, hosts: int, reps: int = 5) -> tuple[float, str]:
    """Median seconds of what ``%mesh stacks`` does (collect every rank's stacks, group
    them, render the text and the HTML) while the last rank sleeps in an endpoint and the
    others idle, and the view's summary (it must name that rank as the odd one out)."""
    from monarch_kernel.widgets.stacks_view import mesh_stacks

    last = (
        actors.slice(hosts=hosts - 1, gpus=n // hosts - 1)
        if hosts > 1
        else actors.slice(gpus=n - 1)
    )
    fut = last.sleep.call_one(600)
    rt = procs.runtime

    def view() -> Any:
        v = mesh_stacks(rt)
        repr(v), v._repr_html_()
        return v

    deadline = time.monotonic() + 60
    while view().odd_ranks != [n - 1]:  # until the sleep shows in its stack
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {n - 1} never showed as the odd one out")
    times, summary = [], ""
    for _ in range(reps):
        t = time.perf_counter()
        v = view()
        times.append(time.perf_counter() - t)
        summary = v.summary()
    procs.interrupt()
    try:
        fut.get(timeout=60)
    except Exception as exc:  # the sleep's KeyboardInterrupt, as the rank reports it
        if "KeyboardInterrupt" not in str(exc):
            raise
    else:
        raise RuntimeError(f"rank {n - 1}'s sleep ended without the interrupt")
    return statistics.median(times), summary


def per_message_cost(reps: int = 2000) -> dict[str, float]:
    """Seconds the controller's receiving code spends per message, measured in this
    process on a real 16-rank mesh: a rank's ``res``, and a host's ``fan_in`` of 16."""
    import zmq

    from bench.ours import Bench
    from monarch_kernel.actor import this_host
    from monarch_kernel.calls.gather import Gather
    from monarch_kernel.controller.state.events import RequestKind
    from monarch_kernel.controller.state.requests import new_request_id
    from monarch_kernel.wire import headers as H
    from monarch_kernel.wire.codec import Codec
    from monarch_kernel.wire.fanin import Part, PartKind, encode_parts

    procs = this_host().spawn_procs(per_host={"gpus": PER_HOST})
    try:
        procs.spawn("bench", Bench).ping.call().get()
        rt = procs.runtime
        inbound, requests = rt.inbound, rt.requests
        sender = Codec(rt.key)  # a peer's codec: same key, its own nonce
        ident = rt.transport.ids.rank_id(0)
        value = pickle.dumps(0)

        def fed(ranks: list[int], frames_of: Callable[[str], list[Any]]) -> float:
            times = []
            for _ in range(reps):
                rid = new_request_id()
                g = Gather(ranks, None, None)
                requests.add(rid, ranks, g, RequestKind.CONTROL)
                frames = [zmq.Frame(ident), *frames_of(rid)]
                t = time.perf_counter()
                inbound.handle(frames)
                times.append(time.perf_counter() - t)
                assert g.future.done()
            return statistics.median(times)

        def z(frames: list[Any]) -> list[Any]:
            return [zmq.Frame(bytes(f)) for f in frames]

        res = fed(
            [0],
            lambda rid: z(sender.encode(H.Result(request=rid, ok=True, rank=0).encode(), value)),
        )
        group = list(range(PER_HOST))
        parts = [Part(PartKind.RESULT, tuple(group), value)]
        fan = fed(
            group,
            lambda rid: z(
                sender.encode(H.FanIn(host=0, request=rid).encode(), encode_parts(parts))
            ),
        )
        return {"res": res, "fan_in_16": fan}
    finally:
        procs.stop()


def extrapolate(cost: dict[str, float], ranks: int) -> dict[str, float]:
    """Computed controller receive work per gathered call at ``ranks`` (16 per host)."""
    hosts = ranks // PER_HOST
    return {"no_fanin": ranks * cost["res"], "fanin": hosts * cost["fan_in_16"]}


def secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def us(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e6:,.0f} µs"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:,.1f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}×"


def markdown(
    rows: list[dict[str, Any]],
    cost: dict[str, float] | None,
    fanin: bool,
    per_host: int = PER_HOST,
    command: str = "python -m bench scale",
) -> str:
    from bench.report import generated_by

    sizes = " / ".join(f"{r['ranks']:,}" for r in rows)
    out = [
        f"# Scale: meshes of {sizes} ranks on one machine (`bench/scale.py`)",
        "",
        generated_by(command) + " How each column is measured: `bench/scale.py`'s docstring.",
        "",
        f"## Scale (local host agents of {per_host} ranks; fan-in {'on' if fanin else 'off'};"
        f" load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)",
        "",
        "| ranks | hosts | ready | agents ready | gathered call | raw floor (same n) | "
        "÷ floor | controller CPU / call | agents' CPU / call | ranks' CPU / call (per rank) | "
        "trivial cell | broadcast delivered | "
        "reply msgs / call | all msgs / call | one-rank call | raw 1 | ÷ raw | `%mesh stacks` |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['ranks']} | {r['hosts']} | {r['ready']:.1f} s | "
            f"{secs(r.get('hosts_ready'))} | "
            f"{ms(r['gather'])} | {ms(r['floor'])} | {ratio(r['gather'], r['floor'])} | "
            f"{us(r.get('ctl_cpu'))} | {ms(r.get('agents_cpu'))} | {ms(r.get('ranks_cpu'))} "
            f"({us(r['ranks_cpu'] / r['ranks'] if r.get('ranks_cpu') is not None else None)}) | "
            f"{ms(r['cell'])} | {r['bcast']:,.0f}/s | "
            f"{r['reply_msgs']:.1f} | "
            f"{r['all_msgs']:.1f} | {us(r['one'])} | {us(r['floor_1'])} | "
            f"{ratio(r['one'], r['floor_1'])} | {ms(r.get('stacks'))} |"
        )
    odd = [f"{r['ranks']}: {r['stacks_odd']}" for r in rows if r.get("stacks_odd")]
    if odd:
        out.append(
            "\n`%mesh stacks`: collect every rank's stacks, group them and render the text "
            "and HTML, while the last rank sleeps in an endpoint; what it said: " + "; ".join(odd)
        )
    by = {r["ranks"]: r for r in rows}
    if 16 in by and 128 in by:
        out.append(
            f"\n128-rank ÷ 16-rank gathered call: {by[128]['gather'] / by[16]['gather']:.2f}× "
            f"(the raw floor: {ratio(by[128]['floor'], by[16]['floor'])}; the controller's "
            f"CPU per call: {by[128]['ctl_cpu'] / by[16]['ctl_cpu']:.2f}×)"
        )
    if cost:
        out += [
            "",
            f"Controller receive cost per message (measured, in process): rank `res` "
            f"{us(cost['res'])}, host `fan_in` of 16 ranks {us(cost['fan_in_16'])}.",
            "",
            "| ranks | computed controller receive work per gathered call, no fan-in | with "
            "fan-in (16 ranks/host) |",
            "|---|---|---|",
        ]
        for n in (1024, 8192):
            e = extrapolate(cost, n)
            out.append(f"| {n:,} | {ms(e['no_fanin'])} | {ms(e['fanin'])} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--iters", type=int, default=30, help="samples per block")
    ap.add_argument("--fanin", default="1", help="0: fan-in off (for comparison)")
    ap.add_argument("--per-host", type=int, default=PER_HOST, help="ranks per host agent")
    ap.add_argument("--floor-max", type=int, default=FLOOR_MAX, help="no raw floor above")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ["MONARCH_KERNEL_FANIN"] = args.fanin
    sizes = [int(x) for x in args.sizes.split(",") if x]
    # the local backend's guard against overcommitting a laptop: this harness means it
    os.environ.setdefault("MONARCH_KERNEL_MAX_LOCAL_RANKS", str(max(sizes)))
    rows = []
    for n in sizes:
        print(f"== {n} ranks", flush=True)
        rows.append(one_size(n, args.iters, args.per_host, n <= args.floor_max))
        print(json.dumps(rows[-1]), flush=True)
    try:
        cost: dict[str, float] | None = per_message_cost()
    except Exception as exc:  # the rows measured so far are still worth their table
        print(f"the per-message cost could not be measured: {exc!r}", file=sys.stderr)
        cost = None
    command = shlex.join(["python", "-m", "bench", "scale", *argv])
    text = markdown(rows, cost, args.fanin != "0", args.per_host, command)
    print(text)
    out = args.out or os.path.join(RESULTS, "scale.md" if args.fanin != "0" else "scale-nofanin.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"rows": rows, "cost": cost}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
