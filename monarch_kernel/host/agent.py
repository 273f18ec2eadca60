"""The host agent (``python -m monarch_kernel.host``), one per machine.

It starts the warm template at once (so torch is imported while it waits), then reads
its configuration (controller addresses and mesh key) as one JSON line on stdin or from
``$MONARCH_KERNEL_HOST_CONFIG``, connects to the controller, forks ranks through the
template, reports every rank death at once with the rank's last output lines, fans
multi-rank messages out to its local ranks, and exits when the controller disappears
(heartbeat loss; on Linux also the parent-death signal).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.z85

from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import limit_size
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire.netaddr import route_source
from monarch_kernel.wire.osutil import die_with_parent, request_tail

log = logging.getLogger("monarch_kernel.host")

#: Seconds between the agent's heartbeats (the controller declares a host lost after a
#: few seconds of silence); also the longest its message loop ever waits.
HEARTBEAT_INTERVAL = 0.5
#: Seconds ranks get to exit cleanly when ``stop`` does not say (its ``grace``).
DEFAULT_GRACE = 3.0
#: The longest a ``dump_stacks`` holds up the agent's loop, waiting for the dumps.
STACKS_WAIT = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Template:
    """Handle on the warm template process (see :mod:`monarch_kernel.host.template`)."""

    def __init__(self, private_dir: str):
        cmd_r, self.cmd_w = os.pipe()
        self.event_r, ev_w = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monarch_kernel.host.template",
                str(cmd_r),
                str(ev_w),
                str(os.getpid()),
            ],
            pass_fds=(cmd_r, ev_w),
            stdin=subprocess.DEVNULL,
            cwd=os.getcwd(),
        )
        os.close(cmd_r)
        os.close(ev_w)
        self.buf = b""

    def command(self, **cmd: Any) -> None:
        os.write(self.cmd_w, (json.dumps(cmd) + "\n").encode())

    def events(self) -> list[dict[str, Any]]:
        data = os.read(self.event_r, 65536)
        if not data:
            return [{"e": "template_exit", "code": self.proc.wait()}]
        self.buf += data
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(json.loads(line))
        return out

    def stop(self, grace: float = DEFAULT_GRACE) -> None:
        """Ask the template to stop its ranks (SIGTERM, then SIGKILL after ``grace``
        seconds) and exit; kill it if it has not exited a while after that."""
        try:
            self.command(op="exit", grace=grace)
        except OSError:
            pass
        try:
            self.proc.wait(grace + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HostAgent:
    def __init__(self, controller_pid: int | None = None) -> None:
        self.controller_pid = controller_pid
        # mode 0700; the local launcher makes it (and removes it if we are killed)
        self.private_dir = os.environ.pop("MONARCH_KERNEL_HOST_DIR", "") or tempfile.mkdtemp(
            prefix="mk-host-"
        )
        self.template = Template(self.private_dir)
        self.pids: dict[int, int] = {}  # rank -> pid
        # Fanned-out messages a busy rank has not taken yet (its inbox is full), in order:
        # forwarding never blocks, so this loop keeps reading the controller's heartbeats.
        self.backlog: dict[int, deque[list[Any]]] = {}
        self.greeted: set[int] = set()  # ranks that said hello and still wait for ours
        self.expected_exits: set[int] = set()
        self.stop_grace = DEFAULT_GRACE  # the controller's ``stop`` may say otherwise
        self.cfg: dict[str, Any] = {}
        #: Handlers of the controller's messages by kind (forwarded ones, with header
        #: ``f``, never get here): ``handler(header)``; "stop" ends the message loop.
        self.handlers: dict[str, Callable[[dict[str, Any]], str | None]] = {
            K.SPAWN_RANKS: self.on_spawn_ranks,
            K.SIGNAL_RANKS: self.on_signal_ranks,
            K.KILL_RANKS: self.on_kill_ranks,
            K.STOP: self.on_stop,
            K.NEW_PORT: self.on_new_port,
            K.HEARTBEAT: self.on_ignored,
            K.HELLO: self.on_ignored,
            K.DUMP_STACKS: self.on_dump_stacks,
        }

    def configure(self, cfg: dict[str, Any]) -> None:
        send = str(cfg.get("send", ""))
        if not cfg.get("advertise") and send.startswith("tcp://"):
            # Any launcher on other machines: our address is the one we reach the
            # controller from (MASTER_ADDR, and the interface gloo/NCCL use).
            try:
                addr = source_address(send)
            except (OSError, ValueError):
                addr = ""
            if addr and not addr.startswith("127.") and addr != "::1":
                cfg = dict(cfg, advertise=addr)
        self.cfg = cfg
        self.host = int(cfg["host"])
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.hb_timeout = float(cfg.get("hb_timeout", 10.0))
        self.ctx = zmq.Context()
        #: Suffix of our ranks' routing ids and ours (launchers.base.ident_tag).
        self.tag = ident_tag(cfg.get("curve_secret", ""))
        ident = b"h%d" % self.host + self.tag
        self.inbox = self.ctx.socket(zmq.DEALER)
        self.inbox.setsockopt(zmq.IDENTITY, ident)
        limit_size(self.inbox)  # ZMQ_MAXMSGSIZE: no frame above it is allocated
        self.curve_client(self.inbox)
        self.inbox.connect(cfg["send"])
        self.out = self.ctx.socket(zmq.DEALER)
        self.out.setsockopt(zmq.IDENTITY, ident)
        self.out.setsockopt(zmq.LINGER, 2000)
        limit_size(self.out)
        self.curve_client(self.out)
        self.out.connect(cfg["recv"])
        self.fan = self.ctx.socket(zmq.ROUTER)
        self.fan.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.fan.setsockopt(zmq.ROUTER_HANDOVER, 1)
        limit_size(self.fan)
        if cfg.get("curve_secret"):  # ranks' sockets are CURVE clients: ours must match
            self.fan.setsockopt(zmq.CURVE_SERVER, 1)
            self.fan.setsockopt(zmq.CURVE_SECRETKEY, cfg["curve_secret"].encode())
        self.fan_addr = f"ipc://{self.private_dir}/fan"
        self.fan.bind(self.fan_addr)
        self.master_port = free_port()
        self.hostname = cfg.get("hostname") or socket.gethostname()
        #: The network interface that owns our advertised address (gloo and NCCL use it).
        self.ifname = interface_of(cfg["advertise"]) if cfg.get("advertise") else None

    def curve_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE client of the controller when the mesh uses CURVE."""
        if self.cfg.get("curve_secret"):
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.cfg["curve_server"].encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.cfg["curve_public"].encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.cfg["curve_secret"].encode())

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        wire_send(self.out, self.codec.encode(header, payload))

    def send_heartbeat(self) -> None:
        """A heartbeat never blocks the loop: if the controller does not take what we
        send (its queue is full), it hears from us once it does."""
        try:
            wire_send(
                self.out, self.codec.encode({"k": K.HEARTBEAT, "h": self.host}), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            pass

    def run(self) -> None:
        self.send(
            {
                "k": K.HOST_READY,
                "h": self.host,
                "pid": os.getpid(),
                "host": self.hostname,
                "addr": self.cfg.get("advertise", "127.0.0.1"),
                "port": self.master_port,
            }
        )
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.template.event_r, zmq.POLLIN)
        poller.register(self.fan, zmq.POLLIN)
        last_rx = last_hb = time.monotonic()
        while True:
            # While a rank waits for our hello, retry it every few milliseconds.
            quick = self.greeted or self.backlog
            # Never wait longer than half a heartbeat interval, so heartbeats go on time.
            events = dict(poller.poll(2 if quick else int(HEARTBEAT_INTERVAL * 500)))
            if self.backlog:
                self.flush_backlog()
            now = time.monotonic()
            if self.template.event_r in events:
                for ev in self.template.events():
                    if self.on_template_event(ev) == "exit":
                        return
            if self.fan in events:
                self.on_greeting(self.fan.recv_multipart())
            if self.greeted:
                self.answer_greetings()
            if self.inbox in events:
                last_rx = now
                while True:
                    try:
                        frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if self.on_message(frames) == "stop":
                        return
            now = time.monotonic()
            if now - last_hb >= HEARTBEAT_INTERVAL:
                self.send_heartbeat()
                last_hb = now
            if now - last_rx > self.hb_timeout:
                log.error(
                    "host %s: controller silent for %.0fs, shutting down", self.host, now - last_rx
                )
                return

    def on_greeting(self, frames: list[Any]) -> None:
        """A starting rank says hello (from a throw-away socket, see ``Rank._greet_host``)."""
        try:
            msg = self.codec.decode(frames[1:])
        except WireError as exc:
            log.warning("host %s dropped a greeting: %s", self.host, exc)
            return
        if msg.kind == K.HELLO and isinstance(msg.header.get("r"), int):
            self.greeted.add(msg.header["r"])

    def answer_greetings(self) -> None:
        """Say hello to the inbox of every greeting rank that is routable by now.

        Arriving there tells the rank that fanned-out messages can reach it.
        """
        hello = self.codec.encode({"k": K.HELLO})
        for r in list(self.greeted):
            try:
                self.fan.send_multipart([b"r%d" % r + self.tag, *hello], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # its inbox has not connected yet (or is full)
                continue
            self.greeted.discard(r)

    def forward(self, rank: int, frames: list[Any]) -> None:
        """Pass a fanned-out message to ``rank``'s inbox, or queue it behind what it has
        not taken yet (never blocks)."""
        queue = self.backlog.get(rank)
        if queue is None:
            try:
                self.fan.send_multipart(
                    [b"r%d" % rank + self.tag, *frames], copy=False, flags=zmq.NOBLOCK
                )
                return
            except zmq.Again:  # its inbox is full: it is busy
                queue = self.backlog[rank] = deque()
            except zmq.ZMQError:  # rank not connected (dead or starting); its
                return  # death or readiness is reported separately
        queue.append(frames)
        if len(queue) % 100_000 == 0:
            log.warning("host %s: %d messages wait for busy rank %s", self.host, len(queue), rank)

    def flush_backlog(self) -> None:
        """Hand queued messages to the ranks that can take them now."""
        for rank, queue in list(self.backlog.items()):
            while queue:
                try:
                    self.fan.send_multipart(
                        [b"r%d" % rank + self.tag, *queue[0]], copy=False, flags=zmq.NOBLOCK
                    )
                except zmq.Again:
                    break
                except zmq.ZMQError:  # it is gone
                    queue.clear()
                    break
                queue.popleft()
            if not queue:
                del self.backlog[rank]

    def on_message(self, frames: list[Any]) -> str | None:
        try:
            msg = self.codec.decode(frames)
        except WireError as exc:
            log.warning("host %s dropped a message: %s", self.host, exc)
            return None
        h = msg.header
        if h.get("f"):
            for r in h["d"]:
                if r in self.pids:
                    self.forward(r, frames)
            return None
        kind = h["k"]
        try:
            handler = self.handlers[kind]
        except (KeyError, TypeError):  # unknown (or unhashable) kind
            log.warning("host %s: unknown message kind %r", self.host, kind)
            return None
        return handler(h)

    def on_spawn_ranks(self, h: dict[str, Any]) -> None:
        """SPAWN_RANKS: fork one rank per spec in ``ranks`` (each merged over ``common``)."""
        common = dict(h["common"])
        common.update(
            key=self.cfg["key"],
            send=self.cfg["send"],
            recv=self.cfg["recv"],
            fanout=self.fan_addr,
            hostname=self.hostname,
            **self.rank_secrets(),
        )
        for spec in h["ranks"]:
            cfg = dict(common, **spec)
            cfg["log"] = os.path.join(self.private_dir, f"rank{spec['rank']}.log")
            if os.path.exists(cfg["log"]):
                os.unlink(cfg["log"])
            self.template.command(op="fork", cfg=cfg)

    def rank_secrets(self) -> dict[str, Any]:
        """What ranks need besides the mesh key: the CURVE keys (through the template's
        pipe, never a command line) and the interface gloo/NCCL should use."""
        out: dict[str, Any] = {k: self.cfg[k] for k in CURVE_FIELDS if self.cfg.get(k)}
        if self.ifname:
            out["ifname"] = self.ifname
        return out

    def on_signal_ranks(self, h: dict[str, Any]) -> None:
        """SIGNAL_RANKS: send signal ``sig`` to the local ranks ``d``."""
        self.signal(h["d"], int(h["sig"]))

    def on_kill_ranks(self, h: dict[str, Any]) -> None:
        """KILL_RANKS: SIGKILL the local ranks ``d``; their exits are reported as expected."""
        self.expected_exits.update(r for r in h["d"] if r in self.pids)
        self.signal(h["d"], signal.SIGKILL)

    def on_stop(self, h: dict[str, Any]) -> str:
        """STOP: leave the message loop (``shutdown`` then stops the ranks, giving them
        ``grace`` seconds to exit cleanly)."""
        try:
            self.stop_grace = max(0.0, float(h.get("grace", DEFAULT_GRACE)))
        except (TypeError, ValueError):
            self.stop_grace = DEFAULT_GRACE
        self.expected_exits.update(self.pids)
        return "stop"

    def on_new_port(self, h: dict[str, Any]) -> None:
        """NEW_PORT: answer request ``i`` with a free port on this host (the rendezvous
        of a re-formed process group)."""
        self.send({"k": K.PORT, "h": self.host, "i": h.get("i"), "port": free_port()})

    def on_ignored(self, h: dict[str, Any]) -> None:
        """HEARTBEAT and HELLO: receiving anything already counts as a heartbeat."""

    def signal(self, ranks: list[int], sig: int) -> None:
        for r in ranks:
            pid = self.pids.get(r)
            if pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def on_dump_stacks(self, h: dict[str, Any]) -> None:
        """DUMP_STACKS: make the local ranks ``d`` dump their stacks (faulthandler, on
        ``STACKS_SIGNAL``) and answer request ``i`` for each, on its behalf (``h`` set).

        Waits at most ``STACKS_WAIT`` in all (the dumps take microseconds, so this loop's
        heartbeats never suffer); a rank that wrote nothing by then gets no answer.
        """
        import pickle

        from monarch_kernel.wire.stacks import STACKS_SIGNAL, parse_faulthandler, stacks_path

        files: dict[int, str] = {}
        for r in h["d"]:
            pid = self.pids.get(r)
            if not pid:
                continue
            path = stacks_path(os.path.join(self.private_dir, f"rank{r}.log"), pid)
            try:  # absent until the rank registered its handler: never signal it before
                os.truncate(path, 0)
                os.kill(pid, STACKS_SIGNAL)
            except OSError:
                continue
            files[r] = path
        sizes = dict.fromkeys(files, -1)
        deadline = time.monotonic() + STACKS_WAIT
        while files:
            time.sleep(0.01)
            last = time.monotonic() >= deadline
            for r, path in list(files.items()):
                try:
                    size = os.path.getsize(path)
                except OSError:
                    del files[r]
                    continue
                if size and (size == sizes[r] or last):  # written, and stopped growing
                    del files[r]
                    with open(path, errors="replace") as f:
                        threads = parse_faulthandler(f.read())
                    header = {"k": K.RESULT, "i": h["i"], "r": r, "ok": 1, "h": self.host}
                    self.send(header, pickle.dumps(threads))
                sizes[r] = size
            if last:
                break

    def on_template_event(self, ev: dict[str, Any]) -> str | None:
        e = ev["e"]
        if e == "forked":
            self.pids[ev["rank"]] = ev["pid"]
            self.send({"k": K.RANK_STARTED, "h": self.host, "r": ev["rank"], "pid": ev["pid"]})
        elif e == "exit":
            rank = ev["rank"]
            if self.pids.get(rank) == ev["pid"]:
                del self.pids[rank]
                self.backlog.pop(rank, None)  # a restarted rank starts afresh
            log_path = os.path.join(self.private_dir, f"rank{rank}.log")
            self.send(
                {
                    "k": K.RANK_EXIT,
                    "h": self.host,
                    "r": rank,
                    "pid": ev["pid"],
                    "code": ev["code"],
                    "sig": ev["signal"],
                    "tail": request_tail(log_path),
                    "expected": rank in self.expected_exits,
                }
            )
            self.expected_exits.discard(rank)
        elif e == "template_exit":
            log.error("host %s: template exited (%s)", self.host, ev.get("code"))
            return "exit"
        return None

    def shutdown(self) -> None:
        # Already on our way out: a SIGTERM now (the controller dying) must not cut the
        # clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.template.stop(self.stop_grace)
        # Report the exits the template emitted while stopping, then say goodbye.
        try:
            os.set_blocking(self.template.event_r, False)
            for ev in self.template.events():
                if ev["e"] == "exit":
                    self.expected_exits.add(ev["rank"])
                    self.on_template_event(ev)
        except (OSError, ValueError):
            pass
        if self.cfg:
            self.ctx.destroy(linger=500)
            self.remove_dead_controller_sockets()
        shutil.rmtree(self.private_dir, ignore_errors=True)
        # A controller killed outright never ran its atexit: its local launcher's
        # directory (which holds our private one) goes with its agents.
        launch = os.path.dirname(self.private_dir)
        dead = self.controller_pid is not None and os.getppid() != self.controller_pid
        if dead and os.path.basename(launch).startswith("mk-launch-"):
            shutil.rmtree(launch, ignore_errors=True)

    def remove_dead_controller_sockets(self) -> None:
        """A controller killed outright leaves its unix sockets' private directory
        behind; the agents it started remove it (never while the controller lives)."""
        addr = str(self.cfg.get("send", ""))
        folder = os.path.dirname(addr.removeprefix("ipc://"))
        if not (addr.startswith("ipc://") and os.path.basename(folder).startswith("mk-mesh-")):
            return
        # The local launcher's agents are the controller's children: re-parented = dead.
        if self.controller_pid is not None and os.getppid() != self.controller_pid:
            shutil.rmtree(folder, ignore_errors=True)


CURVE_FIELDS = ("curve_server", "curve_public", "curve_secret")


def interface_of(addr: str) -> str | None:
    """The name of the network interface that owns IPv4/IPv6 address ``addr``."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return None


def source_address(url: str) -> str:
    """The local address this machine uses to reach ``tcp://HOST:PORT`` (no packet is
    sent: a UDP socket is only routed)."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return route_source(host, int(port))


def join(url: str, token: str, timeout: float = 30.0) -> dict[str, Any]:
    """Fetch this host's configuration from the controller's join endpoint ``url`` with
    single-use ``token`` (``HOST-SECRET-SERVERKEY``) over CURVE (the server key is in
    the token; our keypair is throw-away). Exits with a message naming the address on
    failure."""
    try:
        server = zmq.utils.z85.encode(bytes.fromhex(token.rsplit("-", 1)[1]))
    except (IndexError, ValueError):
        sys.exit(f"monarch host: malformed --token {token[:8]}...")
    try:
        advertise = source_address(url)
    except (OSError, ValueError) as exc:
        sys.exit(f"monarch host: cannot reach {url}: {exc}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(url)
    sock.send(token.encode())
    try:
        if not sock.poll(int(timeout * 1000)):
            sys.exit(
                f"monarch host: no answer from the controller at {url} within {timeout:.0f}s "
                f"(this machine reaches it from {advertise}); check the address and firewall"
            )
        reply = json.loads(sock.recv())
    finally:
        sock.close(0)
    if "error" in reply:
        sys.exit(f"monarch host: the controller at {url} refused to join: {reply['error']}")
    cfg: dict[str, Any] = reply["cfg"]
    cfg.setdefault("advertise", advertise)
    return cfg


def _parse_args(argv: list[str]) -> tuple[str | None, str | None]:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m monarch_kernel.host",
        description="A monarch_kernel host agent. Without options it reads its "
        "configuration from stdin or $MONARCH_KERNEL_HOST_CONFIG (launchers); with "
        "--join it joins a mesh of the join backend.",
    )
    p.add_argument("--join", metavar="tcp://ADDR:PORT", help="the controller's join endpoint")
    p.add_argument(
        "--token",
        help="the single-use credential the notebook shows (default: "
        "$MONARCH_KERNEL_JOIN_TOKEN, which keeps it off the command line)",
    )
    opts = p.parse_args(argv)
    if opts.join and not opts.token:
        opts.token = os.environ.pop("MONARCH_KERNEL_JOIN_TOKEN", None)
    if bool(opts.join) != bool(opts.token):
        p.error("--join and --token go together")
    return opts.join, opts.token


def _read_config() -> dict[str, Any]:
    raw = os.environ.pop("MONARCH_KERNEL_HOST_CONFIG", None)
    if raw is None:
        raw = sys.stdin.readline()
        if not raw.strip():
            sys.exit(0)  # the launcher went away before configuring us
    return json.loads(raw)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="[monarch host] %(message)s")
    url, token = _parse_args(sys.argv[1:])
    # A joined agent outlives the shell that started it (heartbeats end it), unless the
    # engine that started it asks it to die with it (a Ray actor, a Slurm step).
    parent = os.environ.get("MONARCH_KERNEL_PARENT_PID")
    if not url or parent:
        die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    agent = HostAgent(int(parent) if parent else None)
    try:
        agent.configure(join(url, token or "") if url else _read_config())
        agent.run()
    except SystemExit:
        pass
    finally:
        agent.shutdown()


if __name__ == "__main__":
    main()
