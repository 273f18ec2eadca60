"""The host agent's SIGTERM handler (``host.main._Sigterm``): a SIGTERM ends the agent
once, and only from inside the ``try`` whose ``finally`` cleans up. A SIGTERM that came
while the agent was still being built (its template already running) used to raise
there, with no clean-up; the interpreter then finalized with the default handler back,
and the next SIGTERM killed it (test_detach's many-SIGTERMs test saw exit -15)."""

from __future__ import annotations

import signal

import pytest

from monarch_kernel.host.main import _Sigterm

pytestmark = pytest.mark.unit


def test_a_sigterm_before_the_clean_up_is_in_place_is_raised_when_it_is():
    sigterm = _Sigterm()
    sigterm(signal.SIGTERM, None)  # noted, not raised: nothing would clean up
    assert sigterm.came and not sigterm.armed
    with pytest.raises(SystemExit) as exc:
        sigterm.arm()
    assert exc.value.code == 0
    sigterm(signal.SIGTERM, None)  # a second one, during the clean-up: ignored


def test_once_armed_the_first_sigterm_raises_and_later_ones_do_not():
    sigterm = _Sigterm()
    sigterm.arm()
    assert not sigterm.came
    with pytest.raises(SystemExit):
        sigterm(signal.SIGTERM, None)
    for _ in range(3):
        sigterm(signal.SIGTERM, None)
    assert sigterm.came
