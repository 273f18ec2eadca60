"""Rank and host-agent robustness: what user code can do to a rank, and how ranks end.

BaseException in an actor stops only that actor; ``sys.exit`` codes; a graceful stop
(SIGTERM, ``atexit``, ``destroy_process_group``, SIGKILL after the grace); heartbeats
and free ports from the host agent; one grouped error for unpicklable results;
``input()`` forwarded to the notebook; process-group abort and re-form.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import getpass
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from actors import Worker
from conftest import pid_alive
from helpers import wait_for_rank_line, wait_until

from monarch_kernel.actor import (
    Actor,
    ActorError,
    ProcMesh,
    RankDiedError,
    SupervisionError,
    current_rank,
    endpoint,
    this_host,
)
from monarch_kernel.controller.state.events import InputRequested
from monarch_kernel.kernel.remote import RemoteJob
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.ports import PortReservation

pytestmark = pytest.mark.local


class Stopper(Actor):
    """Raises BaseExceptions that are no Exception."""

    def __init__(self, exit_in_init_on: int = -1):
        if current_rank().rank == exit_in_init_on:
            raise SystemExit(9)
        self.calls = 0

    @endpoint
    def exit(self, code: int, ranks: list[int]) -> int:
        self.calls += 1
        if current_rank().rank in ranks:
            raise SystemExit(code)
        return self.calls

    @endpoint
    def custom(self) -> None:
        raise Abandon("gave up")

    @endpoint
    def interrupt(self) -> None:
        raise KeyboardInterrupt

    @endpoint
    def calls_so_far(self) -> int:
        return self.calls


class Abandon(BaseException):
    """A user's BaseException subclass."""


class Stubborn(Actor):
    @endpoint
    def ignore_sigterm_and_sleep(self, seconds: float) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(seconds)


def run_cell(procs: ProcMesh, code: str, timeout: float = 30) -> list[Any]:
    """Run ``code`` as a ``%%remote`` cell on ``procs``; the cell values, by rank."""
    return start_cell(procs, code).wait(timeout).values()


def start_cell(procs: ProcMesh, code: str) -> RemoteJob:
    return RemoteJob(procs, code, "t", None).start()


def _is_busy(procs: ProcMesh, rank: int) -> bool:
    return procs.runtime.ranks[rank].state == "busy"


@contextlib.contextmanager
def intercept(procs: ProcMesh, kind: str, keep: bool = False) -> Iterator[list[dict[str, Any]]]:
    """Record the headers of messages of ``kind`` that reach the controller while the
    block runs (``_at``: when each arrived). The controller's own handling, if any, is
    skipped unless ``keep``."""
    handlers = procs.runtime.inbound._handlers
    seen: list[dict[str, Any]] = []
    before = handlers.get(kind)

    def record(h: dict[str, Any], msg: Any) -> None:
        seen.append({**h, "_at": time.monotonic()})
        if keep and before is not None:
            before(h, msg)

    handlers[kind] = record
    try:
        yield seen
    finally:
        if before is None:
            handlers.pop(kind, None)
        else:
            handlers[kind] = before


@contextlib.contextmanager
def input_requests(procs: ProcMesh) -> Iterator[list[dict[str, Any]]]:
    """The ranks' input() calls while the block runs, as the controller announces them
    (InputRequested), in the keys of the wire's ``input`` header."""
    seen: list[dict[str, Any]] = []

    def record(e: Any) -> None:
        seen.append(
            {"r": e.rank, "i": e.request, "n": e.serial, "p": e.prompt, "pw": int(e.password)}
        )

    procs.runtime.events.subscribe(record, InputRequested)
    try:
        yield seen
    finally:
        procs.runtime.events.unsubscribe(record)


@pytest.fixture
def mesh4():
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    yield procs
    procs.stop()


# -- BaseException in actors -----------------------------------------------------------


def test_base_exception_in_an_endpoint_stops_only_that_actor(procs4):
    stoppers = procs4.spawn("s", Stopper)
    workers = procs4.spawn("w_robust", Worker)
    pids = workers.pid.call().get().values()
    with pytest.raises(SupervisionError) as err:  # Monarch's: the actor failed
        stoppers.exit.call(3, [1]).get(timeout=10)
    text = str(err.value)
    assert text.startswith(
        f"Endpoint call s.exit() failed, The actor {procs4.name}/s[1] and all its "
        "descendants have failed:\n"
    ), text
    assert "actor 's' (Stopper) was stopped: its endpoint raised SystemExit(3)" in text
    assert "other actors on this rank keep running" in text
    # the rank lives on, with its other actors; the stopped actor is gone on rank 1 only
    assert workers.pid.call().get(timeout=10).values() == pids
    assert workers.slice(gpus=1).echo.call_one("still here").get(timeout=10) == "still here"
    with pytest.raises(SupervisionError) as gone:  # later calls say why it is gone
        stoppers.slice(gpus=1).calls_so_far.call_one().get(timeout=10)
    assert str(gone.value).startswith(
        f"Endpoint call s.calls_so_far() failed, The actor {procs4.name}/s[1] and all its "
        "descendants have failed:\n  actor 's' (Stopper) was stopped: its endpoint raised "
        "SystemExit(3)"
    ), str(gone.value)
    assert stoppers.slice(gpus=0).calls_so_far.call_one().get(timeout=10) == 1
    # a custom BaseException on two ranks: one grouped error, both actors stopped
    with pytest.raises(SupervisionError) as err:
        stoppers.slice(gpus=slice(0, 4, 2)).custom.call().get(timeout=10)
    text = str(err.value)
    assert text.count("raised Abandon('gave up')") == 1, text  # grouped: said once
    assert "(on rank(s) 0, 2 of 2)" in text, text
    assert workers.pid.call().get(timeout=10).values() == pids


def test_keyboard_interrupt_in_an_endpoint_keeps_the_actor(procs4):
    stoppers = procs4.spawn("k", Stopper)
    with pytest.raises(ActorError, match="KeyboardInterrupt in Stopper.interrupt") as err:
        stoppers.slice(gpus=2).interrupt.call_one().get(timeout=10)
    assert "was stopped" not in str(err.value)
    assert stoppers.slice(gpus=2).calls_so_far.call_one().get(timeout=10) == 0


def test_base_exception_in_a_constructor_fails_the_spawn_not_the_rank(procs4):
    workers = procs4.spawn("w_ctor", Worker)
    pids = workers.pid.call().get().values()
    bad = procs4.spawn("bad_ctor", Stopper, 3)  # returns, as Monarch's
    with pytest.raises(SupervisionError) as err:
        bad.exit.call(0, []).get(timeout=10)
    assert "Stopper.__init__ raised SystemExit" in str(err.value)
    assert "its constructor raised SystemExit(9)" in str(err.value)
    assert workers.pid.call().get(timeout=10).values() == pids


# -- how ranks end -----------------------------------------------------------------------


def test_sys_exit_in_a_cell_ends_the_rank_with_its_code(mesh4):
    cases = {1: ("sys.exit()", 0), 2: ("sys.exit(5)", 5), 3: ("sys.exit('bye bye')", 1)}
    for r, (call, code) in cases.items():
        with pytest.raises(RankDiedError) as err:
            run_cell(mesh4.slice(gpus=r), f"import sys\n{call}")
        assert f"exit code {code}" in str(err.value)
        assert err.value.death is not None and err.value.death.code == code
    assert "bye bye" in str(err.value)  # the message went to stderr: in the last lines
    death = err.value.death
    assert death is not None
    assert "bye bye" in death.tail  # from the error: the rank itself is restarted by now
    assert run_cell(mesh4.slice(gpus=0), "'alive'") == ["alive"]


def test_stop_runs_atexit_handlers_and_destroys_the_process_group(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        pids = procs.ping().get(timeout=10).values()
        run_cell(
            procs,
            "import atexit, weakref, torch.distributed as dist\n"
            "from monarch_kernel.actor import current_rank\n"
            "dist.init_process_group('gloo')\n"
            f"path = {str(tmp_path)!r} + f'/rank{{current_rank().rank}}'\n"
            "def bye():\n"
            "    with open(path + '.atexit', 'w') as f:\n"
            "        f.write(f'pg live: {dist.is_initialized()}')\n"
            "atexit.register(bye)\n"
            "class Thing: pass\n"
            "thing = Thing()\n"
            "weakref.finalize(thing, lambda: open(path + '.finalizer', 'w').close())\n",
        )
        assert [p["pg"] for p in procs.ping().get(timeout=10).values()] == ["gloo"] * 2
    finally:
        with intercept(procs, K.RANK_EXIT, keep=True) as exits:
            procs.stop()
    # they ended cleanly, by the SIGTERM they were sent: an expected end
    assert sorted((e["r"], e["sig"], e["expected"]) for e in exits) == [
        (0, signal.SIGTERM, True),
        (1, signal.SIGTERM, True),
    ]
    for r in range(2):
        assert (tmp_path / f"rank{r}.atexit").read_text() == "pg live: False"
        assert (tmp_path / f"rank{r}.finalizer").exists()
        assert not pid_alive(pids[r]["pid"])
    assert all(info.state == "stopped" for info in procs.runtime.ranks)


def test_stop_kills_a_rank_that_ignores_sigterm_after_the_grace():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    grace = 1.5
    try:
        stubborn = procs.spawn("stubborn", Stubborn)
        pid = procs.slice(gpus=1).ping().get(timeout=10).values()[0]["pid"]
        fut = stubborn.slice(gpus=1).ignore_sigterm_and_sleep.call_one(60)
        wait_for_rank_line(procs, 1, "ignoring SIGTERM")
    finally:
        t0 = time.monotonic()
        procs.runtime.transport.send_host(0, {"k": K.STOP, "grace": grace})
        procs.stop()
        took = time.monotonic() - t0
    # killed once the grace is over, not when its 60 s sleep ends
    assert grace - 0.2 < took < 30, f"stop took {took:.1f}s"
    assert not pid_alive(pid)
    with pytest.raises(Exception, match="stopped|died"):
        fut.get(timeout=1)


# -- host agent --------------------------------------------------------------------------


def test_host_agent_heartbeats_twice_a_second_and_answers_new_port(procs4):
    host = procs4.runtime.hosts[0]
    seen = [host.last_seen]
    end = time.monotonic() + 2.2
    while time.monotonic() < end:  # when the controller last heard the agent
        if host.last_seen != seen[-1]:
            seen.append(host.last_seen)
        time.sleep(0.02)
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert len(seen) >= 4 and max(gaps) < 0.8, gaps
    port = procs4.runtime.new_port(0)
    assert isinstance(port, int) and 0 < port < 65536


# -- errors ------------------------------------------------------------------------------


def test_unpicklable_results_of_many_ranks_are_one_grouped_error(procs4):
    workers = procs4.spawn("w_pickle", Worker)
    with pytest.raises(ActorError) as err:
        workers.unpicklable.call().get(timeout=10)
    text = str(err.value)
    heads = [ln for ln in text.splitlines() if ln.startswith("SerializationError")]
    assert len(heads) == 1, text
    assert "SerializationError in Worker.unpicklable on ranks 0-3 of 4:" in heads[0]
    assert "result of Worker.unpicklable cannot be pickled" in heads[0]
    with pytest.raises(ActorError) as err:
        run_cell(procs4, "import threading\nthreading.Lock()")
    heads = [ln for ln in str(err.value).splitlines() if ln.startswith("SerializationError")]
    assert len(heads) == 1 and "on ranks 0-3 of 4" in heads[0], str(err.value)
    assert "value of the cell's last expression cannot be pickled" in heads[0]


# -- input() -----------------------------------------------------------------------------


def test_input_getpass_and_stdin_are_asked_of_the_notebook(procs4, monkeypatch):
    """A foreground cell's job answers its ranks' input() with the notebook's input()
    (here the test's stand-in for a person typing), in the cell's own thread."""
    rank1 = procs4.slice(gpus=1)
    typed: list[str] = []
    prompts: list[str] = []

    def person(prompt: str = "") -> str:
        prompts.append(prompt)
        line = typed.pop(0)
        if line == "<refuse>":
            raise EOFError("this notebook does not take input")
        if line == "<slow>":
            time.sleep(1.0)
            return "too late"
        return line

    monkeypatch.setattr(builtins, "input", person)
    monkeypatch.setattr(getpass, "getpass", person)
    with input_requests(procs4) as asked:
        typed.append("bob")
        job = start_cell(rank1, "print('before', flush=True)\nname = input('name? ')\nname.upper()")
        assert job.wait(10).values() == ["BOB"]
        h = asked.pop()
        assert (h["r"], h["i"], h["p"], h["pw"]) == (1, job.request_id, "name? ", 0)
        assert prompts.pop() == "[rank 1] name? "

        typed.append("<refuse>")
        job = start_cell(rank1, "import getpass\ngetpass.getpass()")
        with pytest.raises(ActorError, match="EOFError.*this notebook does not take input"):
            job.wait(10)
        h = asked.pop()
        assert (h["p"], h["pw"]) == ("Password: ", 1)

        typed.append("a line")
        job = start_cell(rank1, "import sys\nsys.stdin.isatty(), sys.stdin.readline()")
        assert job.wait(10).values() == [(False, "a line\n")]
        assert asked.pop()["p"] == ""

        # cancelled while it waits (nobody waits on the job to answer): the rank lives on
        pid = rank1.ping().get(timeout=10).values()[0]["pid"]
        job = start_cell(rank1, "input('waiting> ')")
        wait_until(lambda: asked, timeout=10, what="the rank's input request")
        job.cancel()
        with pytest.raises(ActorError, match="KeyboardInterrupt"):
            job.future.get(10)
        assert rank1.ping().get(timeout=10).values()[0]["pid"] == pid
        asked.clear()

        # an answer that comes too late: EOFError after the rank's timeout
        typed.append("<slow>")
        job = start_cell(
            rank1,
            "import monarch_kernel.rank.stdio.stdin as s\ns.INPUT_TIMEOUT = 0.3\n"
            "try:\n    input()\nfinally:\n    s.INPUT_TIMEOUT = 600.0",
        )
        with pytest.raises(ActorError) as err:
            job.wait(10)
        assert "input() on rank 1: no answer from the notebook in 0.3 s" in str(err.value)
    assert run_cell(rank1, "'alive'") == ["alive"]


# -- process groups ----------------------------------------------------------------------


def _ranks_of(spans: str) -> set[int]:
    """``"0-2, 5"`` -> ``{0, 1, 2, 5}`` (rank lists as errors write them)."""
    ranks: set[int] = set()
    for part in spans.split(","):
        first, _, last = part.strip().partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def test_abort_releases_peers_and_the_group_reforms(procs4):
    sum_code = (
        "import torch, torch.distributed as dist\n"
        "from monarch_kernel.actor import current_rank\n"
        "t = torch.tensor([float(current_rank().rank + 1)])\n"
        "dist.all_reduce(t)\n"
        "t.item()"
    )
    run_cell(procs4, "import torch.distributed as dist\ndist.init_process_group('gloo')")
    assert run_cell(procs4, sum_code) == [10.0] * 4
    pings = procs4.ping().get(timeout=10).values()
    assert [(p["pg"], p["pg_live"]) for p in pings] == [("gloo", True)] * 4
    # ranks 0-2 wait in a collective for rank 3, which is idle: abort the group on
    # every rank (what the controller does when a rank fails), they are released
    stuck = start_cell(procs4.slice(gpus=slice(0, 3)), sum_code)
    for r in range(3):
        wait_until(functools.partial(_is_busy, procs4, r), timeout=10)
    time.sleep(0.2)  # inside all_reduce by now
    assert not stuck.done()
    for r in range(4):
        procs4.runtime.send_control(r, {"k": K.ABORT_PG})
    # the group is re-formable (gloo on CPU): the abort fails the pending collective on
    # ranks 0-2. The aborts reach the ranks one after another, so a rank whose peers
    # aborted first may see its collective fail by their closed connections just before
    # its own abort arrives: that is reported as the collective's error, saying why.
    with pytest.raises(ActorError) as failed:
        stuck.wait(30)
    text = str(failed.value)
    failed_ranks: dict[str, set[int]] = {}
    for kind, spans in re.findall(r"^(\w+) in the cell on ranks? ([\d,\- ]+) of 3", text, re.M):
        failed_ranks.setdefault(kind, set()).update(_ranks_of(spans))
    assert set().union(*failed_ranks.values()) == {0, 1, 2}, text
    assert set(failed_ranks) <= {"ProcessGroupAborted", "RuntimeError"}, text
    assert "ProcessGroupAborted" in failed_ranks, text
    assert "the mesh aborted the process group" in text, text
    if "RuntimeError" in failed_ranks:
        assert "(another rank aborted its process group, or died)" in text, text
    # the failure policy formed the group again in place (no rank was restarted)
    procs4.runtime.wait_recovered(30)
    pings = procs4.ping().get(timeout=10).values()
    assert [(p["pg"], p["pg_live"]) for p in pings] == [("gloo", True)] * 4
    # re-form on every rank at a fresh port, then collectives work again
    with PortReservation() as hold:  # held until rank 0's store listens on it
        backends = run_cell(
            procs4,
            "from monarch_kernel.rank.pg.distributed import reform_process_group\n"
            f"reform_process_group('127.0.0.1', {hold.port})",
        )
    assert backends == ["gloo"] * 4
    assert run_cell(procs4, sum_code) == [10.0] * 4
    run_cell(procs4, "dist.destroy_process_group()")


def test_sigterm_in_a_flood_of_output_ends_the_rank():
    """A SIGTERM while the main thread sends is deferred to the end of that send: in
    the middle of a flood of output it still ends the rank, at once."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        pid = procs.ping().get(timeout=10).values()[0]["pid"]
        job = start_cell(procs, "while True:\n    print('x' * 200)")
        wait_for_rank_line(procs, 0, "xxxx")
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not pid_alive(pid), timeout=5, what="the rank to exit on SIGTERM")
        with pytest.raises(RankDiedError) as err:
            job.wait(5)
        assert err.value.death is not None and err.value.death.signal == signal.SIGTERM
    finally:
        procs.stop()
