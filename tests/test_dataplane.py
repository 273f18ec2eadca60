"""Rank-to-rank tensors: pulled directly from the owner, never through the controller."""

from __future__ import annotations

import os

import pytest
import torch
from actors import DataActor

from monarch_kernel.actor import ActorError, host_mesh


@pytest.fixture(scope="module")
def mesh22():
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 2})
    yield procs
    procs.stop()
    run_id = procs.runtime.run_id
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"mk-{run_id}-")]
    assert not leftovers, f"shared-memory files left behind: {leftovers}"


@pytest.mark.parametrize("transport", ["shm", "tcp", "auto"])
def test_tensor_moves_rank_to_rank(mesh22, transport):
    actors = mesh22.spawn(f"data_{transport}", DataActor)
    n = 3_000_000  # 12 MB
    ref = actors.slice(hosts=0, gpus=0).share_arange.call_one(n).get()
    assert ref.owner == 0 and ref.nbytes == 4 * n and ref.shape == (n,)
    expected = float(torch.arange(n, dtype=torch.float64).sum())
    total, shape = actors.slice(hosts=1, gpus=1).pull.call_one(ref, transport).get()
    assert shape == [n] and total == expected
    # every rank can pull the same ref, also the owner itself
    sums = actors.pull.call(ref, transport).get().values()
    assert sums == [(expected, [n])] * 4


def test_bytes_are_counted_per_rank(mesh22):
    actors = mesh22.spawn("data_count", DataActor)
    ref = actors.slice(hosts=0, gpus=1).share_arange.call_one(1000).get()
    actors.slice(hosts=1, gpus=0).pull.call_one(ref, "tcp").get()
    counts = actors.counters.call().get()
    assert counts.item(hosts=0, gpus=1)["bytes_out"] >= 4000
    assert counts.item(hosts=1, gpus=0)["bytes_in"] >= 4000


def test_released_tensor_gives_a_clear_error(mesh22):
    actors = mesh22.spawn("data_rel", DataActor)
    ref = actors.slice(hosts=0, gpus=0).share_arange.call_one(10).get()
    actors.slice(hosts=0, gpus=0).release.call_one(ref).get()
    with pytest.raises(ActorError, match="released or never shared by rank 0"):
        actors.slice(hosts=1, gpus=0).pull.call_one(ref, "tcp").get()


def test_share_outside_a_rank_is_a_clear_error():
    import monarch_kernel

    with pytest.raises(RuntimeError, match="inside ranks"):
        monarch_kernel.share(torch.zeros(3))


def test_shared_memory_copy_is_private_and_writable(mesh22):
    from actors import ShmWriter

    actors = mesh22.spawn("data_cow", DataActor)
    writers = mesh22.spawn("writers", ShmWriter)
    ref = actors.slice(hosts=0, gpus=0).share_arange.call_one(1000).get()
    base = float(torch.arange(1000, dtype=torch.float64).sum())
    assert writers.slice(hosts=1, gpus=0).pull_and_bump.call_one(ref).get() == base + 1000
    assert actors.slice(hosts=1, gpus=1).pull.call_one(ref, "shm").get() == (base, [1000])
