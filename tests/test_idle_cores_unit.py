"""``osutil.IdleCores``: how many of this process's CPUs were idle between two reads of
``/proc/stat`` (the host template's late import waits for a spare core with it)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

import pytest

from monarch_kernel.wire.osutil import IdleCores, cpu_count

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat"),
]


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _spin_until(started: Any, stop: Any) -> None:
    started.put(1)
    while not stop.is_set():
        _spin(0.01)


def test_a_figure_between_none_and_every_cpu():
    idle = IdleCores()
    _spin(0.05)  # some ticks pass
    time.sleep(0.1)
    spare = idle.since_last()
    assert spare is not None and 0.0 <= spare <= cpu_count()


def test_every_cpu_busy_leaves_less_than_one_idle():
    """With a spinning process per CPU this process may use, less than one is idle."""
    ctx = multiprocessing.get_context("spawn")
    started, stop = ctx.Queue(), ctx.Event()
    spinners = [ctx.Process(target=_spin_until, args=(started, stop)) for _ in range(cpu_count())]
    for p in spinners:
        p.start()
    try:
        for _ in spinners:
            started.get(timeout=60)  # every spinner spins
        idle = IdleCores()
        time.sleep(1.0)  # the span measured
        spare = idle.since_last()
    finally:
        stop.set()
        for p in spinners:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert spare is not None and spare < 0.9, spare
