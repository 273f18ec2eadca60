"""A mesh's phase while ranks are re-formed: a recovery announced for another thread
(an attach that re-forms ranks its host agent restarted meanwhile) keeps requests
waiting even when another recovery (the failure policy's) ends first."""

from __future__ import annotations

import threading

import pytest
from helpers import wait_until

from monarch_kernel.controller.state.events import EventBus, MeshEvent, MeshPhaseChanged
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import MeshPhase

pytestmark = pytest.mark.unit


def running() -> tuple[MeshLifecycle, list[MeshPhase]]:
    events = EventBus()
    seen: list[MeshPhase] = []

    def on_phase(event: MeshEvent) -> None:
        if isinstance(event, MeshPhaseChanged):
            seen.append(event.phase)

    events.subscribe(on_phase, MeshPhaseChanged)
    lifecycle = MeshLifecycle("m", events)
    lifecycle.set(MeshPhase.RUNNING)
    return lifecycle, seen


def phase(lifecycle: MeshLifecycle) -> MeshPhase:
    """The phase now (read afresh: other threads change it)."""
    return lifecycle.phase


def test_a_held_recovery_outlasts_another_that_ends_first():
    lifecycle, seen = running()
    lifecycle.hold_recovery()
    assert phase(lifecycle) is MeshPhase.RECOVERING
    # the failure policy's restart runs and ends while the held one waits for its turn
    lifecycle.begin_recovery()
    lifecycle.end_recovery()
    assert phase(lifecycle) is MeshPhase.RECOVERING
    released = threading.Event()

    def request() -> None:  # a cell sent now waits for the held recovery
        lifecycle.wait_while_recovering(60)
        released.set()

    waiter = threading.Thread(target=request)
    waiter.start()
    assert not released.is_set()
    # the held one runs (its own begin and end), then lets go
    lifecycle.begin_recovery()
    lifecycle.end_recovery()
    assert phase(lifecycle) is MeshPhase.RECOVERING and not released.is_set()
    lifecycle.release_recovery()
    assert phase(lifecycle) is MeshPhase.RUNNING
    waiter.join(60)
    assert released.is_set()
    wait_until(lambda: seen[-1] is MeshPhase.RUNNING, timeout=5, what="RUNNING announced")
    assert MeshPhase.RECOVERING in seen


def test_two_holds_end_with_the_last_and_a_stop_wins_over_both():
    lifecycle, _ = running()
    lifecycle.hold_recovery()
    lifecycle.hold_recovery()
    lifecycle.release_recovery()
    assert phase(lifecycle) is MeshPhase.RECOVERING
    lifecycle.release_recovery()
    assert phase(lifecycle) is MeshPhase.RUNNING
    lifecycle.hold_recovery()
    assert lifecycle.begin_stop()
    lifecycle.release_recovery()
    assert phase(lifecycle) is MeshPhase.STOPPING
    lifecycle.wait_while_recovering(0.1)  # nothing to wait for once stopping
