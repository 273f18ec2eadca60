"""A rank's inbox: its sockets to the controller and its host agent, in-order delivery by
sequence number, the table of handlers, and serving the inbox while user code waits (an
async endpoint awaiting, a sync one blocked on a call to another rank) or holds the main
thread (the relief thread reads it then).

The inbox is one DEALER connected to the controller (direct messages) and to the host
agent's fan-out socket (messages to several ranks), and bound to a peer address (calls
from other ranks), so the main thread blocks in one plain receive. Messages from the
controller carry a per-rank sequence number ``q`` and are handled strictly in that order
whichever path they came by; messages from other ranks carry none (FIFO per caller
comes from its connection). One thread reads the socket at a time (``Lines.reader``):
the main thread, or :class:`~monarch_kernel.rank.runners.Relief` while user code holds
it. Which thread runs each actor message is :mod:`monarch_kernel.rank.lines`' (a base
class of the inbox).

Size: over the ~450-line habit: the rank's sockets, the in-order delivery by sequence
number, the handler table and the waits that read the inbox are one loop's state; what
the handlers do lives in ``cells``, ``actors`` and ``control``.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from monarch_kernel.rank import context, listener_gate
from monarch_kernel.rank.actors import Running
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.lane import RankLane
from monarch_kernel.rank.lines import ACTOR_KINDS, FAST, HERE, Lines, _work_left
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.runners import Wake
from monarch_kernel.rank.signals import TERMINATED_CODE, MainThread, RankTerminated
from monarch_kernel.rank.torch_modes import restore_after_interrupt, torch_modes
from monarch_kernel.wire import Codec, Message, WireError, peer_address
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.arena import ArenaReader, SharedArgumentsError
from monarch_kernel.wire.chunks import Assembler
from monarch_kernel.wire.codec import limit_size, readable
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.kinds import SEQ_EPOCH
from monarch_kernel.wire.osutil import REQUEST_END, REQUEST_START
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.spin import SpinWait, spin_seconds

log = logging.getLogger("monarch_kernel.rank")

#: Result types that skip the (slower) awaitable check.
_NOT_AWAITABLE = frozenset({int, float, str, bytes, bool, type(None), list, dict, tuple})

#: A main-thread handler: ``handler(msg, header, request)``, where ``request`` is the
#: request id when the sender waits for a reply (header ``w``), else None.
Handler = Callable[[Message, H.Ordered, str | None], None]


class RequestEnd(Protocol):
    """What ends with every request (the debugger: no trace may outlive it)."""

    used: bool

    def end_of_request(self) -> None:
        """The request is over."""
        ...


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], ident: bytes) -> zmq.Socket[bytes]:
    """A DEALER with routing id ``ident``, its frame size limited."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 1000)
    limit_size(s)  # ZMQ_MAXMSGSIZE: no frame above it is allocated
    return s


def connect(s: zmq.Socket[bytes], addr: str, cfg: RankConfig) -> None:
    """Connect ``s`` to ``addr``; as a CURVE client (the host's keypair) when the mesh
    uses CURVE: the controller's key for its tcp sockets, the host agent's own public
    key for its fan-out socket."""
    if cfg.curve_secret:
        s.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve_public.encode())
        s.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve_secret.encode())
        server = cfg.curve_server if addr.startswith("tcp://") else None
        s.setsockopt(zmq.CURVE_SERVERKEY, (server or cfg.curve_public).encode())
    s.connect(addr)


def bind_peer(sock: zmq.Socket[bytes], cfg: RankConfig) -> PeerAddress:
    """Bind ``sock`` (the inbox) for actor calls from other ranks: a unix socket in the
    host agent's private (0700) directory and, when the mesh may span machines (its
    sockets use CURVE), a CURVE TCP socket on this host's address that admits the
    mesh's listener key only (``rank.listener_gate``)."""
    from monarch_kernel.rank.dataplane.common import host_addr, socket_path

    # The same path (and TCP port and key, see the controller's rank specs) after a
    # restart: references to this rank held by other ranks reach it again. (A host
    # agent's directory always leaves room for it: ``wire.tempdirs.make_private_dir``.)
    path = socket_path(cfg, f"pr{cfg.slot}")
    tcp_host = host_addr(cfg) if cfg.curve_secret else ""
    return peer_address.bind(
        sock,
        path,
        tcp_host,
        machine=cfg.hostname,
        secret=cfg.peer_secret,
        port=cfg.peer_port,
        gate=listener_gate.gate(),
    )


#: Messages this process's inbox handled in order (a ``batch`` counts once), and calls
#: it took out of ``batch`` messages: statistics, read by tests to see batching work.
inbox_counts = {"messages": 0, "batched_calls": 0}


class Inbox(Lines):
    """The rank's message loop (see the module docstring): read by the main thread,
    or by the relief thread while it is held; which thread runs each actor message is
    :class:`~monarch_kernel.rank.lines.Lines`'."""

    def __init__(
        self,
        cfg: RankConfig,
        sock: zmq.Socket[bytes],
        codec: Codec,
        main: MainThread,
        outbox: Outbox,
        log_fd: int,
    ):
        self.cfg = cfg
        self.rank = cfg.slot  # its wire id: its sequence numbers are found by it in ``d``
        self.sock = sock
        self.codec = codec
        self.main = main
        self.outbox = outbox
        self.log_fd = log_fd
        #: Ordered handlers by kind (``hello`` never gets to them): see :data:`Handler`.
        self.handlers: dict[str, Handler] = {}
        #: Told at the end of every request (set by the rank: its debugger).
        self.request_end: RequestEnd | None = None
        self.next_seq = 0
        self.held: dict[int, tuple[Message, H.Ordered]] = {}
        #: Controller messages read while the main thread was in a handler, kept for it
        #: (a cell, and every controller message after it).
        self.deferred: collections.deque[tuple[Message, H.Ordered]] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake: tuple[Wake, zmq.Poller, zmq.Poller] | None = None  # see serve_until
        #: Completed by :meth:`pump` when a controller message comes while :meth:`idle`
        #: runs the event loop for the actors' background tasks.
        self._idle_stop: asyncio.Future[None] | None = None
        #: Reassembles large values (calls' arguments) that come in chunks.
        self.assembler = Assembler()
        #: Reads calls' arguments that the controller put in shared memory.
        self.arena = ArenaReader(lend=True)
        self.spin = SpinWait(_rank_spin(cfg))
        #: The same-machine lane from the controller (``rank.lane``), read beside the
        #: socket once opened; a poller over both for the main loop's waits.
        self.lane: RankLane | None = None
        self._lane_poller: zmq.Poller | None = None
        self._socket_turn = False  # the socket's turn before the lane's
        #: The requests the main thread is handling, outermost first (an endpoint that
        #: waits serves others inside it): the stop button reaches the innermost, and an
        #: outer one cancelled meanwhile is interrupted once the inner ones are over.
        self.active: list[str | None] = []
        #: request -> the task its async endpoint runs as (started while another
        #: endpoint awaited): cancelled when the stop button cancels that request.
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        #: What the main thread serves (``context.current_request`` there).
        self.here = context.serving()
        self.init_lines(cfg.local_rank)
        main.on_interrupt = self.interrupt_others

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        """Serve the inbox forever (the main thread, once the rank started)."""
        inbox = self.sock
        deferred = self.deferred
        spin = self.spin
        me = self.main_ident
        while True:
            try:
                if self.reader != me:
                    self.reclaim()
                loop = self.loop
                if loop is not None and self.loop_owner is None and _work_left(loop):
                    self.idle(loop)  # background tasks run until a message comes
                    if not deferred and not self.has_message():
                        continue
                if not deferred:
                    if self.lane is None:
                        spin.until_readable(inbox)  # the next call due soon: no wake-up
                        self.receive(wire_recv(inbox))
                    else:
                        self.receive(self._next_message(self.lane))
                while deferred:  # controller messages read while a handler ran
                    if self.reader != me:
                        self.reclaim()
                    self.accept(*deferred.popleft())
            except KeyboardInterrupt:
                continue

    # -- the same-machine lane (rank.lane) -----------------------------------------------
    def read_lane(self, lane: RankLane) -> None:
        """Read ``lane``'s down ring beside the socket from now on (the main thread, in
        the ``lane`` message's handler)."""
        self.lane = lane
        poller = self._lane_poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(lane.wake, zmq.POLLIN)
        if self._wake is not None:  # serve_until's poller of both
            self._wake[1].register(lane.wake, zmq.POLLIN)
        loop = self.loop
        if loop is not None and self._reader_on:  # the event loop reads the inbox too
            loop.add_reader(lane.wake, self.pump)

    def inbox_fds(self) -> list[int]:
        """What to poll for the inbox's messages: the socket's ``ZMQ_FD`` (edge-
        triggered: read all after it fires) and the lane's wake-up pipe."""
        fds = [int(self.sock.getsockopt(zmq.FD))]
        if self.lane is not None:
            fds.append(self.lane.wake)
        return fds

    def has_message(self) -> bool:
        """Whether a message waits in the lane or on the socket (no blocking)."""
        lane = self.lane
        return (lane is not None and lane.pending()) or readable(self.sock)

    def take_message(self) -> Any:
        """The next message of the lane or the socket, or None (no blocking); the two
        take turns while both have some (calls from other ranks come on the socket)."""
        lane = self.lane
        if lane is not None:
            if self._socket_turn and readable(self.sock):
                self._socket_turn = False
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            frames = lane.take()
            if frames is not None:
                self._socket_turn = True
                return frames
        if readable(self.sock):
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        return None

    def _next_message(self, lane: RankLane) -> Any:
        """Block for the next message of the lane or the socket (the main loop): spin
        first, as for the socket alone; the wake-up pipe is emptied before the last
        look, so a message written after it always wakes the poll."""
        sock = self.sock
        while True:
            frames = self.take_message()
            if frames is not None:
                return frames
            if self.spin.until(self.has_message):
                continue
            lane.drain_wake()
            if lane.pending() or readable(sock):
                continue
            assert self._lane_poller is not None
            self._lane_poller.poll()

    def receive(self, frames: list[Any]) -> None:
        """Verify, decode and handle one message (in order)."""
        msg = self.decode(frames)
        if msg is not None:
            self.accept(msg, H.decode_ordered(msg.header))

    def decode(self, frames: list[Any]) -> Message | None:
        """The verified message, None (logged) if it is forged or malformed, or while
        it is a part of a large value still arriving in chunks."""
        try:
            msg = self.assembler.receive(self.codec, frames)
            if msg is not None and "sh" in msg.header:
                return self.arena.take(msg, self.rank)
            return msg
        except WireError as exc:
            log.warning("rank %s dropped a message: %s", self.rank, exc)
            return None

    def greet_host(self, timeout: float = 30.0) -> None:
        """Wait until the host agent can fan messages out to our inbox.

        We say hello from a throw-away socket; the agent answers with a hello sent to
        our inbox's routing id, which arrives once that connection is up. The greeting
        is repeated: an answer may go to the connection of an earlier incarnation of
        this rank that the agent has not dropped yet.
        """
        greet = dealer(self.sock.context, f"g{self.rank}".encode())
        connect(greet, self.cfg.fanout, self.cfg)
        greet.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                # encoded afresh each time: the agent drops a replayed (identical) one
                greet.send_multipart(self.codec.encode(H.Hello(rank=self.rank).encode()))
                while self.sock.poll(100):
                    msg = self.decode(wire_recv(self.sock))
                    if msg is None:
                        continue
                    hdr = H.decode_ordered(msg.header)
                    if isinstance(hdr, H.Hello):
                        return
                    self.accept(msg, hdr)
            raise RuntimeError(f"rank {self.rank}: host agent did not answer in {timeout}s")
        finally:
            greet.close()

    def accept(self, msg: Message, hdr: H.Ordered) -> None:
        """Dispatch ``msg`` in sequence order (held back while earlier ones are missing)."""
        seq = hdr.seq_for(self.rank)
        if seq is None:
            self.dispatch(msg, hdr)
            return
        if seq != self.next_seq:
            if seq >= (self.next_seq // SEQ_EPOCH + 1) * SEQ_EPOCH:
                self._new_epoch(seq)  # a later controller attached: count from its base
            if seq != self.next_seq:
                if seq > self.next_seq:
                    self.held[seq] = (msg, hdr)
                return  # already handled, or a fan-out that does not name us (-1)
        # counted before it runs: a message served while it waits (pump) is the next one
        self.next_seq += 1
        self.dispatch(msg, hdr)
        while self.next_seq in self.held:
            held = self.held.pop(self.next_seq)
            self.next_seq += 1
            self.dispatch(*held)

    def _new_epoch(self, seq: int) -> None:
        """Messages of a later controller of a detachable mesh came: those of earlier
        ones not handled yet (their sender is gone) are dropped."""
        base = seq - seq % SEQ_EPOCH
        self.next_seq = base
        self.held = {q: m for q, m in self.held.items() if q >= base}

    def dispatch(self, msg: Message, hdr: H.Ordered) -> None:
        """Handle one message: an actor's where :meth:`route` says (here, a worker, the
        event loop, its line), anything else on this thread (the main thread, after
        the actors' threads are done: :meth:`quiesce`)."""
        if isinstance(hdr, H.Hello):  # the connection probe: nothing to run, to flush
            return
        inbox_counts["messages"] += 1
        kind = hdr.KIND
        if kind in ACTOR_KINDS:
            where = self.route(msg, hdr, hdr.seq is not None)
            if where == FAST:  # counted in by the main thread's fast path
                try:
                    self.run_here(msg, hdr)
                finally:
                    name = self._entered
                    if name is not None:  # its handler never ran: counted out here
                        self._entered = None
                        self.leave(name)
                return
            if where != HERE:
                return
        elif type(hdr) is H.Batch:
            self._run_batch(msg, hdr)
            return
        elif hdr.seq is not None and threading.get_ident() == self.main_ident:
            self.exclusive = True  # the relief thread starts no controller message
            try:
                runners = self.runners
                if runners is not None and (runners.running or self.loop_owner is not None):
                    self.quiesce()
                self.run_here(msg, hdr)
            finally:
                self.exclusive = False
            return
        self.run_here(msg, hdr)

    def run_saved(self, msg: Message, hdr: H.Ordered) -> None:
        """:meth:`run_here`, inside another message of this thread (what it serves is
        put back after)."""
        here = context.serving()
        saved = (here.request, here.actor, here.slice)
        try:
            self.run_here(msg, hdr)
        finally:
            here.request, here.actor, here.slice = saved

    def _by_handle(self, request: str, pid: int) -> None:
        """Request ``request`` comes from process ``pid``, a rank of this machine that
        takes the result's large CUDA tensors as handles on copies kept for it
        (``rank.dataplane.cuda_results``, loaded at the first such request)."""
        outbox = self.outbox
        if outbox.dump_by_handle is None:
            from monarch_kernel.rank.dataplane.cuda_results import dump_result

            outbox.dump_by_handle = dump_result
        outbox.handle_readers[request] = pid

    def run_here(self, msg: Message, hdr: H.Ordered) -> None:
        """Run one message on this thread with its handler (see ``self.handlers``)."""
        request = hdr.request if hdr.wants_reply else None
        if hdr.reply_to is not None and request is not None:  # a call from another rank
            try:
                route = self.outbox.peer_routes[request] = PeerAddress.decode(hdr.reply_to)
            except ValueError:
                log.warning("rank %s: request %s names no reply address", self.rank, request)
            else:
                pid = hdr.results_pid if type(hdr) is H.Call else None
                if pid is not None and route.ipc and route.machine == self.outbox.machine:
                    self._by_handle(request, pid)
        # A request fanned out by the host agent is answered through it (wire.fanin).
        fanin = (
            request is not None
            and hdr.fanout
            and hdr.reply_to is None
            and self.outbox.fanin_open(request)
        )
        cancelled = self.main.cancelled
        if request is not None and request in cancelled:
            cancelled.discard(request)
            stop = KeyboardInterrupt("cancelled before it started")
            self.outbox.reply_error(request, stop, msg.kind)
            if fanin:
                self.outbox.fanin_close(request)
            return
        if msg.lost:  # its arguments could not be read: answer that, run nothing
            self.outbox.reply_error(request, SharedArgumentsError(msg.lost), msg.kind)
            if fanin:
                self.outbox.fanin_close(request)  # type: ignore[arg-type]
            return
        handler = self.handlers.get(hdr.KIND) or self._other
        on_main = threading.get_ident() == self.main_ident
        here = self.here if on_main else context.serving()
        here.request = hdr.request
        if request is not None:
            _mark(self.log_fd, _START)  # what it prints from here on is this request's
        if on_main:
            self.active.append(hdr.request)
            self.responsive = False  # held by it (the relief thread looks)
            self.serial += 1
            if self.relief_napping:
                self.wake_relief()
        try:
            handler(msg, hdr, request)
        finally:
            if on_main:
                self.active.pop()
                self.responsive = True
            sys.stdout.flush()
            sys.stderr.flush()
            if request is not None:
                _mark(self.log_fd, _END)
            if cancelled:
                cancelled.discard(here.request)
            ended = self.request_end
            if ended is not None and ended.used and on_main:
                ended.end_of_request()
            here.request = None
            if fanin:
                self.outbox.fanin_close(request)  # type: ignore[arg-type]

    def _interrupt_outer(self) -> None:
        """The request that waits here (innermost of :attr:`active`) was cancelled
        while a request it served ran (the stop button's signal went to that one):
        interrupt it now, once."""
        active = self.active
        if not active or not self.main.in_user_code:
            return
        if threading.get_ident() != self.main_ident:
            return
        request = active[-1]
        cancelled = self.main.cancelled
        if request is not None and request in cancelled:
            cancelled.discard(request)
            raise KeyboardInterrupt("cancelled")

    def _run_batch(self, msg: Message, hdr: H.Batch) -> None:
        """Run the fire-and-forget calls of a (verified) ``batch`` in order, each as
        :meth:`dispatch` runs a call that wants no reply (what it does for requests,
        peer callers and fan-ins does not apply); an interrupt stops only the call it
        lands in. A call to an actor that is busy (on another thread) or would run
        elsewhere keeps its order in that actor's line."""
        try:
            calls = H.unbatch(hdr, msg.payload)
        except H.HeaderError as exc:
            log.warning("rank %s: malformed message: %s", self.rank, exc)
            return
        inbox_counts["batched_calls"] += len(calls)
        here = context.serving()
        for call, header, payload in calls:
            one = Message(header, payload)
            if self.route(one, call, True) not in (HERE, FAST):
                continue
            # looked up per call: a call may arm the debugger, which swaps the handler
            handler = self.handlers.get(K.CALL) or self._other
            here.request = None
            try:
                try:
                    handler(one, call, None)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    ended = self.request_end
                    if ended is not None and ended.used:
                        ended.end_of_request()
                    here.request = None
            except KeyboardInterrupt:
                continue  # as Inbox.run does for a message on its own

    def _other(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """A kind this rank does not serve on its main thread, or a malformed header:
        logged, and (malformed, with a reply wanted) answered with the error."""
        error = hdr.error if isinstance(hdr, H.OtherOrdered) else ""
        if not error:
            log.warning("rank %s: unknown message kind %r", self.rank, msg.header["k"])
            return
        log.warning("rank %s: malformed message: %s", self.rank, error)
        if request is not None:
            self.outbox.reply_error(request, H.HeaderError(error), str(msg.header.get("k")))

    # -- user code -------------------------------------------------------------------
    def run_user(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call user code with interrupts enabled; await it if it is a coroutine.

        While a coroutine awaits, the inbox keeps being served (see :meth:`pump`); an
        async endpoint that starts then becomes a task on the running loop, returned
        as :class:`~monarch_kernel.rank.actors.Running` (answered when it ends). On a
        worker thread: :meth:`_run_user_elsewhere`."""
        if threading.get_ident() != self.main_ident:
            return self._run_user_elsewhere(fn, args, kwargs)
        main = self.main
        outer = main.in_user_code
        modes = torch_modes()  # put back if an interrupt lands in torch's own switches
        main.in_user_code = True
        try:
            if main.cancelled and self.here.request in main.cancelled:
                raise KeyboardInterrupt("cancelled")
            result = fn(*args, **kwargs)
            if result.__class__ not in _NOT_AWAITABLE and inspect.isawaitable(result):
                loop = self.event_loop()
                if asyncio._get_running_loop() is loop:  # served while another awaits
                    return self._as_task(loop, result)
                self.take_loop()
                self.wait_depth += 1
                try:
                    loop.call_soon(self.pump)  # anything that came before the reader saw it
                    result = loop.run_until_complete(result)
                finally:
                    self.wait_depth -= 1
                    self.give_loop()
            return result
        except RankTerminated:
            raise
        except KeyboardInterrupt as exc:
            main.in_user_code = outer  # a second press does not cut the restore short
            # (tasks of the loop may be inside an autocast region: it stays open then)
            restore_after_interrupt(modes, autocast=not self.tasks)
            if not exc.args and self.tasks:  # SIGINT (not "cancelled" said by us)
                # The signal reaches only the stack; endpoints that run as tasks stop
                # too: those of the requests cancelled (the stop button), or all of
                # them for a bare interrupt() of the rank
                if main.cancelled:
                    self._cancel_tasks()
                else:
                    for task in list(self.tasks.values()):
                        _cancel(task)
            raise
        except BaseException as exc:
            # SIGTERM's RankTerminated raised inside native code that turned it into an
            # error of its own (torch's autograd: "Cannot extract tensors from value:
            # RankTerminated: 143"): the rank is stopping, its cell did not fail.
            if main.terminating:
                raise RankTerminated(TERMINATED_CODE) from exc
            raise
        finally:
            main.in_user_code = outer

    def _run_user_elsewhere(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """:meth:`run_user` on a thread other than the main one: a worker (whose user
        code the stop button interrupts), the worker that runs the event loop, or the
        relief thread (quick handlers only)."""
        here = context.serving()
        cancelled = self.main.cancelled
        if cancelled and here.request in cancelled:
            raise KeyboardInterrupt("cancelled")
        runners = self.runners
        worker = runners.current() if runners is not None else None
        if worker is None:
            result = fn(*args, **kwargs)
        else:
            with worker.user():
                result = fn(*args, **kwargs)
        if result.__class__ not in _NOT_AWAITABLE and inspect.isawaitable(result):
            loop = self.loop
            if loop is not None and asyncio._get_running_loop() is loop:
                return self._as_task(loop, result)
            private = asyncio.new_event_loop()  # not the actors' loop: its own
            try:
                if worker is None:
                    return private.run_until_complete(result)
                with worker.user():
                    return private.run_until_complete(result)
            finally:
                private.close()
        return result

    def _as_task(self, loop: asyncio.AbstractEventLoop, result: Any) -> Running:
        """An async endpoint started on the running loop: a task, answered when it ends
        (the stop button cancels it with its request)."""
        task = loop.create_task(_as_coroutine(result))
        request = context.serving().request
        if request is not None:  # the stop button cancels it (_cancel_tasks)
            tasks = self.tasks
            tasks[request] = task
            task.add_done_callback(lambda _: tasks.pop(request, None))
            loop.call_later(IDLE_CHECK, self._watch_task, loop, task)
        return Running(task)

    def interrupt_others(self) -> None:
        """SIGINT (the main thread's handler): the threads besides the main one stop
        their user code too: the workers and the tasks of an event loop run by a worker
        (those of the requests the stop button cancelled, or all of them)."""
        runners = self.runners
        if runners is None:
            return
        cancelled = self.main.cancelled
        runners.interrupt(set(cancelled) if cancelled else None)
        loop = self.loop
        if loop is not None and self.loop_owner not in (None, self.main_ident):
            for request, task in list(self.tasks.items()):
                if not cancelled or request in cancelled:
                    loop.call_soon_threadsafe(task.cancel)

    def interrupt_request(self, request: str) -> bool:
        """The stop button for ``request`` if a worker runs it (the control thread)."""
        runners = self.runners
        return runners is not None and runners.interrupt({request}) > 0

    def serve_until(self, fut: Any, timeout: float | None) -> None:
        """Before a thread blocks on a call to another rank (``.get()`` in a sync
        endpoint): serve calls that come meanwhile until ``fut`` is done (or ``timeout``
        passes), so that a call cycle between meshes (A calls B, which calls A back)
        does not wait for itself. The main thread reads the inbox (or, while the relief
        thread reads it, runs what comes for its actor); a worker runs what comes for
        its actor (:meth:`wait_elsewhere`); other threads just block."""
        if timeout == 0 or fut.done():
            return
        me = threading.get_ident()
        if me != self.main_ident:
            self.wait_elsewhere(fut, timeout)
            return
        if self._wake is None:  # a pipe the future's completion writes to
            wake = self._main_wake = Wake()
            both = zmq.Poller()
            both.register(self.sock, zmq.POLLIN)
            both.register(wake.r, zmq.POLLIN)
            if self.lane is not None:
                both.register(self.lane.wake, zmq.POLLIN)
            alone = zmq.Poller()
            alone.register(wake.r, zmq.POLLIN)
            self._wake = (wake, both, alone)
        wake, both, alone = self._wake
        fut.add_done_callback(wake)
        deadline = None if timeout is None else time.monotonic() + timeout
        box = self.open_mailbox(me, wake)
        self.wait_depth += 1
        self.responsive = True
        try:
            while not fut.done():
                left = None if deadline is None else int((deadline - time.monotonic()) * 1000)
                if left is not None and left <= 0:
                    return
                mine = self.reader == me
                events = dict((both if mine else alone).poll(left if mine else 50))
                if wake.r in events:
                    wake.clear()
                if box:
                    self.run_mailbox(box)
                lane = self.lane
                if (
                    mine
                    and (self.sock in events or (lane is not None and lane.wake in events))
                    and not fut.done()
                ):
                    self.pump(until=fut)
        finally:
            self.close_mailbox(me, box)
            self.wait_depth -= 1
            self.main_held()

    def idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Between messages, run the actors' event loop while tasks they started
        (``asyncio.create_task`` in an async endpoint) are pending, as Monarch's actors
        do: until a message from the controller comes (calls from other ranks are served
        meanwhile by :meth:`pump`) or no task is left; not while a worker runs it."""
        if not self.take_loop(wait=False):
            return
        stop: asyncio.Future[None] = loop.create_future()
        self._idle_stop = stop

        def check() -> None:
            if stop.done():
                return
            self._cancel_tasks()
            if not _work_left(loop) or self.deferred:
                stop.set_result(None)
            else:
                loop.call_later(IDLE_CHECK, check)

        loop.call_soon(self.pump)  # what came before the loop's reader looked
        loop.call_soon(check)
        main = self.main
        outer = main.in_user_code
        main.in_user_code = True  # the tasks are user code (interruptible)
        self.wait_depth += 1
        try:
            loop.run_until_complete(stop)
        finally:
            self.wait_depth -= 1
            main.in_user_code = outer
            self._idle_stop = None
            self.give_loop()
            self.responsive = True

    def pump(self, until: Any = None) -> None:
        """Read the inbox while a handler runs: called by the main thread while user
        code waits (``.get()``, an async endpoint's ``await``: the event loop's reader)
        and by the relief thread while the main thread is held. ``until``: the future
        a ``.get()`` waits for; once it is done nothing more is read (the wait is over:
        what came meanwhile waits for the main loop, as it would had the result come
        first; on a loaded machine the result and, say, a supervision event that
        fails the waiting actor are both there when the thread runs again, and serving
        that one first failed an endpoint that had its result).

        Calls from other ranks run now (an actor awaiting a call to another mesh that
        calls back into this one must not wait for itself). Messages from the
        controller to an actor run now too, in order (:meth:`_starts_now`): actors are
        concurrent, so another actor's call does not wait for this endpoint, and one to
        a busy actor waits in that actor's line. Every other controller message (a
        cell, a ``push``), and all after it, is kept for the main thread; so is
        everything while :meth:`idle` runs background tasks (the loop stops, they run
        outside)."""
        me = threading.get_ident()
        if self.reader != me:
            return  # another thread reads the inbox now
        deferred = self.deferred
        on_main = me == self.main_ident
        idle_stop = self._idle_stop if on_main else None
        lane = self.lane
        if lane is not None:
            lane.drain_wake()  # level-triggered where polled: read what it announced
        while deferred and idle_stop is None and self._starts_now(deferred[0][1], True):
            # kept back before this endpoint started (read while idle): may start now
            kept, kept_hdr = deferred.popleft()
            self._start_nested(kept, kept_hdr)
        lock = self.lock
        while until is None or not until.done():
            with lock:
                if self.reader != me or self.full(len(deferred)):
                    return
                frames = self.take_message()
                if frames is None:
                    return
            msg = self.decode(frames)
            if msg is None:
                continue
            hdr = H.decode_ordered(msg.header)
            if hdr.seq is not None:
                if idle_stop is None and self._starts_now(hdr):
                    # to another actor (or in that actor's line): it does not wait
                    # for the endpoint that waits here
                    self._start_nested(msg, hdr)
                    continue
                deferred.append((msg, hdr))
                if idle_stop is not None and not idle_stop.done():
                    idle_stop.set_result(None)
                continue
            self.run_nested(msg, hdr)
            if on_main:
                self._interrupt_outer()

    def run_nested(self, msg: Message, hdr: H.Ordered) -> None:
        """Accept ``msg`` inside what this thread serves (put back after)."""
        here = context.serving()
        saved = (here.request, here.actor, here.slice)
        try:
            self.accept(msg, hdr)
        finally:
            here.request, here.actor, here.slice = saved

    def _cancel_tasks(self) -> None:
        """Cancel the tasks (:attr:`tasks`) of requests the stop button cancelled: the
        control thread's SIGINT reaches only the code on the main thread's stack."""
        cancelled = self.main.cancelled
        if not cancelled or not self.tasks:
            return
        for request, task in list(self.tasks.items()):
            if request in cancelled:
                cancelled.discard(request)
                _cancel(task)

    def _watch_task(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        """While ``task`` runs, look every :data:`IDLE_CHECK` whether the stop button
        cancelled its request (the loop may be busy with an endpoint that awaits)."""
        if task.done():
            return
        self._cancel_tasks()
        if not task.done():
            loop.call_later(IDLE_CHECK, self._watch_task, loop, task)

    def _start_nested(self, msg: Message, hdr: H.Ordered) -> None:
        """Start controller message ``msg`` (the next in order) inside the endpoint that
        waits here (see :meth:`pump`)."""
        self.next_seq += 1
        here = context.serving()
        saved = (here.request, here.actor, here.slice)
        try:
            self.dispatch(msg, hdr)
        finally:
            here.request, here.actor, here.slice = saved
        self._interrupt_outer()

    def _starts_now(self, hdr: H.Ordered, head: bool = False) -> bool:
        """Whether a controller message read while a handler runs starts now: the next
        in order, nothing before it kept back (``head``: it is the first of those kept
        back), to an actor (:data:`ACTOR_KINDS`, or a batch of calls: each keeps its
        actor's order), and (read by the relief thread) not while the main thread runs
        a cell."""
        return (
            (hdr.KIND in ACTOR_KINDS or type(hdr) is H.Batch)
            and (head or not self.deferred)
            and not self.held
            and hdr.seq_for(self.rank) == self.next_seq
            and not (self.exclusive and threading.get_ident() != self.main_ident)
        )


def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` from any thread (its loop may run on another)."""
    loop = task.get_loop()
    if asyncio._get_running_loop() is loop:
        task.cancel()
    else:
        loop.call_soon_threadsafe(task.cancel)


#: Seconds between looks, while :meth:`Inbox.idle` runs the event loop, at whether
#: background tasks are left.
IDLE_CHECK = 0.05


async def _as_coroutine(aw: Any) -> Any:
    return await aw


_START = (REQUEST_START + "\n").encode()
_END = (REQUEST_END + "\n").encode()


def _rank_spin(cfg: RankConfig) -> float:
    """How long this rank spins for its next message (``wire.spin``); a bad
    ``MONARCH_KERNEL_SPIN_US`` given to its host only is logged, and it never spins."""
    try:
        return spin_seconds(cfg.local_world_size)
    except ValueError as exc:
        log.warning("rank %s: %s; not spinning", cfg.slot, exc)
        return 0.0


def _mark(fd: int, marker: bytes) -> None:
    """A request boundary in the rank's log (see ``osutil.request_tail``)."""
    try:
        os.write(fd, marker)
    except OSError:
        pass
