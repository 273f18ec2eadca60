"""Actor calls rank to rank between meshes on different machines (network namespaces).

Two meshes of the ``join`` backend, each on its own emulated machine: ``gens`` on
namespace host 0, ``trainers`` on host 1 (host 2 is an outsider). A trainer holding
the generator mesh calls it directly over the generators' CURVE TCP peer sockets; the
generators call back; tensors, errors, deaths and supervision cross the machines as
they do on one. Every test checks the calls really went rank to rank (the controller
never saw them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import project_processes, wait_no_orphans
from helpers import controller_bytes, wait_until
from netns import Joiner, agent_env, netns_hosts_fixture
from parity_actors import AsyncTrainer, Generator, Introspect, Supervisor, Trainer
from test_rdma import BIG, Owner, Reader
from test_this_proc import Counter, RankSide

from monarch_kernel.actor import (
    ActorError,
    Channel,
    get_or_spawn_controller,
    host_mesh,
    this_host,
    this_proc,
)
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.cluster

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(3)


def _join_mesh(net, first: int, name: str, ranks: int = 2):
    joiner = Joiner(net, first=first, env=agent_env(TESTS))
    mesh = host_mesh(hosts=1, backend="join", bind=net.gateway, on_progress=joiner.progress)
    procs = mesh.spawn_procs({"gpus": ranks}, name=name, timeout=60, on_failure="continue")
    return procs, joiner


@pytest.fixture(scope="module")
def machines(net):
    before = {p.pid for p in project_processes()}
    gprocs, gjoin = _join_mesh(net, 0, "xgens")
    tprocs, tjoin = _join_mesh(net, 1, "xtrainers")
    yield gprocs, tprocs
    tjoin.stop(tprocs)
    gjoin.stop(gprocs)
    left = wait_no_orphans(keep=before)
    assert not left, f"ranks or agents left running: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def pair(machines):
    gprocs, tprocs = machines
    gens = gprocs.spawn("gen", Generator)
    trainers = tprocs.spawn("trainer", Trainer, gens)
    return gens, trainers


def test_meshes_run_on_their_own_machines(machines, net):
    gprocs, tprocs = machines
    g = {r.hostname for r in gprocs.runtime.ranks}
    t = {r.hostname for r in tprocs.runtime.ranks}
    assert g == {net.hosts[0].name} and t == {net.hosts[1].name}
    # each rank listens for peers on its machine's address, encrypted (a CURVE key)
    for procs, host in ((gprocs, net.hosts[0]), (tprocs, net.hosts[1])):
        for info in procs.runtime.ranks:
            assert info.peer.tcp.startswith(f"tcp://{host.addr}:"), info.peer
            assert len(info.peer.curve) == 40 and info.peer.machine == host.name


def test_calls_cross_machines_rank_to_rank(pair, machines):
    gens, trainers = pair
    gprocs, _ = machines
    before = controller_bytes(gprocs.runtime)
    assert trainers.step.call(3).get(timeout=30).values() == [[30, 30], [30, 30]]
    t0 = trainers.slice(gpus=0)
    _, tprocs = machines
    a0 = tprocs.spawn("async_trainer", AsyncTrainer, gens).slice(gpus=0)
    assert a0.step_async.call_one(2).get(timeout=30) == [20, 20]
    assert t0.stream.call_one(5).get(timeout=30) == [50, 50]
    assert t0.choose.call_one(6).get(timeout=30) == 60
    assert t0.ping_pong.call_one(50).get(timeout=30) == sum(i * 10 for i in range(50))
    assert controller_bytes(gprocs.runtime) == before, "a peer call went through the controller"


def test_callbacks_across_machines(pair):
    """The generators (machine 0) get a reference to a trainer (machine 1) and call it
    back while that trainer is itself waiting on them."""
    gens, trainers = pair
    t0 = trainers.slice(gpus=0)
    assert (
        t0.wire_back.call_one(trainers.slice(gpus=0)).get(timeout=30)
        == ["ActorMesh/PeerRequester"] * 2
    )
    versions = trainers.slice(gpus=1).refresh_all.call_one().get(timeout=30)
    assert len(versions) == 2 and all(v >= 1 for v in versions)


def test_error_chain_across_machines(pair):
    _, trainers = pair
    text = trainers.slice(gpus=0).failing.call_one().get(timeout=30)
    assert "ValueError" in text and "generation failed" in text and "KeyError" in text, text


def test_tensor_across_machines(pair):
    """A generator shares a tensor; the trainer on the other machine pulls it over the
    generator's TCP data socket (a one-host mesh of a multi-machine backend has one)."""
    _, trainers = pair
    assert trainers.slice(gpus=0).pull_weights.call_one(1 << 16).get(timeout=30) == 1 << 16


def test_spawn_on_a_mesh_of_another_machine(pair, machines):
    gprocs, _ = machines
    _, trainers = pair
    assert trainers.slice(gpus=1).spawn_on.call_one(gprocs).get(timeout=30) == [10, 10]


def test_channel_port_across_machines(machines):
    """A port opened in the controller, given to actors on another machine."""
    gprocs, _ = machines
    intro = gprocs.spawn("intro", Introspect)
    port, receiver = Channel[tuple[int, int]].open()
    intro.send_to.call(port, 3).get(timeout=30)
    got = sorted(receiver.recv().get(timeout=10) for _ in range(6))
    assert got == sorted((r, i) for r in range(2) for i in range(3))


def test_supervision_across_machines(machines):
    """The owner (machine 0) of a child mesh (machine 1) hears of its failure."""
    gprocs, tprocs = machines
    top = gprocs.spawn("xsup", Supervisor, True)
    assert top.slice(gpus=0).spawn_child.call_one(tprocs.slice(gpus=0), False).get(30) == "ok"
    top.slice(gpus=0).break_child.call_one().get(timeout=30)
    seen = wait_until(
        lambda: top.slice(gpus=0).seen_failures.call_one().get(timeout=30),
        timeout=15,
        what="the owner on the other machine told",
    )
    assert seen[0]["type"] == "RuntimeError" and "leaf failed" in seen[0]["message"], seen


def test_references_survive_a_restart_of_their_rank(pair, machines):
    """A restarted rank listens where it did (same port, same CURVE key): the trainers'
    reference to it works on without being handed out again."""
    gprocs, _ = machines
    gens, trainers = pair
    before = gprocs.runtime.ranks[0]
    old_pid, old_peer = before.pid, before.peer
    report = gprocs.restart([0])
    assert "gen" in report.actors
    after = gprocs.runtime.ranks[0]
    assert after.pid != old_pid and after.peer == old_peer
    ys = trainers.slice(gpus=0).step.call_one(2).get(timeout=30)
    assert ys[0] == 20  # the re-created generator (version 0) on the new process


def test_local_mesh_cannot_be_called_from_another_machine(machines):
    """A mesh of the local backend listens on its own machine only: a rank of another
    machine given it gets a clear error naming why and what to do."""
    _, tprocs = machines
    local = this_host().spawn_procs(per_host={"gpus": 1}, name="xlocal")
    try:
        gens = local.spawn("lgen", Generator)
        trainer = tprocs.slice(gpus=0).spawn("ltrainer", Trainer, gens)
        with pytest.raises(ActorError) as err:
            trainer.step.call_one(1).get(timeout=30)
        text = str(err.value)
        assert "local backend" in text and "multi-machine backend" in text, text
    finally:
        local.stop()


def test_outsiders_get_nothing_from_a_peer_socket(machines, net):
    """From the outsider machine: plain TCP to a rank's peer socket gets no handshake;
    CURVE with the listener's key but a wrong mesh key is dropped unanswered; the rank
    keeps serving."""
    gprocs, _ = machines
    info = gprocs.runtime.ranks[0]
    marker = os.path.join(net.tmp, "peer-forged")
    script = f"""
import zmq, pickle, sys
sys.path[:0] = {[TESTS, os.path.dirname(TESTS)]!r}
from monarch_kernel.wire import Codec, dumps
ctx = zmq.Context()
forged = Codec(b"x" * 32).encode(
    {{"k": {K.EXEC!r}, "i": "o1", "w": 1}},
    *dumps("open({marker!r}, 'w').write('pwned')", "code"),
)
plain = ctx.socket(zmq.DEALER); plain.connect({info.peer.tcp!r}); plain.send_multipart(forged)
curve = ctx.socket(zmq.DEALER)
pub, sec = zmq.curve_keypair()
curve.curve_publickey, curve.curve_secretkey = pub, sec
curve.curve_serverkey = {info.peer.curve!r}.encode()
curve.connect({info.peer.tcp!r}); curve.send_multipart(forged)
print("answered" if curve.poll(2000) or plain.poll(100) else "nothing")
"""
    out = subprocess.run(
        ["ip", "netns", "exec", net.hosts[2].ns, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "nothing", out.stdout + out.stderr
    assert not os.path.exists(marker)
    g = gprocs.spawn("still", Generator)
    assert g.generate.call(1).get(timeout=30).values()[0]["y"] == 10


@pytest.mark.parametrize("n", [1000, BIG], ids=["small", "in_shm"])
def test_rdma_buffer_across_machines(machines, n):
    """A buffer of a rank on machine 0, read and written in place by a rank on machine
    1: over the owner's CURVE TCP data socket (shared memory is of one machine only)."""
    gprocs, tprocs = machines
    owner = gprocs.spawn("rdma_owner", Owner).slice(gpus=0)
    reader = tprocs.spawn("rdma_reader", Reader).slice(gpus=0)
    buf = owner.make.call_one(n).get(timeout=30)
    expected = int(torch.arange(n, dtype=torch.int64).remainder(251).sum())
    assert reader.read_sum.call_one(buf).get(timeout=30) == expected
    reader.write.call_one(buf, 9, 5).get(timeout=30)
    assert owner.head.call_one(n, 6).get(timeout=30) == [9, 9, 9, 9, 9, 5]


def test_the_controllers_own_actors_are_reached_from_other_machines(machines, monkeypatch):
    """``get_or_spawn_controller`` from ranks on another machine: the singleton runs in
    the controller's process (``this_proc()``), reached over its CURVE TCP socket, also
    when that process opened its socket before meshes of other machines ran."""
    from monarch_kernel.actor import client_proc, client_server

    gprocs, _ = machines
    this_proc().stop()
    with monkeypatch.context() as m:  # as if no mesh of another machine ran yet
        m.setattr(client_proc, "reply_tcp_host", lambda: "")
        m.setattr(client_server, "reply_tcp_host", lambda: "")
        assert not this_proc()._requester.address().tcp  # type: ignore[attr-defined]
    ranks = gprocs.spawn("xranks", RankSide)
    try:
        for gpu in (0, 1):
            pid, seen = ranks.slice(gpus=gpu).register.call_one().get(timeout=30)
            assert pid == os.getpid() and seen[-1] == gpu
        assert this_proc()._requester.address().tcp  # type: ignore[attr-defined]
        mine = get_or_spawn_controller("counter", Counter).get()
        assert mine.add.call_one("here").get(timeout=30)[1] == [0, 1, "here"]
    finally:
        this_proc().stop()


def test_frozen_machine_fails_peer_calls(machines, net):
    """Last: the generator ranks' processes stop (SIGSTOP: a machine that vanishes, no
    connection reset); a trainer's call to them fails within the peer heartbeat timeout
    instead of waiting forever."""
    gprocs, tprocs = machines
    gens = gprocs.spawn("frozen", Generator)
    trainer = tprocs.slice(gpus=0).spawn("waiting", Trainer, gens)
    assert trainer.step.call_one(1).get(timeout=30) == [10, 10]  # connected to both
    pids = [r.pid for r in gprocs.runtime.ranks]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        text = trainer.call_crashing.call_one().get(timeout=60)
        took = time.monotonic() - t0
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    print(f"\nfrozen peer machine noticed after {took:.1f}s")
    assert text == "RankDiedError" and took < 20, (text, took)
