"""Cross-host rows ("xhost"): two emulated machines (Linux network namespaces joined by a
bridge, ``tests/netns.py``), ours over the ``join`` backend against raw ZeroMQ over the same
veths, plain and CURVE. Our control sockets over tcp are CURVE, so raw CURVE is the fair
floor for the round trip; the rank -> rank data-plane socket is not CURVE (yet), so for the
64 MiB row both ratios are recorded. Actor -> actor across machines: row 11's caller and
target (bench/a2a.py) on two one-host ``join`` meshes, one per namespace host, the call
going over the target rank's CURVE TCP peer socket; compared with the raw CURVE round trip.

Needs root (namespaces); otherwise every row says so. Everything created here is removed
here: the namespace processes by PID and the namespaces, veths and bridge through
:meth:`NetHosts.close`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import zmq

from bench.common import MiB, Recorder, Settings, median, p99, sample, tensor_iters

ROWS = [
    "xhost_rtt",
    "xhost_r2r_64",
    "xhost_zmq_rtt",
    "xhost_zmq_curve_rtt",
    "xhost_zmq_64",
    "xhost_zmq_curve_64",
    "xhost_rtt_ratio",
    "xhost_r2r_ratio",
    "xhost_r2r_plain_ratio",
    "xhost_r2r_64_enc",
    "xhost_r2r_enc_ratio",
    "xhost_a2a",
    "xhost_a2a_p99",
    "xhost_a2a_ratio",
]
MIB = 64
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/netns.py builds the emulated machines for the test suite; it is imported from
# there (tests/ is not a package) rather than copied, so bench and tests share one builder.
TESTS = os.path.join(REPO, "tests")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "n/a: needs root for network namespaces"
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from netns import unavailable as why

    reason = why()
    return f"n/a: {reason}" if reason else None


def run(s: Settings, rec: Recorder) -> None:
    why = unavailable()
    if why:
        for key in ROWS:
            rec.note(key, why)
        return
    from netns import make_hosts

    net = make_hosts(2)
    try:
        with rec.guard("xhost_zmq_rtt", "xhost_zmq_64"):
            raw(s, rec, net, curve=False)
        with rec.guard("xhost_zmq_curve_rtt", "xhost_zmq_curve_64"):
            raw(s, rec, net, curve=True)
        with rec.guard("xhost_rtt", "xhost_r2r_64", "xhost_r2r_64_enc"):
            ours(s, rec, net)
        with rec.guard("xhost_a2a", "xhost_a2a_p99"):
            actor_to_actor(s, rec, net)
        for mine, floor, key in (
            ("xhost_rtt", "xhost_zmq_curve_rtt", "xhost_rtt_ratio"),
            ("xhost_r2r_64", "xhost_zmq_curve_64", "xhost_r2r_ratio"),
            ("xhost_r2r_64", "xhost_zmq_64", "xhost_r2r_plain_ratio"),
            ("xhost_r2r_64_enc", "xhost_zmq_curve_64", "xhost_r2r_enc_ratio"),
            ("xhost_a2a", "xhost_zmq_curve_rtt", "xhost_a2a_ratio"),
        ):
            rec.ratio(key, mine, floor)
    finally:
        net.close()


def raw(s: Settings, rec: Recorder, net, curve: bool) -> None:
    """``bench.raw_zmq``'s echo server on namespace host 0, a DEALER in this (root)
    namespace connecting over the bridge and host 0's veth."""
    from netns import agent_env

    from bench.raw_zmq import one_way_rate

    env = agent_env()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        public, secret = zmq.curve_keypair()
        env["BENCH_CURVE_SECRET"] = secret.decode()
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    host = net.hosts[0]
    proc = net.popen(
        0,
        [sys.executable, "-m", "bench.raw_zmq", host.addr],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        sock.connect(f"tcp://{host.addr}:{port}")

        def ping() -> None:
            sock.send(b"p")
            sock.recv()

        tag = "xhost_zmq_curve" if curve else "xhost_zmq"
        rec.value(f"{tag}_rtt", median(sample(ping, s.rtt_iters, s.warmup, s.loop_budget_s)))
        rec.value(f"{tag}_{MIB}", one_way_rate(sock, MIB))
        sock.send(b"q")
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        ctx.destroy(linger=0)


def ours(s: Settings, rec: Recorder, net) -> None:
    """A join mesh of the two namespace hosts × 1 rank, the controller (this process) in
    the root namespace on the bridge address."""
    from netns import Joiner

    from bench.ours import Bench
    from monarch_kernel.actor import host_mesh

    joiner = Joiner(net)
    mesh = host_mesh(hosts=2, backend="join", bind=net.gateway, on_progress=joiner.progress)
    procs = mesh.spawn_procs({"gpus": 1}, timeout=90)
    try:
        one = procs.spawn("bench", Bench).slice(hosts=0, gpus=0)
        xs = sample(lambda: one.ping.call_one().get(), s.rtt_iters, s.warmup, s.loop_budget_s)
        rec.value("xhost_rtt", median(xs))

        rec.value(f"xhost_r2r_{MIB}", r2r_rate(procs))
    finally:
        joiner.stop(procs)
    # The same with the data plane encrypted (MONARCH_KERNEL_ENCRYPT_DATA=1).
    joiner = Joiner(net)
    mesh = host_mesh(hosts=2, backend="join", bind=net.gateway, on_progress=joiner.progress)
    env = {"MONARCH_KERNEL_ENCRYPT_DATA": "1"}
    procs = mesh.spawn_procs({"gpus": 1}, timeout=90, env=env)
    try:
        rec.value(f"xhost_r2r_{MIB}_enc", r2r_rate(procs))
    finally:
        joiner.stop(procs)


def actor_to_actor(s: Settings, rec: Recorder, net) -> None:
    """Row 11 across machines: the targets on a one-host join mesh on namespace host 1,
    the caller (holding them) on another on host 0; timed inside the caller's rank."""
    from helpers import controller_bytes
    from netns import Joiner

    from bench.a2a import make_classes
    from monarch_kernel.actor import Actor, endpoint, host_mesh

    Target, Caller = make_classes(Actor, endpoint)
    meshes = []  # (procs, joiner): the targets' mesh, then the caller's
    try:
        for first, name in ((1, "xa2a_targets"), (0, "xa2a_caller")):
            joiner = Joiner(net, first=first)
            mesh = host_mesh(hosts=1, backend="join", bind=net.gateway, on_progress=joiner.progress)
            meshes.append((mesh.spawn_procs({"gpus": 1}, name=name, timeout=90), joiner))
        (tprocs, _), (cprocs, _) = meshes
        targets = tprocs.spawn("xa2a_target", Target)
        caller = cprocs.spawn("xa2a_caller", Caller, targets)
        sent = controller_bytes(tprocs.runtime)
        xs = caller.loop.call_one(s.rtt_iters, s.warmup, s.loop_budget_s).get(timeout=120)
        assert controller_bytes(tprocs.runtime) == sent, "a call went through the controller"
        rec.value("xhost_a2a", median(xs), calls=len(xs))
        rec.value("xhost_a2a_p99", p99(xs))
    finally:
        for procs, joiner in reversed(meshes):
            joiner.stop(procs)


def r2r_rate(procs) -> float:
    """MiB/s of a fresh 64 MiB tensor pulled by host 1's rank from host 0's (median)."""
    from bench.r2r import Holder

    holders = procs.spawn("holders", Holder)
    owner, reader = holders.slice(hosts=0, gpus=0), holders.slice(hosts=1, gpus=0)
    iters, warm = tensor_iters(MIB)
    took = []
    for i in range(iters + warm):
        ref, _ = owner.share_fresh.call_one(MIB).get()
        t = reader.pull_timed.call_one(ref, "tcp").get(timeout=60)
        if i >= warm:
            took.append(t)
    return MIB * MiB / median(took) / MiB
