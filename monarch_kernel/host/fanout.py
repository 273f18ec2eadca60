"""The host agent's socket to its own ranks: greetings and fanned-out messages.

A rank's inbox connects to this ROUTER (``ipc://<private dir>/fan``). A starting rank
says hello from a throw-away socket; our hello reaching its inbox tells it that
fanned-out messages can reach it (see ``Rank._greet_host``). A message the controller
fans out to several ranks of this host is passed on here unchanged, and never blocks:
a busy rank's messages wait in a backlog, in order, so the agent's loop keeps reading
the controller's heartbeats.

Ranks are named by their slot (their wire id), as everywhere in the host agent.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import zmq

from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.codec import NOBLOCK, limit_size
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.key_gate import KeyGate, guard

__all__ = ["RankFanOut"]

log = logging.getLogger("monarch_kernel.host")

#: A warning each time a busy rank's backlog grows by this many messages.
BACKLOG_WARN_EVERY = 100_000


class RankFanOut:
    """The ROUTER socket ranks' inboxes connect to, with its greetings and backlog.

    Invariant: a rank with a backlog gets every later message behind it (``forward``
    queues while the backlog is not empty), so each rank sees the controller's order.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        addr: str,
        codec: Codec,
        host: int,
        tag: bytes,
        curve: tuple[str, str] | None = None,
    ) -> None:
        """Bind ``addr``; ``tag``: the suffix of our ranks' routing ids; ``curve``:
        (our secret key, the key ranks' sockets present) when the mesh uses CURVE."""
        self.codec, self.host, self.tag, self.addr = codec, host, tag, addr
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown rank raises, not drops
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its id over
        limit_size(self.sock)
        if curve is not None:  # ranks' sockets are CURVE clients (our key): ours must match
            secret, public = curve
            guard(self.sock, secret, KeyGate([public]), "mk-fan")
        self.sock.bind(addr)
        #: Ranks that said hello and still wait for ours.
        self.greeted: set[int] = set()
        #: Fanned-out messages a busy rank has not taken yet (its inbox is full), in order.
        self.backlog: dict[int, deque[list[Any]]] = {}

    @property
    def busy(self) -> bool:
        """Whether something waits to be retried soon (a hello or a backlog)."""
        return bool(self.greeted or self.backlog)

    def on_greeting(self) -> None:
        """Read a starting rank's hello."""
        frames = self.sock.recv_multipart()
        try:
            hello = H.decode(self.codec.decode(frames[1:]).header)
        except (WireError, H.HeaderError) as exc:
            log.warning("host %s dropped a greeting: %s", self.host, exc)
            return
        if isinstance(hello, H.Hello) and isinstance(hello.rank, int):
            self.greeted.add(hello.rank)

    def answer_greetings(self) -> None:
        """Say hello to the inbox of every greeting rank that is routable by now."""
        hello = self.codec.encode(H.Hello().encode())
        for r in list(self.greeted):
            try:
                self.sock.send_multipart([b"r%d" % r + self.tag, *hello], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # its inbox has not connected yet (or is full)
                continue
            self.greeted.discard(r)

    def forward(self, rank: int, frames: list[Any]) -> None:
        """Pass a fanned-out message to ``rank``'s inbox, or queue it behind what it has
        not taken yet (never blocks)."""
        queue = self.backlog.get(rank)
        if queue is None:
            try:  # all or nothing: a ROUTER decides on the routing id frame
                wire_send(self.sock, frames, [b"r%d" % rank + self.tag], NOBLOCK)
                return
            except zmq.Again:  # its inbox is full: it is busy
                queue = self.backlog[rank] = deque()
            except zmq.ZMQError:  # rank not connected (dead or starting); its
                return  # death or readiness is reported separately
        queue.append(frames)
        if len(queue) % BACKLOG_WARN_EVERY == 0:
            log.warning("host %s: %d messages wait for busy rank %s", self.host, len(queue), rank)

    def flush_backlog(self) -> None:
        """Hand queued messages to the ranks that can take them now."""
        for rank, queue in list(self.backlog.items()):
            while queue:
                try:
                    wire_send(self.sock, queue[0], [b"r%d" % rank + self.tag], NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # it is gone
                    queue.clear()
                    break
                queue.popleft()
            if not queue:
                del self.backlog[rank]

    def rank_gone(self, rank: int) -> None:
        """``rank``'s process exited: what waited for it is dropped (a restarted rank
        starts afresh)."""
        self.backlog.pop(rank, None)
