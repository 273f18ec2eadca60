"""Headers of messages to a rank's inbox (its main thread, in ``q`` order): from the
controller, and from other ranks."""

from __future__ import annotations

import marshal
from dataclasses import dataclass
from typing import Any, ClassVar

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import (
    CODEC_KEYS,
    HeaderError,
    WireAddress,
    WireHeader,
    check_keys,
    maker,
    missing_key,
)

# -- ordered messages (controller -> rank main thread; rank -> rank) -------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Ordered:
    """What every message to a rank's inbox may carry besides its kind's own keys."""

    KIND: ClassVar[str] = ""
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"i", "w", "q", "f", "d", "rt"}

    request: str | None = None  #: ``i``: the request id
    wants_reply: bool = False  #: ``w``: the sender waits for a ``res``
    seq: int | list[int] | None = None  #: ``q``: sequence number (a list with ``f``)
    fanout: bool = False  #: ``f``: the host agent forwards it to ``targets``
    targets: list[int] | None = None  #: ``d``: the target ranks of a fan-out
    reply_to: WireAddress | None = None  #: ``rt``: a calling rank's reply address

    def _put(self, h: WireHeader) -> WireHeader:
        if self.request is not None:
            h["i"] = self.request
        if self.wants_reply:
            h["w"] = 1
        if self.seq is not None:
            h["q"] = self.seq
        if self.fanout:
            h["f"] = 1
        if self.targets is not None:
            h["d"] = self.targets
        if self.reply_to is not None:
            h["rt"] = self.reply_to
        return h

    def seq_for(self, rank: int) -> int | None:
        """This message's sequence number at ``rank`` (None: unordered; -1: a fan-out
        that does not name ``rank``)."""
        seq = self.seq
        if isinstance(seq, list):
            try:
                return seq[(self.targets or []).index(rank)]
            except (ValueError, IndexError):
                return -1
        return seq


def envelope(h: WireHeader) -> tuple[Any, ...]:
    """The :class:`Ordered` fields of ``h`` in declaration order: the first arguments of
    every ordered kind's fast constructor (see ``base.maker``)."""
    return h.get("i"), bool(h.get("w")), h.get("q"), bool(h.get("f")), h.get("d"), h.get("rt")


@dataclass(frozen=True, slots=True, kw_only=True)
class OtherOrdered(Ordered):
    """An inbox message of an unknown kind, or a malformed one (``error`` says why):
    only its envelope was read, so that its sequence number is still taken."""

    kind: str = ""
    error: str = ""

    @classmethod
    def decode(cls, h: WireHeader, error: str = "") -> OtherOrdered:
        """The envelope of any header (no key is required; a bad one reads as None)."""
        seq, targets, route = h.get("q"), h.get("d"), h.get("rt")
        return cls(
            kind=str(h.get("k")),
            error=error,
            request=h.get("i") if isinstance(h.get("i"), str) else None,
            wants_reply=bool(h.get("w")),
            seq=seq if isinstance(seq, (int, list)) else None,
            fanout=bool(h.get("f")),
            targets=targets if isinstance(targets, list) else None,
            reply_to=route if isinstance(route, list) else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """The actor that owns a spawned actor (``oa``, ``ox``, ``on``): its rank's inbox,
    its mesh's key (hex) and its name."""

    address: WireAddress
    key: str
    name: str

    def encode(self) -> WireHeader:
        """The three keys, as in a ``spawn_actor`` header and an ``owned`` payload."""
        return {"oa": self.address, "ox": self.key, "on": self.name}

    @staticmethod
    def decode(h: WireHeader) -> Owner | None:
        """The owner named in ``h``, None if ``oa`` is absent or empty."""
        address = h.get("oa")
        if not address:
            return None
        return Owner(address=address, key=h["ox"], name=h["on"])


@dataclass(frozen=True, slots=True, kw_only=True)
class SpawnActor(Ordered):
    """``spawn_actor``: construct actor ``a`` (owned by ``oa``/``ox``/``on`` if set;
    ``t``: seconds its constructor may run before the actor fails, Monarch's
    ``actor_spawn_max_idle``)."""

    KIND: ClassVar[str] = K.SPAWN_ACTOR
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"a", "oa", "ox", "on", "t"}

    actor: str
    owner: Owner | None = None
    limit: float | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.SPAWN_ACTOR, "a": self.actor}
        if self.owner is not None:
            h.update(oa=self.owner.address, ox=self.owner.key, on=self.owner.name)
        if self.limit is not None:
            h["t"] = self.limit
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> SpawnActor:
        check_keys(cls, h)
        limit = h.get("t")
        try:
            return _SpawnActor(
                *envelope(h),
                h["a"],
                Owner.decode(h) if "oa" in h else None,
                float(limit) if isinstance(limit, (int, float)) and limit > 0 else None,
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Call(Ordered):
    """``call``: endpoint ``m`` of actor ``a`` (``sl``: the slice it was sent to; ``rp``:
    the calling process of this machine, a rank, takes large CUDA tensors of the result
    as handles on copies kept for it until it reads them or dies,
    ``rank.dataplane.cuda_results``)."""

    KIND: ClassVar[str] = K.CALL
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"a", "m", "sl", "rp"}

    actor: str
    method: str
    slice: list[Any] | None = None  #: labels, sizes, strides, offset
    results_pid: int | None = None  #: ``rp``: the caller's process id

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.CALL, "a": self.actor, "m": self.method}
        if self.slice is not None:
            h["sl"] = self.slice
        if self.results_pid is not None:
            h["rp"] = self.results_pid
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> Call:
        check_keys(cls, h)
        try:
            return _Call(
                *envelope(h),
                h["a"],
                h["m"],
                h.get("sl"),
                _pid(h.get("rp")),
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch(Ordered):
    """``batch``: ``n`` fire-and-forget calls in one signed message (payload: marshal
    of ``[header, payload]`` pairs, run in order; see :func:`unbatch`)."""

    KIND: ClassVar[str] = K.BATCH
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"n"}

    count: int

    def encode(self) -> WireHeader:
        return self._put({"k": K.BATCH, "n": self.count})

    @classmethod
    def decode(cls, h: WireHeader) -> Batch:
        check_keys(cls, h)
        try:
            count = h["n"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        if type(count) is not int or count < 2:
            raise HeaderError(f"batch: n must be an int of at least 2, got {count!r}")
        return _Batch(*envelope(h), count)


#: Keys a call inside a batch must not carry: the batch's envelope orders and routes it,
#: and a batched call wants no reply.
_NOT_IN_BATCH = frozenset(("q", "i", "w", "f", "d", "rt"))


def unbatch(batch: Batch, payload: bytes | memoryview) -> list[tuple[Call, WireHeader, bytes]]:
    """The calls of a verified ``batch`` message, in order; :class:`HeaderError` if the
    payload is not ``n`` well-formed ``[call header, bytes]`` pairs (nothing of it runs)."""
    try:
        items = marshal.loads(payload)
    except (ValueError, EOFError, TypeError) as exc:
        raise HeaderError(f"batch: unreadable payload ({exc})") from None
    if type(items) is not list or len(items) != batch.count:
        raise HeaderError(f"batch: payload is not a list of {batch.count} calls")
    calls = []
    last: WireHeader | None = None
    call: Call | None = None
    for item in items:
        if type(item) is not list or len(item) != 2:
            raise HeaderError("batch: an item is not a [header, payload] pair")
        h, data = item
        if type(data) is not bytes:
            raise HeaderError("batch: an item is not a call header and its payload")
        if call is None or h != last:  # a loop of broadcasts repeats one header: parse once
            if type(h) is not dict or h.get("k") != K.CALL:
                raise HeaderError("batch: an item is not a call header and its payload")
            if not _NOT_IN_BATCH.isdisjoint(h):
                raise HeaderError("batch: a batched call carries envelope keys")
            call, last = Call.decode(h), h
        calls.append((call, h, data))
    return calls


@dataclass(frozen=True, slots=True, kw_only=True)
class Exec(Ordered):
    """``exec``: run a ``%%remote`` cell (all in the payload)."""

    KIND: ClassVar[str] = K.EXEC

    def encode(self) -> WireHeader:
        return self._put({"k": K.EXEC})

    @classmethod
    def decode(cls, h: WireHeader) -> Exec:
        check_keys(cls, h)
        return _Exec(
            *envelope(h),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StopActor(Ordered):
    """``stop_actor``: forget actor ``a``."""

    KIND: ClassVar[str] = K.STOP_ACTOR
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"a"}

    actor: str

    def encode(self) -> WireHeader:
        return self._put({"k": K.STOP_ACTOR, "a": self.actor})

    @classmethod
    def decode(cls, h: WireHeader) -> StopActor:
        check_keys(cls, h)
        try:
            return _StopActor(
                *envelope(h),
                h["a"],
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Debug(Ordered):
    """``debug``: post-mortem pdb on the last failure (``x``: only release it)."""

    KIND: ClassVar[str] = K.DEBUG
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"x"}

    release_only: bool = False

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.DEBUG}
        if self.release_only:
            h["x"] = 1
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> Debug:
        check_keys(cls, h)
        return _Debug(
            *envelope(h),
            bool(h.get("x")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Supervise(Ordered):
    """``supervise`` (rank -> its owner's inbox): a mesh owned by actor ``on`` failed."""

    KIND: ClassVar[str] = K.SUPERVISE
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"on"}

    owner_name: str

    def encode(self) -> WireHeader:
        return self._put({"k": K.SUPERVISE, "on": self.owner_name})

    @classmethod
    def decode(cls, h: WireHeader) -> Supervise:
        check_keys(cls, h)
        try:
            return _Supervise(
                *envelope(h),
                h["on"],
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Ordered):
    """``hello``: a connection probe (controller, host agent), or a starting rank's
    greeting to its host agent (``r``)."""

    KIND: ClassVar[str] = K.HELLO
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"r"}

    rank: int | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.HELLO}
        if self.rank is not None:
            h["r"] = self.rank
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> Hello:
        check_keys(cls, h)
        return _Hello(
            *envelope(h),
            h.get("r"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Lane(Ordered):
    """``lane``: the controller offers this rank a same-machine lane
    (:mod:`monarch_kernel.wire.lane`): the file of its rings ``p``, the pipe that wakes
    the rank ``wk``, the controller's doorbell ``bl`` (all ``/proc/<pid>/fd/<n>``), each
    ring's data bytes ``n`` and the controller's process ``cp``."""

    KIND: ClassVar[str] = K.LANE
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"p", "wk", "bl", "n", "cp"}

    path: str
    wake: str
    bell: str
    capacity: int
    controller: int

    def encode(self) -> WireHeader:
        return self._put(
            {
                "k": K.LANE,
                "p": self.path,
                "wk": self.wake,
                "bl": self.bell,
                "n": self.capacity,
                "cp": self.controller,
            }
        )

    @classmethod
    def decode(cls, h: WireHeader) -> Lane:
        check_keys(cls, h)
        try:
            return _Lane(*envelope(h), h["p"], h["wk"], h["bl"], h["n"], h["cp"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


#: The decoders' constructors (see ``base.maker``).
_SpawnActor = maker(SpawnActor)
_Call = maker(Call)
_Batch = maker(Batch)
_Exec = maker(Exec)
_StopActor = maker(StopActor)
_Debug = maker(Debug)
_Supervise = maker(Supervise)
_Hello = maker(Hello)
_Lane = maker(Lane)


def _pid(value: object) -> int | None:
    """A ``call``'s ``rp``: a process id, or None (absent, or not a positive int)."""
    return value if type(value) is int and value > 0 else None
