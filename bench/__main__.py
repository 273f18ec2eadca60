"""``python -m bench``: run every benchmark against every peer, print and save the table.

    python -m bench                    # everything; writes bench/results/latest.md
    python -m bench --quick            # fewer iterations and sizes (about 3 minutes)
    python -m bench --only ours,zmq    # some peers: ours zmq monarch ray ipp dask train
    python -m bench --bench train      # the training workload alone (bench/train.py)
    python -m bench --bench rtt,calln  # some benchmarks (see BENCHES)
    python -m bench scale              # the scale harness alone (bench/scale.py)
    python -m bench dashboard_traffic  # a benchmark that runs on its own (see STANDALONE)

Every file written into bench/results/ says under its title which command wrote it, when
and on what machine; none is edited by hand (the README links to them).

A run limited with --quick, --only or --bench writes bench/results/partial.md instead, so
latest.md always holds a complete run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from bench.common import Settings
from bench.report import PEERS, markdown, results_json
from bench.runner import PeerRun, run_peer

#: Peers, then "train": the workload benchmark, which runs its six systems itself.
ORDER = ["zmq", "ours", "monarch", "ray", "ipp", "dask", "train"]
BENCHES = [
    "rtt",
    "calln",
    "bcast",
    "pipe",
    "tensor",
    "r2r",
    "ready",
    "cells",
    "fault",
    "peerstate",
    "elastic",
    "detach",
    "ddp",
    "ddpfault",
    "xhost",
    "engines",
    "a2a",
    "dap",
    "train",
]
#: Benchmarks that run on their own, not against the peers: ``python -m bench NAME [ARGS]``
#: runs ``bench.NAME.main(ARGS)``.
STANDALONE = [
    "scale",
    "dashboard_traffic",
    "dashboard_overhead",
    "telemetry",
    "tensor_engine",
    "hsdp",
]
#: Seconds each peer's worker may run (full run, quick run) unless ``--peer-timeout``
#: says otherwise. Ours runs every benchmark (the peers only the first few: faults,
#: training, cross-host and engine rows are ours alone), so it gets more time.
TIMEOUTS = {"ours": (900.0, 420.0), "train": (1500.0, 900.0)}
DEFAULT_TIMEOUT = (240.0, 150.0)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def names(text: str, allowed: list[str], what: str) -> list[str]:
    got = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in got if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return got


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes")
    ap.add_argument("--only", default="", help=f"comma-separated peers: {','.join(ORDER)}")
    ap.add_argument("--bench", default="", help=f"comma-separated benchmarks: {','.join(BENCHES)}")
    ap.add_argument("--out", default=None, help="Markdown output path")
    ap.add_argument("--peer-timeout", type=float, default=None, help="seconds per peer")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv and argv[0] in STANDALONE:
        import importlib

        module = importlib.import_module(f"bench.{argv[0]}")
        result: int = module.main(argv[1:])
        return result
    args = parse(argv)
    peers = names(args.only, ORDER, "peer") or ORDER
    peers = [p for p in ORDER if p in peers]
    settings = Settings.make(args.quick, names(args.bench, BENCHES, "benchmark"))
    if not settings.wants("train"):
        peers = [p for p in peers if p != "train"]
    if settings.benches == ["train"]:
        peers = [p for p in peers if p == "train"]
    partial = args.quick or args.only or args.bench
    out = args.out or os.path.join(RESULTS, "partial.md" if partial else "latest.md")

    load_before = f"{os.getloadavg()[0]:.2f}"
    t0 = time.perf_counter()
    runs: dict[str, PeerRun] = {}
    for peer in peers:
        full, quick = TIMEOUTS.get(peer, DEFAULT_TIMEOUT)
        runs[peer] = run_peer(peer, settings, args.peer_timeout or (quick if args.quick else full))
    total = time.perf_counter() - t0
    load = [load_before, f"{os.getloadavg()[0]:.2f}"]

    ordered = {p: runs[p] for p in ["ours", *[p for p in PEERS if p != "ours"]] if p in runs}
    text = markdown(ordered, settings, total, load, shlex.join(["python", "-m", "bench", *argv]))
    print()
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(results_json(ordered), f, indent=1)
    print(f"written to {out} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
