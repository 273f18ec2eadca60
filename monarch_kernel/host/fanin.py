"""The host agent's fan-in socket: its ranks' answers to fanned-out requests, combined
into one ``fan_in`` message per request (see :mod:`monarch_kernel.wire.fanin`).

Ranks push their signed messages for such a request to a PULL socket in the agent's
private directory. Output chunks and small replies go into the request's
:class:`~monarch_kernel.wire.fanin.Batch`; anything else (a display, a metric, an
``input``, a large value in chunks) goes on to the controller unchanged, right after
what the batch held for its request, so each rank's messages keep their order.

The ranks' once-a-second ``stats`` come here too: the latest of each rank is kept and
all of them go on as one ``host_stats`` message a second (:data:`STATS_EVERY`), so the
controller's idle traffic grows with hosts, not ranks. A rank's stats wait at most that
long; a dead rank's are dropped (its death says more). The GPU each rank is on goes with
them, when the agent samples its GPUs (``gpu``: :mod:`~.gpu_stats`).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import zmq

from monarch_kernel.host.step_fanin import StepFanIn
from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import NOBLOCK, limit_size, readable
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.fanin import MAX_COMBINED, FanIn, Part, encode_parts
from monarch_kernel.wire.key_gate import KeyGate, guard
from monarch_kernel.wire.reports import GpuStats

log = logging.getLogger("monarch_kernel.host")

#: The longest one :meth:`FanInSocket.receive` takes messages off the socket (s), and
#: the most it takes: ranks that keep sending (a flood of output, a large value in
#: chunks passed on) must not hold up the rest of the agent's loop, its heartbeats,
#: a ``kill_ranks`` or a rank's exit report; what is left is taken next time round.
RECEIVE_BUDGET = 0.02
RECEIVE_MAX = 256
#: Seconds between two ``host_stats`` messages (the ranks send theirs once a second).
STATS_EVERY = 1.0

#: ``send(header, payload)``: the agent's send to its controller.
Send = Callable[[H.WireHeader, bytes], None]
#: ``gpu(ranks)``: rank -> the GPU stats of those of ``ranks`` that are on a GPU.
GpuOf = Callable[[Collection[int]], Mapping[int, GpuStats]]


class FanInSocket:
    """The PULL socket ranks send fan-in messages to, and the batches they fill."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        codec: Codec,
        host: int,
        out: zmq.Socket[bytes],
        send: Send,
        curve: tuple[str, str] | None = None,
        gpu: GpuOf | None = None,
    ):
        """``address``: where to bind (``ipc://`` in the private directory); ``out``:
        the agent's socket to the controller (messages passed on unchanged); ``send``:
        the agent's signed send; ``curve``: ``(secret, public)`` of the host on a CURVE
        mesh (the ranks connect as CURVE clients with that key, as to the fan-out);
        ``gpu``: the ranks' GPU stats, sent with theirs (None: none)."""
        self.codec = codec
        self.gpu = gpu
        self.host = host
        self.out = out
        self._send = send
        self.table = FanIn()
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.sock)
        if curve is not None:
            guard(self.sock, curve[0], KeyGate([curve[1]]), "mk-fanin")
        self.sock.bind(address)
        self.address = address
        #: ``fan_in`` messages sent, and rank messages that went into them.
        self.sent = 0
        self.combined = 0
        #: rank -> its latest ``stats`` payload not sent on yet, and when they go.
        self.stats: dict[int, bytes] = {}
        self._stats_due: float | None = None
        #: The ranks' step telemetry, sent on per host (``host.step_fanin``).
        self.steps = StepFanIn(host, send)

    def expect(self, request: str, ranks: list[int]) -> None:
        """The controller fanned ``request`` out to ``ranks`` (ours) and waits for replies."""
        if ranks:
            self.table.expect(request, ranks)

    def rank_gone(self, rank: int) -> None:
        """``rank`` died: its batches go without it (the controller names it). Call it
        before reporting the death: what the rank sent first goes first (see
        :meth:`FanIn.rank_gone`), taken off the socket here if it waits there still."""
        self.receive()
        for request, parts in self.table.rank_gone(rank):
            self.send_parts(request, parts)
        self.stats.pop(rank, None)

    def timeout_ms(self, longest: int) -> int:
        """How long the agent's poll may wait: until the next batch is due."""
        deadline = self.table.next_deadline()
        if self.steps.due is not None:
            deadline = self.steps.due if deadline is None else min(deadline, self.steps.due)
        if self._stats_due is not None:
            deadline = self._stats_due if deadline is None else min(deadline, self._stats_due)
        if deadline is None:
            return longest
        left = int((deadline - time.monotonic()) * 1000) + 1
        return max(0, min(longest, left))

    def receive(self) -> None:
        """Take the messages waiting on the socket (at most :data:`RECEIVE_MAX`, for at
        most :data:`RECEIVE_BUDGET` seconds), then send the batches that are due."""
        deadline = time.monotonic() + RECEIVE_BUDGET
        sock = self.sock
        # readable() first: ending the loop on a raised zmq.Again costs more than the
        # message it follows (and the backend's recv skips the sugar layer's enums).
        for _ in range(RECEIVE_MAX):
            if not readable(sock):
                break
            try:
                frames = wire_recv(sock, NOBLOCK)
            except zmq.Again:  # (only this thread reads it: not expected)
                break
            self.on_message(frames)
            if time.monotonic() >= deadline:
                break  # the poll reports the socket readable again at once
        self.send_due()

    def on_message(self, frames: list[Any]) -> None:
        """One rank message: into its request's batch, or on to the controller."""
        try:
            msg = self.codec.decode(frames)
        except WireError as exc:
            log.warning("host %s dropped a fan-in message: %s", self.host, exc)
            return
        h = msg.header
        kind, request, rank = h.get("k"), h.get("i"), h.get("r")
        now = time.monotonic()
        if kind == K.STEPS and isinstance(rank, int):
            self.steps.add(rank, bytes(msg.payload))
            return
        if kind == K.STATS and isinstance(rank, int):
            if self._stats_due is None:
                self._stats_due = now + STATS_EVERY
            self.stats[rank] = bytes(msg.payload)
            return
        if not isinstance(request, str) or not isinstance(rank, int):
            self.pass_on(None, frames)
            return
        if kind == K.STREAM and isinstance(h.get("n"), str):
            self.table.stream(request, rank, h["n"], bytes(msg.payload), now)
            self.combined += 1
        elif (
            kind == K.RESULT
            and "b" not in h
            and "z" not in h  # a large value's stream start: its chunks follow
            and len(msg.payload) <= MAX_COMBINED
        ):
            self.table.result(request, rank, bool(h.get("ok")), bytes(msg.payload), now)
            self.combined += 1
        elif kind == K.FAN_DIRECT:
            self.table.answered_elsewhere(request, rank)
        else:
            self.pass_on(request, frames)
            if kind == K.RESULT:
                self.table.answered_elsewhere(request, rank)

    def pass_on(self, request: str | None, frames: list[Any]) -> None:
        """Send a rank's message on unchanged (still signed by the rank), after what
        ``request``'s batch holds."""
        if request is not None:
            self.send_parts(request, self.table.take(request))
        wire_send(self.out, frames)

    def send_due(self) -> None:
        """Send the batches that are complete or whose window is over, and the ranks'
        stats once a second."""
        now = time.monotonic()
        for request, parts in self.table.due(now):
            self.send_parts(request, parts)
        self.steps.send_due(now)
        if self._stats_due is not None and now >= self._stats_due:
            stats, self.stats, self._stats_due = self.stats, {}, None
            if stats:
                gpu = dict(self.gpu(stats.keys())) if self.gpu is not None else {}
                if gpu:
                    header = H.HostStats(host=self.host, gpu=True).encode()
                    self._send(header, pickle.dumps((stats, gpu)))
                else:
                    self._send(H.HostStats(host=self.host).encode(), pickle.dumps(stats))

    def send_parts(self, request: str, parts: list[Part]) -> None:
        if parts:
            self._send(H.FanIn(host=self.host, request=request).encode(), encode_parts(parts))
            self.sent += 1

    def close(self) -> None:
        self.sock.close(0)


__all__ = ["FanInSocket"]
