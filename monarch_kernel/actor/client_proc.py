"""``this_proc()`` in the controller: the controller's own process, as a one-point
process mesh whose actors run here (Monarch spawns ``this_proc()`` actors in the client).

:class:`ClientProc` is that mesh's :class:`~monarch_kernel.calls.requester.Requester`:
the same ``ProcMesh``/``ActorMesh`` classes and adverbs as for ranks (``call``,
``call_one``, ``choose``, ``broadcast``, ``stream``, ``stop``), answered by actors of
this process, each on a thread of its own (:mod:`.client_actor`). Their failures reach
supervision as those of actors in ranks do: the owning actor's ``__supervise__`` (here
or in a rank), else ``unhandled_fault_hook``. Ranks reach these actors through
:mod:`.client_server`, opened when a handle first leaves this process.

It is the controller side of the actor API (loaded on first use of ``this_proc()`` in
the controller, never in a rank).
"""

from __future__ import annotations

import contextvars
import gc
import itertools
import logging
import pickle
import socket
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from monarch_kernel.actor.channels import report_unhandled
from monarch_kernel.actor.client_actor import Answer, LocalActor, Work
from monarch_kernel.actor.client_server import PeerServer
from monarch_kernel.actor.peer import requester as peer
from monarch_kernel.actor.peer.reply import reply_tcp_host
from monarch_kernel.calls.errors import MeshStoppedError
from monarch_kernel.calls.future import Future, Waiter
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import PLAIN, ActorSpec, CallOptions, MeshRef
from monarch_kernel.rank.errors import ActorGoneError, exception_report
from monarch_kernel.rank.supervise import MeshFailure
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Codec, Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header, new_key
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import FailureReport

log = logging.getLogger("monarch_kernel.actor")

#: The name of the controller's process as a mesh (actor ids read ``client/name[0]``).
CLIENT_PROC = "client"
#: Seconds :meth:`ClientProc.stop` waits for each actor's thread to end.
STOP_WAIT = 5.0


class ClientProc:
    """The controller's own process as a one-point process mesh (see module doc)."""

    def __init__(self) -> None:
        self._key = new_key()
        self.key = self._key.hex()
        self._shape = Shape((), ())
        self.actors: dict[str, LocalActor] = {}
        #: actors stopped by their mesh's ``stop()``: what calls to them raise
        self._stopped_actors: dict[str, ActorGoneError] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._server: PeerServer | None = None
        self._old_servers: list[PeerServer] = []  # opened before meshes of other machines
        self._codecs: dict[str, Codec] = {}
        self._ids = itertools.count()
        self.hostname = socket.gethostname()

    # -- the Requester protocol -----------------------------------------------------------
    @property
    def name(self) -> str:
        return CLIENT_PROC

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop_mesh` ran (``this_proc()`` then gives a new one)."""
        return self._stopped

    def request(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver,
        options: CallOptions = PLAIN,
        request_id: str | None = None,
    ) -> str:
        if options.control:
            raise RuntimeError(
                "push(), pull() and ping() need ranks: this_proc() in the controller is the "
                "controller's own process (its actors run here); use a mesh of "
                "this_host().spawn_procs() instead"
            )
        self._check(ranks)
        rid = request_id or f"{CLIENT_PROC}-{next(self._ids)}"
        answer = _LocalAnswer(observer, rid)
        self.deliver(header, payload, _owned(buffers), answer, contextvars.copy_context())
        return rid

    def send(
        self, ranks: list[int], header: Header, payload: bytes, buffers: Sequence[Buffer]
    ) -> None:
        self._check(ranks)
        self.deliver(header, payload, _owned(buffers), None, contextvars.copy_context())

    @property
    def waiter(self) -> Waiter | None:
        return None  # the actors' threads answer: nothing to receive while waiting

    def choose(self, ranks: list[int]) -> int:
        return ranks[0]

    def actor_spawned(self, spec: ActorSpec) -> None:
        """Nothing to re-create: this process never restarts."""

    def actor_stopped(self, name: str, ranks: list[int]) -> None:
        """As :meth:`actor_spawned`."""

    def reference(self) -> MeshRef:
        """A handle for other processes: ranks reach this process's server (opened now)."""
        return MeshRef(CLIENT_PROC, self.key, (self.address(),), self._shape)

    def stop_mesh(self, grace: float) -> Future[None]:
        """Stop every actor of this process (their ``__del__`` runs, calls to them raise
        ``SupervisionError``); ``this_proc()`` then gives a new, empty one. The process
        itself (the controller) runs on."""
        self.stop(grace)
        return Future._resolved(None)

    def spawn_owner(self) -> H.Owner | None:
        return None  # an actor spawning from here is the owner (see local_context)

    # -- messages -------------------------------------------------------------------------
    def deliver(
        self,
        header: Header,
        payload: bytes | memoryview,
        buffers: Sequence[Buffer],
        answer: Answer | None,
        context: contextvars.Context,
    ) -> None:
        """Hand a ``spawn_actor``, ``call`` or ``stop_actor`` message to its actor (from
        this process, or from a rank through the server)."""
        kind = header.get("k")
        if kind == K.SPAWN_ACTOR:
            spawn = H.SpawnActor.decode(header)
            actor = self._new_actor(spawn.actor, spawn.owner)
            actor.post(Work("", payload, buffers, answer, context))
        elif kind == K.CALL:
            call = H.Call.decode(header)
            with self._lock:
                target = self.actors.get(call.actor)
            if target is None:
                why = self._stopped_actors.get(call.actor) or ActorGoneError(
                    f"no actor {call.actor!r} in the controller's process", stopped=True
                )
                _refuse(
                    answer, ActorGoneError(str(why), why.stopped), f"{call.actor}.{call.method}"
                )
                return
            target.post(Work(call.method, payload, buffers, answer, context, call.slice))
        elif kind == K.STOP_ACTOR:
            name = str(H.StopActor.decode(header).actor)
            with self._lock:
                gone = self.actors.pop(name, None)
                stopped = f"actor {name!r} was stopped (its actor mesh's stop())"
                self._stopped_actors[name] = ActorGoneError(stopped, stopped=True)
            if gone is not None:
                gone.stop(answer, context)
            elif answer is not None:
                answer(True, pickle.dumps(None), ())
        else:
            _refuse(answer, ValueError(f"the controller's process takes no {kind!r}"), "message")

    def _new_actor(self, name: str, owner: H.Owner | None) -> LocalActor:
        actor = LocalActor(CLIENT_PROC, name, owner, self, self.owner_of)
        with self._lock:
            if self._stopped:
                raise MeshStoppedError(_STOPPED)
            previous, self.actors[name] = self.actors.get(name), actor
            self._stopped_actors.pop(name, None)
        if previous is not None:  # spawned again under its name: the old one goes
            previous.stop(None, contextvars.Context())
        return actor

    def _check(self, ranks: list[int]) -> None:
        if self._stopped:
            raise MeshStoppedError(_STOPPED)
        if ranks != [0]:
            raise ValueError(f"the controller's process is one rank (0), not {ranks}")

    # -- supervision ----------------------------------------------------------------------
    def fault(self, actor: LocalActor, report: FailureReport, path: tuple[str, ...] = ()) -> None:
        """``actor`` failed and nobody waited (``path``: owners that did not handle it):
        its owner's ``__supervise__`` (an actor here or in a rank), else the fault hook."""
        report = FailureReport(**report)
        report["actor"] = actor.name
        report.setdefault("origin", actor.actor_id)
        owner = actor.owner
        failure = MeshFailure(CLIENT_PROC, actor.name, 0, report, path)
        if owner is None:
            report_unhandled(failure)
            return
        if owner.key == self.key:  # an actor of this process
            with self._lock:
                supervisor = self.actors.get(owner.name)
            if supervisor is not None:
                supervisor.supervise(failure, contextvars.copy_context())
                return
        elif self._tell_rank_owner(owner, actor.name, report, path):
            return
        report_unhandled(failure)  # its owner is gone

    def _tell_rank_owner(
        self, owner: H.Owner, actor: str, report: FailureReport, path: tuple[str, ...]
    ) -> bool:
        """Send the owner (an actor in a rank) a ``supervise`` message; False if it
        cannot be reached."""
        body = {"mesh": CLIENT_PROC, "actor": actor, "rank": 0, "report": report, "path": path}
        codec = self._codecs.get(owner.key)
        if codec is None:
            codec = self._codecs[owner.key] = Codec(bytes.fromhex(owner.key))
        header = H.Supervise(owner_name=owner.name).encode()
        try:
            to = PeerAddress.decode(owner.address)
            self._open_server().send(zmq.DEALER, to, codec, header, pickle.dumps(body))
        except (zmq.ZMQError, ConnectionError, ValueError) as exc:
            log.warning("the owner of %s is unreachable (%s)", actor, exc)
            return False
        return True

    def supervise_from(self, owner_name: str, body: dict[str, Any]) -> None:
        """A ``supervise`` message from a rank: an actor that ``owner_name`` (an actor
        here) owns failed, or its rank died."""
        failure = MeshFailure(
            body["mesh"], body["actor"], body["rank"], body["report"], tuple(body["path"])
        )
        with self._lock:
            supervisor = self.actors.get(owner_name)
        if supervisor is None:
            report_unhandled(failure)  # the owner is gone: the controller hears of it
            return
        supervisor.supervise(failure, contextvars.Context())

    # -- addresses ------------------------------------------------------------------------
    def owner_of(self, name: str) -> H.Owner:
        """How actors spawned by actor ``name`` of this process name their owner."""
        return H.Owner(address=self.address().encode(), key=self.key, name=name)

    def address(self) -> PeerAddress:
        """Where ranks reach this process (its server, opened on first use)."""
        return self._open_server().address

    def _open_server(self) -> PeerServer:
        """The server, opened on first use; a new one (the old one serves on) once meshes
        of other machines run and it takes no TCP, so that handles sent from then on
        reach this process from those machines too."""
        with self._lock:
            server = self._server
            if server is not None and (server.address.tcp or not reply_tcp_host()):
                return server
            if self._stopped:
                raise MeshStoppedError(_STOPPED)
            if server is not None:
                self._old_servers.append(server)
            self._server = PeerServer(self, self._key)
            peer.local_meshes[(CLIENT_PROC, self.key)] = self
            return self._server

    # -- life -----------------------------------------------------------------------------
    def stop(self, grace: float = STOP_WAIT) -> None:
        """Stop every actor (after the messages they have), close the server."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            actors, self.actors = list(self.actors.values()), {}
            servers = [*self._old_servers, *([self._server] if self._server else [])]
            self._server, self._old_servers = None, []
        peer.local_meshes.pop((CLIENT_PROC, self.key), None)
        for actor in actors:
            actor.stop(None, contextvars.Context())
        for actor in actors:
            actor.join(max(grace, 0.1))
        del actors
        gc.collect()  # the actors' __del__, as when a rank's process ends
        for server in servers:
            server.close()

    def __repr__(self) -> str:
        return f"<ClientProc {len(self.actors)} actors{' (stopped)' if self._stopped else ''}>"


_STOPPED = (
    "this_proc() of the controller was stopped (its actors are gone); this_proc() gives a new one"
)


class _LocalAnswer:
    """Answers a request of this process: one :class:`Reply` to its observer."""

    __slots__ = ("_observer", "_request")

    def __init__(self, observer: RequestObserver, request: str):
        self._observer = observer
        self._request = request

    def __call__(self, ok: bool, payload: bytes, buffers: Sequence[Buffer]) -> None:
        header = H.Result(request=self._request, ok=ok, rank=0).encode()
        self._observer.on_reply(Reply(0, Message(header, payload, _owned(buffers))))


def _owned(buffers: Sequence[Buffer]) -> list[Buffer]:
    """Copies of a message's out-of-band buffers: within this process a caller and an
    actor must not share the memory of what they pass (a tensor, an array), as they
    would not across processes."""
    return [bytearray(b.raw() if isinstance(b, pickle.PickleBuffer) else b) for b in buffers]


def _refuse(answer: Answer | None, exc: Exception, where: str) -> None:
    """Answer with the failure ``exc`` (nothing for fire and forget)."""
    if answer is not None:
        answer(False, pickle.dumps(exception_report(exc, where)), ())


__all__ = ["CLIENT_PROC", "ClientProc"]
