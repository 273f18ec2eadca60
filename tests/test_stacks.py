"""The hang doctor: ``%mesh stacks`` and the dashboard's Stacks button, on real ranks.

Every selected rank's Python stacks (all threads), grouped by identical stacks with the
odd ones out marked, within a second: from the ranks' control threads while they run
Python or sleep, through their host agents' faulthandler dump while C code holds the
GIL, and an error naming the death for a dead rank.
"""

from __future__ import annotations

import faulthandler
import threading
import time

import pytest
from conftest import wait_no_orphans
from helpers import wait_for_rank_line, wait_until
from test_dashboard import WidgetKernel

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.widgets.stacks_view import StacksView, mesh_stacks
from monarch_kernel.wire.stacks import (
    Frame,
    RankStacks,
    ThreadStack,
    capture_stacks,
    parse_faulthandler,
)


def _patient() -> type[Actor]:
    """The actor class, defined here so that it pickles by value (ranks do not import
    this test module)."""

    def stuck_here(seconds: float) -> None:
        print("parked", flush=True)
        time.sleep(seconds)

    def hold_the_gil_in_c() -> None:
        """Deadlock in C code without releasing the GIL: a default pthread mutex locked
        twice by the same thread (ctypes.PyDLL keeps the GIL during the call)."""
        import ctypes

        libc = ctypes.PyDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed = PTHREAD_MUTEX_INITIALIZER
        print("locking", flush=True)
        time.sleep(0.3)  # the line above reaches the controller first
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)

    class Patient(Actor):
        @endpoint
        def park(self, seconds: float) -> None:
            stuck_here(seconds)

        @endpoint
        def deadlock(self) -> None:
            hold_the_gil_in_c()

        @endpoint
        def die(self) -> None:
            import os

            os._exit(3)

    return Patient


def _functions(rs: RankStacks) -> list[str]:
    return [f.function for t in rs.threads for f in t.frames]


def _main(rs: RankStacks) -> ThreadStack:
    return next(t for t in rs.threads if t.main)


# -- no ranks --------------------------------------------------------------------------


@pytest.mark.unit
def test_faulthandler_dump_parses_like_a_python_capture(tmp_path):
    release = threading.Event()

    def parked_in_helper() -> None:
        release.wait(10)

    helper = threading.Thread(target=parked_in_helper, name="helper")
    helper.start()
    try:
        with open(tmp_path / "dump", "w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read()
        captured = capture_stacks(threading.get_ident())
    finally:
        release.set()
        helper.join()
    parsed = parse_faulthandler(text)
    main = parsed[0]
    assert main.main and main.name == "MainThread" and sum(t.main for t in parsed) == 1
    me = "test_faulthandler_dump_parses_like_a_python_capture"
    assert main.frames[-1].function == me  # innermost last, like a traceback
    helper_stack = next(
        t for t in parsed if any(f.function == "parked_in_helper" for f in t.frames)
    )
    assert helper_stack.frames[0].filename.endswith("threading.py")  # outermost first
    # the same thread seen by capture_stacks: same frames (faulthandler has no lines/names)
    same = next(t for t in captured if t.ident == helper_stack.ident)
    assert same.name == "helper" and not same.main
    assert [f.key for f in same.frames] == [f.key for f in helper_stack.frames]
    assert all(t.ident != threading.get_ident() for t in captured)  # the capturer skipped


@pytest.mark.unit
def test_a_dump_of_the_signalled_thread_alone_parses_as_the_main_thread(tmp_path):
    """The host agent's fallback dump: the main thread's own stack, no thread id."""

    def parked_here() -> str:
        with open(tmp_path / "dump", "w+") as f:
            faulthandler.dump_traceback(f, all_threads=False)
            f.seek(0)
            return f.read()

    text = parked_here()
    assert text.startswith("Stack (most recent call first):")
    (main,) = parse_faulthandler(text)
    assert main.main and main.name == "MainThread" and main.ident == 0
    assert [f.function for f in main.frames[-2:]] == [
        "test_a_dump_of_the_signalled_thread_alone_parses_as_the_main_thread",
        "parked_here",
    ]
    # the agent signals twice, so that the second header proves the first dump whole:
    # the first is taken, the second may be cut short
    second = text.replace("parked_here", "parked_later")
    (first,) = parse_faulthandler(text + second[: len(second) // 2])
    assert first.frames == main.frames


# A process that registers the rank's stacks dump, as a rank does, and whose other
# threads keep starting, ending and calling functions: what a dump of every thread from
# a signal handler crashed on (SIGSEGV within a few hundred dumps, and once at 1,024
# ranks under ``%mesh stacks``).
_CHURNING = """
import sys, threading, time
from monarch_kernel.rank.forked import _register_stacks_dump

def calls(n):
    return calls(n - 1) + 1 if n else sum(x for x in range(3))

def busy():
    while True:
        calls(30)

def short_lived():
    while True:
        t = threading.Thread(target=calls, args=(10,))
        t.start()
        t.join()

_register_stacks_dump(sys.argv[1])
for target in (busy, busy, short_lived, short_lived):
    threading.Thread(target=target, daemon=True).start()

def parked_in_main():
    print("ready", flush=True)
    time.sleep(120)

parked_in_main()
"""


def test_the_agents_dump_is_safe_while_other_threads_run_python(tmp_path):
    import subprocess
    import sys

    from monarch_kernel.host.stacks import dump_stacks

    log = str(tmp_path / "rank0.log")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHURNING, log], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for i in range(300):
            dumped = dict(dump_stacks({0: proc.pid}, {0: log}, wait=5.0))
            assert proc.poll() is None, f"died at dump {i}: {proc.returncode}"
            (main,) = dumped[0]  # the main thread only, always: it got the signal
            assert main.main and main.frames[-1].function == "parked_in_main", main
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_grouping_marks_the_odd_ones_out():
    def rank(r: int, *functions: str) -> RankStacks:
        frames = tuple(Frame("/u/train.py", i + 1, fn, f"{fn}()") for i, fn in enumerate(functions))
        return RankStacks(r, "h", 100 + r, (ThreadStack("MainThread", r, True, frames),), "python")

    stacks = [rank(r, "main", "all_reduce") for r in (0, 1, 2, 4, 5, 6, 7)]
    stacks.append(rank(3, "main", "load_batch"))
    view = StacksView("m", stacks, 0.01)
    assert [g.ranks for g in view.groups] == [(0, 1, 2, 4, 5, 6, 7), (3,)]
    assert [g.odd for g in view.groups] == [False, True] and view.odd_ranks == [3]
    text = repr(view)
    assert (
        "ranks 0-2, 4-7 (7 of 8)\n" in text
        and "rank 3 (1 of 8) [h, pid 103]  << odd one out" in text
    )
    assert text.index("in main") < text.index("in load_batch")  # innermost frame last
    html = view._repr_html_()
    assert html.count("odd one out") == 1 and "load_batch()" in html


@pytest.mark.unit
def test_ranks_without_stacks_are_odd_however_many():
    """On an overloaded machine most ranks may not answer in time: the few that did
    are the reference, and the silent ones the odd ones out, not the other way round."""
    idle = (Frame("/x/monarch_kernel/rank/inbox.py", 1, "run"),)
    answered = [
        RankStacks(r, "h", 100 + r, (ThreadStack("MainThread", r, True, idle),), "python")
        for r in (0, 1)
    ]
    silent = [
        RankStacks(r, "h", 100 + r, (), "none", "did not answer within 1.0s") for r in range(2, 8)
    ]
    view = StacksView("m", answered + silent, 1.0)
    assert [(g.ranks, g.odd) for g in view.groups] == [((0, 1), False), ((2, 3, 4, 5, 6, 7), True)]
    assert view.summary() == "odd ranks out: 2-7 (6 of 8)"
    # no rank answered (a stopped mesh): nothing to compare with, the biggest group leads
    view = StacksView("m", silent, 1.0)
    assert [g.odd for g in view.groups] == [False] and view.odd_ranks == []


# -- real ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def procs8():
    procs = this_host().spawn_procs(per_host={"gpus": 8})
    yield procs
    procs.stop()
    left = wait_no_orphans()
    assert not left, f"mesh left processes behind: {[p.pid for p in left]}"


def test_a_sleeping_rank_stands_out_among_idle_ones(procs8):
    patients = procs8.spawn("patients", _patient())
    fut = patients.slice(gpus=2).park.call_one(60)
    wait_for_rank_line(procs8, 2, "parked")

    def parked() -> StacksView | None:  # (its line can come before it is in the sleep)
        view = mesh_stacks(procs8.runtime)
        main = next((t for t in view.stacks[2].threads if t.main), None)
        here = main.frames[-1].line if main is not None and main.frames else None
        return view if here == "time.sleep(seconds)" else None

    view = wait_until(parked, timeout=10, what="rank 2 in its sleep")
    assert [g.ranks for g in view.groups] == [(0, 1, 3, 4, 5, 6, 7), (2,)]
    idle, odd = view.groups
    assert not idle.odd and _main(idle.stacks).idle and odd.odd
    assert {rs.source for rs in view.stacks} == {"python"}
    assert "stuck_here" in _functions(odd.stacks)
    assert _main(odd.stacks).frames[-1].line == "time.sleep(seconds)"
    # a selection of ranks
    view = mesh_stacks(procs8.runtime, [0, 1, 2, 3])
    text = repr(view)
    assert "ranks 0-1, 3 (3 of 4)\n  MainThread: idle (waiting for work)" in text, text
    assert "rank 2 (1 of 4)" in text and "<< odd one out" in text
    assert "in stuck_here\n        time.sleep(seconds)" in text
    assert "internal frames" in text and "runpy" not in text  # our own frames collapsed
    assert "rank-control" not in text  # the capturing thread itself is not shown
    html = view._repr_html_()
    assert "odd one out" in html and "stuck_here" in html and "border-left:4px solid" in html
    procs8.interrupt()
    with pytest.raises(Exception, match="KeyboardInterrupt"):
        fut.get(timeout=10)


@pytest.fixture
def procs3():
    procs = this_host().spawn_procs(per_host={"gpus": 3}, on_failure="continue")
    yield procs
    procs.stop()


def test_a_rank_stuck_in_c_holding_the_gil_shows_through_faulthandler(procs3):
    patients = procs3.spawn("patients", _patient())
    patients.slice(gpus=1).deadlock.call_one()  # never answers
    wait_for_rank_line(procs3, 1, "locking")

    def stuck_view() -> StacksView | None:
        view = mesh_stacks(procs3.runtime)
        return view if view.stacks[1].source == "faulthandler" else None

    view = wait_until(stuck_view, timeout=10, what="rank 1 to hold the GIL in C")
    assert [g.ranks for g in view.groups] == [(0, 2), (1,)] and view.odd_ranks == [1]
    stuck = view.stacks[1]
    assert stuck.error is None and _main(stuck).name == "MainThread"
    assert "hold_the_gil_in_c" in _functions(stuck)
    # source lines are filled in by the controller, from the files it can read
    assert _main(stuck).frames[-1].line == "libc.pthread_mutex_lock(mutex)"
    assert "via faulthandler" in repr(view)
    # a dead rank: its death instead of stacks, and nothing waits on it
    patients.slice(gpus=2).die.call_one()
    wait_until(lambda: not procs3.runtime.ranks[2].alive, what="rank 2 to die")
    view = mesh_stacks(procs3.runtime)
    dead = view.stacks[2]
    assert dead.source == "none" and "died: exit code 3" in (dead.error or "")
    assert view.stacks[1].source == "faulthandler"


# -- through the kernel ----------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel():
    k = WidgetKernel()
    r = k.run("%mesh m --gpus 4")
    assert "ready" in r.stdout, r.stderr + r.error_text
    yield k
    k.shutdown_and_check()


def test_mesh_stacks_magic_and_the_dashboard_button(kernel):
    r = kernel.run(
        "%%remote m --bg\nimport os, time\n"
        "def stuck_here():\n    print('parked', flush=True)\n    time.sleep(60)\n"
        "if int(os.environ['RANK']) == 2:\n    stuck_here()\n"
    )
    assert not r.errors, r.error_text
    kernel.run("%mesh stacks m")  # warm up: the first view imports its modules
    seen: list[str] = []

    def settled():  # rank 2 in stuck_here, the others back to idle (done with the cell)
        res = kernel.run("%mesh stacks m")
        seen.append(res.text)
        return "stuck_here" in res.text and "ranks 0-1, 3 (3 of 4)" in res.text and res

    r = wait_until(settled, timeout=15, what="the stacks to settle", detail=lambda: seen[-1])
    assert "rank 2 (1 of 4)" in r.text, r.text
    assert "<< odd one out" in r.text and "idle (waiting for work)" in r.text
    html = r.results[-1]["data"]["text/html"]
    assert "odd one out" in html and "stuck_here" in html
    r = kernel.run("%mesh stacks m --ranks 2,3")
    assert "rank 3 (1 of 2)" in r.text and "rank 2 (1 of 2)" in r.text
    # the dashboard's button shows the same view
    comm_id, _ = kernel.button("m", "Stacks")
    kernel.click(comm_id)
    kernel.wait_for(lambda: "odd one out" in kernel.html("m", "mk-stacks"), what="stacks view")
    shown = kernel.html("m", "mk-stacks")
    assert "stuck_here" in shown and "ranks 0-1, 3 (3 of 4)" in shown
    kernel.wait_for(lambda: "odd ones out: ranks 2" in kernel.html("m", "mk-status"))
    # bad input: one line
    for code, expected in [
        ("%mesh stacks nope", "no mesh named 'nope'; live meshes: m"),
        ("%mesh stacks m --ranks 9", "rank 9 is out of range: the mesh has 4 ranks (0-3)"),
    ]:
        r = kernel.run(code)
        shown = r.stderr + r.error_text
        assert expected in shown and "Traceback" not in shown, shown
    kernel.run("m.interrupt()")
