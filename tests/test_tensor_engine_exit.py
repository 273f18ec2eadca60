"""Errors of tensor-engine ops that nothing fetched, in a script (no notebook, no
kernel): ``device_mesh.client.shutdown()`` raises them (Monarch's), and the
interpreter's exit writes those left to stderr, once each (issue 50).

The script runs as a user runs it (this environment's Python, a subprocess) and must
leave no process behind.
"""

from __future__ import annotations

import sys

import pytest
from helpers import assert_in_order, run_program

#: Seconds the script may take (its mesh of 2 starts, three ops fail).
LIMIT = 180

pytestmark = [pytest.mark.local, pytest.mark.timeout(LIMIT + 60)]

PROGRAM = r"""
import sys
import torch
import monarch_kernel
from monarch_kernel import remote
from monarch_kernel.actor import this_host
from monarch_kernel.mesh_controller import RemoteException, spawn_tensor_engine

procs = this_host().spawn_procs({"gpus": 2})
mesh = spawn_tensor_engine(procs)
with mesh.activate():
    fetched = remote(lambda: torch.rand(3) + torch.rand(4), propagate=lambda: torch.ones(()))()
    try:
        monarch_kernel.inspect(fetched, gpus=0)
    except RemoteException:
        print("the fetch raised it")
    remote(lambda: torch.rand(5) + torch.rand(6), propagate=lambda: None)()  # line 17
    try:
        mesh.client.shutdown()
    except RemoteException as exc:
        print("shutdown raised:", str(exc).splitlines()[0])
        print("issued at line", [line for f, line, _ in exc.controller_frames][-1])
    mesh.client.shutdown()  # nothing new: returns
    print("shutdown again: nothing")
    remote(lambda: torch.rand(7) + torch.rand(8), propagate=lambda: None)()  # line 25
print("script done")

# a mesh the script stops itself: its ranks are gone at exit, so the stop reports first
others = this_host().spawn_procs({"gpus": 2})
with others.activate():
    remote(lambda: torch.rand(9) + torch.rand(10), propagate=lambda: None)()  # line 31
others.stop()
print("stopped", file=sys.stderr)
"""

#: What the script prints, in order.
MARKERS = [
    "the fetch raised it",
    "shutdown raised: A tensor-engine op failed on rank 0: RuntimeError: The size of tensor "
    "a (5) must match",
    "issued at line 17",
    "shutdown again: nothing",
    "script done",
]


def test_a_script_reports_errors_nothing_fetched_at_shutdown_and_exit(tmp_path):
    script = tmp_path / "unfetched.py"
    script.write_text(PROGRAM)
    done = run_program([sys.executable, str(script)], tmp_path, LIMIT, grace=30)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{err}"
    assert_in_order(out, MARKERS, err)
    # at exit: the op nothing fetched, once, naming the script's line
    assert err.count("nothing fetched its result") == 2, err  # at the stop, at exit
    assert "The size of tensor a (7) must match the size of tensor b (8)" in err, err
    assert f'File "{script}", line 25' in err, err
    assert "torch.rand(7) + torch.rand(8)" in err, err
    # the stopped mesh's: before its stop, once, naming its line
    assert err.count("failed on rank 0: RuntimeError: The size of tensor a (9)") == 1, err
    assert err.index("(9) must match") < err.index("stopped\n"), err
    assert f'File "{script}", line 31' in err, err
    # not again what a fetch raised, nor what shutdown raised
    assert "(3) must match" not in err, err
    assert "(5) must match" not in err, err
