"""A rank's calls to its own actors, served inline on the calling thread (see
:meth:`monarch_kernel.actor.peer_client.PeerClient.request`)."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.rank import context
from monarch_kernel.rank.context import RankServices
from monarch_kernel.rank.errors import exception_report
from monarch_kernel.wire import Message, dumps, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header


def on_main_thread() -> bool:
    """Whether this is the process's main thread (a rank runs user code there)."""
    return threading.current_thread() is threading.main_thread()


def serve_inline(
    rt: RankServices,
    rank: int,
    header: Header,
    payload: bytes,
    buffers: Sequence[Buffer],
    observer: RequestObserver | None,
) -> None:
    """Serve a call to this rank now, on this thread: a call to this very rank from its
    own busy main thread would wait for itself (actors of one rank share its thread)."""
    kind, name = header["k"], header.get("a", "")
    previous = context.current_actor
    try:
        if kind == K.SPAWN_ACTOR:
            spawn = H.SpawnActor.decode(header)
            cls, args, kwargs = loads(payload, buffers, f"constructor of actor {name!r}")
            if spawn.owner is not None:
                rt.owners[name] = spawn.owner
            context.current_actor = name
            rt.actors[name] = cls(*args, **kwargs)
            rt.tell_peer_actor(name, spawn, payload, buffers)
            value: Any = None
        elif kind == K.STOP_ACTOR:
            rt.actors.pop(name, None)
            rt.owners.pop(name, None)
            rt.tell_peer_actor(name, None)
            value = None
        else:
            actor = rt.actors.get(name)
            if actor is None:
                raise LookupError(f"no actor {name!r} on rank {rank} (was it stopped?)")
            args, kwargs = loads(payload, buffers, "arguments")
            context.current_actor = name
            value = getattr(actor, header["m"])(*args, **kwargs)
            if inspect.isawaitable(value):
                value = _run_coroutine(value)
        out, bufs = dumps(value, "result")
        reply = Message(H.Result(request=None, ok=True, rank=rank).encode(), out, list(bufs))
    except Exception as exc:
        report = exception_report(exc, f"{name}.{header.get('m', kind)}")
        failed = H.Result(request=None, ok=False, rank=rank).encode()
        reply = Message(failed, pickle.dumps(report))
        if observer is None:  # fire and forget: to supervision, as from the runtime
            rt.reply_error(None, exc, f"{name}.{header.get('m', kind)}")
    finally:
        context.current_actor = previous
    if observer is not None:
        observer.on_reply(Reply(rank, reply))


def _run_coroutine(aw: Any) -> Any:
    """Run an async endpoint of this rank to completion from synchronous code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(aw)
        finally:
            loop.close()
    close = getattr(aw, "close", None)
    if close is not None:
        close()
    raise RuntimeError(
        "an async endpoint cannot call an async endpoint of an actor on its own rank "
        "(actors of one rank share its thread); make one of them synchronous"
    )


__all__ = ["on_main_thread", "serve_inline"]
