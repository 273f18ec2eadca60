"""Typed message headers: one frozen dataclass per message kind, with named fields.

On the wire a header stays the flat dict of one-letter keys that
:mod:`monarch_kernel.wire.kinds` documents (marshal-encoded, see
:mod:`monarch_kernel.wire.codec`); in code it is one of these classes. Every class has

* ``KIND`` (the ``k`` it is sent with) and ``KEYS`` (every key it may carry, the codec's
  ``sn``/``sc``/``b`` included);
* ``encode()``: the wire dict, key for key what the hand-written dicts were (the wire
  bytes do not change): an optional field is left out while it is None (or False),
  except where the dict always carried the key (``out``'s ``i`` ...);
* ``decode(header)``: the record, or :class:`HeaderError` naming the kind and the
  missing or unknown key. Hand-written, no reflection: a decode costs about a
  microsecond (the rank handles a call in about a hundred).

:func:`decode` picks the class by ``k``. Values are not converted: ``encode(decode(h))``
gives ``h`` back (less the codec's keys, which ``Codec.encode`` sets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import CODEC_KEYS, HeaderError, WireAddress, WireHeader
from monarch_kernel.wire.headers.control import (
    AbortPg,
    Cancel,
    ControlRequest,
    InputReply,
    TensorStop,
)
from monarch_kernel.wire.headers.fanin import FanIn, FanInDirect, HostStats, HostSteps
from monarch_kernel.wire.headers.from_rank import (
    Display,
    Input,
    LaneOn,
    Metric,
    Owned,
    PeerActor,
    RankNotice,
    Ready,
    Result,
    Resumed,
    Stream,
    rank_result,
)
from monarch_kernel.wire.headers.host import (
    Chunk,
    Detach,
    DumpStacks,
    Heartbeat,
    HostReady,
    KillRanks,
    MeshCommon,
    NewPort,
    Port,
    RankExit,
    RankSpec,
    RankStarted,
    SignalRanks,
    SpawnRanks,
    Stop,
    TakenOver,
)
from monarch_kernel.wire.headers.ordered import (
    Batch,
    Call,
    Debug,
    Exec,
    Hello,
    Lane,
    Ordered,
    OtherOrdered,
    Owner,
    SpawnActor,
    StopActor,
    Supervise,
    unbatch,
)
from monarch_kernel.wire.headers.tensors import TensorOps

# -- the table ----------------------------------------------------------------------

#: Every control-message header class.
AnyHeader: TypeAlias = (
    SpawnActor
    | Call
    | Batch
    | Exec
    | StopActor
    | Debug
    | Supervise
    | Hello
    | Lane
    | ControlRequest
    | AbortPg
    | Cancel
    | TensorStop
    | InputReply
    | Ready
    | Result
    | Stream
    | Display
    | Metric
    | RankNotice
    | Owned
    | PeerActor
    | Input
    | Resumed
    | LaneOn
    | SpawnRanks
    | SignalRanks
    | KillRanks
    | Stop
    | DumpStacks
    | NewPort
    | Heartbeat
    | Chunk
    | HostReady
    | Port
    | RankStarted
    | RankExit
    | Detach
    | TakenOver
    | FanIn
    | FanInDirect
    | HostStats
    | HostSteps
    | TensorOps
)

_CLASSES: tuple[Any, ...] = (
    SpawnActor,
    Call,
    Batch,
    Exec,
    StopActor,
    Debug,
    Supervise,
    Hello,
    Lane,
    AbortPg,
    Cancel,
    TensorStop,
    InputReply,
    Ready,
    Result,
    Stream,
    Display,
    Metric,
    Owned,
    PeerActor,
    Input,
    Resumed,
    LaneOn,
    SpawnRanks,
    SignalRanks,
    KillRanks,
    Stop,
    DumpStacks,
    NewPort,
    Heartbeat,
    Chunk,
    HostReady,
    Port,
    RankStarted,
    RankExit,
    Detach,
    TakenOver,
    FanIn,
    FanInDirect,
    HostStats,
    HostSteps,
    TensorOps,
)
#: kind -> the decoder of its header
DECODERS: dict[str, Callable[[WireHeader], Any]] = {cls.KIND: cls.decode for cls in _CLASSES}
DECODERS.update(dict.fromkeys(ControlRequest.KINDS, ControlRequest.decode))
DECODERS.update(dict.fromkeys(RankNotice.KINDS, RankNotice.decode))
#: The kinds that go to a rank's inbox (its main thread, in ``q`` order).
ORDERED_KINDS = frozenset(
    {
        K.SPAWN_ACTOR,
        K.CALL,
        K.BATCH,
        K.EXEC,
        K.STOP_ACTOR,
        K.DEBUG,
        K.SUPERVISE,
        K.HELLO,
        K.TENSOR_OPS,
        K.LANE,
    }
)


def decode(h: WireHeader) -> AnyHeader:
    """The typed header of any control message (by its kind ``k``)."""
    try:
        decoder = DECODERS[h["k"]]
    except (KeyError, TypeError):
        raise HeaderError(f"no header class for kind {h.get('k')!r}") from None
    result: AnyHeader = decoder(h)
    return result


def decode_ordered(h: WireHeader) -> Ordered:
    """The header of a message to a rank's inbox: its kind's class, else (an unknown
    kind, a malformed header) an :class:`OtherOrdered` that says why."""
    kind = h.get("k")
    if kind not in ORDERED_KINDS:  # not an inbox kind: only its envelope is read
        return OtherOrdered.decode(h)
    try:
        result: Ordered = DECODERS[kind](h)
    except HeaderError as exc:
        return OtherOrdered.decode(h, str(exc))
    return result


def encode(header: AnyHeader) -> WireHeader:
    """The wire dict of ``header`` (``header.encode()``)."""
    return header.encode()


__all__ = [
    "AbortPg",
    "MeshCommon",
    "RankSpec",
    "AnyHeader",
    "Batch",
    "CODEC_KEYS",
    "Call",
    "Cancel",
    "TensorStop",
    "ControlRequest",
    "DECODERS",
    "Debug",
    "Detach",
    "DumpStacks",
    "Exec",
    "FanIn",
    "FanInDirect",
    "HeaderError",
    "Chunk",
    "Heartbeat",
    "Hello",
    "Lane",
    "LaneOn",
    "HostReady",
    "HostStats",
    "HostSteps",
    "Input",
    "InputReply",
    "KillRanks",
    "Metric",
    "NewPort",
    "ORDERED_KINDS",
    "Ordered",
    "OtherOrdered",
    "Owned",
    "Owner",
    "PeerActor",
    "Port",
    "RankExit",
    "RankNotice",
    "RankStarted",
    "Ready",
    "Result",
    "Resumed",
    "SignalRanks",
    "SpawnActor",
    "SpawnRanks",
    "Stop",
    "StopActor",
    "Stream",
    "Display",
    "Supervise",
    "TakenOver",
    "TensorOps",
    "WireAddress",
    "WireHeader",
    "decode",
    "decode_ordered",
    "encode",
    "rank_result",
    "unbatch",
]
