"""Everything a rank sends: to its controller (results, output, metrics, faults) over
one socket shared by its threads, and to other processes' peer addresses (the reply to
a rank-to-rank call, a failure to the actor that owns the failed one)."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import zmq

from monarch_kernel.rank import context
from monarch_kernel.rank.errors import exception_report
from monarch_kernel.rank.lane import LaneGone, RankLane
from monarch_kernel.rank.link import ControllerLink
from monarch_kernel.rank.signals import MainThread
from monarch_kernel.wire import Codec, SerializationError, dumps, handoff, peer_address
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.arena import KEEP_BYTES, MIN_BYTES, Arena
from monarch_kernel.wire.chunks import check_size, encode_parts
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.fanin import MAX_COMBINED
from monarch_kernel.wire.handoff import owned
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import FailureReport
from monarch_kernel.wire.serialize import ValueTooLargeError, What

log = logging.getLogger("monarch_kernel.rank")

#: How long a reply to a calling rank may wait for that rank's socket (it may be gone).
PEER_SEND_TIMEOUT_MS = 5000
#: A detachable mesh's rank whose controller queue is full looks this often (ms) whether
#: the controller went away meanwhile.
ROOM_WAIT_MS = 50
#: ... and between its looks lets other senders take the send lock this long (seconds).
ROOM_TURN_S = 0.002

# States of a fan-in request (bits): its reply was sent; its handler returned; something
# of it went through the host agent (then its reply must too, to stay behind it).
_REPLIED, _ENDED, _VIA_AGENT = 1, 2, 4


class KeptCopies(Protocol):
    """Copies of a result's tensors kept for its caller (``cuda_results.ResultCopies``)."""

    def release(self) -> None:
        """Drop them now (the reply was not sent)."""


class HandleDump(Protocol):
    """Pickles a result for a caller of this machine that takes its large CUDA tensors
    as handles (``rank.dataplane.cuda_results.dump_result``)."""

    def __call__(
        self, value: Any, what: What, reader: int
    ) -> tuple[bytes, list[pickle.PickleBuffer], KeptCopies | None]: ...


class Outbox:
    """A rank's sending side (thread-safe: every send is under one lock).

    ``owners`` is the actors' owners (actor name -> :class:`~wire.headers.Owner`),
    kept by :class:`~monarch_kernel.rank.actors.ActorHost`: a failure of an owned
    actor goes to its owner, not to the controller."""

    def __init__(
        self,
        rank: int,
        ctx: zmq.Context[zmq.Socket[bytes]],
        out: zmq.Socket[bytes],
        codec: Codec,
        main: MainThread,
        owners: Mapping[str, H.Owner],
        hostname: str,
        mesh: str,
    ):
        self.rank = rank
        self.ctx = ctx
        self.out = out
        self.codec = codec
        self.main = main
        self.owners = owners
        self.hostname = hostname
        self.mesh = mesh
        self.lock = threading.Lock()
        #: request id -> the calling rank's reply address (a peer call)
        self.peer_routes: dict[str, PeerAddress] = {}
        #: Requests from ranks of this machine that take the result's large CUDA tensors
        #: as handles on copies kept for them (``rank.dataplane.cuda_results``): the
        #: caller's process id; popped with the request's route
        self.handle_readers: dict[str, int] = {}
        #: How such a result is pickled: set by the inbox at the first such request (the
        #: data plane is a layer above this one)
        self.dump_by_handle: HandleDump | None = None
        self._peer_out: dict[tuple[int, PeerAddress], zmq.Socket[bytes]] = {}
        self._peer_codecs: dict[str, Codec] = {}
        self.machine = ""  # this rank's machine, set once its peer socket is bound
        #: A detachable mesh's rank: whether a controller is connected (else None).
        self.link: ControllerLink | None = None
        #: The host agent's fan-in socket (None: everything goes to the controller) and
        #: the fanned-out requests being answered through it (request -> state bits).
        self.agent: zmq.Socket[bytes] | None = None
        self.fanin: dict[str, int] = {}
        self._fanin_lock = threading.Lock()
        #: Large results' buffers go to the controller through shared memory
        #: (``wire.arena``): set where the controller reads them (a local mesh). The
        #: arena is made with the first such result; None after it could not be.
        self.shm_results = False
        self._arena: Arena | None = None
        #: The same-machine lane to the controller (``rank.lane``) once it was opened:
        #: everything to the controller goes through it from then on (else None).
        self.lane: RankLane | None = None

    # -- the same-machine lane (rank.lane) ---------------------------------------------
    def switch_to_lane(self, lane: RankLane) -> bool:
        """Send everything to the controller through ``lane`` from now on: ``lane_on``
        goes over the socket first, as the last message there (False, nothing changed:
        a detachable mesh's rank, whose messages a link may keep)."""
        if self.link is not None:
            return False
        with self.lock:
            wire_send(self.out, self.codec.encode(H.LaneOn(rank=self.rank).encode()))
            self.lane = lane
        return True

    def _to_controller(self, frames: list[Any]) -> None:
        """Send one message's frames to the controller: through the lane, else the
        socket (the lock held)."""
        lane = self.lane
        if lane is None:
            wire_send(self.out, frames)
            return
        try:
            lane.send(frames)
        except LaneGone as exc:  # nobody reads the lane, or the socket, any more
            log.warning("rank %s: %s; a message to it is dropped", self.rank, exc)
            self.lane = None
            lane.close()

    # -- fan-in (wire.fanin) -----------------------------------------------------------
    def fanin_open(self, request: str) -> bool:
        """Answer ``request`` (fanned out by the host agent) through the agent: its
        output and reply go there, to be combined with its other ranks'. False when
        this rank does not (no agent socket, or a detachable mesh)."""
        if self.agent is None or self.link is not None:
            return False
        with self._fanin_lock:
            self.fanin[request] = 0
        return True

    def fanin_close(self, request: str) -> None:
        """``request``'s handler returned (its reply may come later, from a task)."""
        self._fanin_mark(request, _ENDED)

    def _fanin_mark(self, request: str, bit: int) -> None:
        with self._fanin_lock:
            state = self.fanin.get(request)
            if state is None:
                return
            state |= bit
            if state & _REPLIED and state & _ENDED:
                del self.fanin[request]
            else:
                self.fanin[request] = state

    def send(
        self, header: H.WireHeader, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> None:
        """Send a message to the controller (any thread); a large value as a stream of
        chunks (:mod:`monarch_kernel.wire.chunks`). In a detachable mesh with no
        controller connected, the link keeps the message or drops it instead."""
        parts = encode_parts(self.codec, header, payload, buffers)
        if self.fanin and header.get("i") in self.fanin:
            self._via_agent(header["i"], parts)
            return
        link = self.link
        if link is not None:
            self._send_detachable(link, parts, header, payload, buffers)
        else:
            for frames in parts:  # the lock per part: other threads' output flows meanwhile
                with self.lock:
                    self._to_controller(frames)
        if self.main.pending_signal is not None:  # a signal came while the main thread sent
            self.main.raise_pending()

    def _shared(
        self, header: H.WireHeader, buffers: Sequence[Buffer]
    ) -> tuple[H.WireHeader, Sequence[Buffer]]:
        """A reply to the controller with its buffers put in this rank's arena (header
        ``sh``; lent to the controller while the arena has room to spare, else copied
        out as it receives it), or as it was: no arena here, too small or too large for
        it, or the arena full."""
        if not self.shm_results or not buffers or self.link is not None:
            return header, buffers
        if sum(memoryview(b).nbytes for b in buffers) < MIN_BYTES:
            return header, buffers
        with self.lock:
            arena = self._arena
            if arena is None:
                arena = self._arena = Arena.create(lend=True)
                if arena is None:  # no shared memory here: the socket from now on
                    self.shm_results = False
                    return header, buffers
            where = arena.place(buffers, (0,))
        if where is None:
            return header, buffers
        return {**header, "sh": where}, ()

    @property
    def arena(self) -> Arena | None:
        """This rank's shared memory for large results (None until the first one)."""
        return self._arena

    def tidy(self) -> None:
        """Give back the shared memory of large results that has been idle a while
        (``Arena.trim``; the control thread, about once a second)."""
        arena = self._arena
        if arena is not None and arena.backed() > KEEP_BYTES:
            with self.lock:
                arena.trim()

    def send_stats(self, header: H.WireHeader, payload: bytes) -> None:
        """The once-a-second ``stats`` (control thread): to the host agent where fan-in
        is on (it sends all its ranks' latest stats on as one message a second), else
        to the controller as any message."""
        agent = self.agent
        if agent is None or self.link is not None:
            self.send(header, payload)
            return
        with self.lock:
            wire_send(agent, self.codec.encode(header, payload))

    def _via_agent(self, request: str, parts: list[list[Any]]) -> None:
        """Send a message of a fan-in request to the host agent (FIFO with the rest)."""
        agent = self.agent
        assert agent is not None
        self._fanin_mark(request, _VIA_AGENT)
        for frames in parts:
            with self.lock:
                wire_send(agent, frames)
        if self.main.pending_signal is not None:
            self.main.raise_pending()

    def _send_detachable(
        self,
        link: ControllerLink,
        parts: list[list[Any]],
        header: H.WireHeader,
        payload: bytes,
        buffers: Sequence[Buffer],
    ) -> None:
        """:meth:`send` in a detachable mesh: wait for room in the controller's queue as
        a plain send does, but never past the controller's going away (the link then
        takes the whole message, even part-way through a stream: the controller that
        went away drops its partial stream): a full queue to a dead controller must
        not block the rank.

        Invariant: a waiting sender lets go of the lock between its looks, and the
        control thread reads the link's monitor while it waits (``watch_while_waiting``):
        that thread alone hears the controller go, and it sends too. Without both, a
        sender that kept taking the lock back, or the control thread waiting for room
        itself, left every sender waiting forever for a controller that was killed."""
        for frames in parts:
            while True:
                with self.lock:  # the check too: see :meth:`welcome`
                    if link.holds(header):  # kept for long: copies, not the rank's memory
                        link.divert(header, payload, owned(list(buffers), 0))
                        return
                    try:
                        wire_send(self.out, frames, flags=zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        self.out.poll(ROOM_WAIT_MS, zmq.POLLOUT)
                link.watch_while_waiting()
                # A moment without the lock: a thread waiting for it gets its turn (a
                # lock let go and taken back at once by the same thread starves it).
                time.sleep(ROOM_TURN_S)

    def welcome(self, link: ControllerLink, request: str, timeout: float) -> bool:
        """Answer a controller's ``attached`` with the metric history, and let metrics
        go live, at one moment for every other sender: a metric sent before it is in
        the history (and held), one sent after comes after the history, so a chart
        never starts with a live point. False if the controller took no message for
        ``timeout`` seconds (it has stopped waiting for the answer by then)."""
        with self.lock:  # every other send waits (and checks ``holds``) under it
            value = {"history": link.welcome(), "dropped": link.dropped}
            payload, buffers = dumps(value, "attached")
            header = H.Result(request=request, ok=True, rank=self.rank).encode()
            for frames in encode_parts(self.codec, header, payload, buffers):
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        wire_send(self.out, frames, flags=zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        if time.monotonic() > deadline:
                            return False
                        self.out.poll(ROOM_WAIT_MS, zmq.POLLOUT)
        return True

    def stream(self, name: str, text: str, request: str | None) -> None:
        """Output of stream ``name`` (captured) during ``request``."""
        self.send(H.Stream(rank=self.rank, request=request, name=name).encode(), text.encode())

    def display(self, op: str, display_id: str | None, payload: bytes) -> None:
        """A rich display (``op``: ``display``, ``update``, ``clear``, ``clear_wait``)
        made during the request being served (see :mod:`monarch_kernel.rank.stdio.display`)."""
        header = H.Display(
            rank=self.rank, request=context.current_request, op=op, display_id=display_id
        )
        self.send(header.encode(), payload)

    def report(self, metrics: Mapping[str, Any]) -> None:
        """``monarch_kernel.report(...)``: numbers for the dashboard."""
        clean = {}
        for key, value in metrics.items():
            try:
                clean[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"report({key}=...) needs a number, got {type(value).__name__}"
                ) from None
        header = H.Metric(rank=self.rank, request=context.current_request)
        if self.link is not None:  # a detachable mesh: kept for the next controller too
            self.link.record(clean, context.current_request)
        self.send(header.encode(), pickle.dumps(clean))

    def reply(self, request: str, value: Any, what: What, where: What | None = None) -> None:
        """Send ``value`` as the result of ``request``; ``what`` names it in the error if
        it does not pickle (the same on every rank, so that the controller groups the
        failures of several ranks into one line), ``where`` is the report's ``where``
        (default: ``what``)."""
        reader = self.handle_readers.get(request) if self.handle_readers else None
        by_handle = self.dump_by_handle
        copies = None
        try:
            if reader is None or by_handle is None:
                payload, buffers = dumps(value, what)
            else:
                payload, buffers, copies = by_handle(value, what, reader)
        except SerializationError as exc:
            at = what if where is None else where
            self.reply_error(request, exc, at if isinstance(at, str) else at())
            return
        header = H.rank_result(request, True, self.rank, copies is not None)
        if copies is None:
            self.result(header, payload, buffers)
            return
        queued: list[bool] = []  # the frames went to libzmq (a Ctrl-C may come after)

        def send(*args: Any) -> bool:
            queued.append(self._result(*args))
            return queued[-1]

        try:
            handoff.sending(buffers, send, header, payload, buffers)
        finally:
            if not (queued and queued[-1]):  # never sent: the caller hears of no value
                copies.release()

    def reply_error(
        self, request: str | None, exc: BaseException, where: str, note: str = ""
    ) -> None:
        """Send the failure ``exc`` (at ``where``; ``note`` after its traceback) as the
        result of ``request``, or to supervision (:meth:`fault`) when nobody waits for one."""
        report = exception_report(exc, where, note)
        report["host"] = self.hostname
        if request is None:  # fire-and-forget: goes to supervision
            self.fault(report, context.current_actor)
        else:
            self.fail(request, report)

    def fail(self, request: str, report: FailureReport) -> None:
        """Send the failure ``report`` as the result of ``request``."""
        self.result(H.rank_result(request, False, self.rank), pickle.dumps(report))

    def result(self, header: H.Result, payload: bytes, buffers: Sequence[Buffer] = ()) -> bool:
        """Send a reply: to the controller, or to the calling rank for a peer call. A
        value above the bound on values is answered with that error instead. Returns
        once libzmq let go of the zero-copy ``buffers`` (:mod:`monarch_kernel.wire.handoff`):
        what runs next on this rank may change the returned tensors in place. False if
        the reply was not sent (that error instead, or the calling rank is gone)."""
        return handoff.sending(buffers, self._result, header, payload, buffers)

    def _result(self, header: H.Result, payload: bytes, buffers: Sequence[Buffer]) -> bool:
        wire = header.encode()  # once: check_size reads it, encoding the message fills it
        if self.handle_readers:
            self.handle_readers.pop(header.request, None)  # type: ignore[arg-type]
        try:
            check_size(wire, payload, buffers)
        except ValueTooLargeError as exc:  # the caller hears why, the rank lives on
            self.fail(header.request or "", exception_report(exc, "reply"))
            return False
        route = self.peer_routes.pop(header.request, None) if self.peer_routes else None  # type: ignore[arg-type]
        if route is None:
            request = header.request
            if self.fanin and request in self.fanin:
                self._fanin_result(request, header, payload, buffers)
            else:
                wire, buffers = self._shared(wire, buffers)
                self.send(wire, payload, buffers)
            return True
        try:
            parts = encode_parts(self.codec, wire, payload, buffers)
            with self.lock:  # replies may come from any thread (response ports)
                sock = self._peer_socket(zmq.PUSH, route)
                for frames in parts:
                    wire_send(sock, frames)
        except (zmq.Again, ConnectionError) as exc:
            log.warning(
                "rank %s: peer caller at %s is gone (%s); reply dropped", self.rank, route, exc
            )
            return False
        return True

    def _fanin_result(
        self, request: str, header: H.Result, payload: bytes, buffers: Sequence[Buffer]
    ) -> None:
        """The reply to a fan-in request: to the agent (combined with the other ranks'),
        or, when large and nothing of the request went through the agent (which would
        then have to come first), to the controller directly, the agent told so."""
        large = bool(buffers) or len(payload) > MAX_COMBINED
        if large and not self.fanin.get(request, 0) & _VIA_AGENT:
            self._fanin_mark(request, _REPLIED)
            wire, buffers = self._shared(header.encode(), buffers)
            for frames in encode_parts(self.codec, wire, payload, buffers):
                with self.lock:
                    self._to_controller(frames)
            told = H.FanInDirect(rank=self.rank, request=request).encode()
            with self.lock:
                wire_send(self.agent, self.codec.encode(told))
        else:
            self.send(header.encode(), payload, buffers)
            self._fanin_mark(request, _REPLIED)
        if self.main.pending_signal is not None:
            self.main.raise_pending()

    def _peer_socket(self, kind: int, addr: PeerAddress) -> zmq.Socket[bytes]:
        """A socket (PUSH for replies, DEALER for supervision) connected to another
        process's peer address, kept for the next message; call under ``lock``."""
        key = (kind, addr)
        sock = self._peer_out.get(key)
        if sock is None:
            # a send timeout: a caller or owner that is gone does not block us
            sock = peer_address.open_socket(
                self.ctx, kind, addr, 1000, PEER_SEND_TIMEOUT_MS, self.machine
            )
            self._peer_out[key] = sock
        return sock

    def fault(self, report: FailureReport, actor: str | None, path: tuple[str, ...] = ()) -> None:
        """A failure nobody waits for: to the owner of ``actor`` if an actor spawned it
        (its ``__supervise__``), else to the controller (``unhandled_fault_hook``)."""
        owner = self.owners.get(actor) if actor else None
        if actor:  # the failing actor at this level (its owner sees it as the failure)
            report = report.copy()
            report["actor"] = actor
            report.setdefault("origin", f"{self.mesh}/{actor}[{context.current_rank().rank}]")
        if owner is None:
            if path:  # the owners that did not handle it (see ``MeshFailure``)
                report = report.copy()
                report["path"] = list(path)
            self.send(H.RankNotice(kind=K.FAULT, rank=self.rank).encode(), pickle.dumps(report))
            return
        body = {
            "mesh": self.mesh,
            "actor": actor,
            "rank": context.current_rank().rank,  # its rank now (self.rank: its slot)
            "report": report,
            "path": path,
        }
        codec = self._peer_codecs.get(owner.key)
        if codec is None:
            codec = self._peer_codecs[owner.key] = Codec(bytes.fromhex(owner.key))
        try:
            with self.lock:
                sock = self._peer_socket(zmq.DEALER, PeerAddress.decode(owner.address))
                header = H.Supervise(owner_name=owner.name).encode()
                wire_send(sock, codec.encode(header, pickle.dumps(body)))
        except (zmq.Again, ConnectionError, ValueError):  # the owner is gone (unreachable):
            fault = H.RankNotice(kind=K.FAULT, rank=self.rank).encode()
            self.send(fault, pickle.dumps(report))  # the controller
