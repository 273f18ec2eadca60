"""Messages from ranks and host agents to the controller: verified, then dispatched by kind.

:meth:`Inbound.handle` runs on the thread holding the receive token. It verifies the
signature (a forged message is dropped before anything is parsed), counts the bytes
against the sender rank, and calls the handler registered for the message's kind in
one table (see :mod:`monarch_kernel.wire.kinds` for the header keys of each kind).

Ranks and host agents name themselves by their *slot* (``r``, ``h``, the ranks of a
``fan_in``): :meth:`Inbound.handle` turns each into the logical rank or host it is now
(``records.Slots``) before any handler runs, so handlers only see logical numbers. A
slot the mesh does not know (a rank or host removed by a shrink, late) is dropped.

What ranks show, report and ask the notebook (output, displays, metrics, stats, prompts)
is handled by :class:`~.rank_output.RankOutput`; this module keeps the checks of who sent
what, requests' replies, and the lifecycle of ranks and hosts.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import zmq

from monarch_kernel.calls.requester import ActorSpec
from monarch_kernel.controller.messaging.asks import (
    ASK_HANDLERS,
    AskingMesh,
    StoppableMesh,
    answer_ask,
    stop_for_rank,
)
from monarch_kernel.controller.messaging.rank_output import PromptAnswerer, RankOutput
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import (
    EventBus,
    FaultReported,
    RankDied,
)
from monarch_kernel.controller.state.records import (
    HostInfo,
    MeshRecipe,
    RankEnd,
    RankInfo,
    RankState,
    Slots,
)
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.wire import Codec, Message, WireError
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.arena import ArenaReader, SharedResultError, cannot_map_result
from monarch_kernel.wire.chunks import Assembler
from monarch_kernel.wire.codec import Header
from monarch_kernel.wire.fanin import PartError, PartKind, decode_parts
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import AskRequest, FailureReport, StopRequest

__all__ = ["ASK_HANDLERS", "Inbound", "RankFacingMesh"]

log = logging.getLogger("monarch_kernel.controller")

#: Ranks' shared-memory arenas the controller keeps mapped at once (one per rank that
#: returned a large result; the least recently used is dropped beyond this).
MAX_MAPPED_ARENAS = 4096
#: Seconds between two looks for mapped arenas of rank processes that are gone.
PRUNE_INTERVAL = 5.0

Handler = Callable[[Header, Message], None]
T = TypeVar("T")


def typed(decode: Callable[[Header], T], handler: Callable[[T, Message], None]) -> Handler:
    """A handler of the wire header that hands ``handler`` its typed form."""

    def handle(h: Header, msg: Message) -> None:
        handler(decode(h), msg)

    return handle


class RankFacingMesh(AskingMesh, PromptAnswerer, Protocol):
    """The mesh operations handlers use (``MeshRuntime`` provides them); the mesh is
    also what the actor API's ``ask`` handlers are given."""

    def kill_ranks(self, ranks: Sequence[int]) -> None: ...


class Inbound:
    """Handlers of every message kind the controller receives."""

    def __init__(
        self,
        mesh: RankFacingMesh,
        *,
        ranks: list[RankInfo],
        hosts: list[HostInfo],
        transport: Transport,
        requests: RequestTable,
        events: EventBus,
        recipe: MeshRecipe,
        notify: Callable[[], None],
        rank_died: Callable[[RankInfo, RankEnd], None],
        port_received: Callable[[str, int], None],
        find_mesh: Callable[[str], StoppableMesh | None],
        on_train: Callable[[int, bytes], None] | None = None,
        slots: Slots | None = None,
        on_ready: Callable[[int], None] | None = None,
    ):
        """``notify``: wake threads waiting for ranks and hosts (``MeshLifecycle``);
        ``rank_died``: ``Supervisor.rank_died``; ``port_received``: the answer to
        ``Restarter.new_port``; ``find_mesh``: a live mesh by name (the registry).

        Long on purpose: most of it is the handler table, one line per message kind.
        """
        self._mesh = mesh
        self._name = mesh.name
        self._codec: Codec = mesh.codec
        self._ranks = ranks
        self._hosts = hosts
        self._slots = slots if slots is not None else Slots(ranks, hosts)
        self._transport = transport
        self._requests = requests
        self._events = events
        self._recipe = recipe
        self._notify = notify
        self._rank_died = rank_died
        self._port_received = port_received
        self._find_mesh = find_mesh
        #: Large values from ranks arrive in chunks; a rank that dies mid-way leaves
        #: its partial ones, dropped with it.
        self._assembler = Assembler()
        #: Large results that ranks of a local mesh put in their shared memory
        #: (``wire.arena``), lent in place where the rank offers: one mapping per rank,
        #: dropped once the rank process is gone (a result still held keeps its own).
        self._arenas = ArenaReader(keep=MAX_MAPPED_ARENAS, cannot_map=cannot_map_result, lend=True)
        self._pruned_at = 0.0
        events.subscribe(self._drop_partial, RankDied)
        self._on_train_notice = on_train
        self._on_rank_ready = on_ready
        #: Messages received (each ``fan_in`` counts one, whatever it combines) and
        #: ``fan_in`` messages among them: a gathered call on H hosts costs H.
        self.received = 0
        self.fanned_in = 0
        #: Messages received by kind (verified ones; chunks count as their kind ``ck``).
        self.kinds: dict[str, int] = {}
        #: routing id -> slot of the host agent that sends from it (see _host_heard)
        self._host_idents: dict[bytes, int] = {}
        #: What ranks show, report and ask the notebook, as events (``rank_output``).
        self.output = output = RankOutput(
            mesh, ranks=ranks, events=events, recipe=recipe, own_rank=self._own_rank
        )
        #: kind -> handler of the message with its typed header (``wire.headers``)
        self._handlers: dict[str, Handler] = {
            K.RESULT: typed(H.Result.decode, self._on_result),
            K.STREAM: typed(H.Stream.decode, output.on_stream),
            K.DISPLAY: typed(H.Display.decode, output.on_display),
            K.METRIC: typed(H.Metric.decode, output.on_metric),
            K.STATS: typed(H.RankNotice.decode, output.on_stats),
            K.FAULT: typed(H.RankNotice.decode, self._on_fault),
            K.OWNED: typed(H.Owned.decode, self._on_owned),
            K.PEER_ACTOR: typed(H.PeerActor.decode, self._on_peer_actor),
            K.STOP_MESH: typed(H.RankNotice.decode, self._on_stop_mesh),
            K.ASK: typed(H.RankNotice.decode, self._on_ask),
            K.READY: typed(H.Ready.decode, self._on_ready),
            K.RANK_STARTED: typed(H.RankStarted.decode, self._on_rank_started),
            K.RANK_EXIT: typed(H.RankExit.decode, self._on_rank_exit),
            K.HEARTBEAT: typed(H.Heartbeat.decode, self._on_heartbeat),
            K.HOST_READY: typed(H.HostReady.decode, self._on_host_ready),
            K.PORT: typed(H.Port.decode, self._on_port),
            K.INPUT: typed(H.Input.decode, output.on_input),
            K.RESUMED: typed(H.Resumed.decode, output.on_resumed),
            K.LANE_ON: typed(H.LaneOn.decode, self._on_lane_on),
            K.TRAIN_NOTICE: typed(H.RankNotice.decode, self._on_train),
            K.FAN_IN: typed(H.FanIn.decode, self._on_fan_in),
            K.HOST_STATS: typed(H.HostStats.decode, output.on_host_stats),
        }

    def add_handler(self, kind: str, handler: Handler) -> None:
        """Handle messages of ``kind`` with ``handler(header, message)`` (a feature
        beside the core, such as detaching, adds its own kinds)."""
        self._handlers[kind] = handler

    def handle(self, frames: list[zmq.Frame]) -> None:
        """Verify, decode and dispatch one message ``[identity, *wire frames]``.

        On a CURVE mesh the connection's key (ZAP user id) must be the key of the host
        that the routing id, and the header's sender rank or host, belong to: a peer
        of one host posing as another is dropped (before decoding) and counted."""
        self.received += 1
        transport = self._transport
        origin = transport.ids.sender_host(frames)
        if origin is None:
            return
        try:
            part = self._codec.decode(frames[1:])
            self._host_heard(frames[0].bytes)
            h = part.header
            if origin >= 0 and not self._from_host(origin, h.get("r"), h.get("h")):
                if self._slots.gone(h.get("r"), h.get("h")):
                    return  # a rank or host removed by a shrink, late: not ours now
                transport.ids.impostor(f"header (rank {h.get('r')!r}, host {h.get('h')!r})")
                return
            msg = self._assembler.feed(self._codec, part)  # a large value comes in chunks
        except WireError as exc:
            log.warning("mesh %s dropped a message from %r: %s", self._name, frames[0].bytes, exc)
            return
        if msg is None:
            return
        if "sh" in msg.header:
            msg = self._shared(msg)
        h = msg.header  # a stream's start's header once its last chunk came
        slots = self._slots
        sender = h.get("r")
        if sender is not None:  # the sender's slot -> the rank it is now
            sender = slots.rank.get(sender) if isinstance(sender, int) else None
            if sender is None:
                return  # a rank removed from the mesh (``%mesh shrink``), late: not ours now
            h["r"] = sender
            self._ranks[sender].bytes_in += msg.nbytes
        host = h.get("h")
        if host is not None:
            host = slots.host.get(host) if isinstance(host, int) else None
            if host is None:
                return  # a host removed from the mesh, late
            h["h"] = host
        kinds = self.kinds
        kind = h["k"]
        kinds[kind] = kinds.get(kind, 0) + 1
        handler = self._handlers.get(kind)
        if handler is None:
            log.warning("mesh %s: unknown message kind %r", self._name, h["k"])
            return
        try:
            handler(h, msg)
        except H.HeaderError as exc:  # signed by a sender of ours: another version?
            log.warning("mesh %s dropped a message: %s", self._name, exc)

    def close(self) -> None:
        """The mesh stopped or was let go: its ranks' shared memory is not read again."""
        self._arenas.close()

    def tick(self, now: float) -> None:
        """Now and then (the receiving thread's tick): drop the arena mappings of rank
        processes that are gone however they went (died, restarted, removed by a
        shrink), which would otherwise keep their memory."""
        if now - self._pruned_at >= PRUNE_INTERVAL and self._arenas.mapped():
            self._pruned_at = now
            self._arenas.prune()

    def mapped_arenas(self) -> int:
        """Ranks' shared-memory arenas mapped now (those that sent large results)."""
        return self._arenas.mapped()

    def _shared(self, msg: Message) -> Message:
        """A rank's reply whose buffers are in the rank's shared memory, with them read
        out; one that cannot be read is a failed reply that says why (its request is
        answered, nothing waits for it)."""
        msg = self._arenas.take(msg, 0)
        if not msg.lost:
            return msg
        log.warning("mesh %s: %s", self._name, msg.lost)
        report: FailureReport = {
            "type": SharedResultError.__name__,
            "qualname": f"{SharedResultError.__module__}.{SharedResultError.__qualname__}",
            "message": msg.lost,
            "traceback": "",
            "line": None,
            "tensors": [],
            "where": "reply",
            "exception": pickle.dumps(SharedResultError(msg.lost)),
        }
        return Message({**msg.header, "ok": 0}, pickle.dumps(report))

    def _drop_partial(self, event: object) -> None:
        if isinstance(event, RankDied) and 0 <= event.rank < len(self._ranks):
            info = self._ranks[event.rank]
            slot = info.slot  # partial streams' headers name slots
            self._assembler.forget(lambda h: h.get("r") == slot)
            if info.pid is not None:
                self._arenas.forget(info.pid)  # its shared memory goes with it

    def _from_host(self, host: int, rank: object, claimed: object) -> bool:
        """Whether the header's sender rank and host slots (where present) are on the
        host of slot ``host``."""
        if rank is not None and not (
            isinstance(rank, int) and self._slots.rank_host.get(rank) == host
        ):
            return False
        return claimed is None or claimed == host

    # -- requests ------------------------------------------------------------------------
    def _on_result(self, h: H.Result, msg: Message) -> None:
        if h.rank is not None and h.request is not None:
            self._requests.on_result(h.rank, h.request, msg)

    def _own_rank(self, slot: object, host: int) -> int | None:
        """The rank the process of ``slot`` is now, if it is one of host ``host``'s: an
        agent speaks only for its own ranks (and a removed rank's part may come late)."""
        rank = self._slots.rank.get(slot) if isinstance(slot, int) else None
        return rank if rank is not None and self._ranks[rank].host == host else None

    def _on_fan_in(self, h: H.FanIn, msg: Message) -> None:
        """A host agent's combined answers of its ranks to request ``i`` (``wire.fanin``):
        handled part by part, per rank, as if each rank had sent its own message."""
        self.fanned_in += 1
        try:
            parts = decode_parts(msg.payload)
        except PartError as exc:
            log.warning("mesh %s dropped a message of host %s: %s", self._name, h.host, exc)
            return
        ranks, request, host = self._ranks, h.request, h.host
        of_slot = self._slots.rank.get
        stream = self.output.stream
        for part in parts:
            size = len(part.data)
            mine = []
            for s in part.ranks:  # _own_rank, inline: this loop runs per rank
                r = of_slot(s)
                if r is not None:
                    info = ranks[r]
                    if info.host == host:
                        info.bytes_in += size
                        mine.append(r)
            if part.kind is PartKind.STREAM:
                text = part.data.decode("utf-8", "replace")
                for r in mine:
                    stream(r, request, part.name, text)
            elif mine:
                # One message for the part's ranks (its header names none: each Reply
                # does); see RequestTable.on_results.
                header = {"k": K.RESULT, "i": request, "ok": 1 if part.ok else 0}
                self._requests.on_results(mine, request, Message(header, part.data))

    def _on_fault(self, h: H.RankNotice, msg: Message) -> None:
        report: FailureReport = pickle.loads(msg.payload)
        report["rank"] = h.rank
        self._events.emit(FaultReported(self._name, h.rank, report))

    def _on_owned(self, h: H.Owned, msg: Message) -> None:
        owner = H.Owner.decode(pickle.loads(msg.payload))  # its wire form, pickled
        if owner is not None:
            self._ranks[h.rank].owners[h.actor] = owner

    def _on_peer_actor(self, h: H.PeerActor, msg: Message) -> None:
        """A rank spawned (or stopped) an actor on rank ``r`` directly: remember it
        (forget it) so that a restart of ``r`` re-creates it (see ``wire.kinds``)."""
        recipe, rank, name = self._recipe, h.rank, h.actor
        if not h.spawned:
            recipe.forget_actor(name, [rank])
            return
        owner = h.owner
        payload = bytes(msg.payload)
        buffers = tuple(bytes(b) for b in msg.buffers)  # the frames are not kept
        spec = recipe.actors.get(name)
        ranks = frozenset({rank})
        if spec is not None and (spec.payload, spec.buffers, spec.owner) == (
            payload,
            buffers,
            owner,
        ):
            ranks |= spec.ranks  # the same spawn, reported by another of its ranks
        recipe.remember_actor(ActorSpec(name, payload, buffers, ranks, owner))

    def _on_train(self, h: H.RankNotice, msg: Message) -> None:
        """A rank's training notice (``controller.training.recovery``)."""
        if self._on_train_notice is not None:
            self._on_train_notice(h.rank, bytes(msg.payload))

    def _on_stop_mesh(self, h: H.RankNotice, msg: Message) -> None:
        """A rank holding a reference to a mesh stops it (on a thread of its own: a
        stop waits for the ranks to exit, and this is the receiving thread)."""
        req: StopRequest = pickle.loads(msg.payload)
        args = (self._mesh, h.rank, req, self._find_mesh)
        threading.Thread(target=stop_for_rank, args=args, name="mk-stop", daemon=True).start()

    def _on_ask(self, h: H.RankNotice, msg: Message) -> None:
        """An operation of the actor API asked by a rank (see ``ASK_HANDLERS``); on a
        thread of its own, as it may start a mesh."""
        req: AskRequest = pickle.loads(msg.payload)
        threading.Thread(
            target=answer_ask, args=(self._mesh, h.rank, req), name="mk-ask", daemon=True
        ).start()

    # -- ranks ---------------------------------------------------------------------------
    def _on_lane_on(self, h: H.LaneOn, msg: Message) -> None:
        """The rank opened its same-machine lane: read and write it from now on."""
        self._transport.lane_on(self._ranks[h.rank].slot)

    def _on_ready(self, h: H.Ready, msg: Message) -> None:
        info = self._ranks[h.rank]
        if h.restart_count != info.restarts:
            return  # an earlier incarnation, late: the current one is what we wait for
        if info.state is not RankState.STARTING:
            # Declared dead while it started (too late): it must not run unsupervised.
            self._mesh.kill_ranks([info.rank])
            return
        t = self._transport
        t.probe([t.ids.rank_id(info.rank), t.ids.rank_id(info.rank, b"c")])
        info.pid, info.hostname, info.device = h.pid, h.hostname, h.device
        try:
            info.peer = PeerAddress.decode(h.peer)
        except ValueError:  # not from a rank of this version: no peer calls to it
            info.peer = PeerAddress(info.hostname)
        info.last_seen = time.monotonic()
        t.offer_lane(info.rank)  # before anything else is sent to it: the first in order
        self._requests.set_state(info, RankState.IDLE)
        self._notify()
        if self._on_rank_ready is not None:
            self._on_rank_ready(info.rank)

    def _on_rank_started(self, h: H.RankStarted, msg: Message) -> None:
        self._ranks[h.rank].pid = h.pid

    def _on_rank_exit(self, h: H.RankExit, msg: Message) -> None:
        info = self._ranks[h.rank]
        if info.pid not in (None, h.pid) and info.state is not RankState.STARTING:
            return  # a stale report about an earlier incarnation
        for frames in self._transport.lane_backlog(info.slot):
            self.handle(frames)  # its last words came before its death
        self._rank_died(info, RankEnd.of_exit(h))

    # -- hosts ---------------------------------------------------------------------------
    def _host_heard(self, ident: bytes) -> None:
        """A verified message came on connection ``ident``: if it is a host agent's, the
        agent is alive, whatever the message. An agent that passes on its ranks'
        answers (fan-in: a large value in chunks, a flood of output) may have its
        heartbeats queued behind them, or dropped while its queue to us is full."""
        if ident[:1] != b"h":
            return  # a rank's own connection (``r``/``c``): by far the most messages
        hosts = self._hosts
        slot = self._host_idents.get(ident)
        if slot is None:  # a new agent (misses are not kept: its tag may come later)
            transport = self._transport
            slot = next((s for s in self._slots.host if transport.ids.host_slot_id(s) == ident), -1)
            if slot < 0:
                return
            self._host_idents[ident] = slot
        index = self._slots.host.get(slot)
        if index is not None and index < len(hosts):
            hosts[index].last_seen = time.monotonic()

    def _on_heartbeat(self, h: H.Heartbeat, msg: Message) -> None:
        if h.host is not None:
            self._hosts[h.host].last_seen = time.monotonic()

    def _on_port(self, h: H.Port, msg: Message) -> None:
        if h.request is not None:
            self._port_received(h.request, h.port)

    def _on_host_ready(self, h: H.HostReady, msg: Message) -> None:
        host = self._hosts[h.host]
        host.pid, host.hostname = h.pid, h.hostname
        host.addr, host.port, host.desk, host.dir = h.addr, h.port, h.desk, h.dir
        self._transport.probe([self._transport.ids.host_id(host.index)])
        host.ready = True
        host.last_seen = host.ready_at = time.monotonic()
        self._notify()
