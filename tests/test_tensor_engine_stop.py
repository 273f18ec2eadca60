# mypy: disable-error-code="attr-defined,union-attr"
"""The stop button against the tensor engine's reductions and transfers (issue 50):
through a real kernel, the stop releases ranks waiting in a reduction for a rank held
in a remote function, and a long stream of ops with reductions and transfers in it;
every rank is idle after it, no rank was killed (same pids), what was stopped holds
"stopped by the user", and the next cell's reductions and ``to_mesh`` transfers give
the right values on the same mesh (the process group formed again in place). Without a
kernel: a rank that dies during a reduction fails the fetch waiting for it with the
death's cause.

Each test waits for events (a file a remote function creates when it starts), never
for fixed times; the kernel's shutdown checks that nothing it started is left.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import wait_until

#: Ranks of the kernel tests' mesh (``%mesh m --gpus 3``): a ring of three, so that a
#: rank waits on a peer other than the held one.
RANKS = 3

SETUP = f"""
import os, time, torch, monarch_kernel
import torch.distributed as dist
from monarch_kernel import inspect, reduce, remote
from monarch_kernel.rank.context import current_rank
m.activate()

def _hold(x, started, rank):
    if current_rank().rank == rank:  # the others go on, to the reduction after it
        open(started, "w").close()
        time.sleep(600)  # until the stop button
    else:  # the next op they run is that reduction (they wait there)
        open(started + "." + str(current_rank().rank), "w").close()
    return x + 1

def _mark(x, started):
    if current_rank().rank == 0:
        open(started, "w").close()
    return x

def _slow(x):
    time.sleep(0.1)
    return x + 1

def _pid():
    return torch.tensor(os.getpid())

def _generation():
    return torch.tensor(dist.distributed_c10d._get_default_group().generation)

hold = remote(_hold, propagate=lambda x, started, rank: x + 1)
mark = remote(_mark, propagate=lambda x, started: x)
slow = remote(_slow, propagate=lambda x: x + 1)
pid = remote(_pid, propagate=lambda: torch.tensor(0))
generation = remote(_generation, propagate=lambda: torch.tensor(0))

def every(t):
    return [inspect(t, gpus=i).tolist() for i in range({RANKS})]

print("pids", every(pid()))
print("warm", every(reduce(torch.ones(2), "gpus")))
"""

#: The next cell after a stop: a reduction, an in-place one, a stack and a transfer
#: between ranks, each with the values it must give, and the ranks' pids.
CHECK = """
r = reduce(torch.ones(2) * 2, "gpus")
s = torch.full((2,), 3.0)
reduce_(s, "gpus", "max")
st = reduce(torch.ones(1), "gpus", "stack")
with m.slice(gpus=0).activate():
    seven = torch.full((2,), 7.0)
moved = seven.to_mesh(m.slice(gpus=2))
print("sum", every(r))
print("inplace", every(s))
print("stack", every(st))
with m.slice(gpus=2).activate():
    print("moved", inspect(moved).tolist())
print("pids", every(pid()))
print("generation", every(generation()))
""".replace("reduce_(", "monarch_kernel.reduce_(")


@pytest.fixture(scope="module")
def kernel():
    """A kernel with ``%mesh m --gpus 3`` and the helpers of :data:`SETUP`, shared by
    the module; its shutdown checks that nothing it started is left."""
    from kernel_client import kernel_with_mesh

    k = kernel_with_mesh("m", RANKS)
    try:
        r = k.run(SETUP, timeout=120)
        assert f"warm {[[3.0, 3.0]] * RANKS}" in r.stdout, r.stderr + r.error_text
        yield k, _line(r.stdout, "pids")
    finally:
        k.shutdown_and_check()


def _line(text: str, key: str) -> str:
    """The rest of the line of ``text`` that starts with ``key``."""
    for line in text.splitlines():
        if line.startswith(key + " "):
            return line[len(key) + 1 :]
    raise AssertionError(f"no {key!r} line in {text!r}")


def _stop(k, code: str, *started: str, shown: str | None = None) -> None:
    """Run ``code``, wait until the files ``started`` exist (made on the ranks once the
    ops are running there) and the cell showed ``shown``, press the stop button; the
    cell ends interrupted."""
    from helpers import wait_until

    msg = k.submit(code)
    wait_until(lambda: all(os.path.exists(f) for f in started), timeout=60, what=f"{started} made")
    if shown is not None:
        k.wait_for_output(msg, shown)
    k.km.interrupt_kernel()
    r = k.collect(msg)
    assert "KeyboardInterrupt" in r.error_text, r.stdout + r.stderr + r.error_text


def _check_usable(k, pids: str) -> int:
    """The next cell's reductions and transfer give the right values on the same ranks
    (the 20 s bound: the stopped ops would take far longer), on one process group (the
    same object on every rank, formed as many times). Returns how many times."""
    r = k.run(CHECK, timeout=20)
    out = r.stdout
    assert _line(out, "sum") == str([[6.0, 6.0]] * RANKS), out + r.stderr + r.error_text
    assert _line(out, "inplace") == str([[3.0, 3.0]] * RANKS), out
    assert _line(out, "stack") == str([[[1.0]] * RANKS] * RANKS), out
    assert _line(out, "moved") == "[7.0, 7.0]", out
    assert _line(out, "pids") == pids, "a rank was restarted"
    generations = set(eval(_line(out, "generation")))
    assert len(generations) == 1, out
    return generations.pop()


def _stopped_by_the_user(k, expr: str) -> str:
    r = k.run(f"inspect({expr})")
    assert "RemoteException" in r.error_text, r.stdout + r.error_text
    assert "stopped by the user" in r.error_text, r.error_text
    return r.error_text


def test_the_stop_releases_ranks_waiting_in_a_reduction_for_a_rank_held_in_a_function(
    kernel, tmp_path
):
    k, pids = kernel
    started = str(tmp_path / "held")
    _stop(
        k,
        f"y = hold(torch.ones(2), {started!r}, 1)\n"
        "z = reduce(y, 'gpus')\n"  # ranks 0 and 2 wait here for rank 1
        "w = z\n"
        "for _ in range(20):\n"
        "    w = reduce(w, 'gpus')\n"
        "inspect(w)",
        started,
        *(f"{started}.{r}" for r in (0, 2)),
    )
    # ranks 0 and 2 were stopped waiting for rank 1 in the default group: they aborted
    # it, and the next reduction formed it again, in place, on every rank
    assert _check_usable(k, pids) >= 2
    # the held op, the reduction that waited for it and those queued after it
    text = _stopped_by_the_user(k, "y")
    assert "rank 1" in text, text
    _stopped_by_the_user(k, "z")
    _stopped_by_the_user(k, "w")


def test_the_stop_interrupts_a_long_stream_of_reductions_and_transfers(kernel, tmp_path):
    k, pids = kernel
    started = str(tmp_path / "stream")
    # 400 rounds of a 100 ms op, a reduction and a transfer: 40 s on the ranks, which
    # are still near the start of them when the cell has issued them all
    _stop(
        k,
        f"x = mark(torch.ones(64, 64), {started!r})\n"
        "for _ in range(400):\n"
        "    x = reduce(slow(x), 'gpus', 'avg')\n"
        "    sent = x.slice_mesh(gpus=0).to_mesh(m.slice(gpus=1))\n"
        "print('issued', flush=True)\n"
        "inspect(x)",
        started,
        shown="issued",
    )
    _check_usable(k, pids)
    _stopped_by_the_user(k, "x")
    r = k.run("with m.slice(gpus=1).activate():\n    inspect(sent)")
    assert "stopped by the user" in r.error_text, r.stdout + r.error_text


def test_the_stop_after_the_cell_ended_stops_the_ops_it_left_running(kernel, tmp_path):
    k, pids = kernel
    started = str(tmp_path / "left")
    # 201 ops, fewer than a batch (client.FLUSH_OPS): none reaches the ranks before the
    # cell's body ended, so once the first one ran (it makes ``started``) the notebook
    # waits at the cell's end for the ranks (to show their errors under it): 50 s of
    # ops, longer than that wait. The stop button then stops them.
    msg = k.submit(
        "def _slower(x):\n"
        "    time.sleep(0.5)\n"
        "    return x + 1\n"
        "slower = remote(_slower, propagate=lambda x: x + 1)\n"
        f"x = mark(torch.ones(8), {started!r})\n"
        "for _ in range(100):\n"
        "    x = reduce(slower(x), 'gpus', 'avg')\n"
    )
    wait_until(lambda: os.path.exists(started), timeout=60, what="the ops to start")
    k.km.interrupt_kernel()
    r = k.collect(msg, timeout=30)  # long before the 50 s of ops end
    assert "ops the ranks still ran are stopped" in r.stderr, r.stdout + r.stderr + r.error_text
    _check_usable(k, pids)
    _stopped_by_the_user(k, "x")


# -- a rank's death, without a kernel -----------------------------------------------------


def _exit_on_rank_one(x):
    from monarch_kernel.rank.context import current_rank

    if current_rank().rank == 1:
        os._exit(3)


def test_a_rank_death_during_a_reduction_fails_the_fetch_with_its_cause():
    from monarch_kernel import inspect, reduce, remote
    from monarch_kernel.actor import this_host
    from monarch_kernel.calls.errors import RankDiedError

    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        with procs.activate():
            assert inspect(reduce(torch.ones(2), "gpus")).tolist() == [3.0, 3.0]
            x = torch.ones(2)
            remote(_exit_on_rank_one, propagate="inspect")(x)
            y = reduce(x, "gpus")  # ranks 0 and 2 wait for rank 1, which died
            with pytest.raises(RankDiedError, match="rank 1 .* died: exit code 3"):
                inspect(y)
            # At once, while rank 1 starts again: the ops of this fetch wait for the
            # restart (they once went to the rank not started yet, were dropped, and
            # its next incarnation waited forever for the number they had taken).
            assert inspect(torch.ones(1) + 1, gpus=0).tolist() == [2.0]
            # the mesh, the restarted rank and its process group included, goes on
            assert inspect(reduce(torch.ones(2), "gpus")).tolist() == [3.0, 3.0]
    finally:
        procs.stop()


def _sleep_after_marking(x, started):
    import time

    from monarch_kernel.rank.context import current_rank

    open(f"{started}.{current_rank().rank}", "w").close()
    time.sleep(600)  # until interrupted
    return x


def test_proc_mesh_interrupt_stops_the_ops_running_and_the_next_ones_run(tmp_path):
    from monarch_kernel import fetch_shard, inspect, remote
    from monarch_kernel.actor import this_host
    from monarch_kernel.mesh_controller import RemoteException

    started = str(tmp_path / "sleeping")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with procs.activate():
            y = remote(_sleep_after_marking, propagate=lambda x, started: x)(torch.ones(2), started)
            z = y + 1
            fetched = fetch_shard(z, gpus=1)  # sends the ops; its answer waits for them
            wait_until(
                lambda: all(os.path.exists(f"{started}.{r}") for r in range(2)),
                timeout=60,
                what="both ranks in the function",
            )
            procs.interrupt()
            with pytest.raises(RemoteException, match="stopped by the user"):
                fetched.result(timeout=30)  # long before the 600 s sleep ends
            # the ops sent after the interrupt run (the ranks were told to resume)
            assert inspect(torch.ones(1) + 1, gpus=0).tolist() == [2.0]
    finally:
        procs.stop()


def _deaf_until_stopped(x):
    """Deaf to SIGINT (as a rank is where the signal lands before it began the cell's
    ops: reading them, or still receiving them), until the stop was told."""
    import signal
    import time

    from monarch_kernel.rank.tensors import worker

    told = worker.current()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        deadline = time.monotonic() + 60
        while told._stop_through < 0 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        signal.signal(signal.SIGINT, old)
    return x


def _mark_ran(x, ran):
    from monarch_kernel.rank.context import current_rank

    open(f"{ran}.{current_rank().rank}", "w").close()
    return x + 1


def test_the_stop_stops_the_queued_ops_when_its_sigint_lands_outside_them(tmp_path):
    # The SIGINT alone would stop nothing here: it lands where no op runs. The control
    # thread's ``tensor_stop`` still keeps the queued ops from running (a loaded CI
    # machine once let 600 queued ops run to their end after the stop button).
    from monarch_kernel import fetch_shard, inspect, remote
    from monarch_kernel.actor import this_host
    from monarch_kernel.mesh_controller import RemoteException

    ran = str(tmp_path / "ran")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with procs.activate():
            y = remote(_deaf_until_stopped, propagate=lambda x: x)(torch.ones(2))
            z = remote(_mark_ran, propagate=lambda x, ran: x + 1)(y, ran)
            fetched = fetch_shard(z, gpus=1)
            procs.interrupt()
            with pytest.raises(RemoteException, match="stopped by the user"):
                fetched.result(timeout=60)
            assert not [r for r in range(2) if os.path.exists(f"{ran}.{r}")]
            assert inspect(torch.ones(1) + 1, gpus=0).tolist() == [2.0]
    finally:
        procs.stop()


def _all_reduce_in(t, pg):
    import torch.distributed as dist

    dist.all_reduce(t, group=pg)
    return t


def test_a_poisoned_input_keeps_a_function_with_a_process_group_from_running_anywhere():
    # rank 2's input holds an error: its function cannot run, so the others' would wait
    # in their all_reduce for it; the group's gate makes it run on no rank instead
    from monarch_kernel import inspect, remote
    from monarch_kernel.actor import this_host
    from monarch_kernel.mesh_controller import RemoteException, spawn_tensor_engine

    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        dm = spawn_tensor_engine(procs)
        all_reduce = remote(_all_reduce_in, propagate=lambda t, pg: t.clone())
        with procs.activate():
            bad = torch.zeros(3).index_select(0, procs.rank("gpus") + 1)  # fails on rank 2
            y = all_reduce(bad, dm.process_group("gpus"))
            with pytest.raises(RemoteException) as info:
                inspect(y, gpus=0)  # answered (ranks 0 and 1 did not wait), with the cause
            assert info.value.rank == 2 and info.value.error_type == "IndexError", info.value
            good = all_reduce(torch.ones(2), dm.process_group("gpus"))  # the mesh goes on
            assert inspect(good, gpus=1).tolist() == [3.0, 3.0]
    finally:
        procs.stop()
