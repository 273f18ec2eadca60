"""The ``join`` backend across emulated machines (network namespaces, see ``netns.py``).

Three namespace hosts run ``python -m monarch_kernel.host --join ... --token ...`` as
shown by the launcher; the controller (this process) listens on the bridge address.
Every tcp socket is CURVE; only keys handed out through a join are admitted.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import psutil
import pytest
import zmq
from netns import COMMAND, Joiner, agent_env, netns_hosts_fixture

from monarch_kernel.actor import Actor, endpoint, host_mesh
from monarch_kernel.calls.errors import MeshStartError, MonarchError
from monarch_kernel.wire.kinds import PROTOCOL_VERSION

pytestmark = pytest.mark.cluster


class Probe(Actor):
    @endpoint
    def info(self) -> dict[str, str]:
        import socket

        keys = ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK", "GLOO_SOCKET_IFNAME", "RANK")
        env = {k: os.environ.get(k, "") for k in keys}
        return {"hostname": socket.gethostname(), **env}

    @endpoint
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return float(t.item())


def _ddp_data(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def one_process_ddp_losses(world: int, steps: int) -> list[list[float]]:
    """Each rank's losses as :class:`Trainer` gives them, computed in one process that
    averages the ``world`` ranks' gradients itself (what DDP over gloo must match)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [_ddp_data(r) for r in range(world)]
    expected: list[list[float]] = [[] for _ in range(world)]
    for _ in range(steps):
        grads = []
        for r, (x, y) in enumerate(data):
            model.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            expected[r].append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.sub_(0.1 * sum(g[i] for g in grads) / world)
    return expected


class Trainer(Actor):
    @endpoint
    def train(self, steps: int) -> list[float]:
        import datetime

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _ddp_data(dist.get_rank())
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(4)  # host 3 never joins (the outsider)


@pytest.fixture(scope="module")
def joined(net):
    joiner = Joiner(net)
    launcher_opts = {"bind": net.gateway, "on_progress": joiner.progress}
    t0 = time.monotonic()
    procs = host_mesh(hosts=3, backend="join", **launcher_opts).spawn_procs(
        {"gpus": 2}, timeout=60, on_failure="continue"
    )
    print(f"\n3 joined hosts x 2 ranks up in {time.monotonic() - t0:.1f}s")
    yield procs, joiner
    procs.stop()
    procs.runtime.launcher.shutdown()


def test_join_shows_commands_and_progress(joined, net):
    procs, joiner = joined
    assert procs.extent == {"hosts": 3, "gpus": 2}
    text = "\n".join(joiner.lines)
    commands = COMMAND.findall(text)
    assert len(commands) == 3
    assert all(url.startswith(f"tcp://{net.gateway}:") for url, _ in commands)
    assert len({token for _, token in commands}) == 3  # one credential per host
    assert "3/3 hosts joined" in text
    for i, h in enumerate(net.hosts[:3]):
        assert f"from {h.addr}" in text, (i, text)
    from monarch_kernel.widgets import render

    pane = render.hosts_html(procs.runtime)  # the dashboard's hosts pane
    assert "3/3 hosts joined" in pane and "mk-cmd" not in pane
    assert all(f"joined from {h.addr}" in pane for h in net.hosts[:3]), pane


def test_ranks_run_on_their_own_machines(joined, net):
    procs, _ = joined
    infos = procs.spawn("probe", Probe).info.call().get(timeout=30)
    master = net.hosts[0].addr
    for point, info in infos.items():
        h = point["hosts"]
        assert info["hostname"] == net.hosts[h].name
        assert info["NODE_RANK"] == info["GROUP_RANK"] == str(h)
        assert info["MASTER_ADDR"] == master
        assert info["GLOO_SOCKET_IFNAME"] == "eth0"
    rt = procs.runtime
    assert [h.addr for h in rt.hosts] == [h.addr for h in net.hosts[:3]]


def test_large_broadcast_fans_out_through_the_agents(joined):
    """A large payload goes once per host to its agent (its fan-out socket is CURVE
    too), in order."""
    import torch
    from actors import Counter, Worker

    procs, _ = joined
    big = torch.arange(100_000, dtype=torch.float32)  # 400 KB: over the fan-out size
    counters = procs.spawn("fan", Counter)
    for i in range(5):
        counters.record.broadcast(i, big)
    assert all(log == list(range(5)) for log in counters.get_log.call().get(timeout=30).values())
    expected = float(big.double().sum())
    assert procs.spawn("sum", Worker).checksum.call(big).get(timeout=30).values() == [expected] * 6


def test_cell_across_hosts(joined, net):
    procs, _ = joined
    rt = procs.runtime
    code = "import socket\nwhere = socket.gethostname() + ':' + str(__import__('os').getpid())"
    failed = rt.restarter.run_cell(list(range(6)), code, "[1]", [], time.monotonic() + 30)
    assert failed == ""
    where = procs.pull("where")
    names = [v.split(":")[0] for v in where.values()]
    assert names == [h.name for h in net.hosts[:3] for _ in range(2)]


def test_gloo_all_reduce_across_hosts(joined):
    procs, _ = joined
    probes = procs.spawn("reduce", Probe)
    assert probes.all_reduce.call().get(timeout=60).values() == [21.0] * 6


def test_ddp_across_hosts_matches_one_process(joined):
    """DDP over gloo across the three machines: every rank's losses are those of one
    process that averages the six ranks' gradients itself."""
    procs, _ = joined
    steps = 4
    got = procs.spawn("ddp", Trainer).train.call(steps).get(timeout=60).values()
    expected = one_process_ddp_losses(6, steps)
    for r in range(6):
        assert got[r] == pytest.approx(expected[r], rel=1e-5, abs=1e-6), r


def test_no_key_on_any_command_line(joined):
    procs, joiner = joined
    rt = procs.runtime
    launcher = rt.launcher
    secrets_ = [rt.key.hex()]
    for (mesh, _), slot in launcher._latest.items():
        if mesh == rt.name:
            secrets_ += [slot.cfg.key, slot.cfg.curve_secret]
    assert all(secrets_)
    pids = []
    for agent in joiner.agents.values():
        p = psutil.Process(agent.pid)
        pids += [p.pid] + [c.pid for c in p.children(recursive=True)]
    pids += [r.pid for r in rt.ranks if r.pid]
    assert len(set(pids)) >= 3 + 6
    for pid in set(pids):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        for s in secrets_:
            assert s not in cmdline, pid


def test_unknown_curve_key_is_refused(joined):
    procs, _ = joined
    rt = procs.runtime
    curve = rt.transport.curve
    assert curve is not None
    before = curve.refused
    ctx = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.IDENTITY, b"h0")  # pretends to be host 0
        intruder.setsockopt(zmq.CURVE_SERVERKEY, curve.public)
        intruder.setsockopt(zmq.CURVE_PUBLICKEY, public)
        intruder.setsockopt(zmq.CURVE_SECRETKEY, secret)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(rt.transport.send_addr.replace("0.0.0.0", "127.0.0.1"))
        intruder.connect(rt.transport.recv_addr.replace("0.0.0.0", "127.0.0.1"))
        intruder.send(b"junk", zmq.NOBLOCK) if intruder.poll(0, zmq.POLLOUT) else None
        deadline = time.monotonic() + 5
        while curve.refused == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert curve.refused > before
        assert not intruder.poll(500)  # nothing meant for host 0 reached it
        # A plain (no CURVE) client gets nowhere either.
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(rt.transport.send_addr)
        assert not plain.poll(300)
    finally:
        ctx.destroy(0)
    # ... and the mesh keeps working.
    assert len(procs.spawn("after", Probe).info.call().get(timeout=30)) == 6


INTRUDER = """
import socket, sys, time, zmq
server, send, recv = sys.argv[1].encode(), sys.argv[2], sys.argv[3]
ctx = zmq.Context()
got = 0
for curve in (True, False):
    for ident in (b"h0", b"r0", b"c0"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 0)
        if curve:
            public, secret = zmq.curve_keypair()
            s.setsockopt(zmq.CURVE_SERVERKEY, server)
            s.setsockopt(zmq.CURVE_PUBLICKEY, public)
            s.setsockopt(zmq.CURVE_SECRETKEY, secret)
        s.connect(send)
        s.connect(recv)
        got += bool(s.poll(400))
host, port = recv.removeprefix("tcp://").rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=5) as raw:  # junk bytes
    raw.sendall(bytes([255]) * 4096)
print("received", got)
"""


def test_outsider_namespace_gets_nothing(joined, net):
    """From a machine that never joined: random CURVE keys and plain clients, claiming
    host 0's and rank 0's identities, receive nothing; the mesh keeps working."""
    import subprocess

    procs, _ = joined
    rt = procs.runtime
    curve = rt.transport.curve
    assert curve is not None
    before = curve.refused
    args = [curve.public.decode(), rt.transport.send_addr, rt.transport.recv_addr]
    args = [a.replace("0.0.0.0", net.gateway) for a in args]
    proc = net.popen(
        3,
        [sys.executable, "-c", INTRUDER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=agent_env(),
    )
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0 and "received 0" in out, out
    assert curve.refused >= before + 3
    assert len(procs.spawn("after2", Probe).info.call().get(timeout=30)) == 6


IMPOSTOR = """
import json, sys, time, zmq
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire import Codec
from monarch_kernel.wire import kinds as K
cfg = json.loads(sys.stdin.read())
ctx = zmq.Context()
own = ident_tag(cfg["curve_secret"])  # what host 1's key lets it compute
socks = []
for ident in (b"r0", b"c0", b"h0", b"r0" + own, b"c0" + own, b"h0" + own):
    for addr in (cfg["send"], cfg["recv"]):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.CURVE_SERVERKEY, cfg["curve_server"].encode())
        s.setsockopt(zmq.CURVE_PUBLICKEY, cfg["curve_public"].encode())
        s.setsockopt(zmq.CURVE_SECRETKEY, cfg["curve_secret"].encode())
        s.connect(addr)
        socks.append((ident, addr, s))
codec = Codec(bytes.fromhex(cfg["key"]))  # a host holds the mesh key: signatures pass
time.sleep(1)
for ident, addr, s in socks:
    if addr == cfg["recv"]:
        s.send_multipart(codec.encode({"k": K.HEARTBEAT, "h": 0}))
        s.send_multipart(codec.encode({"k": K.RANK_STARTED, "r": 0, "pid": 1}))
print("ready", flush=True)
sys.stdin.close()
got = []
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    for ident, addr, s in socks:
        if s.poll(0):
            s.recv_multipart()
            got.append(ident.decode(errors="replace"))
    time.sleep(0.01)
print("received", len(got), got, flush=True)
"""


def test_other_hosts_key_cannot_take_a_ranks_identity(joined, net):
    """From a joined machine (host 1's key and the mesh key): DEALERs claiming rank 0's
    and host 0's routing ids (bare, or with the tag host 1's key gives) get nothing meant
    for them while rank 0 keeps answering calls; signed messages they send claiming host
    0 or rank 0 are dropped and counted."""
    import subprocess

    procs, _ = joined
    rt = procs.runtime
    host = next(h for h in range(3) if rt.ranks[0].host != h)  # a host without rank 0
    pid0 = rt.ranks[0].pid
    cfg = dict(rt.launcher._latest[(rt.name, host)].cfg.to_json())
    cfg["send"], cfg["recv"] = (
        a.replace("0.0.0.0", net.gateway) for a in (rt.transport.send_addr, rt.transport.recv_addr)
    )
    before = rt.transport.ids.impostors
    proc = net.popen(
        host,
        [sys.executable, "-c", IMPOSTOR, "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=agent_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(cfg).encode())
    proc.stdin.close()
    assert b"ready" in proc.stdout.readline()
    # While the impostor listens: calls to rank 0 (main thread and control) still work.
    for i in range(3):
        assert len(procs.spawn(f"imp{i}", Probe).info.call().get(timeout=30)) == 6
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == 0 and "received 0" in out, out
    deadline = time.monotonic() + 5
    while rt.transport.ids.impostors < before + 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.transport.ids.impostors >= before + 12  # 6 borrowed identities x 2 messages
    assert rt.ranks[0].pid == pid0  # the forged RANK_STARTED for rank 0 was not taken
    assert len(procs.ping().get(timeout=10)) == 6


def test_tokens_are_single_use_and_checked(net):
    """A token works once; a wrong secret and a second use are refused; the join
    endpoint closes once every token is used."""
    from monarch_kernel.launchers.base import HostConfig
    from monarch_kernel.launchers.join import JoinLauncher

    lines: list[str] = []
    launcher = JoinLauncher(bind=net.gateway, on_progress=lines.append)
    cfgs = [HostConfig(h, "ab" * 32, "tcp://x:1", "tcp://x:2", 10.0, "t") for h in (0, 1)]
    launcher.start_hosts(cfgs)
    (url, token0), (_, token1) = COMMAND.findall(lines[0])
    server = zmq.utils.z85.encode(bytes.fromhex(token0.rsplit("-", 1)[1]))
    forged = "0-" + "0" * 32 + "-" + token0.rsplit("-", 1)[1]
    ctx = zmq.Context()

    def ask(token: str, protocol: int | None = PROTOCOL_VERSION) -> dict[str, object]:
        s = ctx.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_SERVERKEY, server)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(url)
        request = token if protocol is None else json.dumps({"token": token, "protocol": protocol})
        s.send(request.encode())
        try:
            return s.recv_json() if s.poll(5000) else {"timeout": True}  # type: ignore[return-value]
        finally:
            s.close(0)

    try:
        assert "error" in ask(forged)
        # another version's host agent: refused before its (valid) token is used up
        other = ask(token0, protocol=PROTOCOL_VERSION + 1)
        expected = f"speaks protocol {PROTOCOL_VERSION + 1}, the controller {PROTOCOL_VERSION}"
        assert expected in str(other["error"])
        assert other["protocol"] == PROTOCOL_VERSION
        assert "speaks protocol 0" in str(ask(token0, protocol=None)["error"])  # a bare token
        first = ask(token0)
        assert first["protocol"] == PROTOCOL_VERSION
        assert first["cfg"]["host"] == 0 and first["cfg"]["key"] == "ab" * 32  # type: ignore[index]
        assert "used already" in str(ask(token0)["error"])
        assert launcher.refused == 4
        assert "1/2 hosts joined" in "\n".join(lines)
        why = launcher.describe_missing("t", [0, 1])
        assert "host 0 joined from 10.77." in why and "never connected to tcp://x:1" in why
        assert "hosts 1 did not join" in why and "--token " in why
        assert ask(token1)["cfg"]["host"] == 1  # type: ignore[index]
        assert launcher._thread is not None
        launcher._thread.join(2)
        assert not launcher._thread.is_alive()  # every token used: the endpoint closed
    finally:
        launcher.shutdown()
        ctx.destroy(0)


def test_missing_hosts_are_named(net, monkeypatch):
    """Nobody runs the command: the error names the missing hosts and the command; the
    ports come from $MONARCH_KERNEL_PORTS."""
    from monarch_kernel.widgets import render

    monkeypatch.setenv("MONARCH_KERNEL_PORTS", "31000-31050")
    lines: list[str] = []
    shown: list[str] = []

    def dashboard_while_waiting(procs) -> None:
        # what the dashboard's hosts pane shows a second into the wait
        threading.Timer(1.0, lambda: shown.append(render.hosts_html(procs.runtime))).start()

    with pytest.raises(MeshStartError) as err:
        host_mesh(hosts=2, backend="join", bind=net.gateway, on_progress=lines.append).spawn_procs(
            {"gpus": 1}, timeout=2, on_starting=dashboard_while_waiting
        )
    (pane,) = shown
    assert "0/2 hosts joined" in pane
    assert pane.count('<code class="mk-cmd">') == 2 and "--token" in pane
    text = str(err.value)
    assert "hosts 0, 1 did not join" in text
    assert "--join tcp://" in text and "--token" in text
    port = int(COMMAND.search(text).group(1).rsplit(":", 1)[1])  # type: ignore[union-attr]
    assert 31000 <= port <= 31050


def test_mesh_magic_takes_bind_and_advertise():
    from monarch_kernel.kernel.args import mesh_parser

    opts = mesh_parser().parse_args(
        ["m", "--gpus", "2", "--hosts", "4", "--backend", "join", "--bind", "0.0.0.0"]
        + ["--advertise", "10.1.2.3"]
    )
    assert (opts.backend, opts.bind, opts.advertise) == ("join", "0.0.0.0", "10.1.2.3")
    with pytest.raises(ValueError, match="loopback"):
        host_mesh(hosts=2, backend="join", bind="0.0.0.0", advertise="127.0.0.1")


def test_mesh_magic_join_in_a_kernel(net):
    """``%mesh j --backend join``: the cell shows the command per host and the progress
    while it waits; ``%%remote`` then runs on both machines."""
    from kernel_client import Kernel

    k = Kernel(env={"PYTHONPATH": agent_env()["PYTHONPATH"]})
    joiner = Joiner(net)
    try:
        mid = k.submit(f"%mesh j --backend join --hosts 2 --gpus 1 --bind {net.gateway}")
        k.wait_for_output(mid, "host 1: python -m monarch_kernel.host --join", timeout=60)
        joiner.progress(k.output_so_far(mid)[0])  # the people run the shown commands
        r = k.collect(mid, timeout=60)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        assert "2/2 hosts joined" in r.stdout, r.stdout
        r = k.run("%%remote j\nimport socket\nprint('on', socket.gethostname())", timeout=60)
        out = r.stdout
        assert f"on {net.hosts[0].name}" in out and f"on {net.hosts[1].name}" in out, out
    finally:
        k.shutdown_and_check()
        for agent in joiner.agents.values():
            agent.wait(10)


def test_frozen_host_is_lost_and_told_to_exit(joined, net):
    """SIGSTOP host 1's agent: lost within 3 s naming the host; once it runs again it
    reads the controller's stop and exits with its ranks."""
    import signal

    procs, joiner = joined
    rt = procs.runtime
    agent = joiner.agents[1]
    ranks = [psutil.Process(r.pid) for r in rt.ranks if r.host == 1 and r.pid]
    t0 = time.monotonic()
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        mine = [r for r in rt.ranks if r.host == 1]
        while any(r.alive for r in mine) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert rt.hosts[1].lost, "host 1 was never declared lost"
        assert took < 10, took  # by missing heartbeats (2.5 s), not at some later timeout
        assert all("host agent 1 lost" in rt.death_text(r) for r in mine)
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    agent.wait(10)
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


def test_killed_host_agent_is_reported(joined, net):
    """Last: kills host 2's agent; its ranks are reported dead naming the host."""
    procs, joiner = joined
    rt = procs.runtime
    t0 = time.monotonic()
    joiner.agents[2].kill()
    while rt.hosts[2].lost is None and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert rt.hosts[2].lost, "host 2 was never declared lost"
    assert took < 10, took
    with pytest.raises(MonarchError) as err:
        procs.slice(hosts=2).spawn("late", Probe).info.call().get(timeout=10)
    print("\nkilled host:", rt.hosts[2].lost, "|", str(err.value).splitlines()[0])
    assert "host 2" in str(err.value) or net.hosts[2].name in str(err.value), str(err.value)
    alive = procs.slice(hosts=0).spawn("alive", Probe).info.call().get(timeout=10)
    assert len(alive) == 2


def test_source_address_and_interface():
    from monarch_kernel.host.agent import interface_of, source_address

    assert source_address("tcp://127.0.0.1:9") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None
