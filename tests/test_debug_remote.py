"""Debugging ranks from the notebook (issue 16), through a real kernel and jupyter_client:
``breakpoint()`` in a ``%%remote`` cell answered on the stdin channel (``input_request``),
several paused ranks attached in turn or cast to, post-mortem with ``%debug_remote``,
``detach``, the timeout of a forgotten breakpoint, the stop button while a rank is
paused, and a breakpoint in an endpoint attached to later."""

from __future__ import annotations

import queue
import time

import pytest
from kernel_client import Kernel, Result

from monarch_kernel.launchers.local import MAX_RANKS_ENV

#: The cell of most tests: ranks 1 and 3 of 4 stop at line 7 (the line after the
#: breakpoint; line 1 is the %%remote line).
CELL = """%%remote m
import os
rank = int(os.environ["RANK"])
x = rank * 10
if rank in (1, 3):
    breakpoint()
y = x + 1
y"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env={MAX_RANKS_ENV: "4"})
    r = k.run("%mesh m --gpus 4")
    assert "ready" in r.stdout, r.stderr + r.error_text
    yield k
    k.shutdown_and_check()


def prompt(k: Kernel, timeout: float = 30) -> str:
    """The next input_request's prompt (the kernel asks on the stdin channel)."""
    return k.kc.get_stdin_msg(timeout=timeout)["content"]["prompt"]


def drive(
    k: Kernel, code: str, answers: list[str], timeout: float = 60, think: float = 0.0
) -> tuple[Result, list]:
    """Run ``code``, answering each input_request with the next of ``answers`` (after
    ``think`` seconds the first time, as a person would); the cell's result and the
    prompts asked."""
    msg_id = k.kc.execute(code, allow_stdin=True)
    prompts = []
    for i, line in enumerate(answers):
        prompts.append(prompt(k))
        if i == 0:
            time.sleep(think)
        k.kc.input(line)
    return k.collect(msg_id, timeout=timeout), prompts


def no_more_prompts(k: Kernel) -> None:
    with pytest.raises(queue.Empty):
        k.kc.get_stdin_msg(timeout=0.2)


def test_breakpoint_on_two_of_four_ranks_inspect_step_continue(kernel):
    t0 = time.monotonic()
    r, prompts = drive(kernel, CELL, ["p x", "n", "p y", "c", "p x", "c"])
    first = 1 if prompts[0] == "[rank 1] (Pdb) " else 3  # whichever stopped first
    other = 4 - first
    assert prompts == [f"[rank {first}] (Pdb) "] * 4 + [f"[rank {other}] (Pdb) "] * 2, prompts
    out = r.stdout
    assert "rank 1 stopped at cell line 7" in out and "rank 3 stopped at cell line 7" in out
    assert "-> y = x + 1" in out  # pdb's own listing of where it stopped
    lines = out.splitlines()
    # p x, p y on the first, then p x on the other
    assert {str(first * 10), str(first * 10 + 1), str(other * 10)} <= set(lines), out
    assert f"-- attached to rank {other} (stopped at cell line 7) --" in out
    # every rank finished the cell; the paused ones with what they computed
    assert r.text == "ValueMesh(gpus=4; {gpus=0}: 1, {gpus=1}: 11, {gpus=2}: 21, {gpus=3}: 31)"
    assert not r.errors, r.error_text
    no_more_prompts(kernel)
    assert time.monotonic() - t0 < 30
    # the mesh is fine afterwards: no trace function left behind, no stop in the next cell
    assert kernel.run("%remote m y").text.endswith("{gpus=3}: 31)")


def test_cast_to_several_ranks_groups_identical_answers(kernel):
    # rank 3 stops a little after rank 1 (and before the first command is cast)
    late = "    import time; time.sleep(rank / 10)\n    breakpoint()"
    code = CELL.replace("    breakpoint()", late)
    answers = ["@all p type(x).__name__", "--ranks 0:4 p x", "@3", "p rank", "@all c"]
    r, prompts = drive(kernel, code, answers, think=1.5)
    assert prompts == ["[rank 1] (Pdb) "] * 3 + ["[rank 3] (Pdb) "] * 2, prompts
    out = r.stdout
    assert "[ranks 1, 3] 'int'" in out, out  # identical answers: one line
    assert "[rank 1] 10\n[rank 3] 30\n" in out, out  # different ones: by rank
    assert "(not paused: ranks 0, 2)" in out
    assert "\n3\n" in out  # p rank on rank 3, after @3 attached it
    assert "[ranks 1, 3] running on (continue)" in out, out
    assert not r.errors and r.text.endswith("{gpus=3}: 31)"), r.error_text
    assert "->None" not in out  # nothing left over from the last test's stop at a return
    no_more_prompts(kernel)


def test_detach_ignores_the_cells_later_breakpoints(kernel):
    code = (
        "%%remote m --ranks 2\ntotal = 0\nfor i in range(3):\n    breakpoint()\n"
        "    total += i\ntotal"
    )
    r, prompts = drive(kernel, code, ["p i", "c", "p i", "detach"])
    assert prompts == ["[rank 2] (Pdb) "] * 4
    assert r.stdout.count("\n0\n") + r.stdout.startswith("0\n") >= 1 and "\n1\n" in r.stdout
    assert r.text.endswith(": 3)"), r.text + r.error_text
    no_more_prompts(kernel)
    # detach lasts for that cell only: the next breakpoint (or pdb.set_trace) stops again
    code = "%%remote m --ranks 2\nimport pdb; pdb.set_trace()\nz = 5\nz"
    r, prompts = drive(kernel, code, ["c"])
    assert prompts == ["[rank 2] (Pdb) "] and r.text.endswith(": 5)"), r.error_text


def test_post_mortem_on_a_failed_rank(kernel):
    r = kernel.run(
        "%%remote m\nimport os\nrank = int(os.environ['RANK'])\n"
        "def step(v):\n    scale = v - 20\n    return 100 / scale\nstep(rank * 10)"
    )
    assert "ZeroDivisionError" in r.error_text and "rank 2" in r.error_text, r.error_text
    r, prompts = drive(kernel, "%debug_remote m --rank 2", ["p scale, v", "up", "p rank", "q"])
    assert prompts == ["[rank 2] (Pdb) "] * 4, prompts
    out = r.stdout
    assert "rank 2 post-mortem debugger at cell line 6 in step" in out, out
    assert "ZeroDivisionError: division by zero" in out
    assert "(0, 20)" in out and "\n2\n" in out, out
    assert not r.errors, r.error_text
    # debugged: the frame is released
    r = kernel.run("%debug_remote m --rank 2")
    assert "nothing to debug on ranks 2" in r.stdout, r.stdout + r.error_text
    # another failure, released by --clear (and by the next cell)
    kernel.run("%%remote m --ranks 1\n1 / 0")
    r = kernel.run("%debug_remote m --clear")
    assert "released the failed frames kept on ranks 1" in r.stdout, r.stdout + r.error_text
    kernel.run("%%remote m --ranks 1\n1 / 0")
    kernel.run("%remote m 1")
    r = kernel.run("%debug_remote m")
    assert "nothing to debug on ranks 0-3" in r.stdout, r.stdout + r.error_text
    # a bad option is a one-line usage error
    r = kernel.run("%debug_remote m --ranks 9")
    assert r.reply["status"] == "error" and r.reply["ename"] == "UsageError"


def test_post_mortem_cast_to_several_failed_ranks(kernel):
    r = kernel.run(
        "%%remote m --ranks 0:2\nimport os\nlimit = 3\nraise ValueError(os.environ['RANK'])"
    )
    assert "ValueError" in r.error_text
    answers = ["@all p limit", "@all q"]
    r, prompts = drive(kernel, "%debug_remote m --ranks 0:2", answers, think=1.5)
    assert "[ranks 0-1] 3" in r.stdout and "[ranks 0-1] quit the debugger" in r.stdout, r.stdout
    assert not r.errors, r.error_text


def test_a_forgotten_breakpoint_times_out(kernel):
    kernel.run("%%remote m\nimport os\nos.environ['MONARCH_KERNEL_DEBUG_TIMEOUT'] = '1.5'")
    try:
        t0 = time.monotonic()
        msg_id = kernel.kc.execute(
            "%%remote m --ranks 1\nbreakpoint()\nafter = 'ran on'\nafter", allow_stdin=True
        )
        assert prompt(kernel) == "[rank 1] (Pdb) "  # nobody answers it
        r = kernel.collect(msg_id, timeout=30)
        took = time.monotonic() - t0
        assert r.text.endswith(": 'ran on')"), r.error_text
        assert r.stdout.count("rank 1: running on (debugger timed out)") == 1, r.stdout
        assert "no debugger command in 1.5 s at cell line 3: detached, running on" in r.stderr
        assert 1.5 <= took < 15, took
    finally:
        kernel.run("%%remote m\nos.environ.pop('MONARCH_KERNEL_DEBUG_TIMEOUT')")


def test_interrupt_while_a_rank_is_paused(kernel):
    msg_id = kernel.kc.execute(
        "%%remote m\nimport os, time\nif os.environ['RANK'] == '0':\n    breakpoint()\n"
        "    never = 1\nelse:\n    time.sleep(0.2)",
        allow_stdin=True,
    )
    assert prompt(kernel) == "[rank 0] (Pdb) "
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=30)
    assert r.reply["status"] == "error"
    assert "interrupted cell" in r.error_text and "KeyboardInterrupt" in r.error_text, r.error_text
    assert "rank 0" in r.error_text and "line 5" in r.error_text, r.error_text
    no_more_prompts(kernel)
    r = kernel.run("%remote m 'still here'")
    assert r.text.endswith("{gpus=3}: 'still here')"), r.error_text


def test_breakpoint_in_an_endpoint_is_attached_with_debug_remote(kernel):
    r = kernel.run(
        "from monarch_kernel.actor import Actor, endpoint\n"
        "class Stepper(Actor):\n"
        "    def __init__(self):\n        self.v = 0\n"
        "    @endpoint\n"
        "    def bump(self, by):\n        breakpoint()\n        self.v += by\n"
        "        return self.v\n"
        "steppers = m.spawn('steppers', Stepper)\n"
        "fut = steppers.slice(gpus=2).bump.call_one(5)"
    )
    assert not r.errors, r.error_text
    r, prompts = drive(kernel, "%debug_remote m", ["p by", "c"])
    assert prompts == ["[rank 2] (Pdb) "] * 2, prompts
    assert "rank 2 stopped at" in r.stdout and "\n5\n" in r.stdout, r.stdout + r.error_text
    assert kernel.run("fut.get(timeout=10)").text == "5"
    # a cell blocked on the call's result: the notice says how to attach; interrupt it
    msg_id = kernel.kc.execute("steppers.slice(gpus=2).bump.call_one(1).get()")
    kernel.wait_for_output(msg_id, "[rank 2] stopped at", "%debug_remote m --rank 2")
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id)
    assert r.reply["status"] == "error", r
    r, prompts = drive(kernel, "%debug_remote m --rank 2", ["p self.v", "c"])
    assert "\n5\n" in r.stdout, r.stdout + r.error_text
    assert "running on (continue)" not in r.stdout  # (one rank: no cast summary)
    # an endpoint that fails: post-mortem on its frame
    code = (
        "class Failing(Actor):\n    @endpoint\n    def div(self, a):\n"
        "        denominator = a - a\n        return a / denominator\n"
        "failing = m.spawn('failing', Failing)\nfailing.div.call(3).get()"
    )
    r = kernel.run(code)
    assert "ZeroDivisionError in Failing.div on ranks 0-3" in r.error_text, r.error_text
    r, prompts = drive(kernel, "%debug_remote m --rank 3", ["p a, denominator", "q"])
    assert "(3, 0)" in r.stdout and "in div" in r.stdout, r.stdout + r.error_text


def test_a_bg_cell_paused_shows_on_the_dashboard_until_attached(kernel):
    r = kernel.run(
        "from monarch_kernel.widgets.state import MeshState\n"
        "from monarch_kernel.widgets import render\n"
        "st = MeshState(m.runtime)\nst.attach()"
    )
    assert not r.errors, r.error_text
    r = kernel.run("%%remote m --ranks 2 --bg\nimport time\nw = 7\nbreakpoint()\nw += 1\nw")
    assert not r.errors, r.error_text
    look = "st.drain(); v = st.tile(2); (v.state, v.what, st.tile_state(2), st.tile(0).state)"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        shown = kernel.run(look).text
        if "paused" in shown:
            break
        time.sleep(0.2)
    assert shown == "('paused', 'rank 2 stopped at cell line 5', 'paused', 'idle')", shown
    header = kernel.run("render.header_html(st, [st.tile(i) for i in range(4)])").text
    assert "1 paused" in header, header
    r, prompts = drive(kernel, "%debug_remote m", ["p w", "c"])
    assert prompts == ["[rank 2] (Pdb) "] * 2, prompts
    assert "\n7\n" in r.stdout, r.stdout + r.error_text
    r = kernel.run("%%remote m --ranks 2\nw", timeout=30)
    assert r.text.endswith(": 8)"), r.text + r.error_text
    shown = kernel.run(look).text
    assert shown.startswith("('idle'"), shown
    kernel.run("st.detach()")


def test_a_front_end_without_input_detaches_the_paused_ranks(kernel):
    msg_id = kernel.kc.execute(CELL, allow_stdin=False)
    r = kernel.collect(msg_id, timeout=30)
    assert "cannot answer a debugger prompt (StdinNotImplementedError" in r.stdout, r.stdout
    assert "detached, running on" in r.stdout
    assert r.text.endswith("{gpus=3}: 31)"), r.error_text


def test_a_big_output_and_a_breakpoint_in_a_thread(kernel):
    code = (
        "%%remote m --ranks 0\nimport threading\nbig = 'x' * 200_000\nbox = []\n"
        "def work():\n    inner = 41\n    breakpoint()\n    box.append(inner + 1)\n"
        "t = threading.Thread(target=work)\nt.start()\nt.join()\nbox[0]"
    )
    r, prompts = drive(kernel, code, ["p inner", "c", "p len(big), big[:3]"][:2])
    assert prompts == ["[rank 0] (Pdb) "] * 2 and "\n41\n" in r.stdout, r.stdout
    assert r.text.endswith(": 42)"), r.error_text
    r, _ = drive(kernel, "%%remote m --ranks 0\nbreakpoint()\nbig", ["p big", "c"])
    assert "x" * 1000 in r.stdout and len(r.stdout) > 200_000, len(r.stdout)


def test_all_four_ranks_stepped_together(kernel):
    code = CELL.replace("if rank in (1, 3):", "if True:")
    answers = ["@all n", "@all p y", "@0:2 c", "@all c"]
    r, prompts = drive(kernel, code, answers, think=1.5)
    out = r.stdout
    assert "[ranks 0-3]\n--Return--\n> <remote cell" in out, out  # one answer for 4 ranks
    assert "[rank 0] 1\n[rank 1] 11\n[rank 2] 21\n[rank 3] 31\n" in out, out
    assert "[ranks 0-1] running on (continue)" in out, out
    assert "[ranks 2-3] running on (continue)" in out, out
    assert r.text.endswith("{gpus=3}: 31)"), r.error_text
    no_more_prompts(kernel)


@pytest.mark.unit
def test_prompt_targets_and_grouping():
    from monarch_kernel.kernel.debug.console import _grouped, _split_target

    assert _split_target("p x") == (None, "p x")
    assert _split_target("@all p x") == ("all", "p x")
    assert _split_target("@3") == ("3", "")
    assert _split_target("--ranks 0:4 n") == ("0:4", "n")
    assert _grouped({3: "a", 0: "a", 1: "b"}) == [("a", [0, 3]), ("b", [1])]


def test_attached_with_debug_remote_timeout_and_interrupt(kernel):
    kernel.run("%%remote m\nimport os\nos.environ['MONARCH_KERNEL_DEBUG_TIMEOUT'] = '1.5'")
    try:
        # nobody answers the attached prompt: the rank runs on, the magic ends
        kernel.run("%%remote m --ranks 1 --bg\nbreakpoint()\nlate = 1")
        msg_id = kernel.kc.execute("%debug_remote m --rank 1", allow_stdin=True)
        assert prompt(kernel) == "[rank 1] (Pdb) "
        r = kernel.collect(msg_id, timeout=30)
        assert "rank 1: running on (debugger timed out)" in r.stdout, r.stdout + r.error_text
        assert kernel.run("%%remote m --ranks 1\nlate", timeout=30).text.endswith(": 1)")
        # the stop button while attached: the paused work is interrupted where it stood
        kernel.run("%%remote m\nos.environ['MONARCH_KERNEL_DEBUG_TIMEOUT'] = '60'")
        kernel.run("%%remote m --ranks 1 --bg\nbreakpoint()\nnever = 1")
        msg_id = kernel.kc.execute("%debug_remote m --rank 1", allow_stdin=True)
        assert prompt(kernel) == "[rank 1] (Pdb) "
        kernel.km.interrupt_kernel()
        r = kernel.collect(msg_id, timeout=30)
        assert r.reply["status"] == "error" and "KeyboardInterrupt" in r.error_text, r
        r = kernel.run("_monarch_magics.jobs[-1].wait(timeout=10)")
        assert "KeyboardInterrupt" in r.error_text and "line 3" in r.error_text, r.error_text
        assert kernel.run("%remote m 'alive'").text.endswith("{gpus=3}: 'alive')")
    finally:
        kernel.run("%%remote m\nos.environ.pop('MONARCH_KERNEL_DEBUG_TIMEOUT')")


def test_pythonbreakpoint_0_turns_breakpoints_off(kernel):
    code = (
        "%%remote m --ranks 0\nimport os\nos.environ['PYTHONBREAKPOINT'] = '0'\nbreakpoint()\n"
        "os.environ.pop('PYTHONBREAKPOINT')\n'ran through'"
    )
    msg_id = kernel.kc.execute(code, allow_stdin=True)
    r = kernel.collect(msg_id, timeout=30)
    assert r.text.endswith(": 'ran through')"), r.error_text
    no_more_prompts(kernel)


def test_break_command_and_quit(kernel):
    code = "%%remote m --ranks 0\nbreakpoint()\na = 1\nb = 2\nc = a + b\nc"
    r, prompts = drive(kernel, code, ["b 5", "c", "p a, b", "c"])
    assert "Breakpoint 1 at <remote cell" in r.stdout and "(1, 2)" in r.stdout, r.stdout
    assert r.text.endswith(": 3)"), r.error_text
    r, prompts = drive(kernel, code, ["q"])
    assert r.reply["status"] == "error" and "BdbQuit" in r.error_text, r.error_text
    assert kernel.run("%%remote m --ranks 0\n'after quit'").text.endswith("'after quit')")
