"""The request lifecycle: what a subscriber of a real mesh's event bus sees."""

from __future__ import annotations

import os
import signal

import pytest
from actors import Worker
from helpers import wait_for_rank_line, wait_until

from monarch_kernel.calls.errors import ActorError, RankDiedError
from monarch_kernel.controller.state.events import (
    EventBus,
    MeshEvent,
    MeshPhaseChanged,
    RankDied,
    RankStateChanged,
    ReplyReceived,
    RequestFailed,
    RequestKind,
    RequestStarted,
    StreamOutput,
)
from monarch_kernel.controller.state.records import RankState


@pytest.fixture
def mesh(mesh2):
    return mesh2


def test_a_call_is_started_answered_and_moves_ranks_busy_then_idle(mesh):
    seen: list[MeshEvent] = []
    mesh.runtime.events.subscribe(seen.append)
    workers = mesh.spawn("workers", Worker)
    workers.echo.call(5).get()
    workers.say.call("hello").get()

    starts = [e for e in seen if isinstance(e, RequestStarted)]
    assert [(e.kind, e.what) for e in starts] == [
        (RequestKind.SPAWN, "spawn workers"),
        (RequestKind.CALL, "workers.echo"),
        (RequestKind.CALL, "workers.say"),
    ]
    assert all(e.ranks == (0, 1) and e.mesh == mesh.name for e in starts)
    echo = starts[1].request
    assert {e.rank for e in seen if isinstance(e, ReplyReceived) and e.request == echo} == {0, 1}
    flips = [(e.rank, e.previous, e.state) for e in seen if isinstance(e, RankStateChanged)]
    assert flips.count((0, RankState.IDLE, RankState.BUSY)) == 3
    assert flips.count((0, RankState.BUSY, RankState.IDLE)) == 3
    said = [e for e in seen if isinstance(e, StreamOutput) and e.request == starts[2].request]
    assert {e.rank for e in said} == {0, 1} and all("hello" in e.text for e in said)
    assert all(
        info.state is RankState.IDLE and info.outstanding == 0 for info in mesh.runtime.ranks
    )


def test_a_failure_is_reported_once_with_its_report(mesh):
    failed: list[MeshEvent] = []
    mesh.runtime.events.subscribe(failed.append, RequestFailed)
    workers = mesh.spawn("workers", Worker)
    with pytest.raises(ActorError) as err:
        workers.fail_on.call([1]).get()
    assert len(failed) == 1
    event = failed[0]
    assert isinstance(event, RequestFailed)
    assert event.rank == 1 and event.kind is RequestKind.CALL
    assert event.report["type"] == "ValueError" and event.report["rank"] == 1
    # the caller's grouped error and the event share the one decoded report
    assert err.value.failures[0] is event.report


def test_a_death_names_the_requests_it_failed(mesh):
    events: list[MeshEvent] = []
    mesh.runtime.events.subscribe(events.append, RankDied, RequestStarted)
    workers = mesh.spawn("workers", Worker)
    fut = workers.slice(gpus=1).sleep.call_one(60, "to be killed")
    wait_for_rank_line(mesh, 1, "sleeping to be killed")
    os.kill(mesh.runtime.ranks[1].pid, signal.SIGKILL)
    with pytest.raises(RankDiedError):
        fut.get(timeout=10)
    started = [e for e in events if isinstance(e, RequestStarted) and e.what == "workers.sleep"]
    died = [e for e in events if isinstance(e, RankDied)]
    assert len(died) == 1 and died[0].rank == 1 and died[0].state is RankState.DEAD
    assert died[0].requests == (started[0].request,)
    assert died[0].death.signal == signal.SIGKILL


def test_unsubscribe_and_phase_changes(mesh):
    phases: list[MeshEvent] = []
    count = [0]

    def counting(event: MeshEvent) -> None:
        count[0] += 1

    mesh.runtime.events.subscribe(counting)
    mesh.runtime.events.unsubscribe(counting)
    mesh.runtime.events.subscribe(phases.append, MeshPhaseChanged)
    mesh.ping().get()
    mesh.stop()
    assert count[0] == 0
    assert [e.phase for e in phases if isinstance(e, MeshPhaseChanged)] == ["stopping", "stopped"]


@pytest.mark.unit
def test_a_failing_listener_does_not_stop_the_others():
    bus = EventBus()
    got: list[MeshEvent] = []

    def broken(event: MeshEvent) -> None:
        raise RuntimeError("listener bug")

    bus.subscribe(broken, MeshPhaseChanged)
    bus.subscribe(got.append, MeshPhaseChanged)
    event = MeshPhaseChanged("m", "running")  # type: ignore[arg-type]
    bus.emit(event)
    assert got == [event]
    assert bus.wants(MeshPhaseChanged) and not bus.wants(RankDied)
    with pytest.raises(TypeError, match="not mesh event types"):
        bus.subscribe(got.append, int)  # type: ignore[arg-type]


def test_busy_state_follows_pipelined_calls(mesh):
    workers = mesh.spawn("workers", Worker)
    futs = [workers.slice(gpus=0).echo.call_one(i) for i in range(200)]
    assert [f.get(timeout=10) for f in futs] == list(range(200))
    info = mesh.runtime.ranks[0]
    wait_until(lambda: info.state is RankState.IDLE, timeout=5, what="rank 0 idle again")
    assert info.outstanding == 0
