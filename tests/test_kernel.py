"""The monarch kernel, started for real through jupyter_client."""

from __future__ import annotations

import re

import pytest
from conftest import pid_alive
from helpers import wait_until
from kernel_client import Kernel, kernel_with_mesh

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def kernel():
    k = kernel_with_mesh("m", 4)
    yield k
    k.shutdown_and_check()


def test_mesh_binds_name_and_lists_meshes(kernel):
    r = kernel.run("type(m).__name__, m.extent")
    assert r.text == "('ProcMesh', {gpus: 4})"  # Monarch's Extent form
    r = kernel.run("%mesh")
    assert "m" in r.text and "gpus=4" in r.text and "4/4" in r.text


def test_remote_state_survives_between_cells_and_last_value_returns(kernel):
    r = kernel.run("%%remote m\nimport os\nx = int(os.environ['RANK'])\nx * 10")
    assert not r.errors, r.error_text
    assert "{gpus=3}: 30" in r.text
    assert "<table" in r.results[-1]["data"]["text/html"]
    r = kernel.run("%%remote m\nx + 1")
    assert "{gpus=0}: 1" in r.text and "{gpus=3}: 4" in r.text
    r = kernel.run("%%remote m\ny = 5")  # no last expression: nothing displayed
    assert not r.results and not r.errors


def test_slices_and_rank_selection(kernel):
    kernel.run("%%remote m\nimport os\nrank = int(os.environ['RANK'])")
    r = kernel.run("%%remote m.slice(gpus=2)\nrank")
    assert r.text.endswith("2)") and "gpus" not in r.text.split(";")[1]
    r = kernel.run("%%remote m --ranks 1,3\nrank")
    assert "{gpus=0}: 1" in r.text and "{gpus=1}: 3" in r.text
    r = kernel.run("%remote m rank * 2")
    assert "{gpus=3}: 6" in r.text


def test_output_is_labelled_and_collapsed(kernel):
    r = kernel.run("%%remote m\nprint('same everywhere')\nprint('rank', rank)")
    assert "[0-3] same everywhere\n" in r.stdout
    for i in range(4):
        assert f"[{i}] rank {i}\n" in r.stdout
    assert r.stdout.count("same everywhere") == 1
    r = kernel.run("%%remote m --group-outputs rank\nprint('a')\nprint('b')")
    assert r.stdout.index("[0] a") < r.stdout.index("[0] b") < r.stdout.index("[1] a")


def test_fd_level_output_reaches_the_cell(kernel):
    r = kernel.run("%%remote m --ranks 0\nimport os\nos.write(1, b'from C code\\n')")
    assert "from C code" in r.stdout


def test_fd_level_output_written_last_in_a_cell_is_never_left_behind(kernel):
    # The cell ends right after the write: the rank's flush must wait until the drain
    # thread has handed the bytes on (it may have read them and not run yet).
    for i in range(15):
        r = kernel.run(f"%%remote m\nimport os\nos.write(1, b'fd line {i}\\n')")
        assert r.stdout.count(f"fd line {i}\n") == 1, (i, r.stdout)
    # more than a pipe holds, ending in a NUL (a flush mark starts with one)
    flood = "os.write(1, b'y' * 200_000 + b'\\nlast of the flood\\x00\\n')"
    r = kernel.run(f"%%remote m --ranks 0\nimport os\n{flood}")
    assert "last of the flood" in r.stdout, r.stdout[-300:]
    assert "mk-fd-flush" not in r.stdout


def test_grouped_error_points_at_cell_line_and_lists_tensors(kernel):
    code = (
        "%%remote m\n"
        "import torch\n"
        "a = torch.ones(2, 3)\n"
        "b = torch.ones(4, 5)\n"
        "if rank in (1, 3):\n"
        "    a @ b\n"
    )
    r = kernel.run(code)
    assert r.reply["status"] == "error"
    text = r.error_text
    assert "RuntimeError in the cell on ranks 1, 3 of 4" in text
    assert text.count("RuntimeError in the cell") == 1
    assert "line 6, in <module>" in text and "a @ b" in text  # the line as seen in the cell
    assert "a: shape (2, 3) float32 on cpu" in text
    assert "monarch_kernel/" not in text  # no internal frames
    r = kernel.run("%remote m rank")  # the kernel and the ranks are fine
    assert "{gpus=3}: 3" in r.text


@pytest.mark.parametrize(
    "code,expected",
    [
        ("%%remote nope\n1", "no mesh named 'nope'; live meshes: m"),
        ("%%remote m --ranks 9\n1", "rank 9 is out of range: the mesh has 4 ranks (0-3)"),
        ("%%remote m --ranks x\n1", "bad --ranks 'x': rank 'x' is not an integer"),
        ("%%remote m.slice(gpus=slice(0, 2)) --ranks 2\n1", "the mesh has 2 ranks (0-1)"),
        ("%mesh restart m --ranks 7", "rank 7 is out of range: the mesh has 4 ranks (0-3)"),
        ("%%remote m --bogus\n1", "unknown option --bogus"),
        ("%%remote m.slice(hosts=0)\n1", "no dimension 'hosts'"),
        ("%mesh stop nope", "no mesh named 'nope'"),
        ("%mesh 1bad --gpus 2", "must be a Python identifier"),
        ("%mesh q", "how many ranks?"),
        ("%push m", "usage: %push NAME"),
        ("%pull m not_defined_anywhere", "name 'not_defined_anywhere' is not defined on rank"),
        ("%mesh z --gpus 2 --backend nope", "unknown backend 'nope'"),
    ],
)
def test_bad_input_is_a_one_line_error(kernel, code, expected):
    r = kernel.run(code)
    shown = r.stderr + r.error_text
    assert expected in shown, shown
    assert "Traceback" not in shown and "monarch_kernel/" not in shown


def test_unpicklable_cell_value_is_a_clear_error(kernel):
    r = kernel.run("%%remote m --ranks 0\nimport threading\nthreading.Lock()")
    assert "cannot be pickled" in r.error_text and "lock" in r.error_text


def test_bg_output_stays_under_its_cell_while_others_run(kernel):
    bg = kernel.submit(
        "%%remote m --bg\nimport time\nfor i in range(4):\n"
        "    print('tick', i, flush=True)\n    time.sleep(0.25)\n'finished'"
    )
    first = kernel.collect(bg)
    assert "RemoteJob" in first.shown and "running" in first.shown
    display_id = first.displays[0]["transient"]["display_id"]
    other = kernel.run("import time\ntime.sleep(1.5)\nprint('other cell')")
    assert other.stdout == "other cell\n"  # no rank output leaked into this cell
    assert "tick" not in other.stdout
    updates = [
        m
        for m in kernel.other
        if m["msg_type"] == "update_display_data"
        and m["content"]["transient"]["display_id"] == display_id
    ]
    assert all(m["parent_header"]["msg_id"] == bg for m in updates)
    final = updates[-1]["content"]["data"]["text/plain"]
    # every rank's last line: one "[0-3] tick 3" when they came together, else split by
    # when each came (on a loaded machine "[0-1] tick 3" and "[2-3] tick 3")
    assert _ranks_that_printed(final, "tick 3") == {0, 1, 2, 3}, final
    assert "done in" in final and "'finished'" in final


def _ranks_that_printed(text: str, line: str) -> set[int]:
    """The ranks whose ``[ranks] line`` lines are in ``text`` (``[0-3]``, ``[1]``,
    ``[0,2]``: the kernel's prefix of a line that those ranks printed alike)."""
    ranks: set[int] = set()
    for group in re.findall(r"^\[([\d,\- ]+)\] " + re.escape(line) + "$", text, re.M):
        for part in group.split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def test_bg_loop_steered_with_push_and_pull(kernel):
    kernel.run("%push m lr=0.1 stop=False")
    r = kernel.run(
        "%%remote m --bg\nimport os, time\nseen = []\nwhile not stop:\n"
        "    if lr not in seen:\n"
        "        print('rank', os.environ['RANK'], 'sees lr', lr, flush=True)\n"
        "    seen.append(lr)\n    time.sleep(0.02)\nlen(seen)"
    )
    assert "running" in r.shown
    kernel.run("job = _")
    kernel.wait_for_output(r.msg_id, *(f"rank {i} sees lr 0.1" for i in range(4)))
    kernel.run("%push m lr=0.5")
    kernel.wait_for_output(r.msg_id, *(f"rank {i} sees lr 0.5" for i in range(4)))
    r = kernel.run("%pull m lr")
    assert "{gpus=0}: 0.5" in r.text
    r = kernel.run("vals = %pull m seen\nall(0.1 in v and 0.5 in v for v in vals.values())")
    assert r.text == "True", r.error_text
    kernel.run("%push m stop=True")
    r = kernel.run(
        "res = job.wait(timeout=10)\nfinal = %pull m seen\n"
        "job.done(), res.values() == [len(v) for v in final.values()]"
    )
    assert r.text == "(True, True)", r.error_text


def test_interrupt_stops_the_ranks_and_keeps_namespaces(kernel):
    kernel.run("%%remote m\nkeep = 'kept'")
    msg_id = kernel.submit(
        "%%remote m\nimport os, time\nprint('started', os.environ['RANK'], flush=True)\n"
        "time.sleep(60)"
    )
    kernel.wait_for_output(msg_id, *(f"started {i}" for i in range(4)))  # all ranks in it
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=30)  # long before the 60 s sleep ends
    assert r.reply["status"] == "error" and r.reply["ename"] == "RemoteInterrupted"
    # one short grouped message: where the ranks were, none of our library's frames
    assert "interrupted cell" in r.error_text and "KeyboardInterrupt" in r.error_text
    assert "ranks 0-3" in r.error_text and "time.sleep(60)" in r.error_text
    assert "monarch_kernel/" not in r.error_text and len(r.error_text.splitlines()) < 20
    r = kernel.run("%remote m keep")
    assert "{gpus=3}: 'kept'" in r.text
    r = kernel.run("%mesh")
    assert "4/4" in r.text


def test_a_failing_stats_job_does_not_end_the_ranks_control_thread(kernel, tmp_path):
    """A rank's control thread sends its stats once a second; a failure there (here the
    memory read made to raise, in each rank) is logged and the thread goes on: the
    job runs again, and the stop button (a control message) still stops a cell."""
    calls = tmp_path / "stats-calls"
    calls.mkdir()
    kernel.run(
        "%%remote m\n"
        "import os, monarch_kernel.rank.control as _c\n"
        "_real_rss = _c._rss\n"
        f"_calls = {str(calls)!r}\n"
        "def _failing_rss(_n=[0]):\n"
        "    _n[0] += 1\n"
        "    open(os.path.join(_calls, os.environ['RANK'] + '-' + str(_n[0])), 'w').close()\n"
        "    raise OSError('injected: /proc unreadable')\n"
        "_c._rss = _failing_rss"
    )
    try:
        # every rank's job failed, then ran (and failed) again: the thread lived on
        wait_until(
            lambda: all((calls / f"{rank}-2").exists() for rank in range(4)),
            timeout=30,
            what="each rank's stats job to run twice",
        )
        msg_id = kernel.submit("%%remote m\nimport time\nprint('in', flush=True)\ntime.sleep(60)")
        kernel.wait_for_output(msg_id, "in")
        kernel.km.interrupt_kernel()
        r = kernel.collect(msg_id, timeout=30)
        assert r.reply["ename"] == "RemoteInterrupted", r.error_text
    finally:
        kernel.run("%%remote m\n_c._rss = _real_rss")


def test_dead_rank_is_restarted_by_the_default_policy(kernel):
    r = kernel.run("%%remote m --ranks 2\nimport os\nos._exit(3)")
    assert "exit code 3" in r.error_text and "rank 2" in r.error_text
    assert "restarted (policy: restart)" in r.error_text, r.error_text
    r = kernel.run("%%remote m\nimport os\nint(os.environ['RANK'])")  # waits for it
    assert "{gpus=2}: 2" in r.text, r.error_text
    r = kernel.run("%mesh restart m --ranks 1")
    assert "restarted rank(s) 1" in r.stdout, r.stderr + r.error_text
    assert "lost on the restarted rank(s)" in r.stdout
    r = kernel.run("%remote m keep")
    assert "NameError in the cell on ranks 1-2 of 4" in r.error_text  # their namespaces are new


def test_second_mesh_and_stop(kernel):
    r = kernel.run("%mesh two --gpus 2 --hosts 2")
    assert "hosts=2 × gpus=2" in r.stdout, r.stderr + r.error_text
    r = kernel.run("%%remote two\nimport os\nos.environ['GROUP_RANK']")
    assert "{hosts=1, gpus=1}: '1'" in r.text
    kernel.run("%mesh stop two")
    r = kernel.run("%remote two 1")
    assert "is stopped" in r.stderr


def test_mesh_lists_meshes_made_in_cells_and_names_stay_unique(kernel):
    r = kernel.run(
        "from monarch_kernel.actor import this_host\n"
        "cellmade = this_host().spawn_procs(per_host={'gpus': 1}, name='cellmade')"
    )
    assert not r.errors, r.error_text
    r = kernel.run("%mesh")
    assert "cellmade" in r.text and "1/1" in r.text, r.text
    r = kernel.run("%remote cellmade 40 + 2")  # the magics find it by name too
    assert "42" in r.text, r.error_text
    r = kernel.run("this_host().spawn_procs(per_host={'gpus': 1}, name='cellmade')")
    assert "a live mesh is already named 'cellmade'" in r.error_text
    kernel.run("%mesh stop cellmade")
    r = kernel.run("%mesh")
    assert re.search(r"cellmade\s+gpus=1\s+local\s+0/1\s+stopped", r.text), r.text


def test_restart_kernel_leaves_no_orphans():
    k = Kernel()
    try:
        k.run("%mesh r --gpus 2")
        before = k.pids()
        assert len(before) >= 5  # kernel, host agent, template, 2 ranks
        k.km.restart_kernel(now=False)
        wait_until(
            lambda: not any(pid_alive(p) for p in before),
            timeout=15,
            what="the old kernel and its processes to exit",
            detail=lambda: f"still alive: {[p for p in before if pid_alive(p)]}",
        )
    finally:
        k.shutdown()


def test_actor_calls_in_cells_do_not_warn(kernel):
    r = kernel.run(
        "from monarch_kernel.actor import Actor, endpoint\n"
        "class Echo(Actor):\n"
        "    @endpoint\n"
        "    def echo(self, x):\n"
        "        return x\n"
        "echo = m.spawn('echo', Echo)\n"
        "echo.echo.call(3).get().values()"
    )
    assert r.text == "[3, 3, 3, 3]", r.error_text
    assert r.stderr == "" and not r.errors


def test_bg_job_cancel_interrupts_the_ranks(kernel):
    r = kernel.run(
        "%%remote m --bg\nimport os, time\nprint('started', os.environ['RANK'], flush=True)\n"
        "time.sleep(60)"
    )
    assert "running" in r.shown
    kernel.wait_for_output(r.msg_id, *(f"started {i}" for i in range(4)))  # running, not queued
    r = kernel.run(
        "job = _\njob.cancel()\ntry:\n    job.wait(timeout=5)\nexcept Exception as e:\n"
        "    err = e\ntype(err).__name__, 'KeyboardInterrupt' in str(err), job.done()"
    )
    assert r.text == "('RemoteCellError', True, True)", r.error_text


def test_cancel_of_a_queued_cell_skips_it(kernel):
    kernel.run("%%remote m --bg -o first_out\nimport time\ntime.sleep(0.8)\n'first'")
    kernel.run("first = _")
    kernel.run("%%remote m --bg\nran_second = True")
    r = kernel.run(
        "second = _\nsecond.cancel()\ntry:\n    second.wait(timeout=10)\nexcept Exception as e:\n"
        "    err = str(e)\nfirst.wait(timeout=10).values()[0], 'cancelled before it started' in err"
    )
    assert r.text == "('first', True)", r.error_text
    r = kernel.run("%remote m 'ran_second' in globals()")
    assert "{gpus=0}: False" in r.text
