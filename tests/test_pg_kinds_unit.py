"""Which re-formable backend ``init_process_group`` gets, and the environment an NCCL
worker runs with (pure functions; the NCCL worker itself is checked on a GPU by
tests/test_gpu_nccl.py)."""

from __future__ import annotations

import pytest
import torch

from monarch_kernel.rank.pg import backend as pg_backend
from monarch_kernel.rank.pg.nccl_env import shares_gpu, worker_env
from monarch_kernel.rank.pg.reformable import _check_tensor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "requested, cuda, chosen",
    [
        ("gloo", False, "mkgloo"),
        ("cpu:gloo", True, "mkgloo"),
        (None, False, "mkgloo"),
        ("undefined", False, "mkgloo"),
        (None, True, "mknccl"),
        ("nccl", True, "mknccl"),
        ("NCCL", True, "mknccl"),
        ("cpu:gloo,cuda:nccl", True, "mknccl"),
        ("cpu:gloo, cuda:nccl", True, "mknccl"),
        ("nccl", False, "nccl"),  # torch's own error says NCCL is not available
        ("mpi", True, "mpi"),
    ],
)
def test_init_process_group_gets_the_reformable_backend(monkeypatch, requested, cuda, chosen):
    monkeypatch.setattr(pg_backend, "_has_cuda", lambda: cuda)
    monkeypatch.delenv(pg_backend.OPT_OUT, raising=False)
    assert pg_backend.choose_backend(requested) == chosen


def test_opting_out_keeps_what_was_asked(monkeypatch):
    monkeypatch.setattr(pg_backend, "_has_cuda", lambda: True)
    monkeypatch.setenv(pg_backend.OPT_OUT, "0")
    assert pg_backend.choose_backend("nccl") == "nccl"
    assert pg_backend.choose_backend(None) is None


def test_ranks_sharing_a_gpu_get_a_host_id_each():
    base = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "NCCL_DEBUG": "WARN", "HOME": "/root"}
    env = worker_env(base, gpus_on_host=1)
    assert env["NCCL_HOSTID"].endswith("-mk-1")
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_DEBUG"] == "WARN" and "HOME" not in env
    other = worker_env({**base, "LOCAL_RANK": "0"}, gpus_on_host=1)
    assert other["NCCL_HOSTID"] != env["NCCL_HOSTID"]


def test_a_gpu_per_rank_or_the_users_choice_is_left_alone():
    assert "NCCL_HOSTID" not in worker_env({"LOCAL_WORLD_SIZE": "2"}, gpus_on_host=2)
    assert "NCCL_HOSTID" not in worker_env({"LOCAL_WORLD_SIZE": "4"}, gpus_on_host=0)
    mine = {"LOCAL_WORLD_SIZE": "4", "NCCL_HOSTID": "x", "NCCL_SOCKET_IFNAME": "eth0"}
    env = worker_env(mine, gpus_on_host=1)
    assert env["NCCL_HOSTID"] == "x" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    across = worker_env({"LOCAL_WORLD_SIZE": "4", "NCCL_SOCKET_IFNAME": "eth1"}, 1)
    assert across["NCCL_SOCKET_IFNAME"] == "eth1"  # a mesh across hosts keeps its interface
    assert not shares_gpu({"LOCAL_WORLD_SIZE": "many"}, 1)


def test_tensors_a_group_cannot_carry_are_refused_saying_what_to_do():
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="carries CPU tensors.*backend='nccl'"):
        _check_tensor("allreduce", meta, -1)
    with pytest.raises(ValueError, match="carries CPU tensors"):
        _check_tensor("allreduce", meta, 0)  # an NCCL group: CUDA or CPU, nothing else
    with pytest.raises(TypeError, match="expected tensors, got int"):
        _check_tensor("allreduce", 3, -1)  # type: ignore[arg-type]
    _check_tensor("allreduce", torch.zeros(2), 0)  # CPU tensors go to gloo beside NCCL
