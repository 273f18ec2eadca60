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
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence

import zmq

from monarch_kernel.controller.errors import MeshStartError
from monarch_kernel.controller.records import RankInfo
from monarch_kernel.controller.sigint import DeferSigint
from monarch_kernel.wire import Codec
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.codec import send as wire_send

log = logging.getLogger("monarch_kernel.controller")

#: Fan a message out through the host agent when it is at least this large ...
FANOUT_MIN_BYTES = 256 * 1024
#: ... or when at least this many ranks of one host are targeted.
FANOUT_MIN_RANKS = 8

#: Routing ids of the inproc sockets that wake the thread receiving on the recv socket
#: (a message from them only means "look at your conditions again").
WAKE_ID = b"mk-wake"
SIGINT_ID = b"mk-sigint"


class Transport:
    """Sockets, addresses and send paths of one mesh's controller side."""

    def __init__(self, name: str, codec: Codec, ranks: list[RankInfo], bind: str):
        """``bind``: a host address (tcp on a random port), a full ``tcp://`` or
        ``ipc://`` endpoint, or ``"ipc"`` for unix sockets in a private (0700)
        directory (falls back to tcp on 127.0.0.1 where unix sockets are unusable)."""
        self.name = name
        self.codec = codec
        self._ranks = ranks
        self.next_seq = [0] * len(ranks)
        self.send_lock = threading.Lock()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.send_sock = ctx.socket(zmq.ROUTER)
        self.send_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.send_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank reuses its id
        self.send_sock.setsockopt(zmq.LINGER, 0)
        self.recv_sock = ctx.socket(zmq.ROUTER)
        self.recv_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.recv_sock.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = _private_ipc_dir() if bind == "ipc" else None
        try:
            if self._ipc_dir is not None:
                self.send_addr = _bind(self.send_sock, f"ipc://{self._ipc_dir}/send")
                self.recv_addr = _bind(self.recv_sock, f"ipc://{self._ipc_dir}/recv")
            else:
                bind = "127.0.0.1" if bind == "ipc" else bind
                self.send_addr = _bind(self.send_sock, bind)
                self.recv_addr = _bind(self.recv_sock, bind)
        except zmq.ZMQError as exc:
            self.send_sock.close()
            self.recv_sock.close()
            self._remove_ipc_dir()
            raise MeshStartError(
                f"cannot bind the controller sockets on {bind}: {exc}. "
                "Pick another address or free the port."
            ) from None
        wake_addr = f"inproc://mk-wake-{id(self)}"
        self.recv_sock.bind(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_sock = _wake_socket(ctx, WAKE_ID, wake_addr)
        self._sigint_sock = _wake_socket(ctx, SIGINT_ID, wake_addr)  # main thread only

    # -- sending -----------------------------------------------------------------------
    def send_host(self, host: int, header: Header, payload: bytes = b"") -> None:
        """Send to host agent ``host`` (lost messages to a gone agent are dropped)."""
        frames = self.codec.encode(header, payload)
        with self.send_lock, DeferSigint():
            try:
                wire_send(self.send_sock, frames, [b"h%d" % host])
            except zmq.ZMQError as exc:
                log.debug("send to host %s failed: %s", host, exc)

    def send(
        self,
        ranks: Sequence[int],
        header: Header,
        payload: bytes = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Send one message to ``ranks``' main threads (in order, FIFO per rank)."""
        with self.send_lock, DeferSigint():
            if len(ranks) == 1:
                r = ranks[0]
                header["q"] = self.next_seq[r]
                self.next_seq[r] += 1
                self._send_frames(r, self.codec.encode(header, payload, buffers))
                self._ranks[r].bytes_out += len(payload) + (
                    sum(memoryview(b).nbytes for b in buffers) if buffers else 0
                )
                return
            size = len(payload) + sum(memoryview(b).nbytes for b in buffers)
            by_host: dict[int, list[int]] = {}
            for r in ranks:
                info = self._ranks[r]
                info.bytes_out += size
                by_host.setdefault(info.host, []).append(r)
            for host, group in by_host.items():
                if len(group) > 1 and (size >= FANOUT_MIN_BYTES or len(group) >= FANOUT_MIN_RANKS):
                    h = dict(header, d=group, f=1, q=[self._take_seq(r) for r in group])
                    frames = self.codec.encode(h, payload, buffers)
                    try:
                        wire_send(self.send_sock, frames, [b"h%d" % host])
                    except zmq.ZMQError as exc:
                        log.debug("fan-out to host %s failed: %s", host, exc)
                else:
                    for r in group:
                        h = dict(header, q=self._take_seq(r))
                        self._send_frames(r, self.codec.encode(h, payload, buffers))

    def _take_seq(self, r: int) -> int:
        q = self.next_seq[r]
        self.next_seq[r] = q + 1
        return q

    def reset_seq(self, rank: int) -> None:
        """A restarted rank counts its messages from 0 again."""
        with self.send_lock:
            self.next_seq[rank] = 0

    def _send_frames(self, rank: int, frames: list[bytes | memoryview]) -> None:
        try:
            wire_send(self.send_sock, frames, [b"r%d" % rank])
        except zmq.ZMQError as exc:
            # The rank's connection is gone; its death report (pushed by its host agent)
            # fails whatever waits on it.
            log.debug("send to rank %s failed: %s", rank, exc)

    def send_control(self, rank: int, header: Header, payload: bytes = b"") -> None:
        """Send to a rank's control thread (served even while its main thread is busy)."""
        frames = self.codec.encode(header, payload)
        with self.send_lock, DeferSigint():
            try:
                wire_send(self.send_sock, frames, [b"c%d" % rank])
            except zmq.ZMQError as exc:
                log.debug("control send to rank %s failed: %s", rank, exc)

    def probe(self, identities: list[bytes], timeout: float = 10.0) -> None:
        """Wait until the send socket can route to ``identities``.

        A peer announces itself on the receive socket; its connection to the send socket
        is made independently and may lag by a moment. Nothing is sent to it before.
        """
        frames = self.codec.encode({"k": K.HELLO})
        deadline = time.monotonic() + timeout
        for ident in identities:
            while True:
                with self.send_lock, DeferSigint():
                    try:
                        self.send_sock.send_multipart([ident, *frames])
                        break
                    except zmq.ZMQError:
                        pass
                if time.monotonic() > deadline:
                    log.warning("mesh %s: peer %r is not reachable", self.name, ident)
                    return
                time.sleep(0.001)

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
    def close(self) -> None:
        """Close every socket and remove the private directory (nobody receives now)."""
        for sock in (self.send_sock, self.recv_sock, self._wake_sock, self._sigint_sock):
            sock.close(0)
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
    return path


def _bind(sock: zmq.Socket[bytes], host: str) -> str:
    if host.startswith(("ipc://", "tcp://")):
        sock.bind(host)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
