"""The controller's sockets of one mesh and every path a message leaves by.

Two ROUTER sockets per mesh keep the hot path free of thread hand-offs:

* ``send`` ROUTER: callers send on it directly from their own thread, under a lock
  (ranks' inbox and control DEALERs and host agents connect here; routing ids ``r<N>``,
  ``c<N>`` and ``h<N>``);
* ``recv`` ROUTER: results, streams, metrics and deaths, read by the holder of the
  receive token (:mod:`monarch_kernel.controller.receiver`). Two inproc DEALERs connect
  to it too, to wake whichever thread blocks on it.

A multi-rank message goes once per host to the host agent, which fans it out, when the
payload is large or many ranks of that host are targeted; otherwise it goes to each rank
directly. Per-rank sequence numbers (header ``q``) keep delivery FIFO whichever path is
taken.

Flow control (a send never blocks): every message is sent without blocking. When a
peer's queue is full (a busy rank has not read its inbox: ZeroMQ holds about
``SNDHWM`` + ``RCVHWM`` messages), the message goes to a per-peer *backlog* in the
controller instead, and every later message for that peer queues behind it (FIFO). The
I/O thread retries backlogs every :data:`FLUSH_INTERVAL` until they drain. So heartbeats,
deaths and the other ranks and meshes keep flowing while one rank is busy. The backlogs
are bounded (:data:`MAX_BACKLOG_MESSAGES`, :data:`MAX_BACKLOG_BYTES`): past that, a caller
that sends waits (interruptibly: Ctrl-C and stopping the mesh release it) until there is
room, or gets :class:`BackpressureError` if it asked not to wait. The thread that holds
the receive token never waits (it must keep reading the replies that drain the ranks).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from monarch_kernel.calls.errors import MeshStartError, MeshStoppedError, MonarchError
from monarch_kernel.controller.batching import Batcher, batch_payload, batchable
from monarch_kernel.controller.records import RankInfo
from monarch_kernel.controller.sigint import DeferSigint
from monarch_kernel.launchers.base import Curve, curve_server, zap
from monarch_kernel.wire import Codec
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.chunks import encode_parts, frames_size
from monarch_kernel.wire.codec import Buffer, Header, limit_size
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire.ports import bind_port
from monarch_kernel.wire.tempdirs import mark_owners

log = logging.getLogger("monarch_kernel.controller")

#: Fan a message out through the host agent when it is at least this large ...
FANOUT_MIN_BYTES = 256 * 1024
#: ... or when at least this many ranks of one host are targeted.
FANOUT_MIN_RANKS = 8

#: How often the I/O thread retries sending to peers whose queues were full.
FLUSH_INTERVAL = 0.002
#: Bounds on what the controller keeps queued for peers with full queues; past either,
#: senders wait for room.
MAX_BACKLOG_MESSAGES = 100_000
MAX_BACKLOG_BYTES = 256 * 1024 * 1024

_NOBLOCK = int(zmq.NOBLOCK)

#: Routing ids of the inproc sockets that wake the thread receiving on the recv socket
#: (a message from them only means "look at your conditions again").
WAKE_ID = b"mk-wake"
SIGINT_ID = b"mk-sigint"


class BackpressureError(MonarchError):
    """The controller's queues for busy ranks are full and the caller asked not to wait."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE mesh's keys, as a controller that attaches takes them over: the server
    keypair, and per host the client key it admits and the routing-id tag (z85/str)."""

    public: str
    secret: str
    hosts: dict[int, tuple[str, str]]  #: host -> (its client public key, its ident tag)


@dataclass(frozen=True)
class Endpoints:
    """Where an earlier controller of a detachable mesh listened: a controller that
    attaches binds the same sockets (unix sockets, or tcp addresses with the same CURVE
    keys), and its ranks and agents reconnect by themselves."""

    send: str
    recv: str
    ipc_dir: str | None  #: the private directory holding them (removed on a stop)
    curve: CurveKeys | None = None  #: a tcp mesh's keys


#: Seconds a controller that attaches to a tcp mesh retries binding its addresses (the
#: kernel it took the mesh from with ``--force`` closes them a moment later).
REBIND_TIMEOUT = 10.0


class Transport:
    """Sockets, addresses and send paths of one mesh's controller side."""

    def __init__(
        self,
        name: str,
        codec: Codec,
        ranks: list[RankInfo],
        bind: str,
        reuse: Endpoints | None = None,
    ):
        """``bind``: a host address (tcp on a random port, within ``$MONARCH_KERNEL_PORTS``
        when set), a full ``tcp://`` or ``ipc://`` endpoint, or ``"ipc"`` for unix
        sockets in a private (0700) directory (falls back to tcp on 127.0.0.1 where unix
        sockets are unusable).

        Every tcp socket is a CURVE server with a fresh per-mesh keypair (:attr:`curve`);
        a ZAP handler admits only the client keys added to ``curve.allowed``.

        ``reuse``: bind the unix sockets an earlier controller of this (detachable)
        mesh listened on."""
        self.name = name
        self.codec = codec
        self._ranks = ranks
        #: Where this controller's sequence numbers start (see ``wire.kinds.SEQ_EPOCH``).
        self.seq_base = 0
        self.next_seq = [0] * len(ranks)
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
        self._ipc_dir = reuse.ipc_dir if reuse else _private_ipc_dir() if bind == "ipc" else None
        #: The mesh's CURVE keys when it listens on tcp (None on unix sockets).
        self.curve: Curve | None = None
        self._zap_domain = f"mk-{name}-{id(self):x}"
        #: Per host: the suffix of its routing ids (:func:`ident_tag` of its CURVE secret;
        #: empty on unix sockets), and the host each admitted client key (z85, the ZAP
        #: user id) was handed to.
        self._tags: dict[int, bytes] = {}
        self._key_host: dict[str, int] = {}
        #: Messages dropped because the authenticated key (ZAP user id) was not the key of
        #: the host their routing id or header claims (a peer posing as another host).
        self.impostors = 0
        self._impostor_logged = False
        self.send_addr, self.recv_addr = self._bind(bind, reuse)
        wake_addr = f"inproc://mk-wake-{id(self)}"
        self.recv_sock.bind(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_sock = _wake_socket(ctx, WAKE_ID, wake_addr)
        self._sigint_sock = _wake_socket(ctx, SIGINT_ID, wake_addr)  # main thread only
        # Flow control (see the module docstring); the backlogs change under send_lock.
        # Per peer: (frames, bytes, calls) not taken yet; ``backlog_messages`` counts the
        # calls (a batch counts as the calls it carries).
        self._backlog: dict[bytes, deque[tuple[list[Buffer], int, int]]] = {}
        self.backlog_messages = 0
        self.backlog_bytes = 0
        self._room = threading.Condition()
        self._closed = False
        #: Fire-and-forget calls not sent yet (:meth:`send_fire`; under send_lock).
        self._batch = Batcher()
        #: Told when a call starts a new batch: make the I/O thread flush (set by the
        #: mesh's receiver; until then the caller sends at once).
        self.on_batch: Callable[[], None] | None = None
        #: Calls sent in ``batch`` messages, and those messages (statistics, tests).
        self.batched_calls = 0
        self.batches_sent = 0

    def _bind(self, bind: str, reuse: Endpoints | None = None) -> tuple[str, str]:
        """Bind both ROUTERs (CURVE servers on tcp); their addresses. On failure the
        sockets are closed and :class:`MeshStartError` says why."""
        if self._ipc_dir is None and (reuse is None or reuse.curve is not None):
            self.curve = Curve.new() if reuse is None else self._take_keys(reuse)
            for sock in (self.send_sock, self.recv_sock):
                curve_server(sock, self.curve, self._zap_domain)
        try:
            if reuse is not None:  # an earlier controller's sockets
                _rebind(self.send_sock, reuse.send)
                _rebind(self.recv_sock, reuse.recv)
                return reuse.send, reuse.recv
            if self._ipc_dir is not None:
                send_addr = _bind(self.send_sock, f"ipc://{self._ipc_dir}/send")
                return send_addr, _bind(self.recv_sock, f"ipc://{self._ipc_dir}/recv")
            bind = "127.0.0.1" if bind == "ipc" else bind
            return _bind(self.send_sock, bind), _bind(self.recv_sock, bind)
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

    def _take_keys(self, reuse: Endpoints) -> Curve:
        """The CURVE state of an earlier controller (keys, admitted hosts, tags)."""
        keys = reuse.curve
        assert keys is not None
        curve = Curve(keys.public.encode(), keys.secret.encode())
        for host, (public, tag) in keys.hosts.items():
            curve.allowed.add(public.encode())
            self._key_host[public] = host
            self._tags[host] = tag.encode()
        return curve

    def curve_keys(self) -> CurveKeys | None:
        """This mesh's CURVE keys for its attach file (None on unix sockets)."""
        if self.curve is None:
            return None
        hosts = {h: (key, self._tags.get(h, b"").decode()) for key, h in self._key_host.items()}
        return CurveKeys(self.curve.public.decode(), self.curve.secret.decode(), hosts)

    # -- identities --------------------------------------------------------------------
    def admit_host(self, host: int) -> tuple[str, str, str]:
        """A fresh CURVE client keypair for host agent ``host`` (its ranks use it too),
        admitted by the ZAP handler; a previous one of that host is no longer admitted.
        Returns ``(server public, client public, client secret)`` (z85), or empty
        strings on unix sockets."""
        if self.curve is None:
            return ("", "", "")
        public, secret = zmq.curve_keypair()
        for key, h in list(self._key_host.items()):
            if h == host:
                del self._key_host[key]
                self.curve.allowed.discard(key.encode())
        self._key_host[public.decode()] = host
        self._tags[host] = ident_tag(secret)
        self.curve.allowed.add(public)
        return (self.curve.public.decode(), public.decode(), secret.decode())

    def host_id(self, host: int) -> bytes:
        """Routing id of host agent ``host`` (``h<H>`` + its host's tag)."""
        return b"h%d" % host + self._tags.get(host, b"")

    def rank_id(self, rank: int, kind: bytes = b"r") -> bytes:
        """Routing id of ``rank``'s inbox (``r``) or control socket (``c``)."""
        return kind + b"%d" % rank + self._tags.get(self._ranks[rank].host, b"")

    def sender_host(self, frames: list[zmq.Frame]) -> int | None:
        """On a CURVE mesh, the host whose key authenticated the connection a message
        ``[identity, *frames]`` came on, if its routing id belongs to that host; None
        (the message is counted in :attr:`impostors` and must be dropped) otherwise.
        -1 on unix sockets (nothing to check: the user only)."""
        if self.curve is None:
            return -1
        ident = frames[0].bytes
        user = frames[-1].get("User-Id") if len(frames) > 1 else None
        host = self._key_host.get(user) if isinstance(user, str) else None
        if host is not None and ident in (self.host_id(host), *self._rank_ids(ident, host)):
            return host
        self.impostor(f"routing id {ident[:40]!r} on a connection of host {host}")
        return None

    def _rank_ids(self, ident: bytes, host: int) -> tuple[bytes, ...]:
        kind, rest = ident[:1], ident[1:].partition(b".")[0]
        if kind not in (b"r", b"c") or not rest.isdigit():
            return ()
        rank = int(rest)
        if not 0 <= rank < len(self._ranks) or self._ranks[rank].host != host:
            return ()
        return (self.rank_id(rank, kind),)

    def impostor(self, what: str) -> None:
        """Count a message dropped because it claims another host's identity."""
        self.impostors += 1
        if not self._impostor_logged:
            self._impostor_logged = True
            log.warning(
                "mesh %s dropped a message whose %s does not belong to its CURVE key "
                "(counted in impostors; logged once)",
                self.name,
                what,
            )

    # -- sending -----------------------------------------------------------------------
    def send_host(self, host: int, header: Header, payload: bytes = b"") -> None:
        """Send to host agent ``host`` (lost messages to a gone agent are dropped)."""
        frames = self.codec.encode(header, payload)
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            self._deliver(self.host_id(host), frames, len(payload))

    def heartbeat(self, host: int) -> None:
        """A heartbeat to host agent ``host``, unless it has not read what was sent."""
        ident = self.host_id(host)
        with self.send_lock:
            if ident not in self._backlog:
                self._deliver(ident, self.codec.encode({"k": K.HEARTBEAT}), 0)

    def send(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Send one message to ``ranks``' main threads (in order, FIFO per rank); never
        blocks (callers make room first: :meth:`wait_for_room`). A large one goes as a
        stream of chunks (:mod:`monarch_kernel.wire.chunks`)."""
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
                header = {"k": K.BATCH, "n": n, "d": group, "q": seqs}
                if len(group) >= FANOUT_MIN_RANKS or (
                    len(group) > 1 and len(payload) >= FANOUT_MIN_BYTES
                ):
                    header["f"] = 1
                    frames = self.codec.encode(header, payload)
                    self._deliver(self.host_id(host), frames, len(payload), n * len(group))
                    self.batches_sent += 1
                    continue
                # one encoding for every rank of the group: each finds its ``q`` by ``d``
                frames = self.codec.encode(header, payload)
                for r in group:
                    self._deliver(self.rank_id(r), frames, len(payload), n)
                self.batches_sent += len(group)

    def _send(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
    ) -> None:
        """:meth:`send`'s work, send_lock held and no batch waiting."""
        if len(ranks) == 1:
            r = ranks[0]
            header["q"] = self._take_seq(r)
            self._ranks[r].bytes_out += self._deliver_parts(
                self.rank_id(r), encode_parts(self.codec, header, payload, buffers)
            )
            return
        size = len(payload) + (sum(memoryview(b).nbytes for b in buffers) if buffers else 0)
        by_host: dict[int, list[int]] = {}
        for r in ranks:
            info = self._ranks[r]
            info.bytes_out += size
            by_host.setdefault(info.host, []).append(r)
        for host, group in by_host.items():
            if len(group) > 1 and (size >= FANOUT_MIN_BYTES or len(group) >= FANOUT_MIN_RANKS):
                h = dict(header, d=group, f=1, q=[self._take_seq(r) for r in group])
                route = {"f": 1, "d": group}
                parts = encode_parts(self.codec, h, payload, buffers, route)
                self._deliver_parts(self.host_id(host), parts)
            else:
                for r in group:
                    h = dict(header, q=self._take_seq(r))
                    parts = encode_parts(self.codec, h, payload, buffers)
                    self._deliver_parts(self.rank_id(r), parts)

    def _deliver_parts(self, ident: bytes, parts: list[list[Buffer]]) -> int:
        """Deliver a message's parts (one, or a stream's start and chunks) in order;
        their size in bytes (send_lock held)."""
        total = 0
        for frames in parts:
            size = frames_size(frames)
            self._deliver(ident, frames, size)
            total += size
        return total

    def _take_seq(self, r: int) -> int:
        q = self.next_seq[r]
        self.next_seq[r] = q + 1
        return q

    def set_epoch(self, epoch: int) -> None:
        """Number this controller's messages from ``epoch * SEQ_EPOCH`` (the ``epoch``-th
        controller to attach to a detachable mesh; before anything is sent)."""
        with self.send_lock:
            self.seq_base = epoch * K.SEQ_EPOCH
            self.next_seq = [self.seq_base] * len(self.next_seq)

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
            self.next_seq[rank] = self.seq_base
            self._drop(self.rank_id(rank))
            self._drop(self.rank_id(rank, b"c"))

    def send_control(
        self, rank: int, header: Header, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> None:
        """Send to a rank's control thread (served even while its main thread is busy);
        a large value as a stream of chunks."""
        parts = encode_parts(self.codec, header, payload, buffers)
        with self.send_lock, DeferSigint():
            if self._batch:
                self._send_batch()
            self._ranks[rank].bytes_out += self._deliver_parts(self.rank_id(rank, b"c"), parts)

    # -- flow control --------------------------------------------------------------------
    def _deliver(self, ident: bytes, frames: list[Buffer], size: int, calls: int = 1) -> None:
        """Send now, or queue behind what ``ident`` has not taken yet (send_lock held);
        ``calls``: how many calls the message carries (a batch: several)."""
        queue = self._backlog.get(ident)
        if queue is None:
            try:
                wire_send(self.send_sock, frames, [ident], _NOBLOCK)
                return
            except zmq.Again:  # its queue is full: keep it here, retried by the I/O thread
                queue = self._backlog[ident] = deque()
                self.wake()
            except zmq.ZMQError as exc:
                # Not connected (any more): a dead rank's death report, pushed by its host
                # agent, fails whatever waits on it.
                log.debug("mesh %s: send to %r failed: %s", self.name, ident, exc)
                return
        queue.append((frames, size, calls))
        self.backlog_messages += calls
        self.backlog_bytes += size

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
        sent = False
        with self.send_lock:
            for ident, queue in list(self._backlog.items()):
                while queue:
                    frames, size, calls = queue[0]
                    try:
                        wire_send(self.send_sock, frames, [ident], _NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as exc:
                        log.debug("mesh %s: %r is gone: %s", self.name, ident, exc)
                        self._drop(ident)
                        break
                    queue.popleft()
                    self.backlog_messages -= calls
                    self.backlog_bytes -= size
                    sent = True
                if not queue:
                    self._backlog.pop(ident, None)
            left = bool(self._backlog)
        if sent:
            with self._room:
                self._room.notify_all()
        return left

    def _drop(self, ident: bytes) -> None:
        queue = self._backlog.pop(ident, None)
        if queue:
            self.backlog_messages -= sum(calls for _, _, calls in queue)
            self.backlog_bytes -= sum(size for _, size, _ in queue)

    def _full(self) -> bool:
        return (
            self.backlog_messages >= MAX_BACKLOG_MESSAGES or self.backlog_bytes >= MAX_BACKLOG_BYTES
        )

    def wait_for_room(self, wait: bool = True) -> None:
        """Return when the backlogs are under their bounds (at once, almost always).

        Interruptible: the wait is in short slices, so Ctrl-C raises in the main thread,
        and closing the transport (stopping the mesh) raises ``MeshStoppedError``.
        """
        if not self._full():
            return
        if not wait:
            raise BackpressureError(
                f"mesh {self.name!r}: {self.backlog_messages} messages "
                f"({self.backlog_bytes / 2**20:.0f} MiB) wait for busy ranks to read them; "
                "wait for results (.get()) before sending more, or send with waiting allowed"
            )
        with self._room:
            while self._full() and not self._closed:
                self._room.wait(0.1)
        if self._closed:
            raise MeshStoppedError(f"mesh {self.name!r} was stopped while this call waited")

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
        with self._room:
            self._closed = True
            self._room.notify_all()
        with self.send_lock:
            self._batch.clear()
            self._backlog.clear()
            self.backlog_messages = self.backlog_bytes = 0
        for sock in (self.send_sock, self.recv_sock, self._wake_sock, self._sigint_sock):
            sock.close(0)
        if self.curve is not None:
            zap(self._zap_domain, None)
        if not keep_addresses:
            self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _wake_socket(ctx: zmq.Context[zmq.Socket[bytes]], ident: bytes, addr: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(addr)
    return sock


def _private_ipc_dir() -> str | None:
    """A fresh 0700 directory for the controller's unix sockets (None: use tcp)."""
    if not zmq.has("ipc"):
        return None
    path = tempfile.mkdtemp(prefix="mk-mesh-")
    if len(path) > 90:  # unix socket paths are limited to about 100 bytes
        os.rmdir(path)
        return None
    mark_owners(path, [os.getpid()])  # swept once its owners are gone (wire.tempdirs)
    return path


def _rebind(sock: zmq.Socket[bytes], addr: str) -> None:
    """Bind ``addr``, an earlier controller's; a tcp port it still holds (it is being
    told it was taken over) is retried for :data:`REBIND_TIMEOUT` seconds."""
    deadline = time.monotonic() + REBIND_TIMEOUT
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _bind(sock: zmq.Socket[bytes], host: str) -> str:
    if host.startswith(("ipc://", "tcp://")):
        sock.bind(host)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return f"tcp://{host}:{bind_port(sock, host)}"
