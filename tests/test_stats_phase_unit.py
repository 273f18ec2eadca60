"""When a rank's control thread sends its once-a-second stats (``rank.control``): the
ranks of one host agent at one phase of the machine's clock, agents at different ones."""

from __future__ import annotations

import pytest

from monarch_kernel.rank.control import STATS_INTERVAL, next_stats_at, stats_phase

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("now", [0.0, 10.05, 10.3, 10.31, 11.2999, 12345.678])
def test_the_next_report_is_the_next_point_at_the_phase(now):
    phase = 0.3 * STATS_INTERVAL
    at = next_stats_at(now, phase)
    assert now < at <= now + STATS_INTERVAL
    assert (at - phase) / STATS_INTERVAL == pytest.approx(round((at - phase) / STATS_INTERVAL))


def test_ranks_that_start_apart_report_together_once_all_run():
    phase = stats_phase(4242)
    starts = [100.01, 100.27, 100.64, 100.99]  # ranks of one agent, started at any time

    def reports(start: float) -> list[float]:
        at, out = next_stats_at(start, phase), []
        for _ in range(4):
            out.append(round(at, 9))
            at = next_stats_at(at, phase)
        return out

    after = max(starts)
    schedules = [[t for t in reports(s) if t > after] for s in starts]
    assert all(len(s) >= 2 for s in schedules)
    assert len({tuple(s[:2]) for s in schedules}) == 1


def test_agents_report_at_phases_spread_over_the_interval():
    phases = sorted(stats_phase(pid) for pid in range(1000, 1016))
    assert all(0 <= p < STATS_INTERVAL for p in phases)
    gaps = [b - a for a, b in zip(phases, phases[1:])]
    assert min(gaps) > 0.01 * STATS_INTERVAL  # 16 consecutive pids: no two together
    assert stats_phase(1000) == stats_phase(1000)
