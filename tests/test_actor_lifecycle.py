"""Actor lifecycle the Monarch way (issue 51): ``__cleanup__`` on stop (sync and async),
stopping an actor mesh stops the meshes its actors own first (recursively), owned meshes
stop when their owner fails (``__cleanup__`` gets the failure), a raising ``__cleanup__``
is a supervision event, slices of a failed mesh inherit its failure, actors of a
stopped process mesh fail with a supervision error; and exits and crashes of an endpoint
(``BaseException``, ``sys.exit``, ``os._exit``, SIGSEGV): the caller's
``SupervisionError`` names the exception, exit code or signal, other meshes run on."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import re
import signal
import time
from typing import Any

import psutil
import pytest
from helpers import wait_until
from lifecycle_actors import (
    AsyncCleanup,
    AsyncCleanupDel,
    AsyncExits,
    BadInit,
    Concurrent,
    Exits,
    Logs,
    LoopBound,
    Parent,
    ProcOwner,
    RaisingCleanup,
    SlowInit,
    SyncCleanup,
    SyncCleanupDel,
    events,
)

from monarch_kernel import config
from monarch_kernel.actor import ActorError, SupervisionError, this_host

pytestmark = pytest.mark.local

_names = itertools.count()


@pytest.fixture(scope="module")
def meshes():
    """A mesh of 1 rank (owners) and one of 2 (what they own)."""
    owners = this_host().spawn_procs(per_host={"gpus": 1}, name="lc_owners")
    children = this_host().spawn_procs(per_host={"gpus": 2}, name="lc_children")
    yield owners, children
    children.stop()
    owners.stop()


@pytest.fixture
def log(tmp_path):
    return str(tmp_path / "events.log")


def _name(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


@pytest.mark.parametrize("cls", [SyncCleanup, AsyncCleanup], ids=["sync", "async"])
def test_cleanup_runs_when_the_actor_is_stopped(meshes, log, cls):
    _, children = meshes
    actors = children.spawn(_name("cl"), cls, log, "it")
    assert actors.ping.call().get(timeout=30).values() == ["pong"] * 2
    actors.stop().get(timeout=30)  # done once every rank's __cleanup__ ran
    assert sorted(events(log)) == ["it cleanup 0 None", "it cleanup 1 None"]
    with pytest.raises(SupervisionError, match="stopped"):
        actors.ping.call().get(timeout=30)


@pytest.mark.parametrize("child", [SyncCleanup, AsyncCleanup], ids=["sync", "async"])
def test_stopping_a_mesh_stops_the_meshes_its_actors_own_first(meshes, log, child):
    owners, children = meshes
    parent = owners.spawn(_name("par"), Parent, log, children, child, _name("p"))
    assert parent.ping_children.call_one().get(timeout=30) == ["pong"] * 2
    kids = parent.child_mesh.call_one().get(timeout=30)
    parent.stop().get(timeout=60)
    lines = events(log)
    assert len(lines) == 3, lines
    assert all("child cleanup" in line for line in lines[:2])  # recursively, first
    assert "-child" not in lines[2] and " cleanup 0 None" in lines[2]
    with pytest.raises(SupervisionError, match="stopped"):
        kids.ping.call().get(timeout=30)


@pytest.mark.parametrize("how", ["fail", "abort"])
def test_owned_meshes_stop_when_their_owner_fails(meshes, log, hooked, how):
    owners, children = meshes
    parent = owners.spawn(_name("fp"), Parent, log, children, SyncCleanup, _name("f"))
    kids = parent.child_mesh.call_one().get(timeout=30)
    assert kids.ping.call().get(timeout=30).values() == ["pong"] * 2
    failing = parent.fail.call_one() if how == "fail" else parent.abort.call_one("enough")
    with pytest.raises(SupervisionError):
        failing.get(timeout=30)
    wait_until(lambda: len(events(log)) == 3, timeout=30, what="the cleanups")
    lines = events(log)
    assert all("child cleanup" in line and line.endswith("None") for line in lines[:2])
    reason = "the parent fails" if how == "fail" else "enough"
    assert reason in lines[2] and "Exception(" in lines[2]  # __cleanup__(exc)
    with pytest.raises(SupervisionError):
        kids.ping.call().get(timeout=30)
    wait_until(lambda: hooked, timeout=30, what="the owner's failure at the hook")
    assert len(hooked) == 1 and reason in str(hooked[0])


def test_stop_cancels_running_concurrent_calls_before_cleanup(meshes, log):
    """``@concurrent_endpoint``: calls run in parallel (two wait forever at once), their
    code knows its actor (``context()``), and stopping the actor cancels them (their
    callers hear of it) before its ``__cleanup__``."""
    _, children = meshes
    name = _name("conc")
    actors = children.spawn(name, Concurrent, log)
    assert actors.who.call().get(timeout=30).values() == [name] * 2
    with pytest.raises(ActorError, match=r"KeyError.*nope|nope"):
        actors.fail.call().get(timeout=30)
    waiting = [actors.wait_forever.call(tag) for tag in ("x", "y")]
    wait_until(
        lambda: sum("started" in line for line in events(log)) == 4, timeout=30, what="starts"
    )
    actors.stop().get(timeout=60)
    lines = events(log)
    cancelled = [i for i, line in enumerate(lines) if "cancelled" in line]
    cleanups = [i for i, line in enumerate(lines) if line.startswith("cleanup")]
    assert len(cancelled) == 4 and len(cleanups) == 2, lines
    for rank in (0, 1):  # on each rank, its calls were cancelled before its cleanup
        mine = [i for i in cancelled if lines[i].endswith(f" {rank}")]
        assert max(mine) < lines.index(f"cleanup {rank}"), lines
    for fut in waiting:
        with pytest.raises(ActorError, match="cancelled"):
            fut.get(timeout=30)


def test_concurrent_calls_run_on_the_actors_own_event_loop(meshes):
    """Monarch: a ``@concurrent_endpoint``'s calls are tasks of the actor's event loop,
    the one its ordinary ``async`` endpoints run on: a queue made in ``__init__`` and
    bound to that loop by an ordinary endpoint is awaited by a concurrent call. The
    loop goes on while another actor's sync endpoint holds the rank's main thread."""
    from concurrency_actors import Blocker, Setter

    _, children = meshes
    actors = children.spawn(_name("lb"), LoopBound)
    assert actors.prime.call().get(timeout=30).values() == ["first"] * 2  # bound here
    taken = actors.take.call()  # awaits the queue, on the same loop
    assert actors.put.call("x").get(timeout=30).values() == ["put"] * 2
    assert taken.get(timeout=30).values() == ["x"] * 2
    blocker = children.spawn(_name("blk"), Blocker)
    name = f"loop{next(_names)}"
    held = blocker.block.call(name, 60)
    try:
        assert actors.nap.call(0.05).get(timeout=30).values() == ["rested"] * 2
    finally:
        children.spawn(_name("set"), Setter).set.call(name).get(timeout=30)
    assert held.get(timeout=30).values() == ["released"] * 2


@pytest.mark.parametrize("method", ["fail_plain", "fail_concurrent"])
def test_a_concurrent_endpoints_error_names_its_endpoint_as_an_ordinary_ones(meshes, method):
    """The caller's ``ActorError`` names the endpoint that raised, its ranks and the
    remote traceback, for a ``@concurrent_endpoint`` as for an ordinary endpoint
    (Monarch's ``Actor call <actor>.<endpoint> failed.`` context)."""
    _, children = meshes
    actors = children.spawn(_name("err"), LoopBound)
    with pytest.raises(ActorError) as err:
        getattr(actors, method).call().get(timeout=30)
    assert not isinstance(err.value, SupervisionError)  # the actor serves on
    text = str(err.value)
    assert text.startswith(f"KeyError in LoopBound.{method} on ranks 0-1 of 2: 'nope'"), text
    assert f"in {method}\n" in text and "raise KeyError" in text  # its own frame
    assert isinstance(err.value.exception, KeyError)
    assert actors.put.call("y").get(timeout=30).values() == ["put"] * 2


def test_concurrent_endpoint_keeps_monarchs_endpoint_attributes():
    fn: Any = Concurrent.who
    assert fn._method.__name__ == "who" and fn.__name__ == "who"
    assert fn._explicit_response_port is True and fn._monarch_concurrent_endpoint_wrapper
    assert list(inspect.signature(fn).parameters) == ["self", "_monarch_response_port"]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


@pytest.mark.parametrize("owned", ["actor_mesh", "proc_mesh"])
def test_what_an_actor_owns_stops_when_its_process_is_killed(meshes, log, hooked, owned):
    """Monarch: a mesh does not outlive its owner, also when the owner's process dies.
    An actor mesh the owner spawned on another process mesh is stopped (its
    ``__cleanup__`` runs, calls raise ``SupervisionError``) and the death's report says
    so; a process mesh the owner started from its rank ends with that process."""
    _, children = meshes
    owners = this_host().spawn_procs(
        per_host={"gpus": 1}, name=_name("lc_own"), on_failure="continue"
    )
    try:
        tag = _name("own")
        if owned == "actor_mesh":
            owner = owners.spawn("owner", Parent, log, children, SyncCleanup, tag)
            kids = owner.child_mesh.call_one().get(timeout=30)
        else:
            owner = owners.spawn("owner", ProcOwner, log, tag)
        pid = owner.pid.call_one().get(timeout=60)
        started = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: hooked, timeout=30, what="the owner's death at the hook")
        assert "killed by signal 9 (SIGKILL)" in str(hooked[0])
        if owned == "actor_mesh":
            assert f"actor mesh '{tag}_child' on 'lc_children' (ranks 0, 1)" in str(hooked[0])
            wait_until(lambda: len(events(log)) == 2, timeout=30, what="the cleanups")
            assert sorted(events(log)) == [f"{tag}-child cleanup {r} None" for r in (0, 1)]
            with pytest.raises(SupervisionError, match="stopped"):
                kids.ping.call().get(timeout=30)
        else:
            assert started  # its host agent and rank: children of the owner's process
            wait_until(lambda: _gone(started), timeout=30, what="the owner's processes")
    finally:
        owners.stop()


def test_a_raising_cleanup_is_a_supervision_event(meshes, hooked):
    _, children = meshes
    actors = children.spawn(_name("rc"), RaisingCleanup)
    actors.stop().get(timeout=30)
    wait_until(lambda: len(hooked) >= 2, timeout=30, what="the hook")
    assert len(hooked) == 2  # once per rank
    assert all("cleanup refused" in str(f) and "__cleanup__" in str(f) for f in hooked)


def test_a_constructor_that_does_not_return_fails_after_actor_spawn_max_idle(meshes, hooked):
    """Monarch's ``actor_spawn_max_idle`` (default 30s), timed on the rank from the
    constructor's start: ``spawn()`` returns, the actor fails on that rank (its
    supervision hears of it, calls raise saying why), and the rank's other actors serve
    meanwhile (the constructor holds the main thread: they run on a worker)."""
    assert config.DEFAULTS["actor_spawn_max_idle"] == "30s"
    _, children = meshes
    other = children.spawn(_name("oth"), Exits)
    with config.configured(actor_spawn_max_idle="1s"):
        t0 = time.monotonic()
        slow = children.spawn(_name("slow"), SlowInit, 5.0, [0])
        assert time.monotonic() - t0 < 4.0
    assert [f.rank for f in hooked] == [0]
    assert "constructor did not return within 1s" in str(hooked[0])
    assert other.ok.call().get(timeout=3).values() == ["ok", "ok"]
    for view in (slow, slow.slice(gpus=1)):  # (the actor mesh failed)
        with pytest.raises(SupervisionError, match="did not return within 1s"):
            view.ok.call().get(timeout=30)


def test_slices_of_a_failed_mesh_inherit_its_failure(meshes, hooked):
    _, children = meshes
    bad = children.spawn(_name("bad"), BadInit)
    for view in (bad, bad.slice(gpus=1), bad.flatten("x").slice(x=0)):
        with pytest.raises(SupervisionError, match="constructor refused"):
            view.ok.call().get(timeout=30)
    # an actor failed on rank 0 only: a slice without it serves on
    half = children.spawn(_name("half"), Exits)
    with pytest.raises(SupervisionError, match="boom"):
        half.slice(gpus=0).base.call_one().get(timeout=30)
    with pytest.raises(SupervisionError, match="boom"):
        half.slice(gpus=0).ok.call_one().get(timeout=30)
    assert half.slice(gpus=1).ok.call_one().get(timeout=30) == "ok"


def _stop_and_get(procs: Any) -> None:
    procs.stop().get(timeout=60)


def _stop_and_await(procs: Any) -> None:
    async def stop() -> None:
        await procs.stop()

    asyncio.run(stop())


@pytest.mark.parametrize(
    "cls,stop",
    [(SyncCleanupDel, _stop_and_get), (AsyncCleanupDel, _stop_and_await)],
    ids=["sync-get", "async-await"],
)
def test_stopping_a_proc_mesh_runs_cleanup_then_del(log, cls, stop):
    """Monarch: ``proc_mesh.stop()`` stops every actor on it, so each one's
    ``__cleanup__(None)`` runs (sync, or ``async def`` on its event loop) before the
    process ends; its ``__del__`` after that."""
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name=_name("lc_pstop"))
    try:
        actors = procs.spawn("a", cls, log, "it")
        assert actors.ping.call_one().get(timeout=30) == "pong"
    finally:
        stop(procs)  # done once the rank ended
    assert events(log) == ["it cleanup 0 None", "it del 0"]


def test_actors_of_a_stopped_proc_mesh_fail_with_a_supervision_error(hooked):
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="lc_stopped")
    actors = procs.spawn("a", Exits)
    assert actors.ok.call().get(timeout=30).values() == ["ok", "ok"]
    procs.stop()
    for view in (actors, actors.slice(gpus=1)):
        with pytest.raises(SupervisionError, match="stopped"):
            view.ok.call().get(timeout=30)


# -- exits and crashes ---------------------------------------------------------------

#: how an endpoint ends -> (arguments, what the caller's SupervisionError says)
EXITS = {
    "base": ((), r"ActorExitError: boom"),
    "exit": ((3,), r"raised SystemExit\(3\) \(sys\.exit: exit code 3\)"),
    "os_exit": ((5,), r"the process this actor was running on exited with non-zero code 5"),
    "segfault": ((), r"was killed by signal 11 \(SIGSEGV\)"),
}


@pytest.mark.parametrize("cls", [Exits, AsyncExits], ids=["sync", "async"])
@pytest.mark.parametrize("how", list(EXITS))
def test_exits_and_crashes_name_the_cause_and_other_meshes_run_on(meshes, hooked, cls, how):
    """As Monarch: the caller gets a ``SupervisionError`` (``The actor m/a[0] and all its
    descendants have failed:`` and why, naming the exit code or signal), the failure
    goes to supervision once, later calls fail too (or, for a process that ended, go
    to the rank the failure policy restarted), and other meshes run on."""
    owners, _ = meshes
    bystander = owners.spawn(_name("by"), Exits)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name=_name("lc_exit"))
    try:
        victim = procs.spawn("victim", cls)
        args, says = EXITS[how]
        with pytest.raises(SupervisionError) as err:
            getattr(victim, how).call_one(*args).get(timeout=60)
        text = str(err.value)
        assert re.search(r"The actor lc_exit\d+/victim\[0\] and all its descendants", text)
        assert re.search(says, text), text
        assert bystander.ok.call_one().get(timeout=30) == "ok"
        wait_until(lambda: hooked, timeout=30, what="the failure at the hook")
        assert len(hooked) == 1 and re.search(says.split(" \\(")[0], str(hooked[0]))
        if how in ("base", "exit"):  # the actor is gone, its process runs on
            with pytest.raises(SupervisionError, match="ActorExitError|SystemExit"):
                victim.ok.call_one().get(timeout=30)
            assert procs.spawn("again", cls).ok.call_one().get(timeout=30) == "ok"
    finally:
        procs.stop()
    assert bystander.ok.call_one().get(timeout=30) == "ok"


def test_exit_of_an_endpoint_run_by_a_worker_thread(meshes, hooked):
    """The same ends from an endpoint that ran on a worker thread (the main thread held
    by another actor): only that actor ends."""
    from concurrency_actors import Blocker, Setter

    _, children = meshes
    blocker = children.spawn(_name("blk"), Blocker)
    setter = children.spawn(_name("set"), Setter)
    victim = children.spawn(_name("vic"), Exits)
    name = f"exit{next(_names)}"
    held = blocker.block.call(name, 60)
    with pytest.raises(SupervisionError, match=r"SystemExit\(4\) \(sys\.exit: exit code 4\)"):
        victim.exit.call(4).get(timeout=30)
    assert setter.set.call(name).get(timeout=30).values() == ["set"] * 2
    assert held.get(timeout=30).values() == ["released"] * 2


@pytest.mark.parametrize(
    "level,through", [(logging.INFO, ["INFO", "WARNING"]), (logging.ERROR, [])]
)
def test_logging_option_level_sets_the_root_logger_level_of_every_rank(meshes, level, through):
    """Monarch's ``ProcMesh.logging_option(level=...)``: the root logger's level on every
    rank of the mesh (Monarch's ``LoggerRuntimeActor``), awaitable; bad levels are
    refused before anything is sent."""
    _, children = meshes
    logs = children.spawn(_name("lvl"), Logs)
    try:
        assert asyncio.run(_awaited(children.logging_option(level=level))) is None
        assert logs.levels.call().get(timeout=30).values() == [(level, through)] * 2
    finally:
        children.logging_option(level=logging.WARNING).get(timeout=30)  # Python's default
    assert logs.levels.call().get(timeout=30).values() == [(logging.WARNING, ["WARNING"])] * 2
    with pytest.raises(ValueError, match="Invalid logging level: 256"):
        children.logging_option(level=256)
    with pytest.raises(TypeError, match="logging level number"):
        children.logging_option(level="INFO")


async def _awaited(fut: Any) -> Any:
    return await fut


def test_actor_names_and_log_prefix_are_monarchs(meshes):
    """``str(context().actor_instance)`` is Monarch's ``<root>.<module.Class name{point}>``;
    an actor's ``logging`` records start with ``[actor=<that>] `` unless
    ``config.prefix_python_logs_with_actor`` is off."""
    _, children = meshes
    name = _name("logs")
    actors = children.spawn(name, Logs)
    expected = [f"<root>.<lifecycle_actors.Logs {name}{{'gpus': {r}/2}}>" for r in (0, 1)]
    assert actors.instance.call().get(timeout=30).values() == expected
    assert actors.log.call(True).get(timeout=30).values() == [
        [f"[actor={who}] hello there"] for who in expected
    ]
    assert actors.log.call(False).get(timeout=30).values() == [["hello there"]] * 2
