"""CUDA tensors in a rank's calls to ranks of its machine go as data-plane handles on
copies (``rank.dataplane.cuda_args``), not pickled through host memory: tested between two
real ranks with host shared memory in CUDA's place (``tests/ipc_host_memory.py``), so
that it runs on every machine. The receiver sees each tensor as it was when the call was
sent, with its requires_grad and Parameter-ness; the caller's copies are gone once the
call is over, answered, failed or its receiver dead; calls that are not answered, and
small tensors, are pickled as before. (The notebook's own calls have no hook at all:
``EndpointRef._snapshots``.) On a GPU: ``tests/test_gpu_dataplane.py``."""

from __future__ import annotations

import pytest
import torch
from cuda_args_actors import BIG, HANDLES, SEEN, ArgPeer, Taker, sample_value
from helpers import wait_until

from monarch_kernel.actor import this_host, this_proc

pytestmark = pytest.mark.local

BIG_SUM = float(torch.arange(BIG, dtype=torch.float32).sum())  # as the receiver sums
#: What the receiver sees: (sum, requires_grad, type, shape) per key.
EXPECTED = {"big": (BIG_SUM, False, "Tensor", (BIG,)), **SEEN}


@pytest.fixture(scope="module")
def peers():
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        actors = mesh.spawn("args", ArgPeer)
        yield mesh, actors.slice(gpus=0), actors.slice(gpus=1)
    finally:
        mesh.stop()


@pytest.mark.parametrize("how", ["call_one", "call", "choose", "stream"])
def test_answered_calls_send_large_tensors_as_handles_seen_as_they_were_sent(peers, how):
    _, caller, receiver = peers
    before = receiver.bytes_in.call_one().get()
    out = caller.send.call_one(receiver, how).get()
    assert out["seen"] == EXPECTED
    assert out["handles"] == HANDLES
    assert out["left"] == 0, "the caller still holds copies after the call"
    # the four big tensors came through the data plane, the small one in the message
    assert receiver.bytes_in.call_one().get() - before == HANDLES * BIG * 4


def test_the_copy_is_dropped_once_read_while_the_endpoint_still_runs(peers, tmp_path):
    _, caller, receiver = peers
    out = caller.send_while_running.call_one(receiver, str(tmp_path / "go")).get()
    assert out == {"dropped": True, "running": True, "seen": float(BIG)}, out


def test_a_call_that_fails_drops_the_copies(peers):
    _, caller, receiver = peers
    out = caller.send.call_one(receiver, "fails").get()
    assert "refused 5 tensors" in out["seen"], out
    assert out["handles"] == HANDLES and out["left"] == 0


def test_copies_no_receiver_read_are_dropped_when_the_call_is_over(peers):
    """The receiver fails to unpickle the arguments before it reaches the tensors: no
    ``read_done`` ever comes; the failed call's end drops the copies."""
    _, caller, receiver = peers
    before = receiver.bytes_in.call_one().get()
    out = caller.send.call_one(receiver, "unread").get()
    assert "cannot be unpickled on the receiver" in out["seen"], out
    assert out["handles"] == HANDLES and out["left"] == 0, out
    assert receiver.bytes_in.call_one().get() == before  # none of them was read


def test_a_broadcast_is_pickled_as_before(peers):
    _, caller, receiver = peers
    before = receiver.bytes_in.call_one().get()
    out = caller.send.call_one(receiver, "broadcast").get()
    assert out["handles"] == 0 and out["left"] == 0
    assert receiver.bytes_in.call_one().get() == before


def test_an_actor_of_the_notebooks_process_receives_them_too(peers):
    """A rank's call to an actor of the notebook's own process (``this_proc()`` there),
    on the same machine: the notebook's process joins the data plane to read them."""
    _, caller, _ = peers
    taker = this_proc().spawn("taker", Taker)
    try:
        out = caller.send.call_one(taker, "notebook").get()
    finally:
        taker.stop().get(timeout=30)
    assert out["seen"] == {"big": (BIG_SUM, (BIG,)), "small": (16.0, (16,))}, out
    assert out["handles"] == 1 and out["left"] == 0


def test_the_notebooks_calls_send_them_as_handles_once_cuda_is_in_use(peers, monkeypatch):
    """The notebook's own calls (here pytest's process, with host memory in CUDA's place:
    "CUDA in use") to ranks of its machine: it joins the data plane and shares copies,
    dropped once read; the receiver sees the values as they were sent."""
    from ipc_host_memory import HostMemory

    from monarch_kernel.rank.dataplane import cuda_ipc
    from monarch_kernel.rank.dataplane.common import counters_
    from monarch_kernel.rank.dataplane.plane import server

    _, _, receiver = peers
    before = receiver.bytes_in.call_one().get()
    monkeypatch.setattr(cuda_ipc, "device", HostMemory())
    sent = counters_["ipc_arguments"]
    value = sample_value()
    future = receiver.take.call_one(value)
    value["big"].add_(1.0)  # after the call was sent: not what the receiver must see
    assert future.get(timeout=60) == EXPECTED
    assert counters_["ipc_arguments"] - sent == HANDLES
    wait_until(lambda: not server().reads_left, timeout=30, what="the notebook's copies to go")
    monkeypatch.undo()
    assert receiver.bytes_in.call_one().get() - before == HANDLES * BIG * 4


def test_a_notebook_without_cuda_in_use_pickles_them(peers):
    """CUDA not initialised in the notebook's process (the real device): its calls are
    not looked through at all (``cuda_args.may_share``)."""
    from monarch_kernel.rank.dataplane.common import counters_

    _, _, receiver = peers
    before = receiver.bytes_in.call_one().get()
    sent = counters_["ipc_arguments"]
    assert receiver.take.call_one(sample_value()).get(timeout=60)["small"] == SEEN["small"]
    assert counters_["ipc_arguments"] == sent
    assert receiver.bytes_in.call_one().get() == before


def test_a_receiver_that_dies_leaves_the_caller_no_copy(peers):
    """Last in the module: the receiver's rank dies (the fixture's stop ends the mesh)."""
    _, caller, receiver = peers
    pid = receiver.pid.call_one().get()
    out = caller.send.call_one(receiver, "dies").get()
    assert out["handles"] == HANDLES
    assert isinstance(out["seen"], str) and ("died" in out["seen"] or str(pid) in out["seen"]), out
    assert out["left"] == 0, "a dead receiver's copies are still held"
