"""The rank process: receives ordered work on its main thread, control on a side thread.

Sockets (all DEALERs, so a point-to-point call is one hop from the controller):

* ``inbox``  (main thread)  <- controller (direct messages) and this host's agent
  (messages fanned out to several ranks), and calls from other ranks: see
  :mod:`monarch_kernel.rank.inbox`;
* ``ctl``    (control thread) <- controller, push/pull/ping served while user code runs
  (:mod:`monarch_kernel.rank.control`);
* ``out``    (any thread, under a lock) -> controller: results, streams, metrics
  (:mod:`monarch_kernel.rank.outbox`).

:class:`Rank` wires the parts: the inbox hands ordered messages to the actors
(:mod:`~monarch_kernel.rank.actors`) and the cells (:mod:`~monarch_kernel.rank.cells`);
the main thread's state and its signals are :mod:`~monarch_kernel.rank.signals`; the
process starts in :func:`~monarch_kernel.rank.forked.run_forked`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from monarch_kernel.rank import context, listener_gate, telemetry
from monarch_kernel.rank.actors import ActorHost, ResponsePort
from monarch_kernel.rank.cells import Cells
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.context import UserNamespace
from monarch_kernel.rank.control import ControlThread
from monarch_kernel.rank.debug.dap import EndpointBreaks
from monarch_kernel.rank.debug.debugger import RankDebugger
from monarch_kernel.rank.device import bind_gpu
from monarch_kernel.rank.inbox import Inbox, bind_peer, connect, dealer
from monarch_kernel.rank.lane import open_lane
from monarch_kernel.rank.link import ControllerLink, serve_attached
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.sharding import hooks as sharding_hooks
from monarch_kernel.rank.signals import TERMINATED_CODE, MainThread, RankTerminated
from monarch_kernel.rank.stdio import capture, display
from monarch_kernel.rank.stdio.stdin import InputBridge
from monarch_kernel.rank.tensors import make_handler as tensor_ops_handler
from monarch_kernel.shape import Point
from monarch_kernel.wire import Codec, Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire.serialize import What

__all__ = ["TERMINATED_CODE", "Rank", "RankTerminated", "ResponsePort"]


class Rank:
    """One rank: wires its sockets, inbox, outbox, actors, cells and control thread.

    It is the rank's :class:`~monarch_kernel.rank.context.RankServices` (what the actor
    layer uses, through :func:`monarch_kernel.rank.context.services`)."""

    def __init__(self, cfg: RankConfig, log_fd: int):
        """Build a rank: its configuration, sockets, parts and their collaborators, in
        dependency order. Long on purpose: the wiring is a list of constructor calls naming
        what each part is given; one place to read who depends on whom."""
        self.config = cfg
        #: This process's wire id (its slot): its routing ids and the ``r`` of what it
        #: sends. Its rank now is ``config.rank`` (a shrink may renumber it: ``world``).
        self.rank = cfg.slot
        self.log_fd = log_fd
        self.codec = Codec(bytes.fromhex(cfg.key))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Routing ids carry a tag only this host's key holders can compute (see
        # launchers.base.ident_tag): another host's peer cannot take them over.
        tag = ident_tag(cfg.curve_secret)
        ident = b"r%d" % self.rank + tag
        # The peer endpoints are bound before the controller connections: see
        # ``wire.peer_address`` (options per endpoint).
        # Before any TCP listener or peer connection: the key peers admit (and use).
        listener_gate.setup(cfg)
        inbox = dealer(self.ctx, ident)
        self.peer = bind_peer(inbox, cfg)
        connect(inbox, cfg.send, cfg)
        connect(inbox, cfg.fanout, cfg)
        out = dealer(self.ctx, ident)
        connect(out, cfg.recv, cfg)
        ctl = dealer(self.ctx, b"c%d" % self.rank + tag)
        connect(ctl, cfg.send, cfg)
        self.main = MainThread(Outbox.send.__code__)
        #: actor name -> its owner (see ``rank.supervise``)
        self.owners: dict[str, H.Owner] = {}
        self.outbox = Outbox(
            self.rank, self.ctx, out, self.codec, self.main, self.owners, cfg.hostname,
            cfg.mesh_name,
        )  # fmt: skip
        self.outbox.machine = self.peer.machine
        self.outbox.shm_results = bool(cfg.shm_results) and not cfg.detachable
        if cfg.fanin and not cfg.detachable:  # replies to fanned-out requests (wire.fanin)
            agent = self.ctx.socket(zmq.PUSH)
            agent.setsockopt(zmq.LINGER, 1000)
            connect(agent, cfg.fanin, cfg)
            self.outbox.agent = agent
        self.inbox = Inbox(cfg, inbox, self.codec, self.main, self.outbox, log_fd)
        self.namespace: UserNamespace = {"__name__": "__main__", "__builtins__": __builtins__}
        point = Point(dict(zip(cfg.labels, cfg.coords)), cfg.rank, cfg.sizes)
        context.install(point, dict(zip(cfg.labels, cfg.sizes)), self)
        self.stdin = InputBridge(self)
        self.debugger = RankDebugger(self)
        self.inbox.request_end = self.debugger
        self.actor_host = ActorHost(self.rank, self.outbox, self.main, self, self.owners)
        self.actors = self.actor_host.actors
        # actors are concurrent: the inbox chooses each message's thread, keeps the lines
        # of busy actors and starts them when they are free (rank.lines)
        self.inbox.kind_of = self.actor_host.kind_of
        self.actor_host.busy = self.inbox.busy
        self.actor_host.waiting = self.inbox.waiting
        self.actor_host.enter = self.inbox.enter
        self.actor_host.leave = self.inbox.leave
        cells = Cells(self.namespace, self.debugger, self, self.outbox)
        self.inbox.handlers.update(
            {
                K.CALL: self.actor_host.call,
                K.SPAWN_ACTOR: self.actor_host.spawn,
                K.EXEC: cells.exec,
                K.STOP_ACTOR: self.actor_host.stop,
                K.SUPERVISE: self.actor_host.supervise,
                K.DEBUG: cells.debug,
                K.TENSOR_OPS: tensor_ops_handler(self.outbox),  # the tensor engine
                K.LANE: self._open_lane,
            }
        )
        self.control = ControlThread(
            self.rank, ctl, self.codec, self.outbox, self.main, self.namespace,
            self.debugger, self.stdin,
        )  # fmt: skip
        self.control.interrupt_request = self.inbox.interrupt_request
        breaks = EndpointBreaks(
            self.debugger, self.inbox.handlers, self.actor_host.call, self.outbox.reply
        )
        self.control.handlers[K.DAP_BREAKS] = breaks.on_control
        if cfg.detachable:  # the rank outlives its controller (before any thread sends)
            # 2: started by its host agent while no controller held the mesh
            link = ControllerLink(out, log_fd, connected=cfg.detachable != 2)
            self.outbox.link = self.control.link = link
            self.control.handlers[K.ATTACHED] = lambda msg: serve_attached(link, self.outbox, msg)

    def _open_lane(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """``lane``: the controller offers a same-machine lane (``rank.lane``)."""
        if isinstance(hdr, H.Lane):
            open_lane(hdr, self.rank, self.outbox, self.inbox)

    # -- RankServices ------------------------------------------------------------------
    @property
    def key(self) -> str:
        """The mesh's signing key, hex."""
        return self.config.key

    @property
    def terminating(self) -> bool:
        """SIGTERM came: the rank is on its way out."""
        return self.main.terminating

    def send(
        self, header: H.WireHeader, payload: bytes = b"", buffers: Sequence[Buffer] = ()
    ) -> None:
        """Send a message to the controller (any thread)."""
        self.outbox.send(header, payload, buffers)

    def report(self, metrics: Mapping[str, Any]) -> None:
        """``monarch_kernel.report(...)``."""
        self.outbox.report(metrics)

    def reply(self, request: str, value: Any, what: What, where: What | None = None) -> None:
        """Send ``value`` as the result of ``request`` (see :meth:`Outbox.reply`)."""
        self.outbox.reply(request, value, what, where)

    def reply_error(self, request: str | None, exc: BaseException, where: str) -> None:
        """Send the failure ``exc`` for ``request``, or to supervision without one."""
        self.outbox.reply_error(request, exc, where)

    def tell_peer_actor(
        self,
        name: str,
        spawn: H.SpawnActor | None,
        payload: bytes | memoryview = b"",
        buffers: Sequence[Buffer] = (),
    ) -> None:
        """Tell the controller a rank-to-rank message spawned (stopped) actor ``name``."""
        self.actor_host.tell_peer_actor(name, spawn, payload, buffers)

    def serve_until(self, fut: Any, timeout: float | None) -> None:
        """Serve calls from other ranks until ``fut`` is done (see :meth:`Inbox.serve_until`)."""
        self.inbox.serve_until(fut, timeout)

    def claim(self, name: str) -> bool:
        """Count a message of actor ``name`` in if it may run here now (``Lines.claim``)."""
        return self.inbox.claim(name)

    def release(self, name: str) -> None:
        """Count a claimed message of actor ``name`` out (``Lines.leave``)."""
        self.inbox.leave(name)

    # -- UserCode (for the actors and the cells) ---------------------------------------
    def run_user(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call user code (see :meth:`Inbox.run_user`)."""
        return self.inbox.run_user(fn, *args, **kwargs)

    def on_actor_loop(self) -> bool:
        """Whether this thread runs the actors' event loop now."""
        return self.inbox.on_actor_loop()

    def call_on_loop(self, fn: Any) -> None:
        """Run ``fn`` on the actors' event loop (``Lines.call_on_loop``)."""
        self.inbox.call_on_loop(fn)

    def keep_failure(self, exc: BaseException) -> None:
        """Keep ``exc`` for ``%debug_remote``."""
        self.debugger.keep_failure(exc)

    # -- life ----------------------------------------------------------------------------
    def start(self) -> None:
        """Capture output, install the handlers, start the control thread, wait for the
        host agent's greeting and tell the controller the rank is ready."""
        stream = self.outbox.stream
        capture.FdCapture(stream, self.log_fd).start()
        sys.stdout = capture.RankStream("stdout", stream, self.log_fd)
        sys.stderr = capture.RankStream("stderr", stream, self.log_fd)
        capture.install_print()  # a print's line in one write (see rank_print)
        display.install(self.outbox.display)  # IPython's display(), matplotlib figures
        self.main.install()
        self.stdin.install()
        self.debugger.install()
        # per-step telemetry: torch's hooks, steps sent in batches, ``%mesh profile``
        outbox = self.outbox
        telemetry.install(self.rank, outbox.send_stats, outbox.reply, self.control.handlers)
        # FSDP2's first forward compares the ranks' models; DTensor errors get a note
        sharding_hooks.install()
        device = bind_gpu(self.config.local_rank)
        self.control.start()
        self.inbox.greet_host()
        ready = H.Ready(
            rank=self.rank,
            pid=os.getpid(),
            hostname=self.config.hostname,
            device=device,
            restart_count=self.config.restart_count,
            peer=self.peer.encode(),
        )
        self.send(ready.encode())

    def run(self) -> None:
        """Start, then serve the inbox forever."""
        self.start()
        self.inbox.run()
