"""The CUDA IPC protocol of the data plane (``rank.dataplane.cuda_ipc``, its client and
server) end to end between two real ranks, with host shared memory in the place of CUDA
memory (``tests/ipc_host_memory.py``: a receiver's mapping is the owner's memory, as with
CUDA IPC), so that it runs on every machine: a kept mapping renewed on each read and let
go when idle, a tensor given new memory mapped again, a released tensor refused, an RDMA
buffer used one-sided (reads and writes with no message) until it is dropped, and the
death of either side. The same paths on a GPU: ``tests/test_gpu_dataplane.py``."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from conftest import pid_alive
from helpers import wait_until
from ipc_host_memory import IpcPeer

from monarch_kernel.actor import this_host

pytestmark = pytest.mark.local

N = 1024  # float32 values: 4 KiB


def _sum(plus: float = 0.0) -> float:
    return float(sum(range(N))) + plus * N


@pytest.fixture
def pair():
    """(owner, receiver): an IpcPeer on each rank of a fresh two-rank mesh (a killed rank
    is restarted in place; the other goes on)."""
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        peers = mesh.spawn("ipc", IpcPeer)
        yield peers.slice(gpus=0), peers.slice(gpus=1)
    finally:
        mesh.stop()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout=30, what=f"pid {pid} to end after SIGKILL")


def _no_leases(owner: Any, what: str) -> None:
    wait_until(lambda: owner.leases.call_one().get() == 0, timeout=30, what=what)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_a_kept_mapping_is_renewed_on_each_read_and_let_go_when_idle(pair):
    owner, receiver = pair
    ref = owner.share.call_one(N).get()
    mine, theirs = owner.phases.call_one().get(), receiver.phases.call_one().get()
    for bumps in range(3):
        assert receiver.read.call_one(ref).get() == _sum(bumps)
        owner.bump.call_one("t").get()  # in place: each read sees it
    owned = _delta(owner.phases.call_one().get(), mine)
    assert _delta(receiver.phases.call_one().get(), theirs)["map"] == 1, "mapped once"
    assert owned["describe"] == 1 and owned["renew"] == 2
    assert owner.leases.call_one().get() == 1 and receiver.mappings.call_one().get() == 1
    receiver.set_idle.call_one(0.2).get()
    _no_leases(owner, "the idle mapping's owner to be told")
    assert receiver.mappings.call_one().get() == 0
    assert receiver.read.call_one(ref).get() == _sum(3)  # mapped anew
    assert _delta(receiver.phases.call_one().get(), theirs)["map"] == 2


def test_a_tensor_given_new_memory_is_mapped_again_and_the_old_lease_ends(pair):
    owner, receiver = pair
    ref = owner.share.call_one(N).get()
    assert receiver.read.call_one(ref).get() == _sum()
    owner.give_new_memory.call_one(ref.id, 7.0).get()
    assert receiver.read.call_one(ref).get() == 7.0 * N, "read from the old memory"
    assert receiver.phases.call_one().get()["map"] == 2
    assert owner.leases.call_one().get() == 1, "the first lease was kept as well"
    assert receiver.mappings.call_one().get() == 1


def test_a_released_tensor_is_refused_and_its_mapping_let_go(pair):
    owner, receiver = pair
    ref = owner.share.call_one(N).get()
    assert receiver.read.call_one(ref).get() == _sum()
    owner.release.call_one(ref.id).get()
    error = receiver.read_error.call_one(ref).get()
    assert "released or never shared" in error, error
    assert receiver.mappings.call_one().get() == 0
    _no_leases(owner, "the owner to be told")


def _owners_work_for_three_reads(owner: Any, receiver: Any, buf: Any) -> dict:
    """Three reads of ``buf`` by ``receiver``: the owner's describes and renewals."""
    mine = owner.phases.call_one().get()
    for _ in range(3):
        assert receiver.read.call_one(buf, True).get() == _sum()
    return _delta(owner.phases.call_one().get(), mine)


def test_an_rdma_buffer_asks_its_owner_each_time_unless_made_one_sided(pair):
    owner, receiver = pair
    buf = owner.buffer.call_one(N, False).get()
    owned = _owners_work_for_three_reads(owner, receiver, buf)
    assert owned["describe"] == 1 and owned["renew"] == 2
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 0


def test_a_one_sided_buffer_is_read_and_written_with_no_message_until_dropped(pair):
    owner, receiver = pair
    buf = owner.buffer.call_one(N, True).get()
    owned = _owners_work_for_three_reads(owner, receiver, buf)
    assert owned["describe"] == 1 and owned["renew"] == 0, "asked after the first read"
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 2
    owner.bump.call_one("b").get()
    assert receiver.read.call_one(buf, True).get() == _sum(1), "the owner's change unseen"
    receiver.write.call_one(buf, 2.0).get()
    assert owner.owned_sum.call_one("b").get() == 2.0 * N, "not written in the owner's memory"
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 4
    owner.drop_buffer.call_one().get()
    error = receiver.read_error.call_one(buf, True).get()
    assert "released or never shared" in error, error
    assert receiver.mappings.call_one().get() == 0


def test_a_one_sided_reader_learns_at_once_that_the_owner_died(pair):
    owner, receiver = pair
    buf = owner.buffer.call_one(N, True).get()
    assert receiver.read.call_one(buf, True).get() == _sum()
    assert receiver.read.call_one(buf, True).get() == _sum()  # one-sided
    _kill(owner.pid.call_one().get())
    error = receiver.read_error.call_one(buf, True).get()
    assert error.startswith("OwnerDiedError") and "died" in error, error
    assert receiver.mappings.call_one().get() == 0


def test_a_receiver_that_dies_holding_a_mapping_has_its_lease_ended_and_counter_released(pair):
    owner, receiver = pair
    ref = owner.share.call_one(N).get()
    assert receiver.read.call_one(ref).get() == _sum()
    assert owner.leases.call_one().get() == 1
    _kill(receiver.pid.call_one().get())
    _no_leases(owner, "the dead receiver's lease to end")
    assert owner.released_counters.call_one().get() == 1
