"""The progress line of a big mesh's start (``controller.lifecycle.startup.StartProgress``)."""

from __future__ import annotations

import pytest

from monarch_kernel.controller.lifecycle.startup import StartProgress

pytestmark = pytest.mark.unit


def test_the_line_says_the_agents_then_the_ranks():
    waiting = StartProgress(2.04, 3, 8, 0, 128, None)
    assert waiting.line() == "host agents 3/8 ready, ranks 0/128 (2.0 s)"
    ranks = StartProgress(12.44, 8, 8, 40, 128, 3.1)
    assert ranks.line() == "host agents 8/8 ready in 3.1 s; ranks 40/128 ready (12.4 s)"
    done = StartProgress(20.0, 8, 8, 128, 128, 3.1)
    assert done.line().endswith("ranks 128/128 ready (20.0 s)")
