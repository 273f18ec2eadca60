"""What the live dashboard costs: 64 ranks reporting every 10 ms, dashboard on vs off.

Runs in a real monarch kernel (started here through jupyter_client), so the cost of
serialising widget updates onto IOPub is included. One 64-rank mesh; phases alternate
"off" (no dashboard) and "on" (a displayed dashboard, closed again after the phase):

* ``paced``: every rank runs a training-style loop that does a little compute, calls
  ``monarch_kernel.report(step=..., loss=...)`` and sleeps to keep a 10 ms step
  (6400 reports/s at full speed). Throughput = steps/s over all ranks.
* ``saturated``: every rank computes flat out (both cores busy) and reports whenever
  10 ms have passed since its last report. Throughput = compute iterations/s. This is
  the worst case: every CPU cycle the dashboard takes is a cycle the ranks lose.

Meanwhile the client measures the kernel's responsiveness (round trip of a trivial
``execute_request``). ``run()`` returns medians over the alternating pairs; the
overhead is ``1 - on/off``. On a shared or small machine that A/B figure is noisy
(``noise_off_vs_off`` says how much two identical "off" phases differ), so the run also
reports ``dashboard_cpu_share``: the CPU time the dashboard itself used (its updater
thread, measured with ``thread_time``, plus its listener) over all cores' capacity,
which is what it can take from CPU-bound ranks at most.

    python -m bench.dashboard_overhead [--quick]
    python -m bench dashboard_overhead [--quick]   # writes bench/results/dashboard_overhead.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from bench.common import command_line, write_results

RANKS = int(os.environ.get("MK_DASH_BENCH_RANKS", "64"))
REPORT_EVERY_S = 0.01
SETTLE_S = 1.5

PACED = """%%remote bench --bg
import time, monarch_kernel
def work(n=300):
    s = 0
    for k in range(n):
        s += k * k
    return s
t_end = time.time() + {seconds}
steps = 0
while True:
    t = time.time()
    if t >= t_end:
        break
    work()
    steps += 1
    monarch_kernel.report(step=steps, loss=1.0 / steps)
    left = {every} - (time.time() - t)
    if left > 0:
        time.sleep(left)
steps
"""

SATURATED = """%%remote bench --bg
import time, monarch_kernel
t_end = time.time() + {seconds}
iters = 0
last = 0.0
while True:
    s = 0
    for k in range(200):
        s += k * k
    iters += 1
    t = time.time()
    if t - last >= {every}:
        if t >= t_end:
            break
        last = t
        monarch_kernel.report(step=iters, loss=1.0 / iters)
iters
"""


COUNTER = """
from monarch_kernel.controller.state.events import MetricReported
def _count(ev):  # a mesh event listener (MetricReported only): the reports the controller got
    _counted[0] += 1
"""


class _Client:
    """A monarch kernel and a blocking client that drains IOPub as it goes."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        from monarch_kernel.kernel.install import install

        install(prefix=sys.prefix)
        self.km, self.kc = start_new_kernel(kernel_name="monarch")

    def run(self, code: str, timeout: float = 120) -> dict[str, Any]:
        """Execute ``code``; return its text/plain result (or raise on error)."""
        msg_id = self.kc.execute(code)
        result: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while True:
            m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = m["msg_type"], m["content"]
            if t == "execute_result":
                result["text"] = c["data"].get("text/plain", "")
            elif t == "error":
                raise RuntimeError("\n".join(c["traceback"])[-2000:])
            elif t == "status" and c["execution_state"] == "idle":
                return result

    def latency(self) -> float:
        """Seconds for one trivial execute_request round trip (shell reply)."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute("pass", silent=True)
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return time.perf_counter() - t0

    def drain(self) -> None:
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0.01)
            except Exception:  # queue.Empty
                return

    def cpu_seconds(self) -> float:
        import psutil

        process = getattr(self.km.provisioner, "process", None)  # a local kernel's Popen
        if process is None:
            raise RuntimeError("the kernel is not a local process")
        t = psutil.Process(process.pid).cpu_times()
        return float(t.user + t.system)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _phase(client: _Client, template: str, seconds: float, dashboard: bool) -> dict[str, float]:
    if dashboard:
        # A dashboard lives as long as the training it shows: let its first full render
        # (every widget sent once) pass before measuring.
        client.run("from monarch_kernel.widgets import show as _show\n_dash = _show(bench)")
        time.sleep(SETTLE_S)
        client.run("_f0 = _dash.flushes\n_m0 = _dash.messages\n_c0 = _dash.cpu_seconds")
    client.run("_counted = [0]\nbench.runtime.events.subscribe(_count, MetricReported)")
    client.drain()
    cpu0 = client.cpu_seconds()
    t0 = time.monotonic()
    client.run(template.format(seconds=seconds, every=REPORT_EVERY_S) + "\n")
    client.run("_job = _")
    lat = []
    while time.monotonic() - t0 < seconds:
        lat.append(client.latency())
        client.drain()
        time.sleep(0.05)
    out = client.run("_vals = _job.wait(timeout=60)\nsum(_vals.values())")
    wall = time.monotonic() - t0
    cpu = client.cpu_seconds() - cpu0
    total = float(out["text"])
    time.sleep(0.3)  # reports still in flight
    reports = float(client.run("bench.runtime.events.unsubscribe(_count)\n_counted[0]")["text"])
    res = {
        "throughput": total / seconds,
        "reports_per_s": reports / seconds,
        "latency_p50_ms": statistics.median(lat) * 1e3,
        "latency_max_ms": max(lat) * 1e3,
        "kernel_cpu": cpu / wall,
    }
    if dashboard:
        dash = client.run(
            "_dash.update()\n(_dash.flushes - _f0, _dash.messages - _m0, _dash.state.dropped,"
            " _dash.cpu_seconds - _c0)"
        )["text"]
        flushes, messages, dropped, dcpu = (float(x) for x in dash.strip("()").split(","))
        # what the dashboard takes from the machine: its updater's CPU time plus the
        # listener's (a deque append per event), over all cores
        listener = reports * _listener_cost()
        res.update(
            updates_per_s=flushes / wall,
            messages_per_s=messages / wall,
            dropped=dropped,
            cpu_share=(dcpu + listener) / (wall * (os.cpu_count() or 1)),
        )
        client.run("_dash.close()")  # closed: the next show() makes a fresh dashboard
    client.drain()
    return res


_LISTENER_COST: list[float] = []


def _listener_cost() -> float:
    """Seconds per metric report of the dashboard's mesh event listener (measured here
    once): ``MeshState.on_event`` is its :class:`EventInbox`'s ``put``, which needs no mesh."""
    if not _LISTENER_COST:
        import timeit

        from monarch_kernel.controller.state.events import MetricReported
        from monarch_kernel.widgets.inbox import EventInbox

        inbox = EventInbox()
        ev = MetricReported("bench", 3, None, {"step": 1.0, "loss": 0.5}, time.time())
        n = 200_000
        _LISTENER_COST.append(timeit.timeit(lambda: inbox.put(ev), number=n) / n)
    return _LISTENER_COST[0]


def _scenario(client: _Client, template: str, seconds: float, pairs: int) -> dict[str, Any]:
    offs: list[dict[str, float]] = []
    ons: list[dict[str, float]] = []
    for i in range(pairs):
        # alternate the order so that drift (page cache, thermal) hits both sides
        order = (False, True) if i % 2 == 0 else (True, False)
        for dash in order:
            (ons if dash else offs).append(_phase(client, template, seconds, dash))
    ratios = [1 - on["throughput"] / off["throughput"] for on, off in zip(ons, offs)]
    base = [1 - b["throughput"] / a["throughput"] for a, b in zip(offs, offs[1:])]

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "overhead": statistics.median(ratios),
        "overhead_pairs": ratios,
        # how much two "off" phases differ: the noise floor of this machine right now
        "noise_off_vs_off": max((abs(b) for b in base), default=0.0),
        "dashboard_cpu_share": med(ons, "cpu_share"),
        "throughput_off": med(offs, "throughput"),
        "throughput_on": med(ons, "throughput"),
        "reports_per_s_off": med(offs, "reports_per_s"),
        "reports_per_s_on": med(ons, "reports_per_s"),
        "latency_p50_ms_off": med(offs, "latency_p50_ms"),
        "latency_p50_ms_on": med(ons, "latency_p50_ms"),
        "latency_max_ms_on": max(r["latency_max_ms"] for r in ons),
        "kernel_cpu_off": med(offs, "kernel_cpu"),
        "kernel_cpu_on": med(ons, "kernel_cpu"),
        "updates_per_s": med(ons, "updates_per_s"),
        "widget_messages_per_s": med(ons, "messages_per_s"),
        "dropped_events": max(r["dropped"] for r in ons),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Measure the dashboard's overhead; returns a flat dict of figures.

    ``overhead`` fields are fractions (0.01 = 1 % fewer steps with the dashboard on);
    the target is < 0.02 with 64 ranks reporting every 10 ms.
    """
    seconds, pairs = (3.0, 2) if quick else (5.0, 3)
    load = os.getloadavg()[0]  # other work on the machine makes the A/B figures noisy
    client = _Client()
    try:
        t0 = time.monotonic()
        client.run(
            "from monarch_kernel.actor import this_host\n"
            f"bench = this_host().spawn_procs(per_host={{'gpus': {RANKS}}}, name='bench')"
        )
        spawn_s = time.monotonic() - t0
        client.run(COUNTER)
        client.run("%%remote bench\nimport monarch_kernel\nmonarch_kernel.report(step=0)")
        paced = _scenario(client, PACED, seconds, pairs)
        saturated = _scenario(client, SATURATED, seconds, pairs)
        client.run("bench.stop()")
    finally:
        client.shutdown()
    out: dict[str, Any] = {"ranks": RANKS, "report_every_s": REPORT_EVERY_S, "spawn_s": spawn_s}
    out.update({f"paced_{k}": v for k, v in paced.items()})
    out.update({f"saturated_{k}": v for k, v in saturated.items()})
    out["overhead"] = max(paced["overhead"], saturated["overhead"])
    out["dashboard_cpu_share"] = max(paced["dashboard_cpu_share"], saturated["dashboard_cpu_share"])
    out["listener_us_per_event"] = _listener_cost() * 1e6
    out["target"] = 0.02
    out["load_before"] = load
    out["cpus"] = os.cpu_count()
    return out


def markdown(result: dict[str, Any], command: str = "python -m bench dashboard_overhead") -> str:
    """The results file: the dashboard's cost, off vs on, per scenario."""
    from bench.report import generated_by

    lines = [
        "# What the live dashboard costs (`bench/dashboard_overhead.py`)",
        "",
        generated_by(command) + " How it is measured: the module's docstring.",
        "",
        f"{result['ranks']} ranks, each reporting a metric every "
        f"{result['report_every_s'] * 1e3:.0f} ms; load {result['load_before']:.1f} before the "
        f"run, {result['cpus']} CPUs; the mesh was ready in {result['spawn_s']:.1f} s. Off and "
        "on phases alternate; figures are medians over the pairs.",
        "",
        "| scenario | throughput off | throughput on | fewer with the dashboard on | two off "
        "phases differ by (noise) | dashboard's CPU share of the machine | kernel reply, median, "
        "off / on | kernel reply, max on | updates/s | widget messages/s | events dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("paced", "saturated"):

        def g(key: str, name: str = name) -> Any:
            return result[f"{name}_{key}"]

        lines.append(
            f"| {name} | {g('throughput_off'):,.0f}/s | {g('throughput_on'):,.0f}/s | "
            f"{g('overhead'):.1%} | {g('noise_off_vs_off'):.1%} | "
            f"{g('dashboard_cpu_share'):.2%} | {g('latency_p50_ms_off'):.1f} / "
            f"{g('latency_p50_ms_on'):.1f} ms | {g('latency_max_ms_on'):.1f} ms | "
            f"{g('updates_per_s'):.1f} | {g('widget_messages_per_s'):.1f} | "
            f"{g('dropped_events'):.0f} |"
        )
    lines += [
        "",
        f"Target: under {result['target']:.0%} fewer steps with the dashboard on; this run: "
        f"{result['overhead']:.1%} at worst, the dashboard taking "
        f"{result['dashboard_cpu_share']:.2%} of the machine's CPU at most (its event listener: "
        f"{result['listener_us_per_event']:.2f} µs per metric report). "
        "paced: throughput is steps/s over all ranks; saturated: compute iterations/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench dashboard_overhead")
    ap.add_argument("--quick", action="store_true", help="shorter phases, fewer pairs")
    result = run(quick=ap.parse_args(argv).quick)
    print(json.dumps(result, indent=2))
    text = markdown(result, command_line("dashboard_overhead", argv))
    write_results("dashboard_overhead.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
