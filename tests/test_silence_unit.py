"""``controller.lifecycle.silence.SilenceBound``: how long a host agent may be silent."""

from __future__ import annotations

import pytest

from monarch_kernel.controller.lifecycle.silence import FACTOR, MAX_SILENCE, WINDOW, SilenceBound

pytestmark = pytest.mark.unit


def _fed(times: list[float], floor: float = 2.5) -> SilenceBound:
    bound = SilenceBound(floor)
    for t in times:
        bound.seen(3, t)
    return bound


def test_a_quiet_host_gets_the_floor():
    bound = _fed([0.0, 0.5, 1.0, 1.5, 2.1])
    assert bound.allowed(3) == 2.5
    assert bound.allowed(9) == 2.5  # never seen


def test_a_host_whose_messages_come_seconds_apart_gets_more():
    bound = _fed([0.0, 0.5, 3.0, 3.5])  # one gap of 2.5 s
    assert bound.longest_gap(3) == 2.5
    assert bound.allowed(3) == FACTOR * 2.5


def test_the_bound_has_a_ceiling():
    assert _fed([0.0, 30.0]).allowed(3) == MAX_SILENCE


def test_the_same_time_seen_twice_is_no_gap():
    bound = _fed([0.0, 0.5, 0.5, 0.5])
    assert bound.longest_gap(3) == 0.5


def test_old_gaps_age_out_and_a_restart_forgets_them():
    times = [0.0, 4.0] + [4.0 + 0.5 * i for i in range(1, WINDOW + 1)]
    assert _fed(times[:3]).allowed(3) == FACTOR * 4.0
    assert _fed(times).allowed(3) == 2.5  # the 4 s gap is WINDOW gaps ago
    bound = _fed(times[:3])
    bound.forget(3)
    bound.seen(3, 10.0)
    assert bound.allowed(3) == 2.5
