"""The rank process: receives ordered work on its main thread, control on a side thread.

Sockets (all DEALERs, so a point-to-point call is one hop from the controller):

* ``inbox``  (main thread)  <- controller (direct messages) and this host's agent
  (messages fanned out to several ranks): one socket connected to both, so that the
  main thread blocks in a plain receive instead of polling two sockets per message;
* ``ctl``    (control thread) <- controller, push/pull/ping served while user code runs;
* ``out``    (any thread, under a lock) -> controller: results, streams, metrics.

Messages on ``inbox`` carry a per-rank sequence number; they are handled strictly in
that order whichever path they came by (FIFO per sender).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from monarch_kernel.rank import capture, context, env
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.errors import exception_report
from monarch_kernel.shape import Point
from monarch_kernel.wire import (
    Codec,
    Message,
    SerializationError,
    WireError,
    dumps,
    loads,
    peer_address,
)
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import limit_size
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire.osutil import REQUEST_END, REQUEST_START, die_with_parent
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.serialize import What

log = logging.getLogger("monarch_kernel.rank")

#: Result types that skip the (slower) awaitable check.
_NOT_AWAITABLE = frozenset({int, float, str, bytes, bool, type(None), list, dict, tuple})

#: A main-thread handler: ``handler(msg, request)``.
Handler = Callable[[Message, str | None], None]
#: A control-thread handler: ``handler(msg)``.
ControlHandler = Callable[[Message], None]


class Rank:
    """One rank: its sockets, actors, namespace and message loop."""

    def __init__(self, cfg: dict[str, Any], log_fd: int):
        self.cfg = cfg
        self.rank: int = cfg["rank"]
        self.log_fd = log_fd
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.ctx = zmq.Context()
        # Routing ids carry a tag only this host's key holders can compute (see
        # launchers.base.ident_tag): another host's peer cannot take them over.
        tag = ident_tag(cfg.get("curve_secret", ""))
        ident = b"r%d" % self.rank + tag
        #: Actor calls from other ranks (rank to rank, not through the controller) arrive
        #: on the inbox too: it also listens on a unix socket in the host's private
        #: directory and, in a mesh that spans machines, on a CURVE TCP socket, so the
        #: main thread still blocks on one socket. Those messages are signed with this
        #: mesh's key like every other and carry no sequence number (FIFO per sender
        #: comes from the connection); replies go to the caller's reply socket named in
        #: the request (header ``rt``). The peer endpoints are bound before the
        #: controller connections: see ``wire.peer_address`` (options per endpoint).
        self.inbox = self._dealer(ident, None)
        self.peer = _bind_peer(self.inbox, cfg, self.rank)
        self._connect(self.inbox, cfg["send"])
        self._connect(self.inbox, cfg["fanout"])
        #: request id -> the calling rank's reply address (a peer call)
        self.peer_routes: dict[str, PeerAddress] = {}
        self._peer_out: dict[tuple[int, PeerAddress], zmq.Socket] = {}
        #: actor name -> its owner (header keys ``oa``, ``ox``, ``on``, ``or`` of the
        #: spawn): an actor spawned by an actor of some rank; see ``rank.supervise``.
        self.owners: dict[str, dict[str, Any]] = {}
        self._peer_codecs: dict[str, Codec] = {}
        self.out = self._dealer(ident, cfg["recv"])
        self.ctl = self._dealer(b"c%d" % self.rank + tag, cfg["send"])
        self.out_lock = threading.Lock()
        self.actors: dict[str, Any] = {}
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        self.next_seq = 0
        self.held: dict[int, Message] = {}
        self._wake: tuple[int, int, zmq.Poller] | None = None  # see serve_until
        #: Controller messages read by ``_pump`` while an async endpoint awaited.
        self.deferred: collections.deque[Message] = collections.deque()
        self.in_user_code = False
        #: A signal (SIGINT/SIGTERM) that came while the main thread was sending: raised
        #: once that send is over, so a multipart message is never cut in half.
        self.pending_signal: int | None = None
        self.terminating = False  # SIGTERM: the rank is on its way out (see _on_sigterm)
        self.cancelled: set[str] = set()  # requests cancelled before or while they ran
        self.loop: asyncio.AbstractEventLoop | None = None
        self.parent = os.getppid()
        labels, sizes = cfg["labels"], cfg["sizes"]
        point = Point(dict(zip(labels, cfg["coords"])), self.rank)
        context.install(point, dict(zip(labels, sizes)), self)
        #: Ordered (main-thread) handlers: ``handler(msg, request)``, where ``request`` is
        #: the request id when the sender waits for a reply (header ``w``), else None.
        #: HELLO never gets here (see :meth:`_dispatch`).
        self._handlers: dict[str, Handler] = {
            K.CALL: self._call,
            K.SPAWN_ACTOR: self._spawn_actor,
            K.EXEC: self._exec,
            K.STOP_ACTOR: self._stop_actor,
            K.SUPERVISE: self._supervise,
            K.DEBUG: self._debug,
        }
        #: Control-thread handlers: ``handler(msg)``; what they raise is sent back as an
        #: error reply to the request (header ``i``), or as a fault if there is none.
        self._control_handlers: dict[str, ControlHandler] = {
            K.HELLO: _ignore,  # the controller's connection probe
            K.CANCEL: self._cancel,
            K.STACKS: self._stacks,
            K.PUSH: self._push,
            K.PULL: self._pull,
            K.PING: self._ping,
            K.ABORT_PG: self._abort_pg,
            K.INPUT_REPLY: self._input_reply,
        }
        from monarch_kernel.rank.stdin import InputBridge

        self.stdin = InputBridge(self)
        from monarch_kernel.rank.debugger import RankDebugger

        self.debugger = RankDebugger(self)

    def _dealer(self, ident: bytes, addr: str | None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 1000)
        limit_size(s)  # ZMQ_MAXMSGSIZE: no frame above it is allocated
        if addr is not None:
            self._connect(s, addr)
        return s

    def _connect(self, s: zmq.Socket, addr: str) -> None:
        """Connect ``s`` to ``addr``; as a CURVE client (the host's keypair) when the mesh
        uses CURVE: the controller's key for its tcp sockets, the host agent's own public
        key for its fan-out socket."""
        secret = self.cfg.get("curve_secret")
        if secret:
            s.setsockopt(zmq.CURVE_PUBLICKEY, self.cfg["curve_public"].encode())
            s.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
            server = self.cfg["curve_server"] if addr.startswith("tcp://") else None
            s.setsockopt(zmq.CURVE_SERVERKEY, (server or self.cfg["curve_public"]).encode())
        s.connect(addr)

    # -- sending ---------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes = b"", buffers: Any = ()) -> None:
        with self.out_lock:
            wire_send(self.out, self.codec.encode(header, payload, buffers))
        if self.pending_signal is not None:  # a signal came while the main thread sent
            self._raise_pending()

    def _stream(self, name: str, text: str, request: str | None) -> None:
        self.send({"k": K.STREAM, "r": self.rank, "i": request, "n": name}, text.encode())

    def report(self, metrics: dict[str, Any]) -> None:
        clean = {}
        for key, value in metrics.items():
            try:
                clean[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"report({key}=...) needs a number, got {type(value).__name__}"
                ) from None
        header = {"k": K.METRIC, "r": self.rank, "i": context.current_request}
        self.send(header, pickle.dumps(clean))

    def reply(self, request: str, value: Any, what: What, where: What | None = None) -> None:
        """Send ``value`` as the result of ``request``; ``what`` names it in the error if
        it does not pickle (the same on every rank, so that the controller groups the
        failures of several ranks into one line), ``where`` is the report's ``where``
        (default: ``what``)."""
        try:
            payload, buffers = dumps(value, what)
        except SerializationError as exc:
            at = what if where is None else where
            self.reply_error(request, exc, at if isinstance(at, str) else at())
            return
        self._result({"k": K.RESULT, "i": request, "r": self.rank, "ok": 1}, payload, buffers)

    def _result(self, header: dict[str, Any], payload: bytes, buffers: Any = ()) -> None:
        """Send a reply: to the controller, or to the calling rank for a peer call."""
        route = self.peer_routes.pop(header["i"], None) if self.peer_routes else None
        if route is None:
            self.send(header, payload, buffers)
            return
        try:
            with self.out_lock:  # replies may come from any thread (response ports)
                sock = self._peer_socket(zmq.PUSH, route)
                wire_send(sock, self.codec.encode(header, payload, buffers))
        except (zmq.Again, ConnectionError) as exc:
            log.warning(
                "rank %s: peer caller at %s is gone (%s); reply dropped", self.rank, route, exc
            )

    def _peer_socket(self, kind: int, addr: PeerAddress) -> zmq.Socket:
        """A socket (PUSH for replies, DEALER for supervision) connected to another
        process's peer address, kept for the next message; call under ``out_lock``."""
        key = (kind, addr)
        sock = self._peer_out.get(key)
        if sock is None:
            # a send timeout: a caller or owner that is gone does not block us
            sock = peer_address.open_socket(
                self.ctx, kind, addr, 1000, PEER_SEND_TIMEOUT_MS, self.peer.machine
            )
            self._peer_out[key] = sock
        return sock

    def reply_error(self, request: str | None, exc: BaseException, where: str) -> None:
        report = exception_report(exc, where)
        report["host"] = self.cfg["hostname"]
        if request is None:  # fire-and-forget: goes to supervision
            self.fault(report, context.current_actor)
        else:
            self._result(
                {"k": K.RESULT, "i": request, "r": self.rank, "ok": 0}, pickle.dumps(report)
            )

    def fault(self, report: dict[str, Any], actor: str | None, path: tuple[str, ...] = ()) -> None:
        """A failure nobody waits for: to the owner of ``actor`` if an actor spawned it
        (its ``__supervise__``), else to the controller (``unhandled_fault_hook``)."""
        owner = self.owners.get(actor) if actor else None
        if actor:  # the failing actor at this level (its owner sees it as the failure)
            report = dict(report, actor=actor)
        if owner is None:
            if path:
                report = dict(
                    report,
                    message=f"{report.get('message', '')} (not handled by {' -> '.join(path)})",
                )
            self.send({"k": K.FAULT, "r": self.rank}, pickle.dumps(report))
            return
        mesh = str(self.cfg.get("mesh", self.cfg.get("run_id", "")))
        body = {"mesh": mesh, "actor": actor, "rank": self.rank, "report": report, "path": path}
        header = {"k": K.SUPERVISE, "on": owner["on"]}
        key = owner["ox"]
        codec = self._peer_codecs.get(key)
        if codec is None:
            codec = self._peer_codecs[key] = Codec(bytes.fromhex(key))
        try:
            with self.out_lock:
                sock = self._peer_socket(zmq.DEALER, PeerAddress.decode(owner["oa"]))
                wire_send(sock, codec.encode(header, pickle.dumps(body)))
        except (zmq.Again, ConnectionError, ValueError):  # the owner is gone (unreachable):
            self.send({"k": K.FAULT, "r": self.rank}, pickle.dumps(report))  # the controller

    def _supervise(self, msg: Message, request: str | None) -> None:
        """SUPERVISE: a mesh owned by actor ``on`` of this rank failed; its
        ``__supervise__(failure)`` handles it (returns True) or it goes on up."""
        from monarch_kernel.rank.supervise import MeshFailure

        body = pickle.loads(msg.payload)
        owner_name = msg.header["on"]
        owner = self.actors.get(owner_name)
        failure = MeshFailure(
            body["mesh"], body["actor"], body["rank"], body["report"], tuple(body["path"])
        )
        handled = False
        supervise = getattr(owner, "__supervise__", None)
        if supervise is not None:
            context.current_actor = owner_name
            try:
                handled = bool(self.run_user(supervise, failure))
            except Exception as exc:  # __supervise__ itself failed: its owner is told
                self.fault(
                    exception_report(exc, f"{type(owner).__name__}.__supervise__"), owner_name
                )
            finally:
                context.current_actor = None
        if not handled:
            mesh = str(self.cfg.get("mesh", self.cfg.get("run_id", "")))
            me = f"{mesh}/{owner_name}[{self.rank}]"
            self.fault(body["report"], owner_name, (*failure.path, me))

    # -- startup ---------------------------------------------------------------------
    def start(self) -> None:
        capture.FdCapture(self._stream, self.log_fd).start()
        sys.stdout = capture.RankStream("stdout", self._stream, self.log_fd)
        sys.stderr = capture.RankStream("stderr", self._stream, self.log_fd)
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.stdin.install()
        self.debugger.install()
        device = "cpu"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(self.cfg["local_rank"] % torch.cuda.device_count())
            device = f"cuda:{torch.cuda.current_device()}"
        threading.Thread(target=self._control_loop, name="rank-control", daemon=True).start()
        self._greet_host()
        self.send(
            {
                "k": K.READY,
                "r": self.rank,
                "pid": os.getpid(),
                "host": self.cfg["hostname"],
                "dev": device,
                "rc": self.cfg.get("restart_count", 0),
                "pa": self.peer.encode(),
            }
        )

    def _greet_host(self, timeout: float = 30.0) -> None:
        """Wait until the host agent can fan messages out to our inbox.

        We say hello from a throw-away socket; the agent answers with a hello sent to
        our inbox's routing id, which arrives once that connection is up. The greeting
        is repeated: an answer may go to the connection of an earlier incarnation of
        this rank that the agent has not dropped yet.
        """
        greet = self._dealer(f"g{self.rank}".encode(), self.cfg["fanout"])
        greet.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                # encoded afresh each time: the agent drops a replayed (identical) one
                greet.send_multipart(self.codec.encode({"k": K.HELLO, "r": self.rank}))
                while self.inbox.poll(100):
                    msg = self._decode(wire_recv(self.inbox))
                    if msg is not None and msg.kind == K.HELLO:
                        return
                    if msg is not None:
                        self._accept(msg)
            raise RuntimeError(f"rank {self.rank}: host agent did not answer in {timeout}s")
        finally:
            greet.close()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Only user code is interrupted; a SIGINT while we wait is ignored, one while user
        # code sends (prints) is raised when that send is over, so that a multipart
        # message is never cut in half.
        if self.in_user_code:
            if _sending(frame):
                self.pending_signal = signal.SIGINT
                return
            raise KeyboardInterrupt

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM (the mesh stops): leave by SystemExit from wherever the main thread is
        (idle in its receive loop or in user code), so that ``run_forked`` runs the
        clean-up (``destroy_process_group``, ``atexit`` handlers). Deferred while the
        main thread is in the middle of sending a message."""
        if _sending(frame):
            self.pending_signal = signal.SIGTERM
            return
        self.terminating = True
        raise RankTerminated(TERMINATED_CODE)

    def _raise_pending(self) -> None:
        """Raise the signal deferred while the main thread was sending (in the main
        thread only: other threads send too)."""
        if threading.current_thread() is not threading.main_thread():
            return
        sig, self.pending_signal = self.pending_signal, None
        if sig == signal.SIGTERM:
            self._on_sigterm(sig, None)
        elif sig == signal.SIGINT and self.in_user_code:
            raise KeyboardInterrupt

    # -- main loop -------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        inbox = self.inbox
        deferred = self.deferred
        while True:
            try:
                self._receive(wire_recv(inbox))
                while deferred:  # controller messages read while an endpoint awaited
                    self._accept(deferred.popleft())
            except KeyboardInterrupt:
                continue

    def _receive(self, frames: list[Any]) -> None:
        msg = self._decode(frames)
        if msg is not None:
            self._accept(msg)

    def _decode(self, frames: list[Any]) -> Message | None:
        try:
            return self.codec.decode(frames)
        except WireError as exc:
            log.warning("rank %s dropped a message: %s", self.rank, exc)
            return None

    def _accept(self, msg: Message) -> None:
        """Dispatch ``msg`` in sequence order (held back while earlier ones are missing)."""
        h = msg.header
        seq = h.get("q")
        if isinstance(seq, list):
            try:
                seq = seq[h["d"].index(self.rank)]
            except (KeyError, ValueError):
                return  # not for us
        if seq is None:
            self._dispatch(msg)
            return
        if seq != self.next_seq:
            if seq > self.next_seq:
                self.held[seq] = msg
            return
        self._dispatch(msg)
        self.next_seq += 1
        while self.next_seq in self.held:
            self._dispatch(self.held.pop(self.next_seq))
            self.next_seq += 1

    def _dispatch(self, msg: Message) -> None:
        """Handle one ordered message on the main thread (see ``self._handlers``)."""
        h = msg.header
        kind = h["k"]
        if kind == K.HELLO:  # the connection probe: nothing to run, nothing to flush
            return
        request = h.get("i") if h.get("w") else None
        route = h.get("rt")
        if route is not None and request is not None:  # a call from another rank
            try:
                self.peer_routes[request] = PeerAddress.decode(route)
            except ValueError:
                log.warning("rank %s: request %s names no reply address", self.rank, request)
        if request is not None and request in self.cancelled:
            self.cancelled.discard(request)
            self.reply_error(request, KeyboardInterrupt("cancelled before it started"), kind)
            return
        try:
            handler = self._handlers[kind]
        except (KeyError, TypeError):  # unknown (or unhashable) kind
            handler = self._unknown
        context.current_request = h.get("i")
        if request is not None:
            _mark(self.log_fd, _START)  # what it prints from here on is this request's
        try:
            handler(msg, request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            if request is not None:
                _mark(self.log_fd, _END)
            if self.cancelled:
                self.cancelled.discard(context.current_request)
            if self.debugger.used:
                self.debugger.end_of_request()
            context.current_request = None

    def _unknown(self, msg: Message, request: str | None) -> None:
        log.warning("rank %s: unknown message kind %r", self.rank, msg.header["k"])

    def run_user(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call user code with interrupts enabled; await it if it is a coroutine.

        While a coroutine awaits, calls from other ranks keep being served (see
        :meth:`_pump`); one that arrives then and is itself a coroutine becomes a task
        on the running loop, returned as :class:`_Running` (answered when it ends)."""
        outer = self.in_user_code
        self.in_user_code = True
        try:
            if self.cancelled and context.current_request in self.cancelled:
                raise KeyboardInterrupt("cancelled")
            result = fn(*args, **kwargs)
            if result.__class__ not in _NOT_AWAITABLE and inspect.isawaitable(result):
                loop = self.loop
                if loop is None:
                    loop = self.loop = asyncio.new_event_loop()
                    loop.add_reader(int(self.inbox.getsockopt(zmq.FD)), self._pump)
                if loop.is_running():  # served while another endpoint awaits
                    return _Running(loop.create_task(_as_coroutine(result)))
                loop.call_soon(self._pump)  # anything that came before the reader saw it
                result = loop.run_until_complete(result)
            return result
        finally:
            self.in_user_code = outer

    def serve_until(self, fut: Any, timeout: float | None) -> None:
        """Before the main thread blocks on a call to another rank (``.get()`` in a sync
        endpoint): serve calls from other ranks until ``fut`` is done (or ``timeout``
        passes), so that a call cycle between meshes (A calls B, which calls A back)
        does not wait for itself. Other threads just block."""
        if timeout == 0 or fut.done() or threading.current_thread() is not threading.main_thread():
            return
        if self._wake is None:  # a pipe the future's completion writes to, polled with the inbox
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            poller = zmq.Poller()
            poller.register(self.inbox, zmq.POLLIN)
            poller.register(r, zmq.POLLIN)
            self._wake = (r, w, poller)
        r, w, poller = self._wake

        def wake(_: Any) -> None:
            try:
                os.write(w, b".")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass

        fut.add_done_callback(wake)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            left = None if deadline is None else int((deadline - time.monotonic()) * 1000)
            if left is not None and left <= 0:
                return
            events = dict(poller.poll(left))
            if r in events:
                try:
                    os.read(r, 4096)
                except BlockingIOError:
                    pass
            if self.inbox in events:
                self._pump()

    def _pump(self) -> None:
        """Serve the inbox while an async endpoint awaits (on the rank's event loop).

        Calls from other ranks run now: an actor awaiting a call to another mesh that
        calls back into this one (ping-pong across meshes) must not wait for itself.
        Messages from the controller (sequenced) are kept for after the endpoint, so
        that the notebook's calls stay one at a time, in order."""
        inbox = self.inbox
        while int(inbox.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            msg = self._decode(inbox.recv_multipart(zmq.NOBLOCK, copy=False))
            if msg is None:
                continue
            if msg.header.get("q") is not None:
                self.deferred.append(msg)
                continue
            saved = (context.current_request, context.current_actor, context.current_slice)
            try:
                self._accept(msg)
            finally:
                context.current_request, context.current_actor, context.current_slice = saved

    def _spawn_actor(self, msg: Message, request: str | None) -> None:
        """SPAWN_ACTOR: construct actor ``a`` from the pickled ``(cls, args, kwargs)``."""
        name = msg.header["a"]
        cls = None
        owner = msg.header.get("oa")
        if owner:  # spawned by an actor of some rank: its failures go to that owner
            h = msg.header
            self.owners[name] = {"oa": owner, "ox": h["ox"], "on": h["on"]}
        else:
            self.owners.pop(name, None)
        try:
            cls, args, kwargs = loads(msg.payload, msg.buffers, f"constructor of actor {name!r}")
            context.current_actor = name
            self.actors[name] = self.run_user(cls, *args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:  # to the caller
            where = f"{getattr(cls, '__name__', name)}.__init__"
            self.reply_error(request, exc, where)
            if request is not None and name in self.owners:  # and to its owner
                self.fault(exception_report(exc, where), name)
            return
        except BaseException as exc:  # SystemExit ...: that actor is stopped, not the rank
            if self.terminating:
                raise
            self._actor_stopped(request, exc, name, cls, "constructor", "__init__")
            return
        finally:
            context.current_actor = None
        owner = self.owners.get(name)
        if owner is not None:  # the controller tells the owner if this rank dies
            self.send({"k": K.OWNED, "r": self.rank, "a": name}, pickle.dumps(owner))
        if msg.header.get("q") is None:  # from a rank: the controller re-creates it too
            self.tell_peer_actor(name, msg.header, msg.payload, msg.buffers)
        if request:
            self.reply(request, None, f"spawn of {name}")

    def tell_peer_actor(
        self,
        name: str,
        spawn: dict[str, Any] | None,
        payload: bytes | memoryview = b"",
        buffers: Any = (),
    ) -> None:
        """Tell the controller that a rank-to-rank message spawned actor ``name`` here
        (``spawn``: that message's header, with its payload and buffers) or stopped it
        (``spawn`` None): it re-creates on a restart what it knows of."""
        header: dict[str, Any] = {"k": K.PEER_ACTOR, "r": self.rank, "a": name, "x": 0}
        if spawn is not None:
            header["x"] = 1
            for key in ("oa", "ox", "on"):
                if spawn.get(key):
                    header[key] = spawn[key]
        self.send(header, bytes(payload), buffers)

    def _exec(self, msg: Message, request: str | None) -> None:
        """EXEC: run a ``%%remote`` cell in the rank's namespace."""
        from monarch_kernel.rank.cells import run_cell  # imported on the first cell

        run_cell(self, msg, request)

    def _debug(self, msg: Message, request: str | None) -> None:
        """DEBUG: a post-mortem pdb on the last failure (``x``: only release it)."""
        debugger = self.debugger
        if msg.header.get("x"):
            had = debugger.last_failure is not None
            debugger.last_failure = None
            result = had
        else:
            try:
                result = self.run_user(debugger.post_mortem)
            except (Exception, KeyboardInterrupt) as exc:  # interrupted, or pdb failed
                self.reply_error(request, exc, "the post-mortem debugger")
                return
        if request:
            self.reply(request, result, "debug")

    def _stop_actor(self, msg: Message, request: str | None) -> None:
        """STOP_ACTOR: forget actor ``a`` (no error if it is not there)."""
        name = str(msg.header.get("a", ""))
        self.actors.pop(name, None)
        self.owners.pop(name, None)
        if msg.header.get("q") is None:  # from a rank: not to be re-created any more
            self.tell_peer_actor(name, None)
        if request:
            self.reply(request, None, "stop")

    def _call(self, msg: Message, request: str | None) -> None:
        """CALL: run endpoint ``m`` of actor ``a`` with the pickled ``(args, kwargs)``."""
        h = msg.header
        name, method = h["a"], h["m"]
        actor = self.actors.get(name)

        def where() -> str:  # only errors need it: not formatted on the hot path
            return f"{type(actor).__name__ if actor is not None else name}.{method}"

        try:
            if actor is None:
                raise LookupError(f"no actor {name!r} on rank {self.rank} (was it stopped?)")
            args, kwargs = loads(msg.payload, msg.buffers, lambda: f"arguments of {where()}")
            context.current_actor = name
            context.current_slice = h.get("sl")
            fn = getattr(actor, method)
            if getattr(fn, context.EXPLICIT_PORT_ATTR, False):
                # @endpoint(explicit_response_port=True): the endpoint answers through
                # the port it is given (now or later, from any thread); no reply here.
                self.run_user(fn, ResponsePort(self, request, where), *args, **kwargs)
                return
            result = self.run_user(fn, *args, **kwargs)
            if isinstance(result, _Running):  # answered when its task ends
                result.task.add_done_callback(
                    lambda task: self._finish(request, task, name, where, actor)
                )
                return
        except (Exception, KeyboardInterrupt) as exc:  # to the caller
            self.debugger.keep_failure(exc)  # for %debug_remote (post-mortem)
            self.reply_error(request, exc, where())
            return
        except BaseException as exc:  # SystemExit ...: that actor is stopped, not the rank
            if self.terminating:
                raise
            self._actor_stopped(request, exc, name, type(actor), "endpoint", method)
            return
        finally:
            context.current_actor = None
            context.current_slice = None
        if request:
            self.reply(request, result, lambda: f"result of {where()}", where)

    def _finish(
        self,
        request: str | None,
        task: asyncio.Task[Any],
        name: str,
        where: Callable[[], str],
        actor: Any,
    ) -> None:
        """Answer a call that ran as a task (see :meth:`run_user`)."""
        saved = context.current_actor
        context.current_actor = name
        try:
            if task.cancelled():
                self.reply_error(request, KeyboardInterrupt("cancelled"), where())
                return
            exc = task.exception()
            if isinstance(exc, (Exception, KeyboardInterrupt)):
                self.reply_error(request, exc, where())
            elif exc is not None:
                self._actor_stopped(request, exc, name, type(actor), "endpoint", where())
            elif request:
                self.reply(request, task.result(), lambda: f"result of {where()}", where)
        finally:
            context.current_actor = saved

    def _actor_stopped(
        self, request: str | None, exc: BaseException, name: str, cls: Any, what: str, method: str
    ) -> None:
        """User code of actor ``name`` raised a BaseException that is no Exception (say
        SystemExit): like Monarch, only that actor stops; the rank and its other actors
        keep running."""
        self.actors.pop(name, None)
        cls_name = getattr(cls, "__name__", "?")
        report = exception_report(exc, f"{cls_name}.{method}")
        report["message"] = (
            f"actor {name!r} ({cls_name}) was stopped: its {what} raised {exc!r}; "
            "other actors on this rank keep running"
        )
        report["host"] = self.cfg["hostname"]
        if request is None:
            self.fault(report, name)
        else:
            self._result(
                {"k": K.RESULT, "i": request, "r": self.rank, "ok": 0}, pickle.dumps(report)
            )

    # -- control thread --------------------------------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        next_stats = 0.0
        while True:
            if os.getppid() != self.parent:  # our host agent is gone
                os._exit(3)
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_INTERVAL
                self._send_stats()
            if not poller.poll(int(STATS_INTERVAL * 1000)):
                continue
            try:
                msg = self.codec.decode(wire_recv(self.ctl))
            except WireError as exc:
                log.warning("rank %s dropped a control message: %s", self.rank, exc)
                continue
            try:
                self._control(msg)
            except Exception as exc:
                self.reply_error(msg.header.get("i"), exc, msg.kind)

    def _send_stats(self) -> None:
        from monarch_kernel.rank.dataplane import counters

        stats: dict[str, Any] = {"rss": _rss(), "time": time.time(), **counters()}
        if "torch.distributed" in sys.modules:  # so a restart can re-form the group
            from monarch_kernel.rank import distributed

            if distributed.last_backend:
                stats["pg"] = distributed.last_backend
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["gpu_mem"] = torch.cuda.memory_allocated()
        try:
            self.send({"k": K.STATS, "r": self.rank}, pickle.dumps(stats))
        except zmq.ZMQError:
            pass

    def _control(self, msg: Message) -> None:
        """Handle one control message (see ``self._control_handlers``); unknown kinds
        are ignored."""
        kind = msg.header["k"]
        try:
            handler = self._control_handlers[kind]
        except (KeyError, TypeError):  # unknown (or unhashable) kind
            return
        handler(msg)

    def _cancel(self, msg: Message) -> None:
        """CANCEL: interrupt request ``c`` if it runs now, skip it if it has not started."""
        target = msg.header["c"]
        self.cancelled.add(target)  # skipped if it has not started yet
        if len(self.cancelled) > 1000:  # cancels of requests that never came
            self.cancelled.pop()
        if context.current_request == target and self.in_user_code:
            os.kill(os.getpid(), signal.SIGINT)  # raises in the main thread

    def _stacks(self, msg: Message) -> None:
        """STACKS: reply every other thread's Python stack (``wire.stacks``)."""
        from monarch_kernel.wire.stacks import capture_stacks

        self.reply(msg.header["i"], capture_stacks(threading.get_ident()), "stacks")

    def _push(self, msg: Message) -> None:
        """PUSH: set the pickled ``{name: value}`` in the namespace; reply the names."""
        values = loads(msg.payload, msg.buffers, "pushed values")
        self.namespace.update(values)
        self.reply(msg.header["i"], sorted(values), "push")

    def _pull(self, msg: Message) -> None:
        """PULL: reply the values of the pickled list of names, in that order."""
        names = loads(msg.payload, msg.buffers, "pull request")
        missing = [n for n in names if n not in self.namespace]
        if missing:
            raise NameError(f"name {missing[0]!r} is not defined on rank {self.rank}")
        values = [self.namespace[n] for n in names]
        self.reply(msg.header["i"], values, f"pulled {', '.join(names)}")

    def _ping(self, msg: Message) -> None:
        """PING: reply this rank's pid, its count of rejected (forged) messages, the
        backend of its last torch.distributed process group (``pg``) and whether that
        group is live now (``pg_live``)."""
        from monarch_kernel.rank import distributed

        backend, live = distributed.state()
        value = {
            "pid": os.getpid(),
            "rejected": self.codec.rejected,
            "pg": backend,
            "pg_live": live,
        }
        self.reply(msg.header["i"], value, "ping")

    def _abort_pg(self, msg: Message) -> None:
        """ABORT_PG: abort the default process group (releases peers blocked in a
        collective with this rank); fire and forget, errors go to the log. It runs on a
        thread of its own and is waited for at most ABORT_WAIT seconds (so that a ping
        right after it sees the group gone), so a backend slow to abort never holds up
        pings, cancels and stack dumps for long."""
        from monarch_kernel.rank import distributed

        # A failure the abort causes (a collective released with an error) is not kept
        # for post-mortem: its frames hold the aborted group's pending work, and while
        # they live the group cannot be destroyed (the ranks would stay in a dead group).
        self.debugger.last_failure = None
        self.debugger.keep_after = time.monotonic() + ABORT_KEEP_PAUSE

        def abort() -> None:
            try:
                distributed.abort_process_group()
            except Exception:
                log.exception("rank %s: aborting the process group failed", self.rank)

        thread = threading.Thread(target=abort, name="mk-abort-pg", daemon=True)
        thread.start()
        thread.join(ABORT_WAIT)

    def _input_reply(self, msg: Message) -> None:
        """INPUT_REPLY: the notebook's answer to an ``input()`` waiting on this rank."""
        self.stdin.answer(msg.header)


class ResponsePort:
    """Where an endpoint declared with ``explicit_response_port=True`` sends its answer
    (Monarch's ``Port``): ``send(value)`` or ``exception(exc)``, once, from any thread.
    For a fire-and-forget call (``broadcast``) a value goes nowhere and an exception to
    supervision."""

    def __init__(self, runtime: Rank, request: str | None, where: Callable[[], str]):
        self._runtime = runtime
        self._request = request
        self._where = where
        self._sent = False

    def send(self, value: Any) -> None:
        if self._claim() and self._request is not None:
            self._runtime.reply(self._request, value, lambda: f"result of {self._where()}")

    def exception(self, exc: BaseException) -> None:
        if self._claim():
            self._runtime.reply_error(self._request, exc, self._where())

    def _claim(self) -> bool:
        """The first answer wins (a request gets one reply); later ones are dropped."""
        if self._sent:
            return False
        self._sent = True
        return True


def _ignore(msg: Message) -> None:
    """A control message that needs nothing done (HELLO)."""


#: Exit status of a rank that ended on SIGTERM without running user clean-up to the end
#: (it normally ends killed by SIGTERM itself, after the clean-up; see ``run_forked``).
TERMINATED_CODE = 128 + signal.SIGTERM


class _Running:
    """An async endpoint started as a task while another one awaited."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task


async def _as_coroutine(aw: Any) -> Any:
    return await aw


class RankTerminated(SystemExit):
    """Raised in the main thread by SIGTERM: the rank exits (it never stops an actor)."""


def _sending(frame: Any) -> bool:
    """Whether ``frame`` (where a signal found the main thread) is inside ``Rank.send``."""
    code = Rank.send.__code__
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


STATS_INTERVAL = 1.0
#: How long a reply to a calling rank may wait for that rank's socket (it may be gone).
PEER_SEND_TIMEOUT_MS = 5000


def _bind_peer(sock: zmq.Socket, cfg: dict[str, Any], rank: int) -> PeerAddress:
    """Bind ``sock`` (the inbox) for actor calls from other ranks: a unix socket in the
    host agent's private (0700) directory and, when the mesh may span machines (its
    sockets use CURVE), a CURVE TCP socket on this host's address."""
    from monarch_kernel.rank.dataplane import host_addr, private_dir

    # The same path (and TCP port and key, see the controller's rank specs) after a
    # restart: references to this rank held by other ranks reach it again.
    path = os.path.join(private_dir(cfg), f"pr{rank}")
    if len(path) > 100:  # a unix socket path is at most 107 bytes
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="mk-pr-", dir="/tmp"), f"pr{rank}")
    tcp_host = host_addr(cfg) if cfg.get("curve_secret") else ""
    return peer_address.bind(
        sock,
        path,
        tcp_host,
        machine=str(cfg["hostname"]),
        secret=str(cfg.get("peer_secret") or ""),
        port=int(cfg.get("peer_port") or 0),
    )


#: How long the control thread waits for an abort of the process group to finish.
ABORT_WAIT = 1.0
#: Seconds after an ABORT_PG during which failures are not kept for post-mortem.
ABORT_KEEP_PAUSE = 5.0


_START = (REQUEST_START + "\n").encode()
_END = (REQUEST_END + "\n").encode()


def _mark(fd: int, marker: bytes) -> None:
    """A request boundary in the rank's log (see ``osutil.request_tail``)."""
    try:
        os.write(fd, marker)
    except OSError:
        pass


def _rss() -> int:
    """Resident memory of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _register_stacks_dump(log_path: str) -> None:
    """Dump every thread's stack on ``STACKS_SIGNAL`` (the host agent's ``dump_stacks``;
    signal-safe, works while C code holds the GIL). The file gets its name only once the
    handler is in place: the agent signals only ranks whose file exists."""
    import faulthandler

    from monarch_kernel.wire.stacks import STACKS_SIGNAL, stacks_path

    path = stacks_path(log_path, os.getpid())
    try:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
        os.rename(path + ".tmp", path)
    except (OSError, AttributeError, ValueError, RuntimeError) as exc:  # no fallback, then
        log.warning("rank stacks cannot be dumped with faulthandler: %s", exc)


def run_forked(cfg: dict[str, Any], template_pid: int) -> None:
    """Entry point of a freshly forked rank (called by the host template); never returns.

    The rank ends like a Python script: ``sys.exit()`` (or ``sys.exit(None)``) with code
    0, ``sys.exit(n)`` with ``n``, ``sys.exit("message")`` with 1 and the message on
    stderr, an uncaught exception with 1 and its traceback. Then the process group is
    destroyed, ``atexit`` handlers run and the streams are flushed (see :func:`_clean_up`).
    A rank stopped by SIGTERM does all that and then ends killed by SIGTERM.
    """
    code = 0
    terminated = False
    try:
        die_with_parent(signal.SIGKILL, expected_parent=template_pid)
        log_fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        import faulthandler

        faulthandler.enable(file=log_fd, all_threads=False)
        _register_stacks_dump(cfg["log"])
        cfg.setdefault("hostname", socket.gethostname())
        env.apply(RankConfig.from_json(cfg))
        # Same working directory and import path as the controller, so classes that
        # pickle by reference (defined in the user's modules) import here too.
        if cfg.get("cwd") and os.path.isdir(cfg["cwd"]):
            os.chdir(cfg["cwd"])
        sys.path.extend(p for p in cfg.get("sys_path", ()) if p not in sys.path)
        Rank(cfg, log_fd).run()
    except RankTerminated:
        terminated = True
        code = TERMINATED_CODE
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up is not cut short
            runtime = context._runtime
            terminated = terminated or bool(getattr(runtime, "terminating", False))
            _clean_up()
        except BaseException:  # nothing may keep the rank from exiting
            pass
        if terminated:  # stopped: end as the signal asked (the host agent sees SIGTERM)
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:
                pass
        os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as Python gives it to a script."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


#: How long the exit path waits for ``destroy_process_group`` (it may hang on a peer).
DESTROY_TIMEOUT = 1.0


def _clean_up() -> None:
    """What a Python process does on its way out, which ``os._exit`` skips: tear down
    the process group (bounded), run ``atexit`` handlers, flush the streams."""
    from monarch_kernel.rank import distributed

    done = threading.Event()

    def destroy() -> None:
        try:
            distributed.destroy_process_group()
        except Exception:
            pass
        finally:
            done.set()

    if distributed.is_initialized():
        threading.Thread(target=destroy, name="mk-destroy-pg", daemon=True).start()
        done.wait(DESTROY_TIMEOUT)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    capture.flush_fds()
