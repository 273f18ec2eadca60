"""An actor endpoint's ``rref`` on a rank: the endpoint runs as an op of the tensor
engine (a :class:`~monarch_kernel.wire.tensor_ops.CallOp` whose function is
:func:`call_endpoint`), in order with the ops before and after it, and what it returns
stays here as the op's outputs (mesh tensors on the controller).

The op runs on the main thread, which runs ``tensor_ops`` records. An actor busy with
another call then (an ``async def`` endpoint's task, say) is waited for, as Monarch
queues the rref in the actor's mailbox: the op takes its place in the actor's line
(:class:`~monarch_kernel.rank.actors.Turn`), behind the messages that came before it and
ahead of those after, and runs the rank's event loop (the inbox is served meanwhile)
until the line reaches it. The ops after it wait, as a stream waits for an actor's
result. The stop button releases a wait that never ends (the actor's call waits for
something that comes only after the rref): the op and those after it then hold the
interruption. An actor stopped or failed meanwhile fails the op, saying so.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from monarch_kernel.rank import context
from monarch_kernel.rank.actors import Running, Turn, TurnCall
from monarch_kernel.rank.lines import KEPT
from monarch_kernel.wire import Message
from monarch_kernel.wire import kinds as K

#: Actors that an rref waits for on this rank now (name -> how many rrefs): what a
#: rank is doing, for its tests and post-mortems (:func:`waiting_for`).
_waiting: dict[str, int] = {}
_waiting_lock = threading.Lock()


def waiting_for() -> list[str]:
    """The actors of this rank that an rref's op waits for now (their running call, or
    the messages ahead of it in their line), sorted."""
    with _waiting_lock:
        return sorted(_waiting)


def call_endpoint(
    actor: str, method: str, sl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``method`` of this rank's actor ``actor`` on ``args``/``kwargs`` (mesh
    tensors already read as this rank's local tensors) as the actor's next message,
    once the messages before it ended: ``context()`` inside it names the actor and the
    slice ``sl`` it was called on (a ``Call`` header's ``sl``). Returns what it
    returns."""
    runtime = context.services()
    rank = context.current_rank().rank
    actors = getattr(runtime, "actors", None)
    if runtime is None or actors is None:
        raise RuntimeError("an actor endpoint's rref runs on a rank of the actor's mesh")
    instance = actors.get(actor)
    if instance is None:
        raise LookupError(
            f"no actor {actor!r} on rank {rank} (stopped, or its constructor failed?): "
            f"its {method}.rref did not run"
        )
    where = f"{type(instance).__name__}.{method}"
    fn = getattr(instance, method)
    if getattr(fn, context.EXPLICIT_PORT_ATTR, False):
        raise TypeError(
            f"{where} answers through a response port: rref needs an endpoint that "
            "returns its value"
        )
    if not runtime.claim(actor):
        _wait_turn(runtime, actor, where, rank)
        instance = actors.get(actor)
        if instance is None:  # stopped or failed while the rref waited
            runtime.release(actor)
            gone = getattr(getattr(runtime, "actor_host", None), "gone", {}).get(actor)
            raise LookupError(
                f"actor {actor!r} ended on rank {rank} while {where}.rref waited for its "
                f"turn ({gone or 'stopped'}): the rref did not run"
            )
        fn = getattr(instance, method)
    here = context.serving()
    saved = here.actor, here.slice
    here.actor, here.slice = actor, sl
    try:
        run = getattr(runtime, "run_user", None)
        result = run(fn, *args, **kwargs) if run is not None else fn(*args, **kwargs)
    finally:
        here.actor, here.slice = saved
        runtime.release(actor)
    if isinstance(result, Running) or inspect.isawaitable(result):
        # an async endpoint started while this thread's event loop runs: it cannot be
        # waited for here (the loop is this very thread)
        task = getattr(result, "task", None)
        if task is not None:
            task.cancel()
        elif inspect.iscoroutine(result):
            result.close()
        raise RuntimeError(
            f"{where}.rref came while rank {rank}'s event loop was awaiting inside an "
            "async endpoint: an async endpoint's rref runs only between calls"
        )
    return result


def _wait_turn(runtime: Any, actor: str, where: str, rank: int) -> None:
    """Actor ``actor`` is busy, or messages wait in its line: take this op's place at
    the end of that line and wait (running the rank's event loop, where an ``async
    def`` endpoint's task goes on) until the line reaches it. Returns with the actor
    counted in for this op (:meth:`runtime.release` counts it out); raises
    KeyboardInterrupt when the stop button ended the wait."""
    inbox = getattr(runtime, "inbox", None)
    if (
        inbox is None
        or runtime.on_actor_loop()
        or threading.current_thread() is not threading.main_thread()
    ):
        # inside the event loop (an endpoint awaits on this thread: the actor's call
        # may be that very await, which cannot end while this op waits), or off the
        # main thread (no stop button there)
        raise RuntimeError(
            f"actor {actor!r} was running another call on rank {rank} when {where}.rref "
            "came, where the rref cannot wait for it (inside the rank's event loop, or "
            "off its main thread): wait for that call, .get(), before the rref"
        )
    wait = _Wait(Turn(actor))
    # The stop button's SIGINT ends the wait without raising where it lands: the wait
    # runs the inbox (a KeyboardInterrupt there could lose a message being read).
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, wait.on_sigint(previous))
    try:
        placed = _take_place(inbox, actor, where, wait.turn)
        if placed != KEPT:  # the actor was free after all: counted in for this op
            return
        with _waiting_lock:
            _waiting[actor] = _waiting.get(actor, 0) + 1
        try:
            runtime.run_user(wait.until_granted)
        finally:
            with _waiting_lock:
                left = _waiting.pop(actor, 1) - 1
                if left:
                    _waiting[actor] = left
    except BaseException:
        if wait.turn.abandon():
            runtime.release(actor)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if wait.turn.abandon():  # granted: the actor is this op's
        return
    if wait.stopped:
        raise KeyboardInterrupt(
            f"the stop button interrupted {where}.rref on rank {rank} while it waited for "
            f"actor {actor!r} to end the call it ran (and those queued before the rref)"
        )
    raise RuntimeError(f"{where}.rref on rank {rank} could not wait for actor {actor!r}")


def _take_place(inbox: Any, actor: str, where: str, turn: Turn) -> int:
    """Put ``turn`` at the end of ``actor``'s line (``Lines.route``: KEPT), or count the
    actor in for the op if it is free now (FAST or HERE)."""
    entry = TurnCall(actor=actor, method=where.rpartition(".")[2], turn=turn)
    placed: int = inbox.route(Message({"k": K.CALL, "a": actor, "m": entry.method}), entry, True)
    if placed != KEPT:
        # FAST: the main thread's fast path counted the actor in, for the handler that
        # would run next; enter() takes that count (no second one). HERE: nothing
        # counted yet.
        inbox.enter(actor)
    return placed


class _Wait:
    """An rref's wait for its :class:`Turn`: granted, or ended by the stop button."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.stopped = False
        self._wake: Callable[[], None] | None = None

    def on_sigint(self, previous: Any) -> Callable[[int, FrameType | None], None]:
        """The SIGINT handler while the op waits: the wait ends (raised after it); the
        rank's other threads are interrupted as the rank's own handler does."""
        rank_main = getattr(previous, "__self__", None)

        def handler(signum: int, frame: FrameType | None) -> None:
            self.stopped = True
            wake = self._wake
            if wake is not None:
                wake()
            others = getattr(rank_main, "on_interrupt", None)
            if others is not None:
                others()

        return handler

    async def until_granted(self) -> None:
        """Until the turn is granted or the stop button pressed (on the rank's event
        loop: the actor's tasks go on and the inbox is served meanwhile)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def wake() -> None:  # (any thread, or the signal handler)
            loop.call_soon_threadsafe(settle)

        self._wake = wake
        if self.stopped:
            return
        self.turn.on_grant(wake)
        await done
