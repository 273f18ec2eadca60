"""Row 11 (actor -> actor): a caller actor on one mesh holds an actor mesh of another
mesh (passed to its constructor, as a trainer holds its generators) and calls one of its
actors ``call_one(...).get()`` in a loop; timed inside the caller's rank, so the figure
is the rank-to-rank round trip, with the controller out of the path. The same code runs
against each peer's ``Actor``/``endpoint``/``this_host`` (the import line differs)."""

from __future__ import annotations

import time
from typing import Any

from bench.common import Recorder, Settings, median, p99


def make_classes(Actor: Any, endpoint: Any) -> tuple[type, type]:
    class Target(Actor):
        @endpoint
        def ping(self) -> int:
            return 0

    class Caller(Actor):
        def __init__(self, targets: Any) -> None:
            self.one = targets.slice(gpus=0)

        @endpoint
        def loop(self, iters: int, warmup: int, budget: float) -> list[float]:
            ping = self.one.ping
            for _ in range(warmup):
                ping.call_one().get()
            out: list[float] = []
            clock = time.perf_counter
            end = clock() + budget
            for _ in range(iters):
                t0 = clock()
                ping.call_one().get()
                t1 = clock()
                out.append(t1 - t0)
                if t1 > end and len(out) >= 20:
                    break
            return out

    return Target, Caller


def run(s: Settings, rec: Recorder, Actor: Any, endpoint: Any, this_host: Any, stop: Any) -> None:
    Target, Caller = make_classes(Actor, endpoint)
    targets_procs = this_host().spawn_procs(per_host={"gpus": 1})
    caller_procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        targets = targets_procs.spawn("a2a_targets", Target)
        caller = caller_procs.spawn("a2a_caller", Caller, targets)
        with rec.guard("a2a", "a2a_p99"):
            xs = caller.loop.call_one(s.rtt_iters, s.warmup, s.loop_budget_s).get()
            rec.value("a2a", median(xs))
            rec.value("a2a_p99", p99(xs))
    finally:
        stop(caller_procs)
        stop(targets_procs)
