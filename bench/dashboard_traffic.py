"""What the dashboard sends the front end per update, at 16 and 256 ranks.

Runs in a real monarch kernel (started here through jupyter_client) and reads its IOPub
as a front end would: every ``comm_open``/``comm_msg`` byte (the JSON content plus
binary buffers) is counted and put to the widget that sent it (the rank grid or tiles,
the charts, the rest). For each mesh size and view, two phases:

* ``train``: a ``--bg`` loop on every rank prints a line and reports a metric every
  250 ms (ranks stay busy: output, metrics, rates move; states do not; faster, 256
  ranks' output starves the host agents' heartbeats on a 2-core machine);
* ``churn``: foreground ``%%remote`` cells one after the other, the last failing on a
  few ranks: every rank goes busy -> idle (-> error) again and again.

Updates per second are the dashboard's flushes (each a batch of widget messages); bytes
per update are the comm bytes over the flushes. ``grid`` is the heat-map grid (the
default from 64 ranks on), ``tiles`` the one-tile-per-rank view forced at that size
(``MONARCH_KERNEL_GRID_MIN_RANKS``), to compare the two at 256 ranks.

    python -m bench.dashboard_traffic [--quick] [--sizes 16,256]
    python -m bench dashboard_traffic [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import sys
import time
from collections import defaultdict
from typing import Any

PER_HOST = 16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TRAIN = """%%remote big --bg
import time, monarch_kernel
from monarch_kernel.actor import current_rank
r = current_rank().rank
t_end = time.time() + {seconds}
step = 0
while time.time() < t_end:
    step += 1
    monarch_kernel.report(step=step, loss=1.0 / step + 0.01 * r)
    print(f"rank {{r}} step {{step}}", flush=True)
    time.sleep(0.25)
step
"""
CHURN = "%%remote big\nimport time\ntime.sleep(0.05)\n"
FAIL = (
    "%%remote big\nimport os\nif int(os.environ['RANK']) % 50 == 3:\n"
    "    raise ValueError('bad shard')\n"
)


class _Kernel:
    """A monarch kernel whose IOPub is read here, widget bytes counted per widget."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import start_new_kernel

        from monarch_kernel.kernel.install import install

        install(prefix=sys.prefix)
        self.km, self.kc = start_new_kernel(kernel_name="monarch", env={**os.environ, **env})
        self.kind: dict[str, str] = {}  # comm id -> grid | tiles | charts | other
        self.bytes: dict[str, int] = defaultdict(int)
        self.messages: dict[str, int] = defaultdict(int)
        self.display_bytes = 0

    def _count(self, m: dict[str, Any]) -> None:
        t, c = m["msg_type"], m["content"]
        size = len(json.dumps(c, default=str)) + sum(len(b) for b in m.get("buffers") or [])
        if t == "comm_open":
            state = c.get("data", {}).get("state", {})
            name = state.get("_model_name", "")
            if "states" in state and "legend" in state:
                kind = "grid"
            elif name == "ButtonModel" and "mk-tile" in state.get("_dom_classes", ()):
                kind = "tiles"
            elif "chart_id" in state:
                kind = "charts"
            else:
                kind = "other"
            self.kind[c["comm_id"]] = kind
        elif t == "comm_msg":
            kind = self.kind.get(c["comm_id"], "other")
            if kind == "other" and "mk-tile" in str(c.get("data", {}).get("state", {})):
                kind = self.kind[c["comm_id"]] = "tiles"  # a tile's first classes update
        elif t in ("display_data", "update_display_data"):
            self.display_bytes += size
            return
        else:
            return
        self.bytes[kind] += size
        self.messages[kind] += 1

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self._count(self.kc.get_iopub_msg(timeout=left))
            except queue.Empty:
                return

    def run(self, code: str, timeout: float = 300) -> str:
        """Execute ``code`` (counting what comes meanwhile); its text/plain result."""
        msg_id = self.kc.execute(code)
        out = ""
        deadline = time.monotonic() + timeout
        while True:
            m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            self._count(m)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = m["msg_type"], m["content"]
            if t == "execute_result":
                out = c["data"].get("text/plain", "")
            elif t == "error" and "bad shard" not in "".join(c["traceback"]):
                raise RuntimeError("\n".join(c["traceback"])[-2000:])
            elif t == "status" and c["execution_state"] == "idle":
                return out

    def reset(self) -> None:
        self.bytes.clear()
        self.messages.clear()
        self.display_bytes = 0

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _phase(k: _Kernel, name: str, seconds: float) -> dict[str, Any]:
    """Run one phase; what the dashboard sent during it."""
    k.run("_f0, _c0 = big.dashboard().flushes, big.dashboard().cpu_seconds")
    k.reset()
    t0 = time.monotonic()
    if name == "train":
        k.run(TRAIN.format(seconds=seconds))
        k.pump(seconds + 0.5)
        k.run("_.wait(timeout=60)")
    else:
        while time.monotonic() - t0 < seconds:
            k.run(CHURN)
        k.run(FAIL)
    k.pump(0.6)  # the updates the last events caused
    wall = time.monotonic() - t0
    flushes = int(k.run("big.dashboard().flushes - _f0"))
    cpu = float(k.run("big.dashboard().cpu_seconds - _c0"))
    total = sum(k.bytes.values())
    return {
        "seconds": round(wall, 2),
        "updates_per_s": round(flushes / wall, 2),
        "bytes_per_update": round(total / max(1, flushes)),
        "bytes_per_s": round(total / wall),
        "messages_per_s": round(sum(k.messages.values()) / wall, 1),
        # the updater's CPU time (all its ticks, also those that sent nothing) a second
        "dashboard_cpu_ms_per_s": round(1e3 * cpu / wall, 1),
        "bytes_by_widget": {kind: round(b / wall) for kind, b in sorted(k.bytes.items())},
    }


def measure(ranks: int, view: str, seconds: float) -> dict[str, Any]:
    """One mesh of ``ranks`` ranks (16 a host agent) shown as ``view`` (grid | tiles)."""
    env = {"MONARCH_KERNEL_MAX_LOCAL_RANKS": str(max(64, ranks))}
    if view == "tiles":
        env["MONARCH_KERNEL_GRID_MIN_RANKS"] = str(ranks + 1)
    else:
        env["MONARCH_KERNEL_GRID_MIN_RANKS"] = str(min(64, ranks))
    k = _Kernel(env)
    try:
        hosts = max(1, ranks // PER_HOST)
        t0 = time.monotonic()
        k.run(
            f"%mesh big --gpus {min(ranks, PER_HOST)} --hosts {hosts} --on-failure continue",
            timeout=600,
        )
        ready = time.monotonic() - t0
        heat = k.run("big.dashboard().heat") == "True"
        k.pump(1.5)  # the first full render
        out: dict[str, Any] = {"ranks": ranks, "view": "grid" if heat else "tiles"}
        out["ready_s"] = round(ready, 1)
        for phase in ("train", "churn"):
            out[phase] = _phase(k, phase, seconds)
        k.run("%mesh stop big", timeout=120)
        return out
    finally:
        k.shutdown()


def run(quick: bool = False, sizes: tuple[int, ...] = (16, 256)) -> dict[str, Any]:
    """Bytes per update and updates per second of the dashboard for each mesh size:
    16 ranks (tiles, as always), then each bigger size as a grid and as tiles."""
    seconds = 4.0 if quick else 8.0
    rows = []
    for n in sizes:
        views = ["grid", "tiles"] if n >= 64 else ["tiles"]
        for view in views:
            rows.append(measure(n, view, seconds))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows, "load_before": os.getloadavg()[0], "cpus": os.cpu_count()}


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| ranks | view | phase | updates/s | bytes/update | bytes/s | grid or tiles B/s "
        "| charts B/s | other B/s | updater CPU ms/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for phase in ("train", "churn"):
            p = row[phase]
            by = p["bytes_by_widget"]
            ranks_bytes = by.get("grid", 0) + by.get("tiles", 0)
            lines.append(
                f"| {row['ranks']} | {row['view']} | {phase} | {p['updates_per_s']} | "
                f"{p['bytes_per_update']} | {p['bytes_per_s']} | {ranks_bytes} | "
                f"{by.get('charts', 0)} | {by.get('other', 0)} | {p['dashboard_cpu_ms_per_s']} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dashboard_traffic")
    ap.add_argument("--quick", action="store_true", help="shorter phases")
    ap.add_argument("--sizes", default="16,256", help="mesh sizes (ranks), 16 a host agent")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    result = run(args.quick, sizes)
    print(json.dumps(result, indent=1))
    text = table(result)
    print(text)
    out = os.path.join(RESULTS, "dashboard_traffic.md")
    with open(out, "w") as f:
        command = shlex.join(["python", "-m", "bench", "dashboard_traffic", *argv])
        f.write(f"{HEADER}\n{_conditions(result, command)}\n\n{text}\n")
    print(f"written to {out}")
    return 0


HEADER = "# What the dashboard sends the front end (`python -m bench dashboard_traffic`)\n"


def _conditions(result: dict[str, Any], command: str = "python -m bench dashboard_traffic") -> str:
    from bench.report import generated_by

    return (
        f"{generated_by(command)}\n\n"
        f"Load {result['load_before']:.1f} before the run; "
        f"{PER_HOST} ranks a host agent. bytes: JSON content plus buffers of every widget "
        "comm message on IOPub; an update: one flush of the dashboard's updater."
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
