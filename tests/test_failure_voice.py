"""Failures of a ``%%remote`` cell in one voice: a death the policy handled is said
once (what died, why, what was done, what state was lost where); the stop button gives
one short line per group of ranks; live bars line up."""

from __future__ import annotations

import os
import re
import signal

import pytest
from kernel_client import Kernel, kernel_with_mesh

from monarch_kernel.kernel.failure_voice import assigned_names, interrupt_lines
from monarch_kernel.kernel.output_items import BarBlock
from monarch_kernel.wire.reports import FailureReport
from monarch_kernel.wire.terminal import Row

pytestmark = pytest.mark.local


# -- units -------------------------------------------------------------------------------
def test_bar_labels_of_one_block_have_one_width():
    block = BarBlock()
    frames = {0: "50%|#####     |", 1: "40%|####      |", 2: "50%|#####     |"}
    for rank, text in frames.items():
        row = Row(rank, text)
        row.done = True  # final frames: identical ones of several ranks share a line
        block.rows.append((rank, row))
    lines = block.render(collapse=True, label=True).splitlines()
    assert lines == ["[0, 2] 50%|#####     |", "[1]    40%|####      |"]
    assert len({line.index("%") for line in lines}) == 1  # the bars start in one column
    assert block.render(collapse=True, label=False).splitlines() == [
        "50%|#####     |",
        "40%|####      |",
    ]


def test_the_names_a_cell_binds_assignments_first():
    code = "import time\nmodel = 'm'\nfor i in range(3):\n    step += 1\n    x: int = 2\n"
    assert assigned_names(code) == ["model", "step", "x", "time", "i"]
    assert assigned_names("%time x = 1") == []  # magics: not Python


def test_interrupt_lines_group_ranks_by_place():
    def report(rank: int, line: int, code: str) -> FailureReport:
        tb = (
            "Traceback (most recent call last):\n"
            f'  File "<remote cell 5>", line {line}, in <module>\n    {code}\nKeyboardInterrupt\n'
        )
        return FailureReport(type="KeyboardInterrupt", message="", traceback=tb, rank=rank)

    failures = [report(0, 5, "time.sleep(1)"), report(2, 5, "time.sleep(1)"), report(1, 4, "x()")]
    lines = interrupt_lines(failures, [0, 1, 2, 3], 4, [3])
    assert lines == [
        "ranks 0, 2 of 4: KeyboardInterrupt at cell 5, line 5: time.sleep(1)",
        "rank 1 of 4: KeyboardInterrupt at cell 5, line 4: x()",
        "rank 3 of 4: had finished it",
    ]


def test_interrupt_lines_name_an_abort_however_torch_wrapped_it():
    """A rank released by the process group's abort says so, whether the error is our
    ProcessGroupAborted or the RuntimeError torch's C++ made of it (DDP's backward)."""
    ours = FailureReport(type="ProcessGroupAborted", message="rank 1 raised", rank=0)
    message = "ProcessGroupAborted: rank 1 raised\nException raised from"
    wrapped = FailureReport(type="RuntimeError", message=message, rank=2)
    other = FailureReport(type="RuntimeError", message="CUDA error: out of memory", rank=1)
    lines = interrupt_lines([ours, wrapped, other], [0, 1, 2], 3, [])
    assert lines == [
        "ranks 0, 2 of 3: interrupted in a collective (process group aborted)",
        "rank 1 of 3: RuntimeError: CUDA error: out of memory",
    ]


# -- through a kernel --------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel():
    k = kernel_with_mesh("fv", 4)  # the default failure policy: restart
    yield k
    k.shutdown_and_check()


def _pids(kernel: Kernel) -> list[int]:
    r = kernel.run("%%remote fv\nimport os\nos.getpid()")
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


LOOP = """\
%%remote fv
import os, time
from tqdm import tqdm
model = "a model"
step = 0
for _ in tqdm(range(10**6)):
    step += 1
    if step == 20:
        print("at step 20 on", os.environ["RANK"], flush=True)
    time.sleep(0.005)
"""


def test_a_death_the_policy_handled_is_said_once(kernel):
    pids = _pids(kernel)
    cell = kernel.submit(LOOP)
    kernel.wait_for_output(cell, *(f"at step 20 on {r}" for r in range(4)), timeout=60)
    os.kill(pids[3], signal.SIGKILL)
    r = kernel.collect(cell, timeout=120)
    text = r.error_text
    everything = r.stdout + r.stderr + text
    assert r.reply["ename"] == "RankDiedError", text
    # what died and why, once
    assert text.count("rank 3 of mesh 'fv'") == 1 and text.count("killed by SIGKILL") == 1, text
    # what was done: restarted, by the policy; no "unhandled" after that
    assert "restarted (policy: restart)" in text, text
    assert "unhandled" not in everything and "MeshFailure" not in everything, everything
    assert "also failed" not in text and "restarts it now" not in text
    # what state was lost where, and how to keep it
    assert "`model`, `step`" in text and "lost on rank 3" in text, text
    assert "TrainingState" in text and "ranks 0-2 kept theirs" in text
    # the others, as a consequence of the death
    assert "Because rank 3 died, ranks 0-2" in text, text
    # it printed: no "no output" claim
    assert "(no output" not in text and "printed nothing" not in text, text
    # the restart is done: the next cell does not wait for it, and sees what was said
    r = kernel.run("%%remote fv\nstep > 0 if 'step' in dir() else 'lost'")
    assert "is restarting ranks" not in r.stdout, r.stdout
    assert "{gpus=3}: 'lost'" in r.text and "{gpus=0}: True" in r.text, r.text + r.error_text


def test_the_stop_button_says_where_each_group_of_ranks_was(kernel):
    cell = kernel.submit(
        "%%remote fv\nimport os, time\nprint('looping on', os.environ['RANK'], flush=True)\n"
        "while True:\n    time.sleep(0.01)\n"
    )
    kernel.wait_for_output(cell, *(f"looping on {r}" for r in range(4)), timeout=60)
    kernel.km.interrupt_kernel()
    r = kernel.collect(cell, timeout=60)
    assert r.reply["ename"] == "RemoteInterrupted", r.error_text
    lines = r.error_text.splitlines()
    assert lines[0] == "RemoteInterrupted: interrupted cell " + lines[0].split()[3] + (
        " on mesh 'fv'"
    ), lines
    groups = lines[1:]
    assert 1 <= len(groups) <= 4, lines  # at most one line per group of ranks
    assert all(re.match(r"ranks? [0-9, -]+ of 4: ", g) for g in groups), lines
    assert any("KeyboardInterrupt at cell" in g and "time.sleep(0.01)" in g for g in groups)
    assert "Traceback (most recent call last)" not in r.error_text
    assert not any(line.rstrip().endswith(":") for line in lines), lines  # nothing empty
    # status lines (the process group, the replicas) are not in the error
    assert "replicas" not in r.error_text and "re-formed" not in r.error_text
    r = kernel.run("%%remote fv\n1")
    assert not r.errors, r.error_text  # every rank runs on


def test_the_stop_button_puts_the_mesh_status_before_the_error():
    k = Kernel()
    try:
        r = k.run("%mesh fd --gpus 2 --dist")
        assert "ready" in r.stdout, r.stderr + r.error_text
        setup = (
            "%%remote fd\nimport torch, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "ddp = DDP(torch.nn.Linear(4, 4))\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        )
        r = k.run(setup, timeout=120)
        assert not r.errors, r.error_text
        cell = k.submit(
            "%%remote fd\nimport os, time\nprint('looping on', os.environ['RANK'], flush=True)\n"
            "while True:\n    ddp(torch.ones(2, 4)).sum().backward()\n    opt.step()\n"
            "    time.sleep(0.01)\n"
        )
        k.wait_for_output(cell, "looping on 0", "looping on 1", timeout=60)
        k.km.interrupt_kernel()
        r = k.collect(cell, timeout=60)
        assert r.reply["ename"] == "RemoteInterrupted", r.error_text
        assert "Traceback (most recent call last)" not in r.error_text
        assert "replicas" not in r.error_text, r.error_text
        # what the mesh did is said before the error, precisely: DDP replicas compared
        assert "DDP replicas identical (ddp, opt compared)" in r.stdout or (
            "copied to" in r.stdout and "DDP replicas identical" in r.stdout
        ), r.stdout
    finally:
        k.shutdown_and_check()
