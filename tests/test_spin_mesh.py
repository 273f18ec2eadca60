"""Spin, then block on a real mesh (``monarch_kernel.wire.spin``): a bad
``MONARCH_KERNEL_SPIN_US`` fails the mesh's start before anything opens, with an error
naming it (the name stays free); a caller whose replies come late stops spinning (so a
wait on a long call costs no CPU) and still gets every reply."""

from __future__ import annotations

import pytest
from actors import AsyncActor

from monarch_kernel.actor import this_host
from monarch_kernel.wire.osutil import cpu_count
from monarch_kernel.wire.spin import MISSES_TO_REST, SPIN_ENV

needs_two_cpus = pytest.mark.skipif(cpu_count() < 2, reason="nothing spins on a one-CPU machine")


def test_a_bad_spin_setting_fails_the_start_naming_it(monkeypatch):
    monkeypatch.setenv(SPIN_ENV, "fast")
    with pytest.raises(ValueError, match=f"{SPIN_ENV}='fast'.*microseconds"):
        this_host().spawn_procs(per_host={"gpus": 1}, name="spin-bad")
    monkeypatch.delenv(SPIN_ENV)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="spin-bad")  # still free
    try:
        actors = procs.spawn("a", AsyncActor)
        assert actors.bump.call_one().get(timeout=60) == 1
    finally:
        procs.stop().get(timeout=60)


@needs_two_cpus
def test_a_caller_whose_replies_come_late_rests_and_gets_them(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="spin-rest")
    try:
        actors = procs.spawn("a", AsyncActor)
        spin = procs.runtime.receiver._spin
        got: list[int] = []
        # Each reply comes 20 ms after the call: every spin runs out. (Another message
        # landing inside one, a rank's stats, ends that run of misses: call on.)
        while spin.misses < MISSES_TO_REST and len(got) < 50:
            got.append(actors.bump.call_one(0.02).get(timeout=60))
        assert spin.misses >= MISSES_TO_REST
        assert got == list(range(1, len(got) + 1))
        # Resting, it still receives every reply (it blocks at once).
        more = [actors.bump.call_one(0.0).get(timeout=60) for _ in range(20)]
        assert more == list(range(len(got) + 1, len(got) + 21))
    finally:
        procs.stop().get(timeout=60)
