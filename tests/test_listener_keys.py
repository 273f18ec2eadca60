"""A rank's TCP listeners admit only the mesh's listener key (``rank.listener_gate``).

One ``join`` mesh on two emulated machines (network namespaces 0 and 1), its data plane
encrypted (``MONARCH_KERNEL_ENCRYPT_DATA``) so that all three TCP listeners of a rank
are CURVE servers: its peer socket, its reply socket and its data socket. Namespace 2 is
where the mesh grows to; namespace 3 is an outsider that knows every listener's address
and public key. Calls and tensors between the machines work; a client key other than
the listener key (a fresh one, or a host's own key) is refused in the handshake (ZAP): the
outsider sees the refusal, the rank counts it, and its signature checks never see a
frame (a client with the listener key and a wrong mesh key does reach them, and is counted
there: the counters are live).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import zmq
from conftest import project_processes, wait_no_orphans
from helpers import wait_until
from netns import Joiner, agent_env, netns_hosts_fixture

from monarch_kernel.actor import Actor, endpoint, host_mesh
from monarch_kernel.rank.dataplane.plane import ENCRYPT_ENV

pytestmark = pytest.mark.cluster

TESTS = os.path.dirname(os.path.abspath(__file__))
OUTSIDER = 3


class Probe(Actor):
    """What the tests ask a rank: who it is, its listeners and keys, its counters."""

    def __init__(self) -> None:
        self.kept: list = []

    @endpoint
    def where(self) -> str:
        return __import__("socket").gethostname()

    @endpoint
    def call_all(self, probes) -> list[str]:
        """Call every rank of ``probes`` (another actor mesh) rank to rank."""
        return probes.where.call().get(timeout=30).values()

    @endpoint
    def share(self, n: int):
        from monarch_kernel.rank.dataplane.plane import share

        t = torch.arange(n, dtype=torch.float32)
        self.kept.append(t)
        return share(t)

    @endpoint
    def pull(self, ref) -> float:
        return float(ref.get().sum())

    @endpoint
    def listeners(self) -> dict:
        """The TCP listeners (address, server key) and the keys a test client needs."""
        from monarch_kernel.actor.peer import client as peer_client
        from monarch_kernel.rank import context
        from monarch_kernel.rank.dataplane.plane import share

        rt = context.services()
        assert rt is not None
        reply = peer_client.client().reply
        ref = share(torch.zeros(4))
        return {
            "peer": [rt.peer.tcp, rt.peer.curve],
            "reply": [reply.tcp, reply.curve],
            "data": [ref.address, ref.curve_key],
            "listener_key": rt.config.listener_key,
            "host_key": [rt.config.curve_public, rt.config.curve_secret],
        }

    @endpoint
    def counters(self) -> dict:
        """Refused handshakes, and messages dropped at each listener's signature check."""
        from monarch_kernel.actor.peer import client as peer_client
        from monarch_kernel.rank import context
        from monarch_kernel.rank.dataplane.plane import counters

        c = counters()
        rank: Any = context.services()  # the Rank itself: its inbox's codec
        return {
            "keys_refused": c["keys_refused"],
            "peer": rank.codec.rejected,
            "reply": peer_client.client().rejected,
            "data": c["requests_rejected"],
        }


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(4)


@pytest.fixture(scope="module")
def machines(net):
    before = {p.pid for p in project_processes()}
    joiner = Joiner(net, env=agent_env(TESTS))
    hosts = host_mesh(hosts=2, backend="join", bind=net.gateway, on_progress=joiner.progress)
    procs = hosts.spawn_procs(
        {"gpus": 1}, name="pkeys", env={ENCRYPT_ENV: "1"}, timeout=90, on_failure="continue"
    )
    try:
        yield procs
    finally:
        joiner.stop(procs)
        left = wait_no_orphans(keep=before)
        assert not left, f"ranks or agents left running: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def probes(machines):
    return machines.spawn("probe", Probe)


def _counters(probes, rank: int) -> dict:
    return probes.slice(hosts=rank).counters.call_one().get(timeout=30)


def test_calls_and_tensors_cross_machines(probes, machines, net):
    on = probes.where.call().get(timeout=30).values()
    assert on == [net.hosts[0].name, net.hosts[1].name]
    before = [_counters(probes, r) for r in (0, 1)]
    # rank to rank both ways, over the peer sockets (replies over the reply sockets)
    for r in (0, 1):
        assert probes.slice(hosts=r).call_all.call_one(probes).get(timeout=30) == on
    # a tensor over the other machine's encrypted data socket
    ref = probes.slice(hosts=0).share.call_one(1000).get(timeout=30)
    assert ref.curve_key and ref.address.startswith(f"tcp://{net.hosts[0].addr}:"), ref
    assert probes.slice(hosts=1).pull.call_one(ref).get(timeout=30) == sum(range(1000))
    # nothing of that was refused: the listener key is what every rank connects with
    assert [_counters(probes, r) for r in (0, 1)] == before


ATTACK = """
import json, sys, zmq, zmq.utils.monitor
from monarch_kernel.wire import Codec, dumps
from monarch_kernel.wire import kinds as K
listeners, keys, wait_ms = json.loads(sys.argv[1])
forged = Codec(b"x" * 32).encode({"k": K.EXEC, "i": "o1", "w": 1}, *dumps("1", "code"))
kinds = {"peer": zmq.DEALER, "reply": zmq.PUSH, "data": zmq.DEALER}
ctx = zmq.Context()
out = {}
for name, (address, server) in listeners.items():
    for label, (public, secret) in keys.items():
        s = ctx.socket(kinds[name])
        s.linger = 0
        s.curve_publickey, s.curve_secretkey = public.encode(), secret.encode()
        s.curve_serverkey = server.encode()
        s.setsockopt(zmq.RECONNECT_IVL, 60000)  # one handshake each
        mon = s.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        s.connect(address)
        s.send_multipart(forged)
        event = "none"
        if mon.poll(wait_ms):
            event = {
                zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
            }.get(zmq.utils.monitor.recv_monitor_message(mon)["event"], "failed")
        answered = s.type == zmq.DEALER and bool(s.poll(300))
        out[f"{name}/{label}"] = event + (" answered" if answered else "")
        s.disable_monitor()
        mon.close(0)
        s.close(0)
print(json.dumps(out))
"""


def _attack(net, listeners: dict, keys: dict) -> dict:
    """From the outsider machine: each of ``keys`` (label -> z85 pair) connects to each
    of ``listeners`` (name -> [tcp address, server key]) and sends a forged message."""
    arg = json.dumps([listeners, keys, 20000])
    out = subprocess.run(
        ["ip", "netns", "exec", net.hosts[OUTSIDER].ns, sys.executable, "-c", ATTACK, arg],
        capture_output=True,
        text=True,
        timeout=120,
        env=agent_env(TESTS),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_foreign_and_host_keys_are_refused_in_the_handshake(probes, net):
    """A fresh keypair and the rank's own host keypair, each with the listener's right
    server key: refused by ZAP on all three listeners, counted, and no frame reaches a
    signature check. The listener key with a forged message: admitted, dropped there."""
    info = probes.slice(hosts=0).listeners.call_one().get(timeout=30)
    listeners = {name: info[name] for name in ("peer", "reply", "data")}
    assert all(addr.startswith("tcp://") and len(key) == 40 for addr, key in listeners.values())
    foreign = [k.decode() for k in zmq.curve_keypair()]
    before = _counters(probes, 0)
    seen = _attack(net, listeners, {"foreign": foreign, "host": info["host_key"]})
    assert seen == {f"{n}/{k}": "refused" for n in listeners for k in ("foreign", "host")}, seen
    wait_until(
        lambda: _counters(probes, 0)["keys_refused"] >= before["keys_refused"] + 6,
        timeout=30,
        what="the rank to count 6 refused handshakes",
        detail=lambda: _counters(probes, 0),
    )
    after = _counters(probes, 0)
    assert {n: after[n] for n in listeners} == {n: before[n] for n in listeners}, (before, after)

    # control: the mesh's listener key is admitted, and the forged message is dropped at the
    # signature check, counted there (so the counters above would have moved)
    peer = [zmq.curve_public(info["listener_key"].encode()).decode(), info["listener_key"]]
    seen = _attack(net, listeners, {"peer": peer})
    assert seen == {f"{n}/peer": "admitted" for n in listeners}, seen
    wait_until(
        lambda: all(_counters(probes, 0)[n] > after[n] for n in listeners),
        timeout=30,
        what="each listener to count a forged message",
        detail=lambda: _counters(probes, 0),
    )
    assert _counters(probes, 0)["keys_refused"] == after["keys_refused"]
    # the rank serves on
    assert probes.slice(hosts=1).call_all.call_one(probes).get(timeout=30)[0] == net.hosts[0].name


def test_a_grown_host_calls_the_old_ones(machines, net):
    """Last (the mesh grows): a host that joins later gets the same listener key; its rank
    and the old ones call each other and pull each other's tensors."""
    report = machines.grow(hosts="+1", timeout=90)
    assert machines.runtime.world == 3, report
    grown = machines.spawn("grown", Probe)
    on = grown.where.call().get(timeout=30).values()
    assert on == [h.name for h in net.hosts[:3]]
    before = [c["keys_refused"] for c in grown.counters.call().get(timeout=30).values()]
    assert grown.slice(hosts=2).call_all.call_one(grown).get(timeout=30) == on
    assert grown.slice(hosts=0).call_all.call_one(grown).get(timeout=30) == on
    ref = grown.slice(hosts=0).share.call_one(500).get(timeout=30)
    assert grown.slice(hosts=2).pull.call_one(ref).get(timeout=30) == sum(range(500))
    ref = grown.slice(hosts=2).share.call_one(300).get(timeout=30)
    assert grown.slice(hosts=1).pull.call_one(ref).get(timeout=30) == sum(range(300))
    after = [c["keys_refused"] for c in grown.counters.call().get(timeout=30).values()]
    assert after == before and after[2] == 0, (before, after)
