"""A stopgap: learn which request each rank runs and which replies are errors.

The controller emits rank, metric, stream, fault and death events, but (yet) neither
"rank N started request X (cell 5 / counters.incr)" nor "rank N answered request X with
an error". Until it does (a runtime that sets ``emits_request_events = True``), the
dashboard wraps *this runtime instance's* ``request`` method: the wrapper queues one
``begin`` event per request and, per reply, checks the header's ``ok`` flag; error
payloads are unpickled later on the dashboard's thread, never on the receiving thread.
Cost per request: two small closures and a deque append (well under a microsecond).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.controller.errors import MeshStoppedError
from monarch_kernel.wire import kinds as K

Queue = Callable[[dict[str, Any]], None]


def describe_request(header: dict[str, Any]) -> str:
    """``counters.incr`` for a call, ``spawn counters`` for a spawn, "" otherwise."""
    kind = header.get("k")
    if kind == K.CALL:
        return f"{header.get('a')}.{header.get('m')}"
    if kind == K.SPAWN_ACTOR:
        return f"spawn {header.get('a')}"
    if kind == K.EXEC:
        return "cell"
    return ""


def install(runtime: Any, queue: Queue) -> bool:
    """Wrap ``runtime.request`` so that ``queue`` sees request starts and error replies.

    Returns False (and does nothing) if the runtime emits such events itself or is
    already tapped.
    """
    if getattr(runtime, "emits_request_events", False) or getattr(runtime, "_mk_tapped", False):
        return False
    original = runtime.request

    def request(
        ranks: list[int],
        header: dict[str, Any],
        payload: Any,
        buffers: Any,
        on_reply: Callable[[int, Any], None],
        on_death: Callable[[int, BaseException], None],
        *args: Any,
        **kwargs: Any,
    ) -> str:
        if kwargs.get("control"):  # push/pull/ping: not work a rank is "busy" with
            return original(ranks, header, payload, buffers, on_reply, on_death, *args, **kwargs)

        def reply(rank: int, msg: Any) -> None:
            h = msg.header
            if not h.get("ok", 1):
                queue(
                    {
                        "event": "error",
                        "rank": rank,
                        "request": h.get("i"),
                        "payload": bytes(msg.payload),
                    }
                )
            on_reply(rank, msg)

        def death(rank: int, error: BaseException) -> None:
            if not isinstance(error, MeshStoppedError):
                queue({"event": "request_death", "rank": rank, "request": header.get("i")})
            on_death(rank, error)

        rid = original(ranks, header, payload, buffers, reply, death, *args, **kwargs)
        event = {"event": "begin", "ranks": ranks, "request": rid}
        if header.get("k") == K.EXEC:
            event["cell_payload"] = bytes(payload)
        else:
            event["what"] = describe_request(header)
        queue(event)
        return rid

    runtime.request = request
    runtime._mk_tapped = True
    return True
