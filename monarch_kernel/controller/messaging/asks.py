"""What ranks ask of the controller itself: operations of the actor API, and stopping a
mesh they hold a reference to (``ask`` and ``stop_mesh`` in :mod:`monarch_kernel.wire.kinds`).

Each runs on a thread of its own (it may start or stop a mesh, which waits for ranks:
never on the receiving thread) and answers the asking rank's reply socket directly with
one ``res`` message, signed with the key of the mesh the question came through.
"""

from __future__ import annotations

import hmac
import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Protocol

import zmq

from monarch_kernel.wire import Codec, dumps, peer_address
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.peer_address import PeerAddress
from monarch_kernel.wire.reports import AskRequest, StopRequest

log = logging.getLogger("monarch_kernel.controller")


class AskingMesh(Protocol):
    """The mesh a rank's question came through (its ``MeshRuntime``)."""

    @property
    def name(self) -> str: ...
    @property
    def codec(self) -> Codec: ...


class StoppableMesh(AskingMesh, Protocol):
    """A mesh a rank may stop, if it knows its key."""

    @property
    def key(self) -> bytes: ...
    def stop(self, timeout: float = ..., grace: float = ...) -> None: ...


#: ``op -> handler(requester mesh, request) -> result`` for ``ask`` messages, registered
#: by the actor layer (the controller never imports it). The request is the ask's
#: payload: ``{"op", "rt", "id"}`` and the operation's own keys.
ASK_HANDLERS: dict[str, Callable[[AskingMesh, AskRequest], object]] = {}


def answer_ask(requester: AskingMesh, rank: int, req: AskRequest) -> None:
    """Run the asked operation and answer the rank's reply socket."""
    handler = ASK_HANDLERS.get(str(req.get("op")))
    buffers: Sequence[Buffer] = ()
    try:
        if handler is None:
            raise LookupError(f"unknown operation {req.get('op')!r}")
        payload, buffers = dumps(handler(requester, req), "answer to a rank")
        ok = 1
    except Exception as exc:  # reported to the rank that asked
        payload = pickle.dumps({"type": type(exc).__name__, "message": str(exc), "where": "ask"})
        ok, buffers = 0, ()
    _answer(requester, rank, req.get("rt"), req.get("id"), ok, payload, buffers)


def stop_for_rank(
    requester: AskingMesh,
    rank: int,
    req: StopRequest,
    find: Callable[[str], StoppableMesh | None],
) -> None:
    """Stop the mesh ``req`` names (``find`` looks it up by name) if its key matches;
    answer the rank's reply socket."""
    target = find(str(req.get("mesh")))
    error = ""
    if target is None or not hmac.compare_digest(target.key.hex(), str(req.get("key"))):
        error = f"no mesh {req.get('mesh')!r} with that key in this controller"
    elif target is requester:
        error = "a mesh cannot stop itself from one of its own ranks"
    else:
        try:
            target.stop(grace=float(req.get("grace", 3.0)))
        except Exception as exc:  # reported to the rank that asked
            error = f"stopping mesh {req.get('mesh')!r} failed: {exc}"
    if error:
        payload = pickle.dumps({"type": "RuntimeError", "message": error, "where": "stop"})
    else:
        payload = pickle.dumps(None)
    _answer(requester, rank, req.get("rt"), req.get("id"), 0 if error else 1, payload, ())


def _answer(
    requester: AskingMesh,
    rank: int,
    reply_to: object,
    request_id: object,
    ok: int,
    payload: bytes,
    buffers: Sequence[Buffer],
) -> None:
    header: Header = {"k": K.RESULT, "i": request_id, "r": 0, "ok": ok}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        peer_address.connect(sock, PeerAddress.decode(reply_to))
        sock.send_multipart(requester.codec.encode(header, payload, buffers), zmq.NOBLOCK)
    except (zmq.ZMQError, ConnectionError, ValueError) as exc:
        log.warning("could not answer rank %s of mesh %r: %s", rank, requester.name, exc)
    finally:
        sock.close()
