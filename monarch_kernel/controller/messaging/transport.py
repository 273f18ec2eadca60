"""The controller's sockets of one mesh and every path a message leaves by.

Two ROUTER sockets per mesh keep the hot path free of thread hand-offs:

* ``send`` ROUTER: callers send on it directly from their own thread, under a lock
  (ranks' inbox and control DEALERs and host agents connect here; routing ids ``r<N>``,
  ``c<N>`` and ``h<N>``, ``N`` the rank's or host's *slot*: see ``records.Slots``);
* ``recv`` ROUTER: results, streams, metrics and deaths, read by the holder of the
  receive token (:mod:`.receiver`). Two inproc DEALERs connect
  to it too, to wake whichever thread blocks on it.

A multi-rank message goes once per host to the host agent, which fans it out, when the
payload is large or many ranks of that host are targeted; otherwise it goes to each rank
directly. Per-rank sequence numbers (header ``q``) keep delivery FIFO whichever path is
taken. Callers name ranks and hosts by their logical index; what goes on the wire
(routing ids, the ``d`` lists of fan-outs and batches) is their slot, and sequence
numbers are kept per slot (per process): a renumbering changes none of them.

Flow control (a send never blocks): a busy peer's messages wait in the controller
(:mod:`.backlog`); past its bounds, a caller that sends waits for
room. The thread that holds the receive token never waits (it must keep reading the
replies that drain the ranks). Socket plumbing: :mod:`.sockets`;
routing ids, CURVE keys and impostors: :mod:`.routing_ids`.

Size: over the ~450-line habit: every send path (direct, fanned out, batched, with flow
control) shares the send lock, the per-rank sequence numbers and the backlogs; split,
each part would need all three and the lock's invariant would be stated in several
places. Socket plumbing is ``sockets``, batching ``batching``, flow control ``backlog``.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.messaging.backlog import (
    FLUSH_INTERVAL,
    MAX_BACKLOG_BYTES,
    MAX_BACKLOG_MESSAGES,
    Backlog,
    BackpressureError,
)
from monarch_kernel.controller.messaging.batching import Batcher, batch_payload, batchable
from monarch_kernel.controller.messaging.lanes import Lanes
from monarch_kernel.controller.messaging.routing_ids import RoutingIds
from monarch_kernel.controller.messaging.sigint import DeferSigint
from monarch_kernel.controller.messaging.sockets import (
    CurveKeys,
    Endpoints,
    bind,
    private_ipc_dir,
    rebind,
    wake_socket,
)
from monarch_kernel.controller.state.records import HostInfo, RankInfo, Slots
from monarch_kernel.launchers.base import Curve, curve_server, zap
from monarch_kernel.wire import Codec, arena, handoff
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire import lane as L
from monarch_kernel.wire.chunks import encode_parts, frames_size
from monarch_kernel.wire.codec import Buffer, Header, limit_size

log = logging.getLogger("monarch_kernel.controller")

#: Fan a message out through the host agent when it is at least this large ...
FANOUT_MIN_BYTES = 256 * 1024
#: ... or when at least this many ranks of one host are targeted ...
FANOUT_MIN_RANKS = 8
#: ... but on a mesh with same-machine lanes (:mod:`.lanes`), a message to fewer ranks
#: than this goes to each rank directly: measured on 2 CPUs, a gathered call to 16 local
#: ranks sent down their lanes took 0.77 of the time it took through the host agent
#: (5.8 against 7.5 ms), to 32 ranks 0.74, to 8 about as long (2.1 against 2.0 ms).
#: (A message to more ranks still goes through the agents.)
FANOUT_MIN_RANKS_LANES = 32

# Re-exported: where the flow control's figures and the socket records were first found.
__all__ = [
    "FLUSH_INTERVAL",
    "MAX_BACKLOG_BYTES",
    "MAX_BACKLOG_MESSAGES",
    "BackpressureError",
    "CurveKeys",
    "Endpoints",
    "Transport",
]

#: Routing ids of the inproc sockets that wake the thread receiving on the recv socket
#: (a message from them only means "look at your conditions again").
WAKE_ID = b"mk-wake"
SIGINT_ID = b"mk-sigint"


class Transport:
    """Sockets, addresses and send paths of one mesh's controller side."""

    def __init__(
        self,
        name: str,
        codec: Codec,
        ranks: list[RankInfo],
        bind: str,
        reuse: Endpoints | None = None,
        hosts: list[HostInfo] | None = None,
        slots: Slots | None = None,
        lanes: bool = True,
    ):
        """``bind``: a host address (tcp on a random port, within ``$MONARCH_KERNEL_PORTS``
        when set), a full ``tcp://`` or ``ipc://`` endpoint, or ``"ipc"`` for unix
        sockets in a private (0700) directory (falls back to tcp on 127.0.0.1 where unix
        sockets are unusable).

        Every tcp socket is a CURVE server with a fresh per-mesh keypair (:attr:`curve`);
        a ZAP handler admits only the client keys added to ``curve.allowed``.

        ``reuse``: bind the unix sockets an earlier controller of this (detachable)
        mesh listened on. ``hosts`` and ``slots``: the mesh's host records and its map
        of wire ids (made from ``ranks`` and one host per rank host when not given).
        ``lanes``: offer the ranks same-machine lanes (:mod:`.lanes`) where the mesh is
        on unix sockets (not for a detachable mesh, whose ranks outlive this process).

        Long on purpose: most of it is the sockets' options and the state every send path shares,
        each with its comment.
        """
        self.name = name
        self.codec = codec
        self._ranks = ranks
        if hosts is None:
            hosts = [HostInfo(h) for h in range(max((i.host for i in ranks), default=-1) + 1)]
        self._hosts = hosts
        self._slots = slots if slots is not None else Slots(ranks, hosts)
        #: Where this controller's sequence numbers start (see ``wire.kinds.SEQ_EPOCH``).
        self.seq_base = 0
        #: rank slot -> the sequence number of its next ordered message (absent: the base)
        self.next_seq: dict[int, int] = {}
        self.send_lock = threading.Lock()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.send_sock = ctx.socket(zmq.ROUTER)
        self.send_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.send_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank reuses its id
        self.send_sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.send_sock)  # peers never send here: bound what one can queue
        self.recv_sock = ctx.socket(zmq.ROUTER)
        self.recv_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.recv_sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.recv_sock)  # ZMQ_MAXMSGSIZE: no frame above it is allocated
        self._ipc_dir = reuse.ipc_dir if reuse else private_ipc_dir() if bind == "ipc" else None
        #: Shared memory for large arguments (wire.arena): on unix sockets every rank is
        #: on this machine. None: everything goes over the sockets.
        self.arena = (
            arena.Arena.create(lend=True) if self._ipc_dir is not None and arena.enabled() else None
        )
        #: Same-machine lanes to the ranks (:mod:`.lanes`; on unix sockets only), or None.
        self.lanes = self._make_lanes() if lanes and self._ipc_dir is not None else None
        self._zap_domain = f"mk-{name}-{id(self):x}"
        #: Routing ids, admitted CURVE keys and impostors (controller.messaging.routing_ids).
        self.ids = RoutingIds(name, ranks, hosts, self._slots)
        self.send_addr, self.recv_addr = self._bind(bind, reuse)
        wake_addr = f"inproc://mk-wake-{id(self)}"
        self.recv_sock.bind(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_sock = wake_socket(ctx, WAKE_ID, wake_addr)
        self._sigint_sock = wake_socket(ctx, SIGINT_ID, wake_addr)  # main thread only
        # Flow control (controller.messaging.backlog); the backlogs change under send_lock.
        self._backlog = Backlog(name, self.send_sock, self.wake)
        #: Fire-and-forget calls not sent yet (:meth:`send_fire`; under send_lock).
        self._batch = Batcher()
        #: Told when a call starts a new batch: make the I/O thread flush (set by the
        #: mesh's receiver; until then the caller sends at once).
        self.on_batch: Callable[[], None] | None = None
        #: How many ranks the last :meth:`send` went to (the receiver's spin looks).
        self.last_width = 1
        #: Calls sent in ``batch`` messages, and those messages (statistics, tests).
        self.batched_calls = 0
        self.batches_sent = 0

    @staticmethod
    def _make_lanes() -> Lanes | None:
        if not L.supported():
            return None
        try:
            return Lanes()
        except OSError as exc:
            log.info("no same-machine lanes: %s", exc)
            return None

    def _bind(self, address: str, reuse: Endpoints | None = None) -> tuple[str, str]:
        """Bind both ROUTERs (CURVE servers on tcp); their addresses. On failure the
        sockets are closed and :class:`MeshStartError` says why."""
        if self._ipc_dir is None and (reuse is None or reuse.curve is not None):
            keys = reuse.curve if reuse is not None else None
            curve = self.ids.take_keys(keys) if keys is not None else Curve.new()
            self.ids.curve = curve
            for sock in (self.send_sock, self.recv_sock):
                curve_server(sock, curve, self._zap_domain)
        try:
            if reuse is not None:  # an earlier controller's sockets
                rebind(self.send_sock, reuse.send)
                rebind(self.recv_sock, reuse.recv)
                return reuse.send, reuse.recv
            if self._ipc_dir is not None:
                send_addr = bind(self.send_sock, f"ipc://{self._ipc_dir}/send")
                return send_addr, bind(self.recv_sock, f"ipc://{self._ipc_dir}/recv")
            address = "127.0.0.1" if address == "ipc" else address
            return bind(self.send_sock, address), bind(self.recv_sock, address)
        except (zmq.ZMQError, ValueError) as exc:  # ValueError: a bad $MONARCH_KERNEL_PORTS
            self.send_sock.close()
            self.recv_sock.close()
            if reuse is None:
                self._remove_ipc_dir()
            elif getattr(exc, "errno", None) == zmq.EADDRNOTAVAIL:
                raise MeshStartError(
                    f"the mesh's hosts connect to its controller at {reuse.send}, an address "
                    "this machine does not have: attach from the machine whose kernel held "
                    "it (or one that took over its address)"
                ) from None
            raise MeshStartError(
                f"cannot bind the controller sockets on {bind}: {exc}. "
                "Pick another address or free the port."
            ) from None

    @property
    def curve(self) -> Curve | None:
        """The mesh's CURVE keys when it listens on tcp (None on unix sockets)."""
        return self.ids.curve

    # -- sending -----------------------------------------------------------------------
    def send_host(self, host: int, header: Header, payload: bytes = b"") -> None:
        """Send to (logical) host agent ``host`` (lost messages to a gone agent are
        dropped)."""
        self.send_host_slot(self._hosts[host].slot, header, payload)

    def send_host_slot(self, slot: int, header: Header, payload: bytes = b"") -> None:
        """Send to the host agent of slot ``slot`` (one that may have left the records:
        a removed host told to stop)."""
        frames = self.codec.encode(header, payload)
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            self._backlog.deliver(self.ids.host_slot_id(slot), frames, len(payload))

    def heartbeat(self, slot: int) -> None:
        """A heartbeat to the host agent of slot ``slot``, unless it has not read what
        was sent."""
        ident = self.ids.host_slot_id(slot)
        with self.send_lock:
            if ident not in self._backlog:
                self._backlog.deliver(ident, self.codec.encode({"k": K.HEARTBEAT}), 0)

    def trim_arena(self) -> None:
        """Give back the arena's memory that large arguments left idle a while
        (``Arena.trim``; the I/O thread's tick)."""
        shared = self.arena
        if shared is not None and shared.backed() > arena.KEEP_BYTES:
            with self.send_lock:
                shared.trim()

    def send(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Send one message to ``ranks``' main threads (in order, FIFO per rank); never
        blocks (callers make room first: :meth:`wait_for_room`). A large one goes as a
        stream of chunks (:mod:`monarch_kernel.wire.chunks`). Returns once libzmq let go
        of the zero-copy ``buffers`` (:mod:`monarch_kernel.wire.handoff`): the caller may
        change them then without changing what is sent."""
        # the hand-off's wait comes after the lock is released
        handoff.sending(buffers, self._lock_and_send, ranks, header, payload, buffers)

    def _lock_and_send(
        self, ranks: Sequence[int], header: Header, payload: bytes, buffers: Sequence[Buffer]
    ) -> None:
        with self.send_lock, DeferSigint():
            if self._batch:  # calls queued earlier go first (FIFO per rank)
                self._send_batch()
            self._send(ranks, header, payload, buffers)

    def send_fire(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Send a fire-and-forget call to ``ranks`` (in order with everything else sent
        to them). A small one joins the calls that the I/O thread has not sent yet, and
        that thread is told to send them now (:meth:`flush`): calls made back to back
        while it is busy travel as one ``batch`` message per rank or host. Nothing waits
        for more calls to come; any other send, and a full batch, sends them at once."""
        if self.on_batch is None or not batchable(header, payload, buffers):
            self.send(ranks, header, payload, buffers)
            return
        # No DeferSigint (two signal() calls) around the append: an interrupt there at
        # worst leaves the batch to the I/O thread's next round (it flushes every loop).
        with self.send_lock:
            first = not self._batch
            if self._batch.add(ranks, header, payload):
                with DeferSigint():
                    self._send_batch()
                return
        if first:
            self.on_batch()

    def _send_batch(self) -> None:
        """Send the waiting calls: one message per set of ranks (send_lock held)."""
        for ranks, calls in self._batch.take():
            if len(calls) == 1:
                header, payload = calls[0]
                self._send(ranks, header, payload, ())
                continue
            payload = batch_payload(calls)
            for r in ranks:
                self._ranks[r].bytes_out += len(payload)
            by_host: dict[int, list[int]] = {}
            for r in ranks:
                by_host.setdefault(self._ranks[r].host, []).append(r)
            n = len(calls)
            self.batched_calls += n * len(ranks)
            for host, group in by_host.items():
                seqs = [self._take_seq(r) for r in group]
                d = [self._ranks[r].slot for r in group]
                header = {"k": K.BATCH, "n": n, "d": d, "q": seqs}
                if len(group) >= self._fanout_ranks(len(ranks)) or (
                    len(group) > 1 and len(payload) >= FANOUT_MIN_BYTES
                ):
                    header["f"] = 1
                    frames = self.codec.encode(header, payload)
                    self._backlog.deliver(
                        self.ids.host_id(host), frames, len(payload), n * len(group)
                    )
                    self.batches_sent += 1
                    continue
                # one encoding for every rank of the group: each finds its ``q`` by ``d``
                frames = self.codec.encode(header, payload)
                lanes = self.lanes
                for r, slot, seq in zip(group, d, seqs):
                    if lanes is not None and lanes.send(slot, (frames,)):
                        continue
                    if not self._backlog.deliver(self.ids.rank_id(r), frames, len(payload), n):
                        self._untake_seq(r, seq)
                self.batches_sent += len(group)

    def _send(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
    ) -> None:
        """:meth:`send`'s work, send_lock held and no batch waiting.

        Long on purpose: the hot send path, one loop over the ranks with the fan-out and shared-
        memory choices inlined (measured by ``make bench``).
        """
        self.last_width = width = len(ranks)
        if width == 1:
            r = ranks[0]
            header["q"] = seq = self._take_seq(r)
            shared = 0
            if buffers and self.arena is not None:
                shared, buffers = self._share(header, buffers, (self._ranks[r].slot,))
            sent = self._deliver_parts(
                self.ids.rank_id(r),
                encode_parts(self.codec, header, payload, buffers),
                self._ranks[r].slot,
            )
            if sent is None:
                self._untake_seq(r, seq)
            else:
                self._ranks[r].bytes_out += shared + sent
            return
        size = len(payload) + (sum(memoryview(b).nbytes for b in buffers) if buffers else 0)
        # One pass over the ranks (this runs per rank of a gathered call): per host, its
        # ranks with their slots and next sequence numbers (what _take_seq does).
        infos, next_seq, base = self._ranks, self.next_seq, self.seq_base
        by_host: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for r in ranks:
            info = infos[r]
            info.bytes_out += size
            slot = info.slot
            q = next_seq.get(slot, base)
            next_seq[slot] = q + 1
            entry = by_host.get(info.host)
            if entry is None:
                entry = by_host[info.host] = ([], [], [])
            entry[0].append(r)
            entry[1].append(slot)
            entry[2].append(q)
        # The buffers once into the arena for all of them, when they fit: the flags in
        # host order, each message naming its first (``si``); what is sent is then small.
        wire_size, shared = size, False
        if buffers and self.arena is not None:
            readers = [slot for _, slots, _ in by_host.values() for slot in slots]
            placed, buffers = self._share(header, buffers, readers)
            shared = placed > 0
            if shared:
                wire_size = len(payload)
        first = 0
        for host, (group, slots, seqs) in by_host.items():
            many = len(group) > 1
            fanout = many and (
                wire_size >= FANOUT_MIN_BYTES or len(group) >= self._fanout_ranks(width)
            )
            if fanout or (many and self.lanes is not None):
                # One encoding for the group, each rank finding its ``q`` (and its arena
                # flag) by its slot in ``d``: to the host agent, which forwards it to each
                # (a fan-out, answered through the agent); or, with lanes, the same frames
                # to each rank directly (down its lane, or over its socket where the lane
                # has no room), answered directly.
                h = dict(header, d=slots, q=seqs)
                if shared:
                    h["si"] = first
                if fanout:
                    h["f"] = 1
                    route = {"f": 1, "d": slots}
                    parts = encode_parts(self.codec, h, payload, buffers, route)
                    self._deliver_parts(self.ids.host_id(host), parts)
                else:
                    parts = encode_parts(self.codec, h, payload, buffers)
                    for r, slot, seq in zip(group, slots, seqs):
                        if self._deliver_parts(self.ids.rank_id(r), parts, slot) is None:
                            self._untake_seq(r, seq)
            else:
                for i, (r, slot, seq) in enumerate(zip(group, slots, seqs)):
                    h = dict(header, q=seq)
                    if shared:
                        h["si"] = first + i
                    parts = encode_parts(self.codec, h, payload, buffers)
                    if self._deliver_parts(self.ids.rank_id(r), parts, slot) is None:
                        self._untake_seq(r, seq)
            first += len(group)

    def _fanout_ranks(self, width: int) -> int:
        """From how many ranks of one host a message to ``width`` ranks in all goes
        through the host's agent (see :data:`FANOUT_MIN_RANKS_LANES`)."""
        if self.lanes is None or width >= FANOUT_MIN_RANKS_LANES:
            return FANOUT_MIN_RANKS
        return FANOUT_MIN_RANKS_LANES

    def _share(
        self, header: Header, buffers: Sequence[Buffer], readers: Sequence[int]
    ) -> tuple[int, Sequence[Buffer]]:
        """Put ``buffers`` in the arena for ``readers`` (slots, in flag order) and say where
        in ``header``: (their bytes, no buffers left to send); or (0, ``buffers``) where
        they go over the socket (too small, too large, the arena full)."""
        assert self.arena is not None
        where = self.arena.place(buffers, readers, self._dead_slots)
        if where is None:
            header.pop("sh", None)  # a header sent before: its block is not this one's
            return 0, buffers
        header["sh"] = where
        return sum(where["z"]), ()

    def _dead_slots(self) -> list[int]:
        """The wire ids of the ranks that died and were not started again (yet)."""
        return [info.slot for info in self._ranks if not info.alive]

    def _deliver_parts(
        self, ident: bytes, parts: list[list[Buffer]], slot: int | None = None
    ) -> int | None:
        """Deliver a message's parts (one, or a stream's start and chunks) in order,
        down the lane of rank ``slot`` where it has one in use and room; their size in
        bytes, or None when ``ident`` is not connected (nothing of it went; send_lock
        held)."""
        lanes = self.lanes
        if slot is not None and lanes is not None and lanes.send(slot, parts):
            return sum([frames_size(frames) for frames in parts])
        total = 0
        for frames in parts:
            size = frames_size(frames)
            if not self._backlog.deliver(ident, frames, size):
                return None if total == 0 else total
            total += size
        return total

    def _take_seq(self, r: int) -> int:
        slot = self._ranks[r].slot
        q = self.next_seq.get(slot, self.seq_base)
        self.next_seq[slot] = q + 1
        return q

    def _untake_seq(self, r: int, seq: int) -> None:
        """Rank ``r``'s message numbered ``seq`` was dropped (its inbox is not connected:
        a rank starting again, or gone): the next one takes that number. A rank holds
        back every message after a missing number, so a number given to a message it
        never got would leave its next incarnation waiting forever (send_lock held)."""
        slot = self._ranks[r].slot
        if self.next_seq.get(slot) == seq + 1:
            self.next_seq[slot] = seq

    def set_epoch(self, epoch: int) -> None:
        """Number this controller's messages from ``epoch * SEQ_EPOCH`` (the ``epoch``-th
        controller to attach to a detachable mesh; before anything is sent)."""
        with self.send_lock:
            self.seq_base = epoch * K.SEQ_EPOCH
            self.next_seq = {}

    def rekey(self, change: Callable[[], None]) -> None:
        """Run ``change`` (which rewrites the rank and host records: a renumbering) with
        nothing being sent meanwhile; calls batched under the old numbers go first."""
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            change()

    def forget_ranks(self, ranks: Sequence[int]) -> None:
        """These (logical) ranks leave the mesh: drop their counters and what waits for
        them (send_lock held: called from :meth:`rekey`'s change, before the records
        are rewritten)."""
        for r in ranks:
            self.next_seq.pop(self._ranks[r].slot, None)
            self._backlog.drop(self.ids.rank_id(r))
            self._backlog.drop(self.ids.rank_id(r, b"c"))
            if self.lanes is not None:
                self.lanes.drop(self._ranks[r].slot)
        if self.arena is not None:
            self.arena.release([self._ranks[r].slot for r in ranks])

    @property
    def ipc_dir(self) -> str | None:
        """The private directory of the unix sockets (None on tcp)."""
        return self._ipc_dir

    def reset_seq(self, rank: int) -> None:
        """A restarted rank counts its messages from the base again; what was queued
        for its previous incarnation is dropped."""
        with self.send_lock:
            if self._batch:  # sent to its previous incarnation, like what came before
                self._send_batch()
            self.next_seq.pop(self._ranks[rank].slot, None)
            self._backlog.drop(self.ids.rank_id(rank))
            self._backlog.drop(self.ids.rank_id(rank, b"c"))
            if self.lanes is not None:  # read what the previous incarnation sent, then closed
                self.lanes.drop(self._ranks[rank].slot)
            if self.arena is not None:  # what the previous incarnation did not read
                self.arena.release([self._ranks[rank].slot])

    # -- same-machine lanes (:mod:`.lanes`) -----------------------------------------------
    def offer_lane(self, rank: int) -> None:
        """Offer (logical) rank ``rank``, ready now, a lane: an ordered ``lane`` message
        over the socket (nothing where the mesh has no lanes, or none can be made)."""
        lanes = self.lanes
        if lanes is None:
            return
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            offer = lanes.offer(self._ranks[rank].slot, self.ids.rank_id(rank))
            if offer is None:
                return
            header = H.Lane(
                path=offer.path,
                wake=offer.wake,
                bell=offer.bell,
                capacity=offer.capacity,
                controller=offer.pid,
            ).encode()
            self._send([rank], header, b"", ())

    def lane_backlog(self, slot: int) -> list[list[Any]]:
        """The messages of the lanes not handled yet, those of rank ``slot`` included
        (its death is about to be handled: what it sent before comes first)."""
        return [] if self.lanes is None else self.lanes.take_all(slot)

    def lane_on(self, slot: int) -> bool:
        """The rank of ``slot`` took its lane (its ``lane_on`` came): use it both ways."""
        lanes = self.lanes
        if lanes is None:
            return False
        with self.send_lock:
            return lanes.activate(slot)

    def send_control(
        self, rank: int, header: Header, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> None:
        """Send to a rank's control thread (served even while its main thread is busy);
        a large value as a stream of chunks."""
        parts = encode_parts(self.codec, header, payload, buffers)
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            self._ranks[rank].bytes_out += (
                self._deliver_parts(self.ids.rank_id(rank, b"c"), parts) or 0
            )

    # -- flow control (controller.messaging.backlog) -------------------------------------------
    @property
    def backlog_messages(self) -> int:
        """Calls waiting in the controller for busy peers (a batch: the calls in it)."""
        return self._backlog.messages

    @property
    def backlog_bytes(self) -> int:
        return self._backlog.nbytes

    @property
    def backlogged(self) -> bool:
        """Whether some peer has messages waiting in the controller."""
        return bool(self._backlog) or bool(self._batch)

    def flush(self) -> bool:
        """Send the waiting batch of calls, and what backlogged peers can take now; True
        while some is still queued."""
        if self._batch:
            with self.send_lock, DeferSigint():
                if self._batch:
                    self._send_batch()
        if not self._backlog:
            return False
        with self.send_lock:
            return self._backlog.flush()

    def wait_for_room(self, wait: bool = True) -> None:
        """Return when the backlogs are under their bounds (at once, almost always);
        interruptible (see :meth:`.Backlog.wait_for_room`)."""
        self._backlog.wait_for_room(wait)

    def probe(self, identities: list[bytes], timeout: float = 10.0) -> bool:
        """Wait until the send socket can route to ``identities`` (False: some could
        not be reached in ``timeout`` seconds).

        A peer announces itself on the receive socket; its connection to the send socket
        is made independently and may lag by a moment. Nothing is sent to it before.
        """
        deadline = time.monotonic() + timeout
        for ident in identities:
            # one encoding per identity: r<R> and c<R> are one process, whose codec
            # drops a second copy of the same signed message as a replay
            frames = self.codec.encode({"k": K.HELLO})
            while True:
                with self.send_lock, DeferSigint():
                    try:
                        self.send_sock.send_multipart([ident, *frames])
                        break
                    except zmq.ZMQError:
                        pass
                if time.monotonic() > deadline:
                    log.warning("mesh %s: peer %r is not reachable", self.name, ident)
                    return False
                time.sleep(0.001)
        return True

    # -- waking the receiving thread -----------------------------------------------------
    def wake(self) -> None:
        """Make the thread receiving on the recv socket (if any) look at its conditions."""
        with self._wake_lock:
            try:
                self._wake_sock.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # queue full: the receiver has wake-ups enough; closed: stopping

    def wake_from_sigint(self) -> None:
        """:meth:`wake` for a SIGINT handler (main thread, no lock)."""
        # Python runs signal handlers in the main thread only, so this socket (used by
        # nobody else) needs no lock, which the interrupted code might hold.
        try:
            self._sigint_sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- closing -------------------------------------------------------------------------
    def close(self, keep_addresses: bool = False) -> None:
        """Close every socket and remove the private directory (nobody receives now);
        ``keep_addresses``: keep the directory (a detachable mesh's next controller
        binds there)."""
        self._backlog.close()
        with self.send_lock:
            self._batch.clear()
            self._backlog.clear()
            if self.arena is not None:
                self.arena.close()
            if self.lanes is not None:
                self.lanes.close()
        for sock in (self.send_sock, self.recv_sock, self._wake_sock, self._sigint_sock):
            sock.close(0)
        if self.curve is not None:
            zap(self._zap_domain, None)
        if not keep_addresses:
            self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
