"""An actor endpoint's ``rref`` on a rank: the endpoint runs as an op of the tensor
engine (a :class:`~monarch_kernel.wire.tensor_ops.CallOp` whose function is
:func:`call_endpoint`), in order with the ops before and after it, and what it returns
stays here as the op's outputs (mesh tensors on the controller).

The op runs on the thread that runs ``tensor_ops`` records (the main thread, or the
event loop's turn on it while an ``async def`` endpoint awaits there): it never waits
for the actor, which could be that very await. An actor busy with another call then
fails the op (its outputs hold the error), saying why.
"""

from __future__ import annotations

import inspect
from typing import Any

from monarch_kernel.rank import context
from monarch_kernel.rank.actors import Running


def call_endpoint(
    actor: str, method: str, sl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``method`` of this rank's actor ``actor`` on ``args``/``kwargs`` (mesh
    tensors already read as this rank's local tensors) as the actor's next message:
    ``context()`` inside it names the actor and the slice ``sl`` it was called on (a
    ``Call`` header's ``sl``). Returns what it returns."""
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
        raise RuntimeError(
            f"actor {actor!r} was running another call on rank {rank} when {where}.rref "
            "came: an rref runs in order with the tensor engine's ops and cannot wait for "
            "the actor (wait for that call, .get(), before the rref)"
        )
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
