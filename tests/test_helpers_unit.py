"""The tests' own wait_until helper: returns as soon as the condition holds, else fails
with a message naming what it waited for and for how long."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import WaitTimeout, wait_until

pytestmark = pytest.mark.unit


def test_returns_the_first_true_value():
    values: Iterator[object] = iter([0, None, [], "ready"])
    assert wait_until(lambda: next(values), timeout=5, interval=0) == "ready"


def test_condition_is_checked_even_with_no_time_to_wait():
    assert wait_until(lambda: 3, timeout=0) == 3


def test_timeout_names_what_and_the_timeout_and_the_detail():
    calls = 0

    def never() -> bool:
        nonlocal calls
        calls += 1
        return False

    with pytest.raises(WaitTimeout) as err:
        wait_until(
            never, timeout=0.05, interval=0.01, what="rank 2 to start", detail=lambda: "it said x"
        )
    assert str(err.value) == "timed out after 0.05s waiting for rank 2 to start; it said x"
    assert isinstance(err.value, AssertionError)  # a failed test, not an error
    assert calls >= 2  # polled, and checked once more at the deadline


def test_timeout_without_what_names_the_condition():
    def cluster_is_up() -> bool:
        return False

    with pytest.raises(WaitTimeout, match=r"waiting for the condition .*cluster_is_up"):
        wait_until(cluster_is_up, timeout=0)


def test_errors_in_the_condition_are_not_swallowed():
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, timeout=1)


def test_negative_timeout_is_rejected():
    with pytest.raises(ValueError, match="must be >= 0"):
        wait_until(lambda: True, timeout=-1)
