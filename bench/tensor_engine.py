"""The tensor engine's costs, from the controller: ops per second and a fetch round trip.

* ``ops``: Monarch's ``test_many``: a chain of 2,048 small ops (``t = t + 1`` on a
  10-element tensor) on a 4-rank local mesh under ``activate()``; *issued* is ops/s
  until the last op returned in the notebook (fake propagation, recording, batching),
  *completed* until a fetch of the result came back from every rank.
* ``fetch``: the median round trip of ``inspect(t)`` on the same mesh (a ``tensor_ops``
  request to every rank, the shard's value back), nothing else in flight.
* ``monarch``: the same two rows with Monarch's own tensor engine (the ``torchmonarch``
  wheel installed beside this package), when it runs on this machine's CPUs; otherwise
  the row says why not.

    python -m bench tensor_engine [--quick]   # writes bench/results/tensor-engine.md
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import command_line, write_results

OPS = 2048
RANKS = 4

#: The same workload in a fresh process for Monarch (its runtime and ours in one process
#: would share torch's dispatch mode stack).
_MONARCH = """
import json, statistics, time, torch
import monarch
from monarch.actor import this_host
pm = this_host().spawn_procs(per_host={"gpus": %(ranks)d})
with pm.activate():
    t = torch.zeros(10)
    monarch.inspect(t)
    rounds = []
    for _ in range(%(rounds)d):
        t0 = time.perf_counter()
        for _ in range(%(ops)d):
            t = t + 1
        t1 = time.perf_counter()
        monarch.inspect(t)
        rounds.append((t1 - t0, time.perf_counter() - t0))
    rts = []
    for _ in range(%(fetches)d):
        a = time.perf_counter()
        monarch.inspect(t)
        rts.append(time.perf_counter() - a)
print("RESULT " + json.dumps({"rounds": rounds, "rts": rts}))
"""


def _ours(rounds: int, fetches: int) -> dict[str, Any]:
    import torch

    import monarch_kernel
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        with procs.activate():
            t = torch.zeros(10)
            monarch_kernel.inspect(t)
            timed = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(OPS):
                    t = t + 1
                t1 = time.perf_counter()
                monarch_kernel.inspect(t)
                timed.append((t1 - t0, time.perf_counter() - t0))
            rts = []
            for _ in range(fetches):
                a = time.perf_counter()
                monarch_kernel.inspect(t)
                rts.append(time.perf_counter() - a)
    finally:
        procs.stop().get()
    return {"rounds": timed, "rts": rts}


def _monarch(rounds: int, fetches: int) -> dict[str, Any]:
    code = _MONARCH % {"ranks": RANKS, "rounds": rounds, "ops": OPS, "fetches": fetches}
    try:
        # a session of its own: signals meant for this process's group do not reach it
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 300 s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {done.returncode}: {tail[0][:200]}"}


def _row(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | — | — | — | {r['error']} |"
    issued = statistics.median(OPS / a for a, _ in r["rounds"])
    done = statistics.median(OPS / b for _, b in r["rounds"])
    rt = statistics.median(r["rts"]) * 1e3
    return f"| {name} | {issued:,.0f} | {done:,.0f} | {rt:.2f} | |"


def markdown(ours: dict[str, Any], monarch: dict[str, Any], command: str) -> str:
    from bench.report import machine_info

    lines = [
        "# Tensor engine: ops/s from the controller and a fetch round trip",
        "",
        f"Written by `{command}`; do not edit by hand.",
        "",
        *machine_info(),
        "",
        f"A chain of {OPS:,} small ops (`t = t + 1`, 10 floats) on {RANKS} local CPU ranks "
        "under `activate()` (Monarch's `test_many`); medians over the rounds.",
        "",
        "| engine | ops/s issued | ops/s completed (fetched) | fetch round trip (ms) | note |",
        "|---|---:|---:|---:|---|",
        _row("monarch_kernel", ours),
        _row("Monarch (torchmonarch)", monarch),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench tensor_engine")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--no-monarch", action="store_true", help="skip Monarch's row")
    args = ap.parse_args(argv)
    rounds, fetches = (2, 20) if args.quick else (5, 100)
    ours = _ours(rounds, fetches)
    monarch = {"error": "skipped"} if args.no_monarch else _monarch(rounds, fetches)
    text = markdown(ours, monarch, command_line("tensor_engine", argv))
    write_results("tensor-engine.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
