"""A rank's calls to its own actors, served inline on the calling thread (see
:meth:`monarch_kernel.actor.peer.client.PeerClient.request`)."""

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
from monarch_kernel.rank.errors import ActorGoneError, exception_report
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
    """Serve a call to this rank now, on this thread (the main thread, which claimed the
    actor: ``rt.claim``; released here, or when its task ends)."""
    kind, name = header["k"], header.get("a", "")
    previous = context.current_actor
    released = False
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
                raise ActorGoneError(f"no actor {name!r} on rank {rank} (was it stopped?)")
            args, kwargs = loads(payload, buffers, "arguments")
            context.current_actor = name
            value = getattr(actor, header["m"])(*args, **kwargs)
            if inspect.isawaitable(value):
                loop = _running_loop()
                if loop is not None:
                    # Called from an async endpoint (its loop runs): the callee runs as a
                    # task of that loop, answered when it ends (the caller awaits it).
                    task = loop.create_task(_awaited(value))

                    def done(t: asyncio.Task[Any]) -> None:
                        try:
                            _answer(rt, rank, name, header, kind, observer, t)
                        finally:
                            rt.release(name)

                    task.add_done_callback(done)
                    released = True  # when the task ends
                    return
                value = _run_coroutine(value)
        out, bufs = dumps(value, "result")
        reply = Message(H.Result(request=None, ok=True, rank=rank).encode(), out, list(bufs))
    except Exception as exc:
        reply = _failed(rt, rank, name, header, kind, observer, exc)
    finally:
        context.current_actor = previous
        if not released:
            rt.release(name)
    if observer is not None:
        observer.on_reply(Reply(rank, reply))


def _failed(
    rt: RankServices,
    rank: int,
    name: str,
    header: Header,
    kind: str,
    observer: RequestObserver | None,
    exc: Exception,
) -> Message:
    report = exception_report(exc, f"{name}.{header.get('m', kind)}")
    failed = H.Result(request=None, ok=False, rank=rank).encode()
    if observer is None:  # fire and forget: to supervision, as from the runtime
        rt.reply_error(None, exc, f"{name}.{header.get('m', kind)}")
    return Message(failed, pickle.dumps(report))


def _answer(
    rt: RankServices,
    rank: int,
    name: str,
    header: Header,
    kind: str,
    observer: RequestObserver | None,
    task: asyncio.Task[Any],
) -> None:
    """The reply of an inline call that ran as a task."""
    exc = (
        RuntimeError(f"{name}.{header.get('m', kind)} was cancelled")
        if task.cancelled()
        else task.exception()
    )
    if exc is None:
        try:
            out, bufs = dumps(task.result(), "result")
        except Exception as error:
            exc = error
        else:
            ok = H.Result(request=None, ok=True, rank=rank).encode()
            reply = Message(ok, out, list(bufs))
    if exc is not None:
        if not isinstance(exc, Exception):
            exc = RuntimeError(repr(exc))
        reply = _failed(rt, rank, name, header, kind, observer, exc)
    if observer is not None:
        observer.on_reply(Reply(rank, reply))


async def _awaited(aw: Any) -> Any:
    return await aw


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _run_coroutine(aw: Any) -> Any:
    """Run an async endpoint of this rank to completion from synchronous code."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(aw)
    finally:
        loop.close()


__all__ = ["on_main_thread", "serve_inline"]
