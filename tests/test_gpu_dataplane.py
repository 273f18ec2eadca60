"""CUDA tensors rank to rank on one host by CUDA IPC (``rank.dataplane.cuda_ipc``): values,
dtype and shape kept, the copy on the receiver's GPU, no byte through host memory
(``bytes_staged`` stays 0), and no GPU memory left behind when either side is SIGKILLed.
Mappings are kept: a tensor read again is not mapped again (the owner renews its lease and
the reader still sees every change), an idle mapping is let go, and an RDMA buffer is
made ``one_sided`` is read one-sided after its first use (no message), a dropped one
refused at once. A CUDA tensor in a rank's call to a rank of its machine goes by CUDA IPC
too (``rank.dataplane.cuda_args``), its copy dropped once the call is answered.

Needs CUDA: skipped without a GPU. Owner and receiver are ranks of two one-rank meshes of
this machine (a ref reaches ranks of other meshes of its machine over the owner's unix
socket), so that killing one leaves the other's mesh whole. Run on a GPU machine with
``python -m pytest tests/test_gpu_dataplane.py``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from conftest import pid_alive
from helpers import wait_until

from monarch_kernel.actor import Actor, endpoint, this_host

pytestmark = [pytest.mark.local, pytest.mark.gpu]

MIB = 1 << 20
SLACK = 300 * MIB  # a CUDA context's own memory, allocator rounding


class Gpu(Actor):
    def __init__(self) -> None:
        self.kept: dict[str, Any] = {}

    @endpoint
    def pid(self) -> int:
        torch.ones(1, device="cuda")  # this rank's CUDA context, before any baseline
        return os.getpid()

    @endpoint
    def share(self, n: int, dtype: str = "float32", strided: bool = False):
        import monarch_kernel

        t = torch.arange(2 * n if strided else n, device="cuda").to(getattr(torch, dtype))
        if strided:
            t = t.view(n, 2)[:, 1]  # a non-contiguous view of a bigger storage
        self.kept["t"] = t
        return monarch_kernel.share(t)

    @endpoint
    def rdma(self, n: int, one_sided: bool = False):
        from monarch_kernel.rdma import RDMABuffer

        self.kept["b"] = t = torch.arange(n, device="cuda", dtype=torch.float32)
        self.kept["buffer"] = buffer = RDMABuffer(t, one_sided=one_sided)
        return buffer

    @endpoint
    def bump(self, key: str) -> None:
        self.kept[key].add_(1)  # on the GPU, not waited for here

    @endpoint
    def fill(self, key: str, value: float, wait: bool = False) -> None:
        self.kept[key].fill_(value)
        if wait:  # what a one-sided buffer's owner does before readers read
            torch.cuda.synchronize()

    @endpoint
    def drop_buffer(self) -> None:
        self.kept["buffer"].drop().get()

    @endpoint
    def rdma_reads(self, buf, n: int, times: int) -> list[float]:
        dst = torch.empty(n, device="cuda", dtype=torch.float32)
        sums = []
        for _ in range(times):
            buf.read_into(dst).get()
            sums.append(float(dst.double().sum()))
        return sums

    @endpoint
    def rdma_read_error(self, buf, n: int) -> str:
        try:
            buf.read_into(torch.empty(n, device="cuda", dtype=torch.float32)).get()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    @endpoint
    def phases(self) -> dict:
        from monarch_kernel.rank.dataplane import cuda_ipc

        return dict(cuda_ipc.phase_counts)

    @endpoint
    def set_idle(self, seconds: float) -> None:
        from monarch_kernel.rank.dataplane import cuda_ipc

        cuda_ipc.mappings.idle = seconds

    @endpoint
    def owned_sum(self, key: str) -> float:
        return float(self.kept[key].double().sum())

    @endpoint
    def pull(self, ref, transport: str = "auto", keep: bool = False):
        t = ref.get(transport)
        if keep:
            self.kept["copy"] = t
        return str(t.device), str(t.dtype), list(t.shape), float(t.double().sum())

    @endpoint
    def rdma_roundtrip(self, buf, n: int) -> tuple[float, str]:
        dst = torch.empty(n, device="cuda", dtype=torch.float32)
        buf.read_into(dst).get()
        buf.write_from(torch.full((n,), 2.0, device="cuda")).get()
        return float(dst.double().sum()), str(dst.device)

    @endpoint
    def map_and_hold(self, ref) -> None:
        """Map the owner's tensor by IPC and keep the mapping (as if killed mid-copy)."""
        from monarch_kernel.rank.dataplane import cuda_ipc
        from monarch_kernel.rank.dataplane.client import client

        msg = client().request(ref, {"op": "ipc", "id": ref.id, "p": os.getpid()})
        self.kept["mapped"] = cuda_ipc.open_mapping(msg.header, getattr(torch, ref.dtype))

    @endpoint
    def copy_sum(self) -> float:
        return float(self.kept["copy"].double().sum())

    @endpoint
    def drop_all(self) -> None:
        from monarch_kernel.rank.dataplane.plane import server

        for ident in list(server().tensors):
            server().release(ident)
        self.kept.clear()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

    @endpoint
    def leases(self) -> int:
        from monarch_kernel.rank.dataplane.plane import server

        return len(server().leases.held)

    @endpoint
    def counters(self) -> dict:
        from monarch_kernel.rank.dataplane.plane import counters

        return counters()

    @endpoint
    def take(self, t) -> tuple[str, float]:
        return str(t.device), float(t.double().sum())

    @endpoint
    def send_then_busy(self, other, n: int) -> dict[str, Any]:
        """Call ``other.take`` with a CUDA tensor, then queue seconds of GPU work on this
        rank's stream: the answer must not wait for that work (the argument's copy was
        finished when the call was made)."""
        t = torch.arange(n, device="cuda", dtype=torch.float32)
        future = other.take.call_one(t)
        torch.cuda._sleep(int(8e9))  # a few seconds of one busy kernel, queued after the call
        seen = future.get(timeout=60)
        busy = not torch.cuda.current_stream().query()  # still in the kernel when answered
        torch.cuda.synchronize()
        return {"seen": seen, "answered_while_busy": busy}

    @endpoint
    def make(self, n: int) -> Any:
        """A CUDA tensor of this actor's own (``bump_made`` changes it later)."""
        self.kept["made"] = torch.arange(n, device="cuda", dtype=torch.float32)
        return self.kept["made"]

    @endpoint
    def bump_made(self) -> None:
        self.kept["made"].add_(1)

    @endpoint
    def fetch_from(self, other, n: int) -> dict[str, Any]:
        """Call ``other.make``; once the reply is here, have ``other`` change its tensor,
        then read the reply (it must be the value as returned); what came, and how many
        copies and leases ``other`` still holds afterwards."""
        future = other.make.call_one(n)
        deadline = time.monotonic() + 60
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        other.bump_made.call_one().get(timeout=60)
        t = future.get(timeout=60)
        seen = (str(t.device), float(t.double().sum()))
        return {"seen": seen, "held": other.held.call_one().get()}

    @endpoint
    def held(self) -> int:
        """Copies and leases this rank's data plane holds, once none (at most 30 s)."""
        from monarch_kernel.rank.dataplane.plane import server

        owner = server()
        deadline = time.monotonic() + 30
        while (owner.tensors or owner.leases.held) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(owner.tensors) + len(owner.leases.held)

    @endpoint
    def send_to(self, other, n: int) -> dict[str, Any]:
        """Call ``other.take`` with a CUDA tensor of ``n`` float32 values, changed on the
        GPU right after the call is sent; what the receiver saw, how many arguments went
        as handles, and how many copies and leases this rank still holds afterwards."""
        from monarch_kernel.rank.dataplane.common import counters_
        from monarch_kernel.rank.dataplane.plane import server

        t = torch.arange(n, device="cuda", dtype=torch.float32)
        before = counters_["ipc_arguments"]
        future = other.take.call_one(t)
        t.add_(1)  # not what the receiver must see
        seen = future.get(timeout=60)
        owner = server()
        deadline = time.monotonic() + 30
        while (owner.tensors or owner.leases.held) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {
            "seen": seen,
            "handles": counters_["ipc_arguments"] - before,
            "held": len(owner.tensors) + len(owner.leases.held),
        }


@pytest.fixture
def pair():
    """(owner, receiver): a Gpu actor in each of two one-rank meshes."""
    meshes = [this_host().spawn_procs(per_host={"gpus": 1}) for _ in range(2)]
    try:
        yield [m.spawn("gpu", Gpu).slice(gpus=0) for m in meshes]
    finally:
        for m in meshes:
            m.stop()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _wait_free(at_least: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    free = _free()
    while free < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        free = _free()
    return free


def _expected(n: int, strided: bool = False) -> float:
    if strided:
        return float(torch.arange(2 * n, dtype=torch.float64).view(n, 2)[:, 1].sum())
    return float(torch.arange(n, dtype=torch.float64).sum())


@pytest.mark.parametrize(
    "dtype, strided", [("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_cuda_tensor_moves_by_ipc_without_host_copy(pair, dtype, strided):
    owner, receiver = pair
    n = 1 << 20
    ref = owner.share.call_one(n, dtype, strided).get()
    assert ref.cuda
    device, got_dtype, shape, total = receiver.pull.call_one(ref).get()
    assert device.startswith("cuda") and got_dtype == f"torch.{dtype}" and shape == [n]
    want = float(torch.arange(2 * n if strided else n).to(getattr(torch, dtype)).double()
                 .view(-1, 2 if strided else 1)[:, -1].sum())  # fmt: skip
    assert total == want
    mine, theirs = owner.counters.call_one().get(), receiver.counters.call_one().get()
    assert theirs["bytes_ipc"] >= ref.nbytes and theirs["bytes_staged"] == 0
    assert mine["bytes_staged"] == 0 and theirs["ipc_fallbacks"] == 0
    # explicitly through host memory: staged through pinned memory, counted
    assert receiver.pull.call_one(ref, "tcp").get() == (device, got_dtype, shape, total)
    assert receiver.counters.call_one().get()["bytes_staged"] >= ref.nbytes


def test_rdma_buffer_on_cuda_reads_and_writes_by_ipc(pair):
    owner, receiver = pair
    n = 1 << 20
    buf = owner.rdma.call_one(n).get()
    total, device = receiver.rdma_roundtrip.call_one(buf, n).get()
    assert total == _expected(n) and device.startswith("cuda")
    assert owner.owned_sum.call_one("b").get() == 2.0 * n  # written in the owner's memory
    assert receiver.counters.call_one().get()["bytes_staged"] == 0
    assert owner.counters.call_one().get()["bytes_staged"] == 0


def test_no_gpu_memory_left_when_the_receiver_dies_holding_a_mapping(pair):
    owner, receiver = pair
    receiver_pid = receiver.pid.call_one().get()
    owner.pid.call_one().get()
    before = _free()
    n = 256 * MIB // 4
    ref = owner.share.call_one(n).get()
    receiver.map_and_hold.call_one(ref).get()
    assert owner.leases.call_one().get() == 1
    os.kill(receiver_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while owner.leases.call_one().get() and time.monotonic() < deadline:
        time.sleep(0.1)  # the owner notices the death within a second
    assert owner.leases.call_one().get() == 0, "the dead receiver's lease was kept"
    owner.drop_all.call_one().get()  # the owner lets its tensor go
    free = _wait_free(before - SLACK)
    assert free >= before - SLACK, f"{(before - free) / MIB:.0f} MiB of GPU memory leaked"


def test_the_copy_outlives_the_owner_and_nothing_is_left(pair):
    owner, receiver = pair
    owner_pid = owner.pid.call_one().get()
    receiver.pid.call_one().get()
    before = _free()
    n = 256 * MIB // 4
    ref = owner.share.call_one(n).get()
    receiver.pull.call_one(ref, keep=True).get()
    os.kill(owner_pid, signal.SIGKILL)
    assert receiver.copy_sum.call_one().get() == _expected(n)  # still valid: its own memory
    receiver.drop_all.call_one().get()
    free = _wait_free(before - SLACK)
    assert free >= before - SLACK, f"{(before - free) / MIB:.0f} MiB of GPU memory leaked"


def test_a_tensor_read_again_is_not_mapped_again_and_every_change_is_seen(pair):
    owner, receiver = pair
    n = 1 << 20
    ref = owner.share.call_one(n).get()
    mine, theirs = owner.phases.call_one().get(), receiver.phases.call_one().get()
    for bumps in range(3):
        assert receiver.pull.call_one(ref).get()[3] == _expected(n) + bumps * n
        owner.bump.call_one("t").get()  # in place, on the owner's GPU
    mine2, theirs2 = owner.phases.call_one().get(), receiver.phases.call_one().get()
    assert theirs2["map"] - theirs["map"] == 1, "mapped once, kept for the next reads"
    assert mine2["describe"] - mine["describe"] == 1
    assert mine2["renew"] - mine["renew"] == 2, "each later read: the lease renewed"
    assert owner.leases.call_one().get() == 1
    receiver.set_idle.call_one(0.2).get()
    wait_until(lambda: owner.leases.call_one().get() == 0, timeout=30,
               what="the idle mapping to be let go and the owner told")  # fmt: skip
    assert receiver.pull.call_one(ref).get()[3] == _expected(n) + 3 * n  # mapped anew


def test_an_rdma_buffer_is_mapped_once_and_each_read_sees_the_owners_work(pair):
    owner, receiver = pair
    n = 1 << 20
    buf = owner.rdma.call_one(n).get()
    before = receiver.phases.call_one().get()
    assert receiver.rdma_reads.call_one(buf, n, 3).get() == [_expected(n)] * 3
    owner.fill.call_one("b", 5.0).get()  # not waited for by the owner: each read asks it
    assert receiver.rdma_reads.call_one(buf, n, 1).get() == [5.0 * n]
    assert receiver.phases.call_one().get()["map"] - before["map"] == 1
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 0


def test_a_one_sided_rdma_buffer_needs_no_message_after_its_first_use_and_a_drop_is_refused(
    pair,
):
    owner, receiver = pair
    n = 1 << 20
    buf = owner.rdma.call_one(n, one_sided=True).get()
    assert receiver.rdma_reads.call_one(buf, n, 3).get() == [_expected(n)] * 3
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 2
    owner.fill.call_one("b", 5.0, wait=True).get()  # the owner's side of one-sided use
    assert receiver.rdma_reads.call_one(buf, n, 1).get() == [5.0 * n]
    assert receiver.counters.call_one().get()["ipc_one_sided"] == 3
    owner.drop_buffer.call_one().get()
    error = receiver.rdma_read_error.call_one(buf, n).get()
    assert "dropped by its owner" in error, error


def test_a_one_sided_reader_learns_its_owner_died_and_no_gpu_memory_is_left(pair):
    owner, receiver = pair
    owner_pid = owner.pid.call_one().get()
    receiver.pid.call_one().get()
    before = _free()
    n = 256 * MIB // 4
    buf = owner.rdma.call_one(n, one_sided=True).get()
    first, second = receiver.rdma_reads.call_one(buf, n, 2).get()  # one-sided, the 2nd
    assert first == second > 0
    os.kill(owner_pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(owner_pid), timeout=30, what="the owner to end")
    error = receiver.rdma_read_error.call_one(buf, n).get()
    assert "died" in error, error
    receiver.drop_all.call_one().get()
    free = _wait_free(before - SLACK)
    assert free >= before - SLACK, f"{(before - free) / MIB:.0f} MiB of GPU memory leaked"


def test_cuda_endpoint_arguments_and_results_rank_to_rank_go_by_ipc_and_copies_are_dropped(pair):
    caller, receiver = pair
    n = 16 * MIB // 4
    out = caller.send_to.call_one(receiver, n).get()
    device, total = out["seen"]
    assert device.startswith("cuda") and total == _expected(n), out
    assert out["handles"] == 1 and out["held"] == 0, out
    theirs, mine = receiver.counters.call_one().get(), caller.counters.call_one().get()
    assert theirs["bytes_ipc"] >= 4 * n and theirs["bytes_staged"] == 0, theirs
    assert mine["bytes_staged"] == 0 and theirs["ipc_fallbacks"] == 0, mine
    # the other way: the receiver returns a CUDA tensor (rank.dataplane.cuda_results),
    # changed on its GPU after the reply went and before the caller reads it
    out = receiver.fetch_from.call_one(caller, n).get()
    assert out["seen"][0].startswith("cuda") and out["seen"][1] == _expected(n), out
    assert out["held"] == 0, out
    answered, read = caller.counters.call_one().get(), receiver.counters.call_one().get()
    assert answered["ipc_results"] == 1 and answered["bytes_staged"] == 0, answered
    assert read["bytes_ipc"] >= 8 * n and read["ipc_fallbacks"] == 0, read


def test_a_cuda_argument_never_waits_for_gpu_work_the_caller_queued_after_the_call(pair):
    caller, receiver = pair
    n = 4 * MIB // 4
    out = caller.send_then_busy.call_one(receiver, n).get()
    assert out["seen"][1] == _expected(n), out
    assert out["answered_while_busy"], "the receiver waited for the caller's later GPU work"
