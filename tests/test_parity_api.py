"""Monarch parity of ``Channel.open_ranked`` and ``HostMesh.size``/``shutdown``."""

from __future__ import annotations

import asyncio

import pytest
from conftest import pid_alive, wait_until
from parity_api_actors import Sender

from monarch_kernel.actor import (
    ActorError,
    Channel,
    HostMesh,
    ProcMesh,
    RankedPortReceiver,
    host_mesh,
    this_host,
)
from monarch_kernel.actor import hosts as hosts_mod
from monarch_kernel.launchers.local import LocalLauncher

# -- Channel.open_ranked ----------------------------------------------------------------


@pytest.fixture(scope="module")
def senders():
    """Four ranks spawned from a host mesh of their own (shut down after the module)."""
    hosts = host_mesh(1)
    procs = hosts.spawn_procs(per_host={"gpus": 4}, name="ranked")
    yield procs.spawn("sender", Sender)
    hosts.shutdown()
    assert procs.stopped


def test_ranked_receiver_gives_each_value_its_senders_rank(senders):
    port, receiver = Channel[int].open_ranked()
    assert isinstance(receiver, RankedPortReceiver)
    senders.send_values.call(port, 3).get()
    got = sorted(receiver.recv().get(timeout=10) for _ in range(12))
    assert got == [(r, 100 * r + i) for r in range(4) for i in range(3)]


def test_ranked_rank_is_the_point_in_the_slice_called(senders):
    # Monarch: the rank within the slice the message went to (message_rank)
    port, receiver = Channel[int].open_ranked()
    senders.slice(gpus=slice(2, 4)).send_values.call(port, 1).get()
    got = sorted(receiver.recv().get(timeout=10) for _ in range(2))
    assert got == [(0, 200), (1, 300)]
    senders.slice(gpus=3).send_values.broadcast(port, 1)  # a single point: rank 0
    assert receiver.recv().get(timeout=10) == (0, 300)


def test_plain_receiver_ranked_view_and_exceptions(senders):
    port, receiver = Channel[int].open()
    ranked = receiver.ranked()
    senders.slice(gpus=1).send_values.call_one(port, 2).get()
    assert receiver.recv().get(timeout=10) == 100  # both read the same messages
    assert ranked.recv().get(timeout=10) == (0, 101)
    senders.slice(gpus=slice(1, 2)).fail_to.call(port, "bad value").get()
    with pytest.raises(ActorError, match="bad value"):
        ranked.recv().get(timeout=10)


def test_ranked_message_from_the_controller_has_no_rank():
    port, receiver = Channel[str].open_ranked()
    port.send("from the client")
    with pytest.raises(ValueError, match="without a rank"):
        receiver.recv().get(timeout=10)


def test_ranked_channel_opened_in_a_rank(senders):
    # rank 0 opens the channel; ranks 1-3 (a slice: message ranks 0-2) send to it
    got = senders.slice(gpus=0).collect_ranked.call_one(senders.slice(gpus=slice(1, 4)), 3)
    assert got.get(timeout=30) == [(0, 100), (1, 200), (2, 300)]


# -- HostMesh size / shutdown -----------------------------------------------------------


@pytest.mark.unit
def test_host_mesh_size_sizes_extent():
    one = host_mesh(1)
    assert (one.size(), len(one), one.sizes, dict(one.extent)) == (1, 1, {}, {})
    with pytest.raises(KeyError, match="hosts"):
        one.size("hosts")
    three = HostMesh(3)
    assert three.size() == 3 and three.size("hosts") == 3 and three.size(["hosts"]) == 3
    assert three.sizes == {"hosts": 3} and three.extent == {"hosts": 3} and len(three) == 3
    with pytest.raises(KeyError, match="gpus"):
        three.size("gpus")
    assert this_host() is this_host()


def test_shutdown_stops_every_proc_mesh_of_the_host_mesh_only():
    hosts, other_hosts = host_mesh(1), host_mesh(1)
    a = hosts.spawn_procs(per_host={"gpus": 2})
    b = hosts.spawn_procs(per_host={"gpus": 1})
    other = other_hosts.spawn_procs(per_host={"gpus": 1})
    try:
        pids = a.spawn("s", Sender).pid.call().get().values()
        pids += b.spawn("s", Sender).pid.call().get().values()
        assert len(set(pids)) == 3 and all(pid_alive(p) for p in pids)
        assert hosts.shutdown().get(timeout=1) is None
        assert a.stopped and b.stopped and not other.stopped
        wait_until(lambda: not any(pid_alive(p) for p in pids), what="the ranks to exit")
        with pytest.raises(RuntimeError, match="shut down.*spawns no more"):
            hosts.spawn_procs(per_host={"gpus": 1})
        assert "shut down" in repr(hosts)
        assert hosts.shutdown().get() is None  # again: nothing to do
        # another host mesh's ranks keep working
        assert other.spawn("s", Sender).pid.call_one().get() > 0
    finally:
        other_hosts.shutdown()
    assert other.stopped


def test_this_host_shutdown_stops_its_meshes_then_a_new_one_follows():
    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": 1})
    (pid,) = procs.spawn("s", Sender).pid.call().get().values()
    host.shutdown()
    assert procs.stopped
    wait_until(lambda: not pid_alive(pid), what="the rank to exit")
    with pytest.raises(RuntimeError, match="shut down"):
        host.spawn_procs(per_host={"gpus": 1})
    fresh = this_host()
    assert fresh is not host and fresh is this_host()


def test_async_with_shuts_the_host_mesh_down():
    async def main() -> tuple[HostMesh, ProcMesh]:
        async with host_mesh(1) as hosts:
            procs = hosts.spawn_procs(per_host={"gpus": 1})
            assert await procs.spawn("s", Sender).pid.call_one() > 0
        return hosts, procs

    hosts, procs = asyncio.run(main())
    assert procs.stopped
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(hosts.__aenter__())


class _CountingLauncher:
    """The shared local launcher, counting ``shutdown()`` calls."""

    def __init__(self) -> None:
        self.inner = LocalLauncher.shared()
        self.name = "counting"
        self.shutdowns = 0

    def __getattr__(self, attr: str) -> object:
        return getattr(self.inner, attr)

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_shutdown_releases_a_launcher_of_its_own_only_once(monkeypatch):
    counting = _CountingLauncher()
    monkeypatch.setattr(hosts_mod, "get_launcher", lambda backend, **o: counting)
    hosts = HostMesh(1, "counting")
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    hosts.shutdown()
    hosts.shutdown()
    assert procs.stopped and counting.shutdowns == 1
    # the local backend's launcher is shared by every local host mesh: it stays
    shared = LocalLauncher.shared()
    monkeypatch.setattr(shared, "shutdown", lambda: pytest.fail("shared launcher released"))
    monkeypatch.setattr(hosts_mod, "get_launcher", lambda backend, **o: shared)
    HostMesh(1, "local").shutdown()
