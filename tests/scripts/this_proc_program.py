"""A plain Python program (no notebook) in Monarch's style whose controller-side actors
run in its own process: ``this_proc()`` and a ``get_or_spawn_controller`` singleton that
the ranks report to. Prints its results, then ``this_proc program done``."""

import os

from monarch_kernel.actor import (
    Actor,
    current_rank,
    endpoint,
    get_or_spawn_controller,
    this_host,
    this_proc,
)


class Tally(Actor):
    def __init__(self) -> None:
        self.total = 0

    @endpoint
    def add(self, n: int) -> int:
        self.total += n
        return self.total

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Worker(Actor):
    @endpoint
    def report(self) -> int:
        tally = get_or_spawn_controller("tally", Tally).get()
        return tally.add.call_one(current_rank().rank + 1).get()


if __name__ == "__main__":
    tally = get_or_spawn_controller("tally", Tally).get()
    print("tally runs here:", tally.pid.call_one().get() == os.getpid())
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    workers = procs.spawn("workers", Worker)
    workers.report.call().get()
    print("tally", tally.add.call_one(0).get())
    local = this_proc().spawn("local", Tally)
    print("local", local.add.call_one(5).get())
    procs.stop().get()
    print("this_proc program done")
