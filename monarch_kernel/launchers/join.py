"""The ``join`` backend: machines started any other way join the mesh with one command.

``start_hosts`` binds a *join endpoint* (a CURVE server with its own keypair) and shows,
per host, the one line to run on that machine::

    python -m monarch_kernel.host --join tcp://ADDR:PORT --token H-SECRET-SERVERKEY

The token is single-use and expires (:data:`TOKEN_TTL`): ``H`` is the host index,
``SECRET`` 32 random hex digits, ``SERVERKEY`` the join endpoint's public CURVE key (hex;
public, so it may be seen). The agent connects over CURVE with a throw-away keypair,
sends the token, and receives its :class:`~.base.HostConfig` (mesh key, its CURVE keypair
for the mesh's sockets) encrypted: no key is ever on a command line. The mesh's own
sockets admit only the CURVE keys handed out this way.

Addresses: the controller binds ``bind`` (default ``0.0.0.0``: every interface) and tells
hosts to connect to ``advertise`` (default: :func:`default_advertise`, the address of the
interface that holds the default route, else the first non-loopback address). A loopback
address is refused for ``advertise`` unless ``allow_loopback`` (tests on one machine).
Ports come from ``$MONARCH_KERNEL_PORTS`` (``30000-30100``) when set, else any free one.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85

from monarch_kernel.launchers.base import (
    Curve,
    HostConfig,
    HostHandle,
    curve_server,
    zap,
)
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.netaddr import is_loopback, route_source
from monarch_kernel.wire.ports import bind_port

#: Seconds a join token stays valid.
TOKEN_TTL = 900.0


def default_advertise() -> str:
    """The address other machines most likely reach this one at: the source address of
    the default route (no packet is sent), else the first non-loopback IPv4 address."""
    try:
        addr = route_source("192.0.2.1")  # TEST-NET-1: only routed, never contacted
        if not is_loopback(addr):
            return addr
    except OSError:
        pass
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return str(a.address)
    raise ValueError(
        "found no non-loopback address to advertise; pass advertise=ADDR (--advertise)"
    )


#: Environment variable that carries a join token instead of ``--token`` (engines pass
#: it this way so it is on no command line).
TOKEN_ENV = "MONARCH_KERNEL_JOIN_TOKEN"


@dataclass
class _Slot:
    cfg: HostConfig
    secret: str
    expires: float
    joined_from: str | None = None
    used: bool = False
    #: The secret of the group token that may claim this slot (engines that run one
    #: command on every machine), else None.
    group: str | None = None
    #: Whether its command was shown to the user (else an engine runs it).
    shown: bool = False


class JoinHost:
    """Handle on one host that joins (a :class:`~.base.HostHandle`); the agent runs on
    a machine this process does not control, so it has no pid or exit code."""

    def __init__(self, launcher: JoinLauncher, slot: _Slot, command: str):
        self._launcher = launcher
        self._slot = slot
        self.command = command
        #: Set by the mesh: tells the agent to exit (a ``stop`` over the control plane);
        #: a frozen or partitioned agent that comes back reads it and exits.
        self.tell_exit: Callable[[], object] | None = None

    @property
    def pid(self) -> int | None:
        return None

    @property
    def joined(self) -> bool:
        return self._slot.joined_from is not None

    @property
    def host(self) -> int:
        return self._slot.cfg.host

    def status(self) -> str:
        """One line for the dashboard: joined from where, or the command still to run."""
        if self._slot.joined_from:
            return f"joined from {self._slot.joined_from}"
        if self._slot.used:
            return "stopped before it joined"
        return f"waiting; run on that machine: {self.command}"

    def notice(self) -> str | None:
        return None

    def exit_code(self) -> int | None:
        return None

    def log_tail(self, n: int = 20) -> str:
        if self._slot.joined_from:
            return f"(joined from {self._slot.joined_from}; its log is on that machine)"
        return f"(not joined yet; run on that machine: {self.command})"

    def wait_or_kill(self, timeout: float) -> None:
        """The agent is on another machine: tell it to exit (it also exits when the
        controller falls silent)."""
        if self.tell_exit is not None:
            try:
                self.tell_exit()
            except Exception:  # the mesh's sockets are closed: it is stopping anyway
                pass

    def cleanup(self) -> None:
        self._slot.used = True  # the token can no longer be used


@dataclass
class JoinLauncher:
    """Shows the join command per host and admits hosts that present a valid token
    (a :class:`~.base.Launcher`)."""

    bind: str = "0.0.0.0"
    advertise: str | None = None
    ttl: float = TOKEN_TTL
    #: Called with a line of progress ("2/4 hosts joined ..."); default: ``print``.
    on_progress: Callable[[str], object] | None = None
    allow_loopback: bool = False
    name: str = "join"
    #: The interpreter in the command shown (another machine's ``python``); engines on a
    #: shared file system pass ``sys.executable``.
    python: str = "python"
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Issued tokens by secret, and the latest slot of each (mesh, host).
    _slots: dict[str, _Slot] = field(default_factory=dict)
    _latest: dict[tuple[str, int], _Slot] = field(default_factory=dict)
    #: Join attempts refused (bad, used or expired tokens).
    refused: int = 0

    def __post_init__(self) -> None:
        if self.advertise is None:
            if self.bind not in ("0.0.0.0", "*", "::", ""):
                self.advertise = self.bind
            else:
                self.advertise = default_advertise()
        if is_loopback(self.advertise) and not self.allow_loopback:
            raise ValueError(
                f"advertise={self.advertise!r} is a loopback address other machines cannot "
                "reach; pass an address of this machine they can reach (--advertise)"
            )
        self._sock: zmq.Socket[bytes] | None = None
        self.url = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def same_machine(self) -> bool:
        return False

    def check_capacity(self, ranks: int, running: int = 0) -> None:
        """Other machines' capacity is theirs to judge: nothing to check here."""

    def _progress(self, line: str) -> None:
        (self.on_progress or print)(line)

    def _endpoint(self) -> None:
        """Bind the join endpoint unless it is open (a CURVE server; any client key may
        *ask*, only a valid token gets an answer). It closes itself once every token it
        issued is used or void (lock held)."""
        if self._sock is not None:
            return
        self._stop = threading.Event()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self._curve = Curve.new()
        self._domain = f"mk-join-{id(self):x}"
        curve_server(sock, self, self._domain)
        port = bind_port(sock, self.bind or "0.0.0.0")
        self._sock = sock
        self.url = f"tcp://{self.advertise}:{port}"
        self._thread = threading.Thread(
            target=self._serve, args=(sock, self._domain, self._stop), name="mk-join", daemon=True
        )
        self._thread.start()

    # ZAP for the join endpoint: every client key may ask (the token is the credential).
    @property
    def secret(self) -> bytes:
        return self._curve.secret

    def callback(self, domain: str, key: bytes) -> bool:
        return True

    def token(self, slot: _Slot) -> str:
        """``HOST-SECRET-SERVERKEY`` (``gN-SECRET-SERVERKEY`` for a group of N)."""
        key = zmq.utils.z85.decode(self._curve.public).hex()
        if slot.group is not None:
            size = sum(s.group == slot.group for s in self._slots.values())
            return f"g{size}-{slot.group}-{key}"
        return f"{slot.cfg.host}-{slot.secret}-{key}"

    def command(self, slot: _Slot, with_token: bool = True) -> str:
        """The line to run on a machine; ``with_token=False`` leaves the token out (it
        then goes in ``$MONARCH_KERNEL_JOIN_TOKEN``)."""
        line = f"{self.python} -m monarch_kernel.host --join {self.url}"
        return f"{line} --token {self.token(slot)}" if with_token else line

    def _issue(self, configs: list[HostConfig], group: str | None) -> list[_Slot]:
        """New slots for ``configs`` (lock held); a host started again voids its old one."""
        self._endpoint()
        now = time.monotonic()
        slots = []
        for cfg in configs:
            slot = _Slot(cfg, secrets.token_hex(16), now + self.ttl, group=group)
            old = self._latest.get((cfg.mesh, cfg.host))
            if old is not None:
                old.used = True
            self._slots[slot.secret] = self._latest[(cfg.mesh, cfg.host)] = slot
            slots.append(slot)
        return slots

    def start_for_engine(
        self, configs: list[HostConfig], group: bool
    ) -> tuple[list[JoinHost], str, list[str]]:
        """Slots for an engine to start (nothing is shown). ``group``: for engines that
        run one command on every machine (``srun``, a multi-machine Lightning job), one
        *group* token that admits ``len(configs)`` hosts, each taking the next host index
        not joined yet; else a token per host (a Ray actor per bundle). Returns the
        handles, the command without the token, and the tokens (one for a group; pass
        each in :data:`TOKEN_ENV`)."""
        with self._lock:
            slots = self._issue(configs, secrets.token_hex(16) if group else None)
            command = self.command(slots[0], with_token=False) if slots else ""
            tokens = [self.token(s) for s in (slots[:1] if group else slots)]
            handles = [JoinHost(self, s, f"{command} (token in ${TOKEN_ENV})") for s in slots]
        return handles, command, tokens

    def start_hosts(self, configs: list[HostConfig]) -> list[HostHandle]:
        """Issue a token per config, show the commands, and return at once; the hosts
        are admitted as they join (progress goes to ``on_progress``)."""
        with self._lock:
            handles: list[HostHandle] = []
            lines = []
            for slot in self._issue(configs, None):
                slot.shown = True
                handles.append(JoinHost(self, slot, self.command(slot)))
                lines.append(f"  host {slot.cfg.shown}: {self.command(slot)}")
        mesh = configs[0].mesh if configs else ""
        lines.insert(
            0,
            f"mesh {mesh!r}: run on each machine (single-use tokens, valid "
            f"{self.ttl / 60:.0f} min):",
        )
        self._progress("\n".join(lines))
        return handles

    def describe_missing(self, mesh: str, hosts: list[int]) -> str:
        """Which hosts of ``mesh`` never joined, and the command each still needs."""
        with self._lock:
            slots = [s for h in hosts if (s := self._latest.get((mesh, h))) is not None]
            joined = [s for s in slots if s.joined_from]
            waiting = [s for s in slots if not s.joined_from]
            out = [
                f"host {s.cfg.shown} joined from {s.joined_from} but never connected to "
                f"{s.cfg.send} / {s.cfg.recv} (a firewall? open those ports, or pick them "
                "with MONARCH_KERNEL_PORTS=LOW-HIGH)"
                for s in joined
            ]
            if waiting:
                which = ", ".join(str(s.cfg.shown) for s in waiting)
                if all(s.shown for s in waiting):
                    out.append(f"hosts {which} did not join; run on each machine:")
                    out += [f"  host {s.cfg.shown}: {self.command(s)}" for s in waiting]
                else:
                    out.append(f"hosts {which} did not join")
        return "\n".join(out)

    def _serve(self, sock: zmq.Socket[bytes], domain: str, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self._serve_one(sock)
                with self._lock:
                    if all(s.used for s in self._slots.values()):
                        if self._sock is sock:
                            self._sock = None  # the next start_hosts binds a new one
                        return
        finally:
            sock.close(0)
            zap(domain, None)

    def _serve_one(self, sock: zmq.Socket[bytes]) -> None:
        try:
            if not sock.poll(200):
                return
            ident, frame = sock.recv_multipart(copy=False)
        except (zmq.ZMQError, ValueError):
            return
        peer = str(frame.get("Peer-Address") or "?")
        token, protocol = _join_request(bytes(frame.bytes))
        if protocol != K.PROTOCOL_VERSION:  # refused before the token is looked at
            with self._lock:
                self.refused += 1
            reply: dict[str, object] = {
                "error": f"this host agent speaks protocol {protocol}, the controller "
                f"{K.PROTOCOL_VERSION}: install the same monarch_kernel version on every "
                "machine"
            }
            line = None
        else:
            reply, line = self._admit(token, peer)
        reply["protocol"] = K.PROTOCOL_VERSION
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([ident.bytes, json.dumps(reply).encode()])
        if line:
            self._progress(line)

    def _claim(self, token: str) -> _Slot | None:
        """The slot ``token`` names (lock held): its own, or for a group token the
        first one of the group nobody took yet (else a used one, for the error)."""
        head, _, rest = token.partition("-")
        secret = rest.partition("-")[0]
        if head.startswith("g"):
            group = [s for s in self._slots.values() if s.group is not None]
            group = [s for s in group if hmac.compare_digest(s.group or "", secret)]
            group.sort(key=lambda s: s.cfg.host)
            free = [s for s in group if not s.used]
            return (free or group)[0] if group else None
        slot = self._slots.get(secret)
        if slot is None or slot.group is not None:
            return None
        return slot if hmac.compare_digest(slot.secret, secret) else None

    def _admit(self, token: str, peer: str) -> tuple[dict[str, object], str | None]:
        with self._lock:
            slot = self._claim(token)
            if slot is None:
                self.refused += 1
                return {"error": "invalid token"}, None
            if slot.used:
                self.refused += 1
                what = (
                    "every host of this group joined already"
                    if slot.group
                    else ("this token was used already")
                )
                return {"error": what}, None
            if time.monotonic() > slot.expires:
                self.refused += 1
                return {"error": "this token expired; create the mesh again"}, None
            slot.used, slot.joined_from = True, peer
            mesh = slot.cfg.mesh
            group = [s for (m, _), s in self._latest.items() if m == mesh]
            done = sum(s.joined_from is not None for s in group)
            host = slot.cfg.shown
            line = f"mesh {mesh!r}: {done}/{len(group)} hosts joined (host {host} from {peer})"
            return {"cfg": slot.cfg.to_json()}, line

    def shutdown(self) -> None:
        """Close the join endpoint (tokens not used yet become useless)."""
        with self._lock:
            for slot in self._slots.values():
                slot.used = True
            self._sock = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1)


def _join_request(raw: bytes) -> tuple[str, int]:
    """``(token, protocol)`` of a join request: ``{"token": ..., "protocol": N}``; a bare
    token (a host agent from before the protocol had a version) is protocol 0."""
    text = raw.decode(errors="replace")
    try:
        req = json.loads(text)
    except ValueError:
        return text, 0
    if not isinstance(req, dict):
        return text, 0
    protocol = req.get("protocol", 0)
    return str(req.get("token", "")), protocol if isinstance(protocol, int) else 0
