"""The controller side of one process mesh: sockets, I/O thread, requests, supervision.

Two ROUTER sockets per mesh keep the hot path free of thread hand-offs:

* ``send`` ROUTER: callers send on it directly from their own thread, under a lock
  (ranks' and host agents' inbox DEALERs connect here);
* ``recv`` ROUTER: results, streams, metrics and deaths. One thread at a time reads it,
  the holder of the *receive token*: a caller blocked in ``Future.get()`` takes the token
  and receives its own reply (leader/follower), so a call costs no wake-up of a second
  thread; the I/O thread holds the token whenever no caller has for a few milliseconds
  (streams of background work, deaths, futures that are awaited or polled).

A multi-rank message goes once per host to the host agent, which fans it out, when the
payload is large or many ranks of that host are targeted; otherwise it goes to each rank
directly. Per-rank sequence numbers keep delivery FIFO whichever path is taken.
"""

from __future__ import annotations

import _signal  # the C module: signal.signal()'s enum wrapping costs microseconds per call
import atexit
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch_kernel.controller.errors import MeshStartError, MeshStoppedError, RankDiedError
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Codec, Message, WireError
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import new_key
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.osutil import describe_exit

log = logging.getLogger("monarch_kernel.controller")

HEARTBEAT_INTERVAL = 1.0
#: Fan a message out through the host agent when it is at least this large ...
FANOUT_MIN_BYTES = 256 * 1024
#: ... or when at least this many ranks of one host are targeted.
FANOUT_MIN_RANKS = 8
TAIL_LINES = 50
#: After a caller stopped receiving (and no reply is owed to anyone), the I/O thread
#: waits this long before it takes the receive token back, so that a loop of calls
#: never has to wake it. Only unsolicited messages (streams of fire-and-forget work,
#: heartbeats) can wait this long.
READER_GRACE = 0.02

Listener = Callable[[dict[str, Any]], None]
Sink = Callable[[int, str, str], None]  # (rank, stream name, text)


@dataclass
class RankInfo:
    """What the controller knows about one rank."""

    rank: int
    host: int
    local_rank: int
    coords: tuple[int, ...]
    state: str = "starting"  # starting | idle | busy | dead | stopped
    pid: int | None = None
    hostname: str = ""
    device: str = ""
    restarts: int = 0
    death: dict[str, Any] | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    partial: dict[str, str] = field(default_factory=dict)
    outstanding: int = 0
    last_seen: float = 0.0
    #: Latest once-a-second report from the rank: rss, gpu_mem (with CUDA), data-plane
    #: bytes_in/bytes_out, time.
    stats: dict[str, Any] = field(default_factory=dict)
    #: Control-plane bytes the controller sent to / received from this rank.
    bytes_out: int = 0
    bytes_in: int = 0

    @property
    def alive(self) -> bool:
        return self.state not in _GONE


_GONE = frozenset({"dead", "stopped"})


@dataclass
class HostInfo:
    index: int
    handle: Any = None  # launcher handle
    pid: int | None = None
    hostname: str = ""
    addr: str = "127.0.0.1"
    port: int = 0
    ready: bool = False
    lost: str | None = None
    last_seen: float = field(default_factory=time.monotonic)


class Pending:
    """An outstanding request: which ranks still owe a reply, and what to do with it."""

    __slots__ = ("id", "waiting", "on_reply", "on_death", "sink")

    def __init__(
        self,
        request_id: str,
        ranks: list[int],
        on_reply: Callable[[int, Message], None],
        on_death: Callable[[int, BaseException], None],
        sink: Sink | None = None,
    ):
        self.id = request_id
        self.waiting = set(ranks)
        self.on_reply = on_reply
        self.on_death = on_death
        self.sink = sink


_MAIN_THREAD = threading.main_thread().ident

#: Routing ids of the inproc sockets that wake the thread receiving on the recv socket
#: (a message from them only means "look at your conditions again").
_WAKE_ID = b"mk-wake"
_SIGINT_ID = b"mk-sigint"


class _DeferSigint:
    """Hold Ctrl-C back while the main thread sends or receives; raise it between messages.

    A KeyboardInterrupt raised in the middle of a multipart send would glue the parts
    sent so far to the next message (both lost: the rank then waits forever for that
    sequence number); in the middle of a receive it would lose the part just received,
    and inside a reply handler it would leave a request half done. While deferred, a
    SIGINT only calls ``wake`` (for a receive loop: a message to the socket it blocks
    on), which stops at the next message boundary; the previous handler then runs.
    """

    __slots__ = ("_wake", "_previous", "pending")

    def __init__(self, wake: Callable[[], None] | None = None):
        self._wake = wake
        self._previous: Any = None
        self.pending: tuple[int, Any] | None = None

    def __enter__(self) -> _DeferSigint:
        if threading.get_ident() == _MAIN_THREAD:
            previous = _signal.getsignal(_signal.SIGINT)
            if callable(previous):  # SIG_DFL / SIG_IGN raise nothing in Python
                _signal.signal(_signal.SIGINT, self._defer)
                self._previous = previous
        return self

    def _defer(self, signum: int, frame: Any) -> None:
        self.pending = (signum, frame)
        if self._wake is not None:
            self._wake()

    def __exit__(self, *exc: Any) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            _signal.signal(_signal.SIGINT, previous)
            if self.pending is not None:
                previous(*self.pending)  # usually raises KeyboardInterrupt


_live_meshes: weakref.WeakSet[MeshRuntime] = weakref.WeakSet()
_ids = itertools.count()
_id_prefix = uuid.uuid4().hex[:6]


def new_request_id() -> str:
    return f"{_id_prefix}{next(_ids)}"


class MeshRuntime:
    """Controller state of one process mesh (``hosts`` host agents × ``per_host`` ranks)."""

    def __init__(
        self,
        name: str,
        per_host: dict[str, int],
        hosts: int,
        launcher: Any,
        env: dict[str, str] | None = None,
        hb_timeout: float = 10.0,
        bind: str | None = None,
    ):
        """``bind``: where the controller's sockets listen: a host address (tcp on a
        random port), a full ``tcp://`` or ``ipc://`` endpoint, or ``"ipc"`` for unix
        sockets in a private (0700) directory. By default ``"ipc"`` when every host is
        on this machine (the local launcher), else ``127.0.0.1``.
        """
        if hosts < 1:
            raise ValueError(f"a mesh needs at least one host, got hosts={hosts}")
        extent = ({"hosts": hosts} if hosts > 1 else {}) | dict(per_host)
        self.name = name
        self.shape = Shape.from_extent(extent)
        self.n_hosts = hosts
        self.per_host = len(Shape.from_extent(per_host))
        self.launcher = launcher
        self.env = dict(env or {})
        self.hb_timeout = hb_timeout
        self.world = len(self.shape)
        self.started_at = time.time()
        self.state = "starting"
        self.run_id = uuid.uuid4().hex[:12]
        self.key = new_key()
        self.codec = Codec(self.key)
        self.ranks = [
            RankInfo(r, r // self.per_host, r % self.per_host, c)
            for r, c in enumerate(self.shape._coords())
        ]
        self.hosts = [HostInfo(h) for h in range(hosts)]
        self.next_seq = [0] * self.world
        self.requests: dict[str, Pending] = {}
        self.listeners: list[Listener] = []
        self.default_sink: Sink = print_sink
        self.faults: list[dict[str, Any]] = []
        self.stream_sinks: dict[str, Sink] = {}  # request id -> sink (e.g. a --bg cell)
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        ctx = zmq.Context.instance()
        self.send_sock = ctx.socket(zmq.ROUTER)
        self.send_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.send_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank reuses its id
        self.send_sock.setsockopt(zmq.LINGER, 0)
        self.recv_sock = ctx.socket(zmq.ROUTER)
        self.recv_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.recv_sock.setsockopt(zmq.LINGER, 0)
        if bind is None:
            bind = "ipc" if getattr(launcher, "name", None) == "local" else "127.0.0.1"
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
        # The receive token (see the module docstring) and the I/O thread's idling state.
        self._recv_lock = threading.Lock()
        self._reader: int | None = None  # ident of the thread holding the token
        self._io_cv = threading.Condition()
        self._io_followers: list[Any] = []  # futures whose waiters the I/O thread serves
        self._posted: deque[tuple[Callable[..., None], tuple]] = deque()  # see _post
        self._io_needed = False  # the last caller left replies owed: I/O thread, take over
        self._last_release = 0.0
        self._running = True
        self._rcvtimeo = -1
        wake_addr = f"inproc://mk-wake-{id(self)}"
        self.recv_sock.bind(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_sock = _wake_socket(ctx, _WAKE_ID, wake_addr)
        self._sigint_sock = _wake_socket(ctx, _SIGINT_ID, wake_addr)  # main thread only
        self._io = threading.Thread(target=self._io_loop, name=f"mesh-{name}-io", daemon=True)
        self._io.start()
        _live_meshes.add(self)

    # -- start-up --------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Start host agents and ranks; return when every rank is ready."""
        deadline = time.monotonic() + timeout
        try:
            configs = [self._host_config(h) for h in range(self.n_hosts)]
            handles = self.launcher.start_hosts(configs)
            for host, handle in zip(self.hosts, handles):
                host.handle = handle
            self._wait(lambda: all(h.ready for h in self.hosts), deadline, "host agents")
            master = self.hosts[0]
            common = {
                "labels": list(self.shape.labels),
                "sizes": list(self.shape.sizes),
                "world_size": self.world,
                "local_world_size": self.per_host,
                "master_addr": master.addr,
                "master_port": master.port,
                "run_id": self.run_id,
                "env": self.env,
                "sys_path": [p for p in sys.path if p],
                "cwd": os.getcwd(),
            }
            self._common = common
            for host in self.hosts:
                self._spawn_ranks([r for r in self.ranks if r.host == host.index])
            self._wait(lambda: all(r.state != "starting" for r in self.ranks), deadline, "ranks")
            dead = [r for r in self.ranks if not r.alive]
            if dead:
                raise MeshStartError(
                    "ranks died while starting:\n" + "\n".join(self.death_text(r) for r in dead)
                )
        except BaseException:
            self.stop()
            raise
        self.state = "running"
        self._emit({"event": "mesh", "state": "running"})

    def _host_config(self, h: int) -> dict[str, Any]:
        return {
            "host": h,
            "key": self.key.hex(),
            "send": self.send_addr,
            "recv": self.recv_addr,
            "hb_timeout": self.hb_timeout,
            "mesh": self.name,
        }

    def _spawn_ranks(self, ranks: list[RankInfo]) -> None:
        specs = []
        for r in ranks:
            r.state, r.death, r.pid = "starting", None, None
            specs.append(
                {
                    "rank": r.rank,
                    "local_rank": r.local_rank,
                    "coords": list(r.coords),
                    "host": r.host,
                    "restart_count": r.restarts,
                }
            )
        if specs:
            self.send_host(
                ranks[0].host, {"k": K.SPAWN_RANKS, "ranks": specs, "common": self._common}
            )

    def _wait(self, cond: Callable[[], bool], deadline: float, what: str) -> None:
        with self._cv:
            while not cond():
                self._check_hosts_started(what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MeshStartError(
                        f"mesh {self.name!r}: {what} not ready in time; "
                        "check the host agents' logs or raise the start timeout"
                    )
                self._cv.wait(min(left, 0.2))

    def _check_hosts_started(self, what: str) -> None:
        for host in self.hosts:
            handle = host.handle
            if handle is not None and handle.exit_code() is not None:
                raise MeshStartError(
                    f"host agent {host.index} exited (code {handle.exit_code()}) while "
                    f"starting {what}:\n{handle.log_tail()}"
                )
            if host.lost:
                raise MeshStartError(f"host agent {host.index} lost: {host.lost}")

    # -- sending -----------------------------------------------------------------------
    def check_alive(self, ranks: list[int]) -> None:
        if self.state in ("stopped", "stopping"):
            raise MeshStoppedError(
                f"mesh {self.name!r} is stopped; create a new mesh (or %mesh restart it)"
            )
        for r in ranks:
            info = self.ranks[r]
            if info.state in _GONE:
                raise RankDiedError(self.death_text(info), info.death)

    def send_host(self, host: int, header: dict[str, Any], payload: bytes = b"") -> None:
        frames = self.codec.encode(header, payload)
        with self._send_lock, _DeferSigint():
            try:
                wire_send(self.send_sock, frames, [f"h{host}".encode()])
            except zmq.ZMQError as exc:
                log.debug("send to host %s failed: %s", host, exc)

    def send(
        self,
        ranks: list[int],
        header: dict[str, Any],
        payload: bytes = b"",
        buffers: list[Any] | tuple = (),
    ) -> None:
        """Send one message to ``ranks`` (in order, FIFO per rank)."""
        with self._send_lock, _DeferSigint():
            if len(ranks) == 1:
                r = ranks[0]
                header["q"] = self.next_seq[r]
                self.next_seq[r] += 1
                self._send_frames(r, self.codec.encode(header, payload, buffers))
                self.ranks[r].bytes_out += len(payload) + (
                    sum(memoryview(b).nbytes for b in buffers) if buffers else 0
                )
                return
            size = len(payload) + sum(memoryview(b).nbytes for b in buffers)
            for r in ranks:
                self.ranks[r].bytes_out += size
            by_host: dict[int, list[int]] = {}
            for r in ranks:
                by_host.setdefault(self.ranks[r].host, []).append(r)
            for host, group in by_host.items():
                if len(group) > 1 and (size >= FANOUT_MIN_BYTES or len(group) >= FANOUT_MIN_RANKS):
                    h = dict(header, d=group, f=1, q=[self._take_seq(r) for r in group])
                    frames = self.codec.encode(h, payload, buffers)
                    try:
                        wire_send(self.send_sock, frames, [f"h{host}".encode()])
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

    def _send_frames(self, rank: int, frames: list[Any]) -> None:
        try:
            wire_send(self.send_sock, frames, [b"r%d" % rank])
        except zmq.ZMQError as exc:
            # The rank's connection is gone; its death report (pushed by its host agent)
            # fails whatever waits on it.
            log.debug("send to rank %s failed: %s", rank, exc)

    def send_control(self, rank: int, header: dict[str, Any], payload: bytes = b"") -> None:
        """Send to a rank's control thread (served even while its main thread is busy)."""
        frames = self.codec.encode(header, payload)
        with self._send_lock, _DeferSigint():
            try:
                wire_send(self.send_sock, frames, [b"c%d" % rank])
            except zmq.ZMQError as exc:
                log.debug("control send to rank %s failed: %s", rank, exc)

    def request(
        self,
        ranks: list[int],
        header: dict[str, Any],
        payload: bytes,
        buffers: list[Any] | tuple,
        on_reply: Callable[[int, Message], None],
        on_death: Callable[[int, BaseException], None],
        sink: Sink | None = None,
        control: bool = False,
        waited: bool = False,
    ) -> str:
        """Register a request expecting one reply per rank, then send it.

        ``waited``: the caller will block in ``wait_for`` (receiving the replies itself);
        otherwise the I/O thread is asked to receive at once.
        """
        self.check_alive(ranks)
        rid = new_request_id()
        header["i"] = rid
        header["w"] = 1
        self.requests[rid] = Pending(rid, ranks, on_reply, on_death, sink)
        for r in ranks:
            self.ranks[r].outstanding += 1
        if control:
            for r in ranks:
                self.send_control(r, header, payload)
        else:
            self.send(ranks, header, payload, buffers)
        # A rank may have died between the check and the send; fail it now if so.
        for r in ranks:
            if self.ranks[r].state in _GONE:
                self._fail_rank_requests(self.ranks[r])
        if not waited:
            self.ensure_reader()
        return rid

    def signal_ranks(self, ranks: list[int], sig: int) -> None:
        by_host: dict[int, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.ranks[r].host, []).append(r)
        for host, group in by_host.items():
            self.send_host(host, {"k": K.SIGNAL_RANKS, "d": group, "sig": int(sig)})

    # -- restart ---------------------------------------------------------------------
    def restart_ranks(self, ranks: list[int], timeout: float = 60.0) -> None:
        """Kill (if alive) and start again the given ranks on their hosts."""
        self.check_alive([])
        deadline = time.monotonic() + timeout
        alive = [r for r in ranks if self.ranks[r].alive]
        by_host: dict[int, list[int]] = {}
        for r in alive:
            by_host.setdefault(self.ranks[r].host, []).append(r)
        for host, group in by_host.items():
            self.send_host(host, {"k": K.KILL_RANKS, "d": group})
        self._wait(lambda: all(not self.ranks[r].alive for r in ranks), deadline, "rank exits")
        infos = [self.ranks[r] for r in ranks]
        with self._send_lock:
            for info in infos:
                self.next_seq[info.rank] = 0
                info.restarts += 1
                info.tail.clear()
        for host in {i.host for i in infos}:
            self._spawn_ranks([i for i in infos if i.host == host])
        self._wait(
            lambda: all(self.ranks[r].state != "starting" for r in ranks),
            deadline,
            "restarted ranks",
        )
        dead = [self.ranks[r] for r in ranks if not self.ranks[r].alive]
        if dead:
            raise MeshStartError(
                "ranks died while restarting:\n" + "\n".join(self.death_text(r) for r in dead)
            )

    # -- stopping --------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Stop every rank and host agent of this mesh; idempotent."""
        with self._cv:
            if self.state in ("stopped", "stopping"):
                return
            self.state = "stopping"
        for host in self.hosts:
            self.send_host(host.index, {"k": K.STOP})
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            if host.handle is not None:
                host.handle.wait_or_kill(max(0.5, deadline - time.monotonic()))
        error = MeshStoppedError(f"mesh {self.name!r} was stopped while this call was running")
        for rid, pending in list(self.requests.items()):
            self.requests.pop(rid, None)
            for r in list(pending.waiting):
                pending.on_death(r, error)
        for info in self.ranks:
            if info.alive:
                info.state = "stopped"
        self.state = "stopped"
        self._close_sockets()
        for host in self.hosts:
            if host.handle is not None:
                host.handle.cleanup()
        _live_meshes.discard(self)
        self._emit({"event": "mesh", "state": "stopped"})

    def _close_sockets(self) -> None:
        """End the I/O thread, wait for a receiving caller to leave, close the sockets."""
        me = threading.get_ident()
        self._running = False
        self._wake()
        with self._io_cv:
            self._io_cv.notify_all()
        if self._io.ident != me:
            self._io.join(5)
        # A caller receiving in another thread returns now (its future failed above).
        if self._reader != me and not self._recv_lock.acquire(timeout=5):
            log.warning("mesh %s: a thread still receives; closing anyway", self.name)
        for sock in (self.send_sock, self.recv_sock, self._wake_sock, self._sigint_sock):
            sock.close(0)
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- receiving: callers (leader/follower) ------------------------------------------
    def wait_for(self, fut: Any, timeout: float | None) -> None:
        """Receive in this thread until ``fut`` is done or ``timeout`` passes.

        Used by ``Future.get``: if the receive token is free, the caller takes it and
        handles whatever arrives, its own replies included. Otherwise this returns at
        once and the future is waited on: the token's holder completes it.
        ``timeout=0`` only makes sure that some thread receives.
        """
        if timeout == 0:
            self.ensure_reader()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reader == threading.get_ident():  # a handler on the receiving thread
            self._receive_until(fut, deadline, None)
            return
        if not self._take_token(fut):
            return
        try:
            with _DeferSigint(self._wake_from_sigint) as sigint:
                self._receive_until(fut, deadline, sigint)
        finally:
            self._give_token()

    def ensure_reader(self) -> None:
        """Make sure some thread receives now (for futures that nobody blocks on)."""
        if self._reader is None:
            with self._io_cv:
                self._io_needed = True
                self._io_cv.notify()

    def _take_token(self, fut: Any) -> bool:
        """Take the receive token if it is free; else follow its holder.

        The holder receives our reply too. Taking the token from the I/O thread would
        cost more wake-ups than it saves on this call, so the I/O thread serves it and
        hands the token over afterwards (see ``_serve``): the next call finds it free.
        """
        while True:
            if self._recv_lock.acquire(blocking=False):
                self._reader = threading.get_ident()
                return True
            with self._io_cv:  # atomic with the I/O thread's hand-over (_hand_over)
                if self._reader == self._io.ident:
                    self._io_followers.append(fut)
                    return False
                if self._reader is not None:
                    return False  # a caller receives: it (or the I/O thread after it) serves us
            # Released in between, or taken and not yet named: let its holder run, retry.
            time.sleep(0)

    def _give_token(self) -> None:
        with self._io_cv:
            self._reader = None
            self._last_release = time.monotonic()
            self._recv_lock.release()
            if self.requests:
                # Replies are still owed to others (followers, awaited futures, --bg
                # cells): the I/O thread receives them from now on.
                self._io_needed = True
                self._io_cv.notify()

    def _receive_until(self, fut: Any, deadline: float | None, sigint: _DeferSigint | None):
        while not fut.done() and self._running:
            if sigint is not None and sigint.pending:
                return
            if not self._receive_one(deadline):
                return

    def _receive_one(self, deadline: float | None) -> bool:
        """Block for one message (token held) and handle it; False once past ``deadline``.

        Wake-up messages (see ``_wake``) return at once, so the caller looks at its
        conditions again.
        """
        sock = self.recv_sock
        if deadline is None:
            ms = -1
        else:
            ms = int((deadline - time.monotonic()) * 1000) + 1
            if ms <= 0:
                return False
        if ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        try:
            frames = wire_recv(sock)
        except zmq.Again:
            return False
        if len(frames) == 2 and frames[0].bytes in (_WAKE_ID, _SIGINT_ID):
            self._run_posted()
            return True
        try:
            self._on_frames(frames)
        except Exception:  # never let one bad message stop the receiving
            log.exception("mesh %s: error handling a message", self.name)
        return True

    def _wake(self) -> None:
        """Make the thread receiving on the recv socket (if any) look at its conditions."""
        with self._wake_lock:
            try:
                self._wake_sock.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # queue full: the receiver has wake-ups enough; closed: stopping

    def _wake_from_sigint(self) -> None:
        # Python runs signal handlers in the main thread only, so this socket (used by
        # nobody else) needs no lock, which the interrupted code might hold.
        try:
            self._sigint_sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- I/O thread ------------------------------------------------------------------
    def _io_loop(self) -> None:
        me = threading.get_ident()
        last_hb = time.monotonic()
        while self._running:
            now = time.monotonic()
            if now - last_hb >= HEARTBEAT_INTERVAL:
                last_hb = now
                self._heartbeat(now)
            until_hb = last_hb + HEARTBEAT_INTERVAL - now
            idle = 0.0 if self._io_needed else self._callers_idle_wait(now)
            if idle <= 0 and self._recv_lock.acquire(blocking=False):
                self._reader = me
                self._io_needed = False
                handed_over = False
                try:
                    handed_over = self._serve(until_hb)
                finally:
                    if not handed_over:
                        self._reader = None
                        self._recv_lock.release()
                continue
            with self._io_cv:
                # A caller holds the token: it notifies us when it leaves replies owed.
                busy = self._recv_lock.locked()
                if busy:
                    wait = READER_GRACE
                elif idle > 0 and not self._io_needed:
                    wait = idle  # callers may come back for the token
                else:
                    continue  # take the token now
                if self._running:
                    self._io_cv.wait(min(until_hb, wait))

    def _callers_idle_wait(self, now: float) -> float:
        """How long to leave the token to callers before the I/O thread takes it."""
        if self._reader is not None:
            return READER_GRACE
        if self._io_followers:
            return 0.0  # callers wait for this thread to receive their replies
        return self._last_release + READER_GRACE - now

    def _serve(self, timeout: float) -> bool:
        """Receive (token held) until ``timeout`` passes (False), or until the callers
        that follow this thread have their replies (True: the token was handed over)."""
        deadline = time.monotonic() + timeout
        while self._running:
            if not self._receive_one(deadline):
                return False
            if self._io_followers and self._hand_over():
                return True
        return False

    def _hand_over(self) -> bool:
        """Release the token if every follower has its reply, so the next call finds
        it free; atomic with followers registering (see ``_take_token``)."""
        with self._io_cv:
            if not all(f.done() for f in self._io_followers):
                return False
            self._io_followers.clear()
            self._reader = None
            self._last_release = time.monotonic()
            self._recv_lock.release()
            return True

    def _heartbeat(self, now: float) -> None:
        if self.state in ("stopping", "stopped"):
            return
        for host in self.hosts:
            if host.lost:
                continue
            self.send_host(host.index, {"k": K.HEARTBEAT})
            code = host.handle.exit_code() if host.handle is not None else None
            if code is not None:
                self._post(self._host_lost, host, f"host agent process exited with code {code}")
            elif host.ready and now - host.last_seen > self.hb_timeout:
                self._post(self._host_lost, host, f"no heartbeat for {now - host.last_seen:.1f}s")

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread that holds the receive token, so that what
        fails requests never races with the handling of their replies."""
        self._posted.append((fn, args))
        self._wake()
        self.ensure_reader()

    def _run_posted(self) -> None:
        while self._posted:
            fn, args = self._posted.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("mesh %s: error in %s", self.name, getattr(fn, "__name__", fn))

    def _host_lost(self, host: HostInfo, why: str) -> None:
        if host.lost:
            return
        host.lost = why
        for info in self.ranks:
            if info.host == host.index and info.alive:
                self._rank_died(info, {"reason": f"host agent {host.index} lost: {why}"})
        with self._cv:
            self._cv.notify_all()

    def _on_frames(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            msg = self.codec.decode(frames[1:])
        except WireError as exc:
            log.warning("mesh %s dropped a message from %r: %s", self.name, ident, exc)
            return
        h = msg.header
        kind = h["k"]
        sender = h.get("r")
        if sender is not None and 0 <= sender < self.world:
            self.ranks[sender].bytes_in += msg.nbytes
        if kind == K.RESULT:
            rid = h["i"]
            pending = self.requests.get(rid)
            rank = h["r"]
            info = self.ranks[rank]
            info.outstanding = max(0, info.outstanding - 1)
            if pending is None or rank not in pending.waiting:
                return
            pending.waiting.discard(rank)
            if not pending.waiting:
                self.requests.pop(rid, None)
            pending.on_reply(rank, msg)
        elif kind == K.STREAM:
            text = bytes(msg.payload).decode("utf-8", "replace")
            self._on_stream(h["r"], h.get("i"), h["n"], text)
        elif kind == K.METRIC:
            import pickle

            self._emit(
                {
                    "event": "metric",
                    "rank": h["r"],
                    "request": h.get("i"),
                    "values": pickle.loads(msg.payload),
                    "time": time.time(),
                }
            )
        elif kind == K.STATS:
            import pickle

            stats = pickle.loads(msg.payload)
            info = self.ranks[h["r"]]
            info.stats = stats
            info.last_seen = time.monotonic()
            self._emit({"event": "stats", "rank": h["r"], "stats": stats, "time": time.time()})
        elif kind == K.READY:
            info = self.ranks[h["r"]]
            self._probe([b"r%d" % info.rank, b"c%d" % info.rank])
            info.pid, info.hostname, info.device = h["pid"], h["host"], h["dev"]
            info.state = "idle"
            info.last_seen = time.monotonic()
            self._emit({"event": "rank", "rank": info.rank, "state": "idle"})
            with self._cv:
                self._cv.notify_all()
        elif kind == K.RANK_STARTED:
            self.ranks[h["r"]].pid = h["pid"]
        elif kind == K.RANK_EXIT:
            info = self.ranks[h["r"]]
            if info.pid not in (None, h["pid"]) and info.state != "starting":
                return  # a stale report about an earlier incarnation
            self._rank_died(info, h)
        elif kind == K.HEARTBEAT:
            self.hosts[h["h"]].last_seen = time.monotonic()
        elif kind == K.HOST_READY:
            host = self.hosts[h["h"]]
            host.pid, host.hostname = h["pid"], h["host"]
            host.addr, host.port = h["addr"], h["port"]
            self._probe([b"h%d" % host.index])
            host.ready = True
            host.last_seen = time.monotonic()
            with self._cv:
                self._cv.notify_all()
        elif kind == K.FAULT:
            import pickle

            report = pickle.loads(msg.payload)
            report["rank"] = h["r"]
            self.faults.append(report)
            self._emit({"event": "fault", "rank": h["r"], "report": report})
            self.default_sink(
                h["r"],
                "stderr",
                f"unhandled {report['type']} in {report['where']} (fire-and-forget): "
                f"{report['message']}\n",
            )

    def _probe(self, identities: list[bytes], timeout: float = 10.0) -> None:
        """Wait until the send socket can route to ``identities``.

        A peer announces itself on the receive socket; its connection to the send socket
        is made independently and may lag by a moment. Nothing is sent to it before.
        """
        frames = self.codec.encode({"k": K.HELLO})
        deadline = time.monotonic() + timeout
        for ident in identities:
            while True:
                with self._send_lock, _DeferSigint():
                    try:
                        self.send_sock.send_multipart([ident, *frames])
                        break
                    except zmq.ZMQError:
                        pass
                if time.monotonic() > deadline:
                    log.warning("mesh %s: peer %r is not reachable", self.name, ident)
                    return
                time.sleep(0.001)

    def _on_stream(self, rank: int, rid: str | None, name: str, text: str) -> None:
        info = self.ranks[rank]
        # Keep whole lines for the death report and the dashboard.
        buf = info.partial.get(name, "") + text
        *lines, rest = buf.split("\n")
        info.tail.extend(lines)
        info.partial[name] = rest[-4096:]
        pending = self.requests.get(rid) if rid else None
        sink = pending.sink if pending is not None and pending.sink else None
        if sink is None:
            sink = self.stream_sinks.get(rid) if rid else None
        (sink or self.default_sink)(rank, name, text)
        self._emit({"event": "stream", "rank": rank, "request": rid, "name": name, "text": text})

    def _rank_died(self, info: RankInfo, h: dict[str, Any]) -> None:
        expected = bool(h.get("expected"))
        info.state = "stopped" if expected or self.state == "stopping" else "dead"
        host = self.hosts[info.host]
        tail = list(h.get("tail") or []) or list(info.tail)[-20:]
        info.death = {
            "rank": info.rank,
            "host": host.hostname or f"host {info.host}",
            "pid": h.get("pid", info.pid),
            "code": h.get("code"),
            "signal": h.get("sig"),
            "reason": h.get("reason"),
            "tail": tail,
            "time": time.time(),
        }
        self._fail_rank_requests(info)
        self._emit({"event": "rank", "rank": info.rank, "state": info.state, "death": info.death})
        with self._cv:
            self._cv.notify_all()

    def _fail_rank_requests(self, info: RankInfo) -> None:
        if self.state in ("stopping", "stopped"):
            error: BaseException = MeshStoppedError(
                f"mesh {self.name!r} was stopped while this call was running"
            )
        else:
            error = RankDiedError(self.death_text(info), info.death)
        for rid, pending in list(self.requests.items()):
            if info.rank in pending.waiting:
                pending.waiting.discard(info.rank)
                if not pending.waiting:
                    self.requests.pop(rid, None)
                pending.on_death(info.rank, error)
        info.outstanding = 0

    def death_text(self, info: RankInfo) -> str:
        d = info.death or {}
        if d.get("reason"):
            how = d["reason"]
        elif info.state == "stopped":
            how = "was stopped"
        else:
            how = describe_exit(d.get("code"), d.get("signal"))
        text = (
            f"rank {info.rank} of mesh {self.name!r} (host {d.get('host', info.hostname)}, "
            f"pid {d.get('pid', info.pid)}) died: {how}"
        )
        if d.get("tail"):
            text += "\nlast output lines:\n  " + "\n  ".join(d["tail"][-20:])
        if info.state == "dead":
            text += f"\nRestart it with %mesh restart {self.name} --ranks {info.rank}"
            text += " (or ProcMesh.restart)."
        return text

    # -- events ----------------------------------------------------------------------
    def _emit(self, event: dict[str, Any]) -> None:
        event["mesh"] = self.name
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:
                log.exception("mesh listener failed")


def print_sink(rank: int, name: str, text: str) -> None:
    """Default output sink outside the kernel: ``[rank N] line`` on our stdout/stderr."""
    stream = sys.stderr if name == "stderr" else sys.stdout
    lines = text.splitlines(keepends=True)
    stream.write("".join(f"[rank {rank}] {line}" for line in lines))
    stream.flush()


def _wake_socket(ctx: zmq.Context, ident: bytes, addr: str) -> zmq.Socket:
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


def _bind(sock: zmq.Socket, host: str) -> str:
    if host.startswith(("ipc://", "tcp://")):
        sock.bind(host)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def live_meshes() -> list[MeshRuntime]:
    return list(_live_meshes)


@atexit.register
def _stop_all() -> None:
    for mesh in list(_live_meshes):
        try:
            mesh.stop(timeout=3)
        except Exception:  # pragma: no cover - best effort at exit
            pass
