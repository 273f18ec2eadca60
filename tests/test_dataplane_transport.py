"""The data plane's choice of transport for a CUDA tensor (``rank.dataplane.transport``):
CUDA IPC within a host, pinned host memory between hosts or where IPC is not possible,
host bytes for CPU tensors and receivers without CUDA. Pure: no GPU needed."""

from __future__ import annotations

import pytest

from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.dataplane.transport import (
    Facts,
    Transport,
    alloc_conf,
    choose,
    expandable_segments,
    ipc_enabled,
)

pytestmark = pytest.mark.unit


def facts(**kw):
    base = {"same_host": True, "owner_device": "cuda", "receiver_cuda": True}
    return Facts(**{**base, **kw})


def test_same_host_cuda_to_cuda_is_ipc():
    assert choose(facts()) is Transport.IPC


def test_across_hosts_is_staged_through_pinned_memory():
    assert choose(facts(same_host=False)) is Transport.STAGED_PINNED


@pytest.mark.parametrize("same_host", [True, False])
def test_cpu_tensors_and_receivers_without_cuda_are_host_bytes(same_host):
    assert choose(facts(same_host=same_host, owner_device="cpu")) is Transport.HOST_BYTES
    assert choose(facts(same_host=same_host, receiver_cuda=False)) is Transport.HOST_BYTES
    cpu_to_cpu = facts(same_host=same_host, owner_device="cpu", receiver_cuda=False)
    assert choose(cpu_to_cpu) is Transport.HOST_BYTES


@pytest.mark.parametrize(
    "conf, expandable",
    [
        ("", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments : true", True),
        ("expandable_segments:False", False),
        ("garbage_collection_threshold:0.6", False),
    ],
)
def test_expandable_segments_stage_instead_of_ipc(conf, expandable):
    assert expandable_segments(conf) is expandable
    want = Transport.STAGED_PINNED if expandable else Transport.IPC
    assert choose(facts(alloc_conf=conf)) is want


def test_ipc_can_be_turned_off():
    assert choose(facts(ipc_enabled=False)) is Transport.STAGED_PINNED
    assert not ipc_enabled({"MONARCH_KERNEL_CUDA_IPC": "0"})
    assert ipc_enabled({}) and ipc_enabled({"MONARCH_KERNEL_CUDA_IPC": "1"})


def test_alloc_conf_reads_both_names():
    env = {"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert expandable_segments(alloc_conf(env))
    assert alloc_conf({}) == ""


def _ref(cuda: bool, conf: str = "") -> TensorRef:
    return TensorRef(0, 0, "", "ipc://x", "", "run", 1, "float32", (4,), 16, cuda, 0, "",
                     "m", "", 1, conf)  # fmt: skip


def test_a_ref_carries_the_owners_allocator_settings(monkeypatch):
    monkeypatch.setattr(TensorRef, "same_host", lambda self: True)
    monkeypatch.delenv("MONARCH_KERNEL_CUDA_IPC", raising=False)
    assert choose(_ref(True).facts(receiver_cuda=True)) is Transport.IPC
    staged = _ref(True, "expandable_segments:True").facts(receiver_cuda=True)
    assert choose(staged) is Transport.STAGED_PINNED
    assert choose(_ref(False).facts(receiver_cuda=True)) is Transport.HOST_BYTES


def test_ipc_transport_on_a_cpu_tensor_is_a_clear_error():
    with pytest.raises(ValueError, match="transport='ipc' is for CUDA tensors"):
        _ref(False)._use_shm("ipc")
    with pytest.raises(ValueError, match="auto, shm, tcp or ipc"):
        _ref(False)._use_shm("rdma")


def test_leases_end_when_the_receiver_is_done_dies_or_takes_too_long(monkeypatch):
    released = []
    import torch

    monkeypatch.setattr(
        torch.UntypedStorage,
        "_release_ipc_counter_cuda",
        lambda h, o: released.append((h, o)),
        raising=False,
    )
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    leases = cuda_ipc.Leases()
    import os

    done = leases.add(cuda_ipc.Lease("t1", os.getpid(), 1e18, (b"a", 1)))
    late = leases.add(cuda_ipc.Lease("t2", os.getpid(), 10.0, (b"b", 2)))
    dead = leases.add(cuda_ipc.Lease("t3", 2**22 + 12345, 1e18, (b"c", 3)))
    leases.done(done)
    assert set(leases.held) == {late, dead}
    assert leases.expire(now=5.0) == 1  # the dead receiver's: its counter is released
    assert released == [(b"c", 3)] and set(leases.held) == {late}
    assert leases.expire(now=11.0) == 1  # the deadline: the receiver may still map it
    assert released == [(b"c", 3)] and leases.held == {}
