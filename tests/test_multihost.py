"""Two emulated hosts (two local host agents): dims {"hosts": 2, "gpus": 2}."""

from __future__ import annotations

import pytest
import torch
from actors import Counter, Worker

from monarch_kernel.actor import host_mesh

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def mesh22():
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 2})
    yield procs
    procs.stop()


def test_two_by_two_mesh_coordinates(mesh22):
    assert mesh22.extent == {"hosts": 2, "gpus": 2}
    workers = mesh22.spawn("w", Worker)
    infos = workers.whoami.call().get()
    for point, info in infos.items():
        assert info["coords"] == dict(point)
        assert info["rank"] == point.rank
        assert info["env"]["GROUP_RANK"] == str(point["hosts"])
        assert info["env"]["LOCAL_RANK"] == str(point["gpus"])
        assert info["env"]["WORLD_SIZE"] == "4"
    assert infos.item(hosts=1, gpus=0)["rank"] == 2


def test_slicing_hosts_and_gpus(mesh22):
    counters = mesh22.spawn("c", Counter)
    host1 = counters.slice(hosts=1)
    assert host1.extent == {"gpus": 2}
    host1.incr.call(5).get()
    gpu0 = counters.slice(gpus=0)
    assert gpu0.extent == {"hosts": 2}
    assert gpu0.value.call().get().values() == [0, 5]
    assert counters.slice(hosts=1, gpus=1).value.call_one().get() == 5
    vm = counters.value.call().get()
    assert vm.item(hosts=1, gpus=1) == 5 and vm.item(hosts=0, gpus=1) == 0


def test_fanout_to_both_hosts_keeps_order_and_content(mesh22):
    counters = mesh22.spawn("c2", Counter)
    big = torch.arange(200_000, dtype=torch.float32)
    for i in range(10):
        counters.record.broadcast(i, big)
    assert all(log == list(range(10)) for log in counters.get_log.call().get().values())
    workers = mesh22.spawn("w2", Worker)
    expected = float(big.double().sum())
    assert workers.checksum.call(big).get().values() == [expected] * 4


def test_host_agents_are_distinct_processes(mesh22):
    rt = mesh22.runtime
    assert len({h.pid for h in rt.hosts}) == 2
    assert [r.host for r in rt.ranks] == [0, 0, 1, 1]
