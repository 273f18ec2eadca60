"""A detachable mesh's host agent: who holds the mesh, how long it runs on without a
controller, and the attach desk through which another controller takes it over.

While a controller holds the mesh the agent works as always. It *loses* its controller
when that one says so (``detach``: its kernel shut down) or is known to be gone: its
process ended (on this machine) or its connection closed. A controller silent for the
agent's ``hb_timeout`` that still lives keeps the mesh (:mod:`.liveness`). From then on the
agent sends nothing to it, keeps its ranks running and records the ones that end, and
stops them all (leaving nothing behind) once ``detach_keep`` seconds have passed since
the controller was last heard, unless another controller attached through the desk
(:mod:`monarch_kernel.wire.desk` describes the requests) first.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from monarch_kernel.host.config import AgentConfig
from monarch_kernel.host.liveness import SilentController, gone_reason
from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire.codec import limit_size
from monarch_kernel.wire.desk import (
    DESK,
    DESK_REPLY,
    FORGED_REPLY,
    MAX_REQUEST_AGE,
    ControllerId,
    DeskOp,
    DeskReply,
    DeskRequest,
    RankStatus,
)
from monarch_kernel.wire.key_gate import KeyGate, close_gates, guard
from monarch_kernel.wire.osutil import die_with_parent
from monarch_kernel.wire.tempdirs import SOCKET_NAME_ROOM, make_private_dir, mark_owners

log = logging.getLogger("monarch_kernel.host")

#: Seconds between looks at whether the holding controller's process still runs.
HOLDER_CHECK_INTERVAL = 0.5
#: Restarts of one rank an agent makes while no controller holds the mesh (a rank that
#: keeps dying is left dead, as the controller's failure policy does).
MAX_DETACHED_RESTARTS = 3


def leave_launcher(private_dir: str) -> str:
    """Make this agent outlive its controller: no parent-death signal, a private
    directory of its own (the one ``private_dir`` the launcher made goes with its
    kernel), its output logged there (``agent.log``); the new directory."""
    die_with_parent(0)  # signal 0: none
    own = make_private_dir("mk-detached-", room=SOCKET_NAME_ROOM)
    mark_owners(own, [os.getpid()])
    shutil.rmtree(private_dir, ignore_errors=True)  # made for us, still unused
    log_fd = os.open(os.path.join(own, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    return own


class DeskHost(Protocol):
    """What the desk needs of its host agent."""

    #: rank -> pid of the ranks running now
    pids: dict[int, int]

    def tell_taken_over(self, by: ControllerId) -> None:
        """Tell the controller holding the mesh now that ``by`` took it over."""
        ...


@dataclass(frozen=True)
class StopAsked:
    """The desk was asked to stop the mesh: ranks get ``grace`` seconds."""

    grace: float


class Desk:
    """The holder, the detached clock and the attach desk of one host agent."""

    def __init__(self, cfg: AgentConfig, private_dir: str, ctx: zmq.Context[Any]):
        self.keep = cfg.detach_keep
        self.policy = cfg.on_failure
        self.hb_timeout = cfg.hb_timeout
        self.codec = Codec(bytes.fromhex(cfg.key))
        self.ctx = ctx
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.sock)
        #: The agent's private directory (its ranks' logs), told with the desk.
        self.dir = private_dir
        self.address = self._bind(cfg, private_dir)
        #: The agent's verdict on a silent controller, and through it the state of its
        #: connection to the controller (:meth:`follow`).
        self.silent: SilentController | None = None
        self.holder: ControllerId | None = cfg.controller()
        self.attached = True
        #: monotonic time the current holder attached: its silence counts from here
        self.attached_at = time.monotonic()
        self.detached_since: float | None = None  #: time.time() the holder was lost
        self.keep_until: float | None = None  #: time.time() the agent gives up
        self.epoch = 0
        self.refused: Counter[str] = Counter()
        #: Ranks that ended since the holder was lost (told to the next one at attach).
        self.ended: dict[int, RankStatus] = {}
        #: rank -> times this agent restarted it since the holder was lost
        self.restarts: dict[int, int] = {}
        self._holder_checked = 0.0
        self._silence = 0.0  #: seconds without a controller message, at the clock's last look

    def _bind(self, cfg: AgentConfig, private_dir: str) -> str:
        """Bind the desk: a unix socket in ``private_dir`` on a mesh of unix sockets;
        on a tcp (CURVE) mesh a CURVE server on the address the agent is reached at,
        with the agent's keypair, admitting the controller's key only (the one in the
        attach file: a kernel that attaches uses it), so another machine can attach."""
        if not cfg.curve_secret:
            address = f"ipc://{private_dir}/desk"
            self.sock.bind(address)
            return address
        self.gate = KeyGate([cfg.curve_server])
        guard(self.sock, cfg.curve_secret, self.gate, f"mk-desk-{cfg.mesh}")
        where = cfg.advertise or "127.0.0.1"
        port = self.sock.bind_to_random_port(f"tcp://{where}")
        return f"tcp://{where}:{port}"

    def follow(self, silent: SilentController) -> None:
        """Judge a silent controller, and see its connection, through the agent's
        ``silent`` (:mod:`monarch_kernel.host.liveness`). On tcp a killed kernel's
        connection closes at once: a kernel that attaches then need not wait for the
        silence."""
        self.silent = silent

    @property
    def link_up(self) -> bool:
        """Whether the agent's connection to the controller is up (True until known)."""
        return self.silent is None or self.silent.link.up

    # -- the clock -------------------------------------------------------------------
    def lose_controller(self, why: str, silence: float | None = None) -> None:
        """The holder is gone (``silence``: seconds since it was last heard; by default
        since its connection closed, or its last message as the clock last saw it)."""
        if not self.attached:
            return
        if silence is None:
            down = self.silent.link.down_for() if self.silent is not None else 0.0
            silence = max(down, self._silence)
        self.attached = False
        now = time.time()
        self.detached_since = now - silence
        self.keep_until = self.detached_since + self.keep
        log.warning(
            "mesh detached (%s): its ranks keep running for %.0fs unless a controller "
            "attaches (%%mesh attach)",
            why,
            self.keep_until - now,
        )

    def expired(self, now: float, silence: float) -> bool:
        """Look at the holder (``silence``: seconds since a controller message); True
        once the mesh has been without a controller for its ``keep`` seconds."""
        self._silence = silence
        if self.attached:
            if silence > self.hb_timeout:
                # silent, but only lost once known gone (a busy kernel keeps its mesh)
                why = self.silent.gone(silence, self.holder) if self.silent is not None else ""
                if why is not None:
                    self.lose_controller(
                        f"no word from the controller for {silence:.0f}s"
                        + (f": {why}" if why else ""),
                        silence,
                    )
            elif now - self._holder_checked >= HOLDER_CHECK_INTERVAL:
                self._holder_checked = now
                holder = self.holder
                if holder is not None and holder.alive() is False:
                    self.lose_controller(f"{holder.describe()} ended")
            return False
        return self.keep_until is not None and time.time() >= self.keep_until

    def rank_exited(
        self, rank: int, pid: int, code: int | None, sig: int | None, expected: bool
    ) -> bool:
        """A rank ended: recorded for the next controller while none holds the mesh;
        True when the failure policy (``restart``) says to start it again now."""
        holder = self.holder
        if self.attached and holder is not None and holder.alive() is False:
            self.lose_controller(f"{holder.describe()} ended")  # before the clock noticed
        if self.attached:
            return False
        n = self.restarts.get(rank, 0)
        self.ended[rank] = RankStatus(rank, pid, False, code, sig, time.time(), n)
        if expected or self.policy != "restart" or n >= MAX_DETACHED_RESTARTS:
            return False
        self.restarts[rank] = n + 1
        log.warning("rank %s ended while detached; restarting it (failure policy)", rank)
        return True

    # -- requests --------------------------------------------------------------------
    def serve(self, host: DeskHost) -> StopAsked | None:
        """Answer every request waiting on the desk; a :class:`StopAsked` when one asked
        (and was allowed) to stop the mesh."""
        stop = None
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return stop
            ident, body = frames[0], frames[1:]
            reply, asked = self._answer(host, body)
            if isinstance(reply, DeskReply):
                out = self.codec.encode({"k": DESK_REPLY}, reply.to_json())
            else:
                out = [reply]
            try:
                self.sock.send_multipart([ident, *out], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the asker went away
            stop = asked or stop

    def _answer(
        self, host: DeskHost, body: list[bytes]
    ) -> tuple[DeskReply | bytes, StopAsked | None]:
        replayed = self.codec.replayed
        try:
            msg = self.codec.decode(body)
            if msg.header.get("k") != DESK:
                raise WireError(f"not a desk request: {msg.header.get('k')!r}")
            req = DeskRequest.from_json(bytes(msg.payload))
        except (WireError, ValueError) as exc:
            if self.codec.replayed > replayed:
                return self._refuse("replayed", "refused: a replayed request"), None
            self.refused["forged"] += 1
            log.warning("desk refused a request: %s (counted)", exc)
            return FORGED_REPLY, None
        if abs(time.time() - req.sent_at) > MAX_REQUEST_AGE:
            return self._refuse("replayed", "refused: the request is too old (replayed?)"), None
        if req.op is DeskOp.STATUS:
            return self.status(host), None
        if req.op is DeskOp.RELEASE:
            if self.holder == req.controller:
                self.lose_controller("the attach was undone")
            return self.status(host), None
        held = self._held_by_other(req.controller)
        if held is not None and not req.force:
            what = (
                "attach with --force to take it over"
                if req.op is DeskOp.ATTACH
                else ("stop it there, or use --force")
            )
            return self._refuse("held", f"the mesh is attached to {held.describe()}; {what}"), None
        if req.op is DeskOp.STOP:
            return self.status(host), StopAsked(req.grace)
        if held is not None:
            host.tell_taken_over(req.controller)
        return self._attach(host, req.controller), None

    def _held_by_other(self, asker: ControllerId) -> ControllerId | None:
        holder = self.holder
        if not self.attached or holder is None or holder == asker:
            return None
        why = gone_reason(holder, self.silent.link) if self.silent is not None else None
        if why is not None:  # it just died; the clock has not noticed yet
            self.lose_controller(why)
            return None
        return holder

    def _attach(self, host: DeskHost, by: ControllerId) -> DeskReply:
        if self.holder != by:
            self.epoch += 1
        reply = self.status(host)
        self.holder, self.attached = by, True
        self.attached_at = time.monotonic()
        self.detached_since = self.keep_until = None
        self.ended.clear()
        self.restarts.clear()
        log.warning("mesh attached by %s", by.describe())
        return reply

    def _refuse(self, why: str, text: str) -> DeskReply:
        self.refused[why] += 1
        return DeskReply(
            False, text, self.holder if self.attached else None, refused=dict(self.refused)
        )

    def status(self, host: DeskHost | None = None) -> DeskReply:
        """How this host's part of the mesh is (its ranks: those running and those that
        ended while no controller held it)."""
        ranks = dict(self.ended)
        for rank, pid in (host.pids if host is not None else {}).items():
            last = self.ended.get(rank)
            if last is not None and last.pid != pid:  # restarted: how it ended before
                n = self.restarts.get(rank, 0)
                ranks[rank] = RankStatus(rank, pid, True, last.code, last.signal, last.ended_at, n)
            else:
                ranks[rank] = RankStatus(rank, pid, True)
        return DeskReply(
            True,
            holder=self.holder if self.attached else None,
            detached_since=self.detached_since,
            keep_until=self.keep_until,
            epoch=self.epoch,
            ranks=tuple(sorted(ranks.values(), key=lambda r: r.rank)),
            refused=dict(self.refused),
        )

    # -- the end ---------------------------------------------------------------------
    def close(self, cfg: AgentConfig) -> None:
        """Close the desk; stopping with no controller attached, remove what the
        controller would have: its sockets' directory and the attach file."""
        self.sock.close(0)
        close_gates(self.ctx)
        if self.attached:
            return  # the holder stopped us: it cleans up after itself
        folder = os.path.dirname(cfg.send.removeprefix("ipc://"))
        if cfg.send.startswith("ipc://") and os.path.basename(folder).startswith("mk-mesh-"):
            shutil.rmtree(folder, ignore_errors=True)
        if cfg.attach_file and os.path.basename(cfg.attach_file).startswith("monarch-mesh-"):
            try:
                os.unlink(cfg.attach_file)
            except OSError:
                pass
