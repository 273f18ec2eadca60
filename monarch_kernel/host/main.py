"""Starting a host agent (``python -m monarch_kernel.host``): its configuration from
stdin, ``$MONARCH_KERNEL_HOST_CONFIG`` or a controller's join endpoint; the addresses
and interface it is reached at."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import zmq
import zmq.utils.z85

from monarch_kernel.host.config import AgentConfig
from monarch_kernel.host.netinfo import source_address
from monarch_kernel.host.template_handle import Template
from monarch_kernel.wire import fd_limit
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.jsontypes import JsonObject
from monarch_kernel.wire.osutil import die_with_parent


def join(url: str, token: str, timeout: float = 30.0) -> JsonObject:
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
    sock.send(json.dumps({"token": token, "protocol": K.PROTOCOL_VERSION}).encode())
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
    if reply.get("protocol") != K.PROTOCOL_VERSION:
        sys.exit(
            f"monarch host: the controller at {url} speaks protocol {reply.get('protocol')}, "
            f"this host agent {K.PROTOCOL_VERSION}: install the same monarch_kernel version "
            "on every machine"
        )
    cfg: JsonObject = reply["cfg"]
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


def _read_config() -> JsonObject:
    """The launcher's configuration: ``$MONARCH_KERNEL_HOST_CONFIG`` or a line of stdin."""
    raw = os.environ.pop("MONARCH_KERNEL_HOST_CONFIG", None)
    if raw is None:
        raw = sys.stdin.readline()
        if not raw.strip():
            sys.exit(0)  # the launcher went away before configuring us
    cfg: JsonObject = json.loads(raw)
    return cfg


class _Sigterm:
    """SIGTERM ends the agent by SystemExit (its clean-up, in ``finally``, runs): once,
    and only once that clean-up is in place.

    The parent-death signal comes again each time the thread the agent is parented to
    ends, and a controller killed outright ends its threads one by one (the agent is
    re-parented to the next of them each time): several SIGTERMs may come within
    moments. Another SystemExit raised in the clean-up would cut it short (the agent's
    and its dead controller's temporary directories were left behind).

    Until :meth:`arm` (the agent is being built: its template is already running) a
    SIGTERM is only noted, and ``arm`` raises it: a SystemExit raised there had no
    clean-up to run, left the template and the directory behind, and let the next
    SIGTERM kill the interpreter as it finalized (the default handler back)."""

    def __init__(self) -> None:
        #: A SIGTERM came (the clean-up then waits for a dying controller: see
        #: ``HostAgent.controller_gone``).
        self.came = False
        #: The clean-up is in place: a SIGTERM may raise.
        self.armed = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.came:
            return
        self.came = True
        if self.armed:
            raise SystemExit(0)

    def arm(self) -> None:
        """Called first thing inside the ``try`` whose ``finally`` cleans up."""
        self.armed = True
        if self.came:
            raise SystemExit(0)


def main() -> None:
    """Run a host agent until its controller stops it or goes away."""
    logging.basicConfig(level=logging.WARNING, format="[monarch host] %(message)s")
    url, token = _parse_args(sys.argv[1:])
    # A joined agent outlives the shell that started it (heartbeats end it), unless the
    # engine that started it asks it to die with it (a Ray actor, a Slurm step).
    parent = os.environ.get("MONARCH_KERNEL_PARENT_PID")
    if not url or parent:
        die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sigterm = _Sigterm()
    signal.signal(signal.SIGTERM, sigterm)
    # The template first: its imports (torch, about a second) run beside the agent's
    # own (a tenth to a fifth of a second), not after them. If the agent fails before
    # its clean-up is in place, the template dies with it (its parent-death signal).
    template = Template()
    from monarch_kernel.host.agent import HostAgent

    agent = HostAgent(int(parent) if parent else None, template)
    code: object = None
    try:
        sigterm.arm()
        raw = join(url, token or "") if url else _read_config()
        cfg = AgentConfig.from_json(raw)
        try:  # each rank keeps connections to this agent open too
            fd_limit.ensure(cfg.ranks, "this host agent")
        except ValueError as exc:
            raise SystemExit(f"host agent {cfg.host}: {exc}") from None
        agent.configure(cfg)
        agent.run()
    except SystemExit as exc:
        code = exc.code  # SIGTERM (0), or a refused join (why, as a message)
    finally:
        agent.shutdown(signalled=sigterm.came)
    if code not in (None, 0):
        raise SystemExit(code)  # a message is printed to stderr, and the exit status is 1
