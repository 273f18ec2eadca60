"""``this_proc()`` in the controller is the controller's own process (Monarch's client):
its actors run here, each on a thread of its own, with the API of actors in ranks
(adverbs, async endpoints, supervision, stop), reachable from ranks; and Monarch's
``Instance.proc_mesh`` and ``HostMesh.is_fake_in_process``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import wait_until

import monarch_kernel.actor as actor_api
from monarch_kernel.actor import (
    Actor,
    ActorError,
    MeshFailure,
    SupervisionError,
    context,
    current_actor_name,
    current_rank,
    endpoint,
    get_or_spawn_controller,
    this_host,
    this_proc,
)

pytestmark = pytest.mark.local

#: Shared by the actors of this process (the test's own, since they run here).
both_in = threading.Barrier(2)
finalized: list[str] = []


class Where(Actor):
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.log: list[str] = []

    @endpoint
    def where(self) -> dict[str, Any]:
        inst = context().actor_instance
        return {
            "pid": os.getpid(),
            "thread": threading.get_ident(),
            "rank": str(current_rank()),
            "id": current_actor_name(),
            "name": inst.name,
            "proc_mesh": (inst.proc_mesh.name, dict(inst.proc_mesh.extent)),
            "tag": self.tag,
        }

    @endpoint
    def meet(self) -> str:
        both_in.wait(timeout=30)  # only if the other actor runs at the same time
        return self.tag

    @endpoint
    def work(self, i: int) -> list[str]:
        self.log.append(f"in {i}")
        time.sleep(0.05)  # work, during which a second call must not start
        self.log.append(f"out {i}")
        return list(self.log)

    @endpoint
    def fail(self, why: str) -> None:
        raise ValueError(why)

    @endpoint
    def abort_me(self, reason: str) -> None:
        context().actor_instance.abort(reason)

    @endpoint
    def exit_me(self) -> None:
        raise SystemExit(3)

    @endpoint
    def self_call(self) -> str:
        me = this_proc().spawn("inner", Where, "inner")  # a child on this process
        mine = me.where.call_one().get()
        return f"{mine['id']} then {self.tag}"

    def __del__(self) -> None:
        finalized.append(self.tag)


class Waiter(Actor):
    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.order: list[str] = []

    @endpoint
    async def wait_for_go(self) -> list[str]:
        self.order.append("waiting")
        await self.go.wait()  # the next call, go(), runs meanwhile
        self.order.append("went")
        return self.order

    @endpoint
    async def release(self) -> None:
        self.order.append("go")
        self.go.set()


@pytest.fixture
def hooked(monkeypatch):
    got: list[MeshFailure] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", got.append)
    yield got
    this_proc().stop()


def test_actors_run_in_this_process_on_threads_of_their_own(hooked):
    a = this_proc().spawn("a", Where, "a")
    b = this_proc().spawn("b", Where, "b")
    here = a.where.call_one().get(timeout=30)
    assert here["pid"] == os.getpid() and here["thread"] != threading.get_ident()
    assert here["rank"] == "{}" and here["id"] == "client/a[0]" and here["name"] == "a"
    assert here["proc_mesh"] == ("client", {})  # Instance.proc_mesh: this process
    assert b.where.call_one().get(timeout=30)["thread"] not in (here["thread"],)
    # Monarch's adverbs on the one-point mesh
    (only,) = a.where.call().get(timeout=30).values()
    assert only["tag"] == "a" and a.where.choose().get(timeout=30)["tag"] == "a"
    assert [f.get(timeout=30)["tag"] for f in a.where.stream()] == ["a"]
    a.where.broadcast()
    # two actors run at the same time (each blocks until the other is in)
    fa, fb = a.meet.call_one(), b.meet.call_one()
    assert (fa.get(timeout=30), fb.get(timeout=30)) == ("a", "b")
    # one actor runs its plain calls one at a time, in order
    f1, f2 = a.work.call_one(1), a.work.call_one(2)
    assert f1.get(timeout=30) == ["in 1", "out 1"]
    assert f2.get(timeout=30) == ["in 1", "out 1", "in 2", "out 2"]
    # an actor calls an actor it spawned on its own process (and nothing waits for itself)
    assert a.self_call.call_one().get(timeout=30) == "client/inner[0] then a"
    proc = this_proc()
    assert len(proc) == 1 and dict(proc.extent) == {} and proc.name == "client"
    assert context().actor_instance.proc_mesh.name == "client"
    assert this_host().is_fake_in_process is False
    assert hooked == []


def test_async_endpoints_interleave_at_await(hooked):
    w = this_proc().spawn("waiter", Waiter)
    waiting = w.wait_for_go.call_one()
    w.release.call_one().get(timeout=30)
    assert waiting.get(timeout=30) == ["waiting", "go", "went"]


def test_failures_go_to_the_hook_and_calls_raise_supervision_error(hooked):
    a = this_proc().spawn("a", Where, "a")
    with pytest.raises(ActorError, match="ValueError in Where.fail on rank 0 of 1"):
        a.fail.call_one("asked").get(timeout=30)  # to the caller, not to supervision
    a.fail.broadcast("nobody waits")
    wait_until(lambda: hooked, timeout=10, what="the fault hook")
    (failure,) = hooked
    assert str(failure).startswith(
        "MeshFailure(mesh_name=client, crashed_ranks=[0], event=Supervision event: actor "
        "client/a[0] failed:\n  Traceback (most recent call last):\n"
    ) and str(failure).endswith("  ValueError: nobody waits\n)"), str(failure)
    assert failure.report().startswith(
        "The actor client/a[0] and all its descendants have failed:\n  Traceback"
    )
    assert a.where.call_one().get(timeout=30)["tag"] == "a"  # it runs on
    # abort(): that call fails, the creator's supervision hears of it, later calls raise
    with pytest.raises(ActorError, match=r"actor 'a' \(Where\) aborted: enough"):
        a.abort_me.call_one("enough").get(timeout=30)
    wait_until(lambda: len(hooked) == 2, timeout=10, what="the abort at the hook")
    with pytest.raises(SupervisionError) as info:
        a.where.call_one().get(timeout=30)
    assert str(info.value) == (
        "Endpoint call a.where() failed, The actor client/a[0] and all its descendants "
        "have failed:\n  actor 'a' (Where) aborted: enough"
    )
    # SystemExit stops that actor only
    b = this_proc().spawn("b", Where, "b")
    with pytest.raises(ActorError, match=r"actor 'b' \(Where\) was stopped: Where.exit_me"):
        b.exit_me.call_one().get(timeout=30)
    with pytest.raises(SupervisionError, match="was stopped"):
        b.where.call_one().get(timeout=30)
    # a stopped actor mesh
    c = this_proc().spawn("c", Where, "c")
    assert c.stop().get(timeout=30) is None
    with pytest.raises(SupervisionError) as info:
        c.where.call().get(timeout=30)
    assert str(info.value) == (
        "Endpoint call c.where() failed, Supervision event: actor client/c[0] has status:\n"
        "  stopped: actor 'c' was stopped (its actor mesh's stop())"
    )
    assert len(hooked) == 2  # once per failure


class Boss(Actor):
    """Spawns workers (on this process or on a mesh of ranks) and supervises them."""

    def __init__(self, handles: bool) -> None:
        self.handles = handles
        self.seen: list[str] = []

    @endpoint
    def start(self, procs: Any = None) -> int:
        self.procs = procs if procs is not None else this_proc()
        self.workers = self.procs.spawn("workers", Where, "worker")
        return len(self.workers)

    @endpoint
    def break_workers(self) -> None:
        self.workers.fail.broadcast("worker bad")

    @endpoint
    def seen_(self) -> list[str]:
        return list(self.seen)

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.seen.append(str(failure))
        return self.handles


@pytest.mark.parametrize("on_ranks", [False, True])
def test_an_actor_here_supervises_the_actors_it_spawned(hooked, on_ranks):
    procs = this_host().spawn_procs(per_host={"gpus": 2}) if on_ranks else None
    n = 2 if on_ranks else 1
    where = f"{procs.name}/workers" if procs is not None else "client/workers"
    try:
        boss = this_proc().spawn("boss", Boss, True)
        assert boss.start.call_one(procs).get(timeout=60) == n
        boss.break_workers.call_one().get(timeout=30)
        wait_until(lambda: len(boss.seen_.call_one().get()) == n, timeout=20, what="supervise")
        seen = boss.seen_.call_one().get(timeout=30)
        assert all(s.startswith(f"MeshFailure(mesh_name={where.split('/')[0]}, ") for s in seen)
        assert all(f"Supervision event: actor {where}[" in s for s in seen)
        assert hooked == []  # handled
        lazy = this_proc().spawn("lazy", Boss, False)
        lazy.start.call_one(procs).get(timeout=60)
        lazy.break_workers.call_one().get(timeout=30)
        wait_until(lambda: len(hooked) == n, timeout=20, what="the fault hook")
        for failure in hooked:  # not handled: the owner failed, naming its child's failure
            assert str(failure).startswith(
                "MeshFailure(mesh_name=client, crashed_ranks=[0], event=Supervision event: "
                "actor client/lazy[0] failed because it did not handle a supervision event "
                "from its child. The child's event was:\n  Supervision event: actor "
                f"{where}["
            ), str(failure)
            assert failure.report().startswith(f"The actor {where}[")
            assert failure.path == ("client/lazy[0]",)
    finally:
        if procs is not None:
            procs.stop()


class Counter(Actor):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    @endpoint
    def add(self, who: Any) -> tuple[int, list[Any]]:
        self.seen.append(who)
        return os.getpid(), list(self.seen)


class RankSide(Actor):
    @endpoint
    def register(self) -> tuple[int, list[Any]]:
        counter = get_or_spawn_controller("counter", Counter).get()
        return counter.add.call_one(current_rank().rank).get()

    @endpoint
    def call_handle(self, counter: Any) -> tuple[int, list[Any]]:
        return counter.add.call_one(f"handle{current_rank().rank}").get()

    @endpoint
    def spawn_there(self, proc: Any) -> str:
        self.child = proc.spawn("from_rank", Where, "from_rank")
        return self.child.where.call_one().get()["id"]

    @endpoint
    def whole(self) -> tuple[str, dict[str, int]]:
        pm = context().actor_instance.proc_mesh
        return pm.name, dict(pm.extent)


def test_ranks_reach_the_actors_of_this_process(hooked, mesh2):
    ranks = mesh2.spawn("ranks", RankSide)
    # get_or_spawn_controller from ranks: the singleton runs in this process
    for gpu in (0, 1):
        pid, seen = ranks.slice(gpus=gpu).register.call_one().get(timeout=60)
        assert pid == os.getpid() and seen[-1] == gpu
    mine = get_or_spawn_controller("counter", Counter).get()
    assert mine.add.call_one("controller").get(timeout=30)[1] == [0, 1, "controller"]
    # a handle passed as an argument; a rank spawns on this process
    assert ranks.slice(gpus=1).call_handle.call_one(mine).get(timeout=30)[1][-1] == "handle1"
    assert ranks.slice(gpus=0).spawn_there.call_one(this_proc()).get(timeout=30) == (
        "client/from_rank[0]"
    )
    assert "from_rank" in this_proc()._requester.actors  # type: ignore[attr-defined]
    # Instance.proc_mesh in a rank: its whole process mesh
    assert ranks.whole.call().get(timeout=30).values() == [(mesh2.name, {"gpus": 2})] * 2
    assert hooked == []


def test_stopping_this_proc_runs_finalizers_and_a_new_one_follows(hooked):
    finalized.clear()
    proc = this_proc()
    a = proc.spawn("a", Where, "fin_a")
    proc.spawn("b", Where, "fin_b")
    assert a.where.call_one().get(timeout=30)["tag"] == "fin_a"
    assert proc.stop().get(timeout=30) is None
    wait_until(lambda: sorted(finalized) == ["fin_a", "fin_b"], timeout=10, what="__del__")
    assert proc.stopped
    with pytest.raises(SupervisionError, match="this_proc\\(\\) of the controller was stopped"):
        a.where.call_one().get(timeout=30)
    fresh = this_proc()
    assert not fresh.stopped
    assert fresh.spawn("c", Where, "c").where.call_one().get(timeout=30)["id"] == "client/c[0]"


# -- as Monarch programs run: a plain Python program, the monarch kernel -------------------

REPO = Path(__file__).resolve().parent.parent


def test_a_plain_python_program_runs_its_actors_in_its_own_process():
    tag = uuid.uuid4().hex  # every process the program starts inherits it
    env = {**os.environ, "MK_THIS_PROC_TAG": tag}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    script = REPO / "tests" / "scripts" / "this_proc_program.py"
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("[rank ")]
    assert lines == ["tally runs here: True", "tally 3", "local 5", "this_proc program done"]

    def tagged() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("MK_THIS_PROC_TAG") == tag and p.status() != "zombie":
                    out.append(p)
        return out

    wait_until(lambda: not tagged(), timeout=10, what="the program's processes to exit")


TALKER = """
import os
from monarch_kernel.actor import Actor, endpoint, this_proc

class Talker(Actor):
    @endpoint
    def say(self, text):
        print(text)
        return os.getpid()

    @endpoint
    def fail(self, why):
        raise ValueError(why)

    @endpoint
    def die(self):
        os._exit(1)

here = this_proc().spawn("here", Talker)
"""


def test_in_the_monarch_kernel_output_and_failures_show_under_the_cell():
    from kernel_client import Kernel

    kernel = Kernel()
    try:
        assert not kernel.run(TALKER).errors
        r = kernel.run("here.say.call_one('said in the kernel process').get() == os.getpid()")
        assert r.text == "True" and "said in the kernel process" in r.stdout, r.stderr
        # a failure nobody waits for: the default hook prints it under the cell that caused
        # it, and the kernel runs on
        cell = kernel.submit("here.fail.broadcast('nobody waits')")
        kernel.wait_for_output(
            cell,
            "unhandled failure: MeshFailure(mesh_name=client, crashed_ranks=[0], event="
            "Supervision event: actor client/here[0] failed:",
            "ValueError: nobody waits",
        )
        assert not kernel.collect(cell).errors
        # ... and of a rank: under the cell that is running when it comes
        r = kernel.run("%mesh m --gpus 1")
        assert "ready" in r.stdout, r.stderr + r.error_text
        assert not kernel.run("far = m.spawn('far', Talker)").errors
        cell = kernel.submit("far.fail.broadcast('a rank fails')")
        kernel.wait_for_output(
            cell,
            "unhandled failure: MeshFailure(mesh_name=m, crashed_ranks=[0], event=Supervision "
            "event: actor m/far[0] failed:",
            "ValueError: a rank fails",
            timeout=60,
        )
        assert not kernel.collect(cell).errors
        # The rank's death comes in a cell of its own: a process that calls os._exit()
        # right after sending a failure can take that message down with its ZeroMQ I/O
        # thread, so the two in one cell would race. The kernel's failure policy
        # restarts the rank within milliseconds: its restart count tells it died.
        cell = kernel.submit(
            "import time\n"
            "r0 = m.runtime.ranks[0]\n"
            "before = r0.restarts\n"
            "far.die.broadcast()\n"
            "deadline = time.monotonic() + 30\n"
            "while r0.alive and r0.restarts == before and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "'rank 0 died' if time.monotonic() < deadline else 'rank 0 did not die'"
        )
        kernel.wait_for_output(
            cell,
            "unhandled failure: MeshFailure(mesh_name=m, crashed_ranks=[0], event=Supervision "
            "event: actor m[0] failed:\n  the process this actor was running on exited with "
            "non-zero code 1",
            timeout=60,
        )
        assert kernel.collect(cell).text == "'rank 0 died'"
        assert kernel.run("1 + 1").text == "2"  # the kernel never exits for a failure
        assert kernel.km.is_alive()
    finally:
        kernel.shutdown_and_check()
