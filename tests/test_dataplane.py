"""Rank-to-rank tensors: pulled directly from the owner, never through the controller."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from actors import DataActor

from monarch_kernel.actor import Actor, ActorError, endpoint, host_mesh


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
    reader = actors.slice(hosts=0 if transport == "shm" else 1, gpus=1)
    total, shape = reader.pull.call_one(ref, transport).get()
    assert shape == [n] and total == expected
    # every rank can pull the same ref, also the owner itself; shared memory only on
    # the owner's host (a host is a host agent, even on one machine)
    if transport == "shm":
        sums = actors.slice(hosts=0).pull.call(ref, transport).get().values()
        assert sums == [(expected, [n])] * 2
        with pytest.raises(ActorError, match="on another host"):
            actors.slice(hosts=1, gpus=0).pull.call_one(ref, transport).get()
    else:
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


@pytest.mark.unit
def test_share_outside_a_rank_is_a_clear_error(monkeypatch):
    import monarch_kernel
    from monarch_kernel.rank.dataplane import client, plane

    # (a controller RDMABuffer made earlier in this process joins the data plane: not here)
    monkeypatch.setattr(client, "_controller_config", None)
    monkeypatch.setattr(plane, "_server", None)
    with pytest.raises(RuntimeError, match="inside ranks"):
        monarch_kernel.share(torch.zeros(3))


def test_shared_memory_copy_is_private_and_writable(mesh22):
    from actors import ShmWriter

    actors = mesh22.spawn("data_cow", DataActor)
    writers = mesh22.spawn("writers", ShmWriter)
    ref = actors.slice(hosts=0, gpus=0).share_arange.call_one(1000).get()
    base = float(torch.arange(1000, dtype=torch.float64).sum())
    assert writers.slice(hosts=0, gpus=1).pull_and_bump.call_one(ref).get() == base + 1000
    assert actors.slice(hosts=0, gpus=0).pull.call_one(ref, "shm").get() == (base, [1000])


class Probe(Actor):
    """Looks at the data plane from inside a rank: its sockets, its shm files, replays."""

    def __init__(self):
        self.kept = {}

    @endpoint
    def listening(self) -> list[tuple[str, int]]:
        """The TCP/UDP addresses this rank process listens on."""
        me = psutil.Process()
        return [
            (c.laddr.ip, c.laddr.port)
            for c in me.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]

    @endpoint
    def share_big(self, n: int):
        import monarch_kernel

        return monarch_kernel.share(torch.arange(n, dtype=torch.float32))

    @endpoint
    def share_kept(self, n: int, view: str = ""):
        """Share a tensor of ``n`` floats (or a view of one) and keep it to change later."""
        import monarch_kernel

        t = torch.zeros(n, dtype=torch.float32)
        if view == "strided":  # not contiguous: served over the socket
            t = torch.zeros(2 * n, dtype=torch.float32)[::2]
        self.kept[n] = t
        return monarch_kernel.share(t)

    @endpoint
    def bump_kept(self, n: int, by: float) -> None:
        self.kept[n].add_(by)  # in place, after share()

    @endpoint
    def pull_sum(self, ref, transport: str = "auto") -> float:
        return float(ref.get(transport).double().sum())

    @endpoint
    def pull_bump(self, ref) -> float:
        t = ref.get()
        t += 1  # copy-on-write: the owner's copy must not change
        return float(t.double().sum())

    @endpoint
    def counters(self) -> dict:
        from monarch_kernel.rank.dataplane.plane import counters

        return counters()

    @endpoint
    def release(self, ref) -> None:
        ref.release()

    @endpoint
    def notify_then_fetch(self, ref) -> tuple[str, int]:
        """Send the owner two one-way ``ipc_done`` (one naming no lease, one malformed:
        refused there), and a fetch of 8 bytes whose answer nobody reads (as one given up
        on), then a fetch of 16 on the same socket: what answers it, and its byte count."""
        from monarch_kernel.rank.dataplane.client import client

        c = client()
        c.notify(ref, {"op": "ipc_done", "lease": 10**6})
        c.notify(ref, {"op": "ipc_done", "lease": "not an int"})
        stray = {"k": "req", "op": "fetch", "id": ref.id, "off": 0, "len": 8}
        stray.update(n=os.urandom(16).hex(), t=time.time())
        frames = c.codec_for(ref).encode(stray, b"", ())
        c._socket(*c._address(ref)).send_multipart(frames, copy=False)
        msg = c.request(ref, {"op": "fetch", "id": ref.id, "off": 0, "len": 16})
        return msg.header["k"], sum(len(b) for b in msg.buffers)

    @endpoint
    def replay(self, ref, address: str) -> list[str]:
        """Send one signed fetch twice (as an eavesdropper who captured it would), and a
        fetch without a nonce; what the owner answered to each."""
        import zmq

        from monarch_kernel.rank.dataplane.plane import _client

        client = _client()
        captured = client.frames({"op": "fetch", "id": ref.id})
        unsigned_nonce = client.codec.encode({"k": "req", "op": "fetch", "id": ref.id})
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        answers = []
        try:
            for i, frames in enumerate((captured, list(captured), unsigned_nonce)):
                sock.send_multipart(frames)
                if i == 1 and not sock.poll(1000):  # the wire itself drops a replay
                    answers.append("replayed: dropped by the codec")
                    continue
                assert sock.poll(10_000), "no answer from the owner"
                msg = client.codec.decode(sock.recv_multipart())
                answers.append(msg.header.get("error") or msg.header["k"])
        finally:
            sock.close()
        return answers


def _shm_files(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"mk-{run_id}-")]


@pytest.fixture(scope="module")
def mesh12():
    procs = host_mesh(hosts=1).spawn_procs(per_host={"gpus": 2})
    yield procs
    procs.stop()
    leftovers = _shm_files(procs.runtime.run_id)
    assert not leftovers, f"shared-memory files left behind: {leftovers}"


def test_one_host_uses_ipc_and_shared_memory_no_tcp(mesh12):
    probes = mesh12.spawn("probe1", Probe)
    n = 1_000_000  # 4 MB: placed in shared memory at share time
    ref = probes.slice(gpus=0).share_big.call_one(n).get()
    assert ref.address == "" and ref.ipc.startswith("ipc://")
    sock_dir = os.path.dirname(ref.ipc[len("ipc://") :])
    assert os.stat(sock_dir).st_mode & 0o777 == 0o700
    assert ref.shm and os.path.exists(ref.shm)
    assert os.stat(ref.shm).st_mode & 0o777 == 0o600
    expected = float(torch.arange(n, dtype=torch.float64).sum())
    reader = probes.slice(gpus=1)
    assert reader.pull_sum.call_one(ref, "auto").get() == expected
    assert reader.pull_sum.call_one(ref, "tcp").get() == expected  # the unix socket
    # no rank of a one-host mesh listens on TCP (any local user could connect to it)
    assert list(probes.listening.call().get().values()) == [[], []]
    before = probes.slice(gpus=0).counters.call_one().get()["bytes_out"]
    assert reader.pull_bump.call_one(ref).get() == expected + n  # a private copy
    assert reader.pull_sum.call_one(ref, "shm").get() == expected  # owner's unchanged
    # got by mapping the file placed at share time: the owner serves no bytes
    assert probes.slice(gpus=0).counters.call_one().get()["bytes_out"] == before
    probes.slice(gpus=0).release.call_one(ref).get()
    # the owner's descriptor is closed (its number may be reused, never the inode)
    assert not os.path.exists(ref.shm) or os.stat(ref.shm).st_ino != ref.shm_ino
    with pytest.raises(ActorError, match="released or never shared by rank 0"):
        reader.pull_sum.call_one(ref).get()


def test_other_host_goes_through_tcp(mesh22):
    probes = mesh22.spawn("probe2", Probe)
    n = 1_000_000
    owner = probes.slice(hosts=0, gpus=0)
    ref = owner.share_big.call_one(n).get()
    assert ref.address.startswith("tcp://127.0.0.1:") and ref.shm
    port = int(ref.address.rsplit(":", 1)[1])
    # bound to the host's address, not to every interface
    assert ("127.0.0.1", port) in owner.listening.call_one().get()
    assert ("0.0.0.0", port) not in owner.listening.call_one().get()
    before = owner.counters.call_one().get()["bytes_out"]
    expected = float(torch.arange(n, dtype=torch.float64).sum())
    assert probes.slice(hosts=1, gpus=0).pull_sum.call_one(ref).get() == expected
    assert owner.counters.call_one().get()["bytes_out"] - before == 4 * n  # over the socket
    with pytest.raises(ActorError, match="on another host"):
        probes.slice(hosts=1, gpus=1).pull_sum.call_one(ref, "shm").get()


def test_replayed_fetch_is_refused_and_counted(mesh22):
    probes = mesh22.spawn("probe3", Probe)
    owner = probes.slice(hosts=0, gpus=1)
    ref = owner.share_big.call_one(1000).get()
    before = owner.counters.call_one().get()["replays_refused"]
    other_host, same_host = probes.slice(hosts=1, gpus=0), probes.slice(hosts=0, gpus=0)
    for reader, address in ((other_host, ref.address), (same_host, ref.ipc)):
        first, again, no_nonce = reader.replay.call_one(ref, address).get()
        assert first == "data"
        assert "replayed" in again and "replayed" in no_nonce
    assert owner.counters.call_one().get()["replays_refused"] - before == 4
    # the owner keeps serving honest requests
    expected = float(torch.arange(1000, dtype=torch.float64).sum())
    assert probes.slice(hosts=1, gpus=1).pull_sum.call_one(ref).get() == expected


def test_a_one_way_request_gets_no_answer_and_the_next_request_its_own(mesh22):
    """``ipc_done`` is one-way (a round trip less per CUDA IPC read): the owner answers
    neither a good nor a bad one; and an answer to another request (one given up on) on
    that socket is dropped: the reader's request reads its own answer."""
    probes = mesh22.spawn("probe4", Probe)
    owner = probes.slice(hosts=0, gpus=1)
    ref = owner.share_big.call_one(1000).get()
    before = owner.counters.call_one().get()["requests_rejected"]
    for reader in (probes.slice(hosts=0, gpus=0), probes.slice(hosts=1, gpus=0)):
        assert reader.notify_then_fetch.call_one(ref).get() == ("data", 16)
    assert owner.counters.call_one().get()["requests_rejected"] - before == 2


@pytest.mark.unit
def test_nonces_are_bounded_and_expire():
    import time

    from monarch_kernel.rank.dataplane.plane import _Nonces

    nonces = _Nonces(window=60.0, limit=3)
    now = time.time()
    assert nonces.admit("a" * 32, now)
    assert not nonces.admit("a" * 32, now)  # replay
    assert not nonces.admit("b" * 32, now - 61)  # stale
    assert not nonces.admit("c" * 32, now + 61)  # from the future
    assert not nonces.admit("short", now) and not nonces.admit(None, now)
    for i in range(5):
        assert nonces.admit(f"{i}" * 32, now + i / 100)
    assert len(nonces.seen) == 3
    assert not nonces.admit("a" * 32, now)  # forgotten, but older than what was dropped


@pytest.mark.parametrize("view", ["", "strided"])
def test_get_sees_the_owners_tensor_as_it_is_at_get_time(mesh22, view):
    """Same host (shared memory, or the socket for a tensor that cannot move there) and
    other host (TCP): a change the owner makes in place after share() is seen by get()."""
    probes = mesh22.spawn(f"probe_live{view}", Probe)
    n = 512 * 1024  # 2 MiB of float32
    owner = probes.slice(hosts=0, gpus=0)
    ref = owner.share_kept.call_one(n, view).get()
    assert bool(ref.shm) == (view == "")  # moved into shared memory in place, or not
    same_host, other_host = probes.slice(hosts=0, gpus=1), probes.slice(hosts=1, gpus=0)
    assert same_host.pull_sum.call_one(ref).get() == 0.0
    owner.bump_kept.call_one(n, 1.0).get()
    transports = ["auto", "shm", "tcp"]
    for transport in transports:
        assert same_host.pull_sum.call_one(ref, transport).get() == float(n)
    assert other_host.pull_sum.call_one(ref).get() == float(n)
    # a receiver's writes stay private; the owner keeps changing and every path sees it
    assert same_host.pull_bump.call_one(ref).get() == 2.0 * n
    owner.bump_kept.call_one(n, 2.0).get()
    for transport in transports:
        assert same_host.pull_sum.call_one(ref, transport).get() == 3.0 * n
    assert other_host.pull_sum.call_one(ref).get() == 3.0 * n
    owner.release.call_one(ref).get()
    for reader in (same_host, other_host):
        with pytest.raises(ActorError, match="released or never shared by rank 0"):
            reader.pull_sum.call_one(ref).get()


class PlainPeek(Actor):
    """A reader that tries the owner's TCP data socket without CURVE."""

    @endpoint
    def plain_fetch(self, ref) -> str:
        """A correctly signed fetch over a plain (unencrypted) connection."""
        import zmq

        from monarch_kernel.rank.dataplane.plane import _client

        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A DEALER's send blocks while it has no pipe to a peer: the refused handshake
        # can drop the pipe that connect() made (it comes back on the reconnect).
        sock.setsockopt(zmq.SNDTIMEO, 1500)
        sock.connect(ref.address)
        try:
            sock.send_multipart(_client().frames({"op": "fetch", "id": ref.id}))
            return "answered" if sock.poll(1500) else "no answer"
        except zmq.Again:
            return "no answer"
        finally:
            sock.close()


def test_encrypted_data_plane_between_hosts():
    """MONARCH_KERNEL_ENCRYPT_DATA=1: the TCP data socket is a CURVE server (its key in
    the ref); tensors still arrive whole, a plain connection gets nothing, and ranks of
    the owner's host keep the unencrypted unix socket."""
    env = {"MONARCH_KERNEL_ENCRYPT_DATA": "1"}
    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 2}, env=env)
    try:
        probes = procs.spawn("probe_enc", Probe)
        n = 1_000_000
        ref = probes.slice(hosts=0, gpus=0).share_big.call_one(n).get()
        assert ref.address.startswith("tcp://") and len(ref.curve_key) == 40
        expected = float(torch.arange(n, dtype=torch.float64).sum())
        assert probes.slice(hosts=1, gpus=0).pull_sum.call_one(ref, "tcp").get() == expected
        assert probes.slice(hosts=0, gpus=1).pull_sum.call_one(ref, "tcp").get() == expected
        peek = procs.spawn("peek", PlainPeek)
        assert peek.slice(hosts=1, gpus=1).plain_fetch.call_one(ref).get() == "no answer"
    finally:
        procs.stop()
