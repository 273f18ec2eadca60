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
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeAlias, TypeVar

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Header

#: A header on the wire: the one-letter keys of :mod:`monarch_kernel.wire.kinds`.
WireHeader: TypeAlias = Header
#: A peer address on the wire (``PeerAddress.encode()``): ``[machine, ipc, tcp, curve]``.
WireAddress: TypeAlias = list[str]

#: Keys every header may carry: the kind and what ``Codec.encode`` adds.
CODEC_KEYS = frozenset({"k", "sn", "sc", "b"})


T = TypeVar("T")


class HeaderError(ValueError):
    """A header misses a key its kind needs, carries one it does not know, or is of a
    kind no header class describes."""


def _check(cls: type[Any], h: WireHeader) -> None:
    if not h.keys() <= cls.KEYS:
        unknown = sorted(h.keys() - cls.KEYS)
        raise HeaderError(f"{cls.KIND!r} header: unknown key(s) {unknown}")


def _maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of ``cls`` taking every field positionally, in declaration order
    (the base class's first), for the decoders: a frozen dataclass's own ``__init__``
    goes through ``object.__setattr__`` per field, which costs about three times as much
    (1 us for a ``call``); here the slots' descriptors are set directly."""
    new = object.__new__
    setters = tuple(getattr(cls, f.name).__set__ for f in fields(cls))  # type: ignore[arg-type]

    def make(*values: Any) -> T:
        obj = new(cls)
        for put, value in zip(setters, values):
            put(obj, value)
        return obj

    return make


def _missing(cls: type[Any], exc: KeyError) -> HeaderError:
    return HeaderError(f"{cls.KIND!r} header: missing key {exc.args[0]!r}")


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
    """``spawn_actor``: construct actor ``a`` (owned by ``oa``/``ox``/``on`` if set)."""

    KIND: ClassVar[str] = K.SPAWN_ACTOR
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"a", "oa", "ox", "on"}

    actor: str
    owner: Owner | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.SPAWN_ACTOR, "a": self.actor}
        if self.owner is not None:
            h.update(oa=self.owner.address, ox=self.owner.key, on=self.owner.name)
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> SpawnActor:
        _check(cls, h)
        try:
            return _SpawnActor(
                h.get("i"),
                bool(h.get("w")),
                h.get("q"),
                bool(h.get("f")),
                h.get("d"),
                h.get("rt"),
                h["a"],
                Owner.decode(h) if "oa" in h else None,
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Call(Ordered):
    """``call``: endpoint ``m`` of actor ``a`` (``sl``: the slice it was sent to)."""

    KIND: ClassVar[str] = K.CALL
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"a", "m", "sl"}

    actor: str
    method: str
    slice: list[Any] | None = None  #: labels, sizes, strides, offset

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.CALL, "a": self.actor, "m": self.method}
        if self.slice is not None:
            h["sl"] = self.slice
        return self._put(h)

    @classmethod
    def decode(cls, h: WireHeader) -> Call:
        _check(cls, h)
        try:
            return _Call(
                h.get("i"),
                bool(h.get("w")),
                h.get("q"),
                bool(h.get("f")),
                h.get("d"),
                h.get("rt"),
                h["a"],
                h["m"],
                h.get("sl"),
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Exec(Ordered):
    """``exec``: run a ``%%remote`` cell (all in the payload)."""

    KIND: ClassVar[str] = K.EXEC

    def encode(self) -> WireHeader:
        return self._put({"k": K.EXEC})

    @classmethod
    def decode(cls, h: WireHeader) -> Exec:
        _check(cls, h)
        return _Exec(
            h.get("i"), bool(h.get("w")), h.get("q"), bool(h.get("f")), h.get("d"), h.get("rt")
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
        _check(cls, h)
        try:
            return _StopActor(
                h.get("i"),
                bool(h.get("w")),
                h.get("q"),
                bool(h.get("f")),
                h.get("d"),
                h.get("rt"),
                h["a"],
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


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
        _check(cls, h)
        return _Debug(
            h.get("i"),
            bool(h.get("w")),
            h.get("q"),
            bool(h.get("f")),
            h.get("d"),
            h.get("rt"),
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
        _check(cls, h)
        try:
            return _Supervise(
                h.get("i"),
                bool(h.get("w")),
                h.get("q"),
                bool(h.get("f")),
                h.get("d"),
                h.get("rt"),
                h["on"],
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


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
        _check(cls, h)
        return _Hello(
            h.get("i"),
            bool(h.get("w")),
            h.get("q"),
            bool(h.get("f")),
            h.get("d"),
            h.get("rt"),
            h.get("r"),
        )


# -- controller -> rank control thread ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRequest(Ordered):
    """``push``, ``pull``, ``ping``, ``stacks``, ``abort_pg``: a request to a rank's
    control thread (``kind``; all it needs is in the payload)."""

    KIND: ClassVar[str] = ""  #: one of KINDS: see ``kind``
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS
    KINDS: ClassVar[frozenset[str]] = frozenset({K.PUSH, K.PULL, K.PING, K.STACKS, K.ABORT_PG})

    kind: str

    def encode(self) -> WireHeader:
        return self._put({"k": self.kind})

    @classmethod
    def decode(cls, h: WireHeader) -> ControlRequest:
        if not h.keys() <= cls.KEYS:
            raise HeaderError(
                f"{h.get('k')!r} header: unknown key(s) {sorted(h.keys() - cls.KEYS)}"
            )
        return _ControlRequest(
            h.get("i"),
            bool(h.get("w")),
            h.get("q"),
            bool(h.get("f")),
            h.get("d"),
            h.get("rt"),
            h["k"],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """``cancel``: interrupt request ``c`` (running) or skip it (not started)."""

    KIND: ClassVar[str] = K.CANCEL
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"c"}

    target: str

    def encode(self) -> WireHeader:
        return {"k": K.CANCEL, "c": self.target}

    @classmethod
    def decode(cls, h: WireHeader) -> Cancel:
        _check(cls, h)
        try:
            return cls(target=h["c"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class InputReply:
    """``input_reply``: the answer to ``input`` ``n``: the line ``v`` or why none ``e``."""

    KIND: ClassVar[str] = K.INPUT_REPLY
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"n", "v", "e"}

    serial: int
    value: str | None = None
    error: str | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.INPUT_REPLY, "n": self.serial}
        if self.error is not None:
            h["e"] = self.error
        if self.value is not None:
            h["v"] = self.value
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> InputReply:
        _check(cls, h)
        try:
            return cls(serial=h["n"], value=h.get("v"), error=h.get("e"))
        except KeyError as exc:
            raise _missing(cls, exc) from None


# -- rank -> controller -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """``ready``: rank ``r`` started, greeted by its host agent, taking work."""

    KIND: ClassVar[str] = K.READY
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "pid", "host", "dev", "rc", "pa"}

    rank: int
    pid: int
    hostname: str  #: ``host``
    device: str  #: ``dev``: ``cpu`` or ``cuda:N``
    restart_count: int  #: ``rc``
    peer: WireAddress  #: ``pa``: the peer address its inbox listens on

    def encode(self) -> WireHeader:
        return {
            "k": K.READY,
            "r": self.rank,
            "pid": self.pid,
            "host": self.hostname,
            "dev": self.device,
            "rc": self.restart_count,
            "pa": self.peer,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> Ready:
        _check(cls, h)
        try:
            return cls(
                rank=h["r"],
                pid=h["pid"],
                hostname=h["host"],
                device=h["dev"],
                restart_count=h["rc"],
                peer=h["pa"],
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """``res``: the answer to request ``i`` (``ok``: the payload is the value, else a
    failure report); from rank ``r``, or from host agent ``h`` on its behalf."""

    KIND: ClassVar[str] = K.RESULT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"i", "r", "ok", "h"}

    request: str | None
    ok: bool
    rank: int | None = None
    host: int | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.RESULT}
        if self.request is not None:
            h["i"] = self.request
        if self.rank is not None:
            h["r"] = self.rank
        h["ok"] = 1 if self.ok else 0
        if self.host is not None:
            h["h"] = self.host
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Result:
        _check(cls, h)
        try:
            return _Result(h.get("i"), bool(h["ok"]), h.get("r"), h.get("h"))
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream:
    """``out``: text rank ``r`` wrote to stream ``n`` while serving request ``i``."""

    KIND: ClassVar[str] = K.STREAM
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i", "n"}

    rank: int
    request: str | None  #: always on the wire (None while idle)
    name: str  #: ``stdout`` or ``stderr``

    def encode(self) -> WireHeader:
        return {"k": K.STREAM, "r": self.rank, "i": self.request, "n": self.name}

    @classmethod
    def decode(cls, h: WireHeader) -> Stream:
        _check(cls, h)
        try:
            return _Stream(h["r"], h["i"], h["n"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Metric:
    """``metric``: numbers ``report()`` ed by rank ``r`` during request ``i``."""

    KIND: ClassVar[str] = K.METRIC
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i"}

    rank: int
    request: str | None  #: always on the wire (None while idle)

    def encode(self) -> WireHeader:
        return {"k": K.METRIC, "r": self.rank, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> Metric:
        _check(cls, h)
        try:
            return _Metric(h["r"], h["i"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankNotice:
    """A rank -> controller message with no keys but its rank ``r`` (``kind``):
    ``fault``, ``stats``, ``stop_mesh``, ``ask`` (all they say is in the payload)."""

    KIND: ClassVar[str] = ""  #: one of KINDS: see ``kind``
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r"}
    KINDS: ClassVar[frozenset[str]] = frozenset({K.FAULT, K.STATS, K.STOP_MESH, K.ASK})

    kind: str
    rank: int

    def encode(self) -> WireHeader:
        return {"k": self.kind, "r": self.rank}

    @classmethod
    def decode(cls, h: WireHeader) -> RankNotice:
        if not h.keys() <= cls.KEYS:
            raise HeaderError(
                f"{h.get('k')!r} header: unknown key(s) {sorted(h.keys() - cls.KEYS)}"
            )
        try:
            return cls(kind=h["k"], rank=h["r"])
        except KeyError as exc:
            raise HeaderError(f"{h.get('k')!r} header: missing key {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Owned:
    """``owned``: actor ``a`` of rank ``r`` is owned by an actor elsewhere (payload)."""

    KIND: ClassVar[str] = K.OWNED
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "a"}

    rank: int
    actor: str

    def encode(self) -> WireHeader:
        return {"k": K.OWNED, "r": self.rank, "a": self.actor}

    @classmethod
    def decode(cls, h: WireHeader) -> Owned:
        _check(cls, h)
        try:
            return cls(rank=h["r"], actor=h["a"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerActor:
    """``peer_actor``: a rank-to-rank message spawned (``x`` 1, with its owner) or
    stopped (``x`` 0) actor ``a`` on rank ``r``."""

    KIND: ClassVar[str] = K.PEER_ACTOR
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "a", "x", "oa", "ox", "on"}

    rank: int
    actor: str
    spawned: bool
    owner: Owner | None = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.PEER_ACTOR, "r": self.rank, "a": self.actor}
        h["x"] = 1 if self.spawned else 0
        if self.owner is not None:
            h.update(oa=self.owner.address, ox=self.owner.key, on=self.owner.name)
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> PeerActor:
        _check(cls, h)
        try:
            owner = Owner.decode(h) if "oa" in h else None
            return cls(rank=h["r"], actor=h["a"], spawned=bool(h["x"]), owner=owner)
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Input:
    """``input``: rank ``r``'s ``input()`` number ``n`` asks prompt ``p`` (a debugger
    prompt adds ``dbg``, ``at``, ``pm``)."""

    KIND: ClassVar[str] = K.INPUT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i", "n", "p", "pw", "dbg", "at", "pm"}

    rank: int
    request: str | None  #: always on the wire
    serial: int
    prompt: str
    password: bool = False  #: ``pw``: do not echo (``getpass``)
    debugger: bool = False  #: ``dbg``
    where: str | None = None  #: ``at``: where the debugger stopped
    post_mortem: bool | None = None  #: ``pm`` (with ``dbg``)

    def encode(self) -> WireHeader:
        h: WireHeader = {
            "k": K.INPUT,
            "r": self.rank,
            "i": self.request,
            "n": self.serial,
            "p": self.prompt,
            "pw": int(self.password),
        }
        if self.debugger:
            h["dbg"] = 1
        if self.where is not None:
            h["at"] = self.where
        if self.post_mortem is not None:
            h["pm"] = int(self.post_mortem)
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Input:
        _check(cls, h)
        try:
            pm = h.get("pm")
            return cls(
                rank=h["r"],
                request=h["i"],
                serial=h["n"],
                prompt=h["p"],
                password=bool(h["pw"]),
                debugger=bool(h.get("dbg")),
                where=h.get("at"),
                post_mortem=None if pm is None else bool(pm),
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    """``resumed``: rank ``r``'s debugger let it run on (``why``); prompt ``n`` is over."""

    KIND: ClassVar[str] = K.RESUMED
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i", "n", "why"}

    rank: int
    request: str | None  #: always on the wire
    serial: int
    why: str

    def encode(self) -> WireHeader:
        return {
            "k": K.RESUMED,
            "r": self.rank,
            "i": self.request,
            "n": self.serial,
            "why": self.why,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> Resumed:
        _check(cls, h)
        try:
            return cls(rank=h["r"], request=h["i"], serial=h["n"], why=h["why"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


# -- controller <-> host agent ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SpawnRanks:
    """``spawn_ranks``: fork one rank per spec of ``ranks``, each merged over
    ``common`` (see :class:`monarch_kernel.rank.config.RankConfig`)."""

    KIND: ClassVar[str] = K.SPAWN_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"ranks", "common"}

    ranks: list[WireHeader]
    common: WireHeader

    def encode(self) -> WireHeader:
        return {"k": K.SPAWN_RANKS, "ranks": self.ranks, "common": self.common}

    @classmethod
    def decode(cls, h: WireHeader) -> SpawnRanks:
        _check(cls, h)
        try:
            return cls(ranks=h["ranks"], common=h["common"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalRanks:
    """``signal_ranks``: send signal ``sig`` to the host's ranks ``d``."""

    KIND: ClassVar[str] = K.SIGNAL_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d", "sig"}

    targets: list[int]
    signal: int

    def encode(self) -> WireHeader:
        return {"k": K.SIGNAL_RANKS, "d": self.targets, "sig": self.signal}

    @classmethod
    def decode(cls, h: WireHeader) -> SignalRanks:
        _check(cls, h)
        try:
            return cls(targets=h["d"], signal=h["sig"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class KillRanks:
    """``kill_ranks``: SIGKILL the host's ranks ``d`` (their exits are expected)."""

    KIND: ClassVar[str] = K.KILL_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d"}

    targets: list[int]

    def encode(self) -> WireHeader:
        return {"k": K.KILL_RANKS, "d": self.targets}

    @classmethod
    def decode(cls, h: WireHeader) -> KillRanks:
        _check(cls, h)
        try:
            return cls(targets=h["d"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """``stop``: the host agent stops its ranks (``grace`` seconds to exit) and exits."""

    KIND: ClassVar[str] = K.STOP
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"grace"}

    grace: float | None = None  #: seconds (not checked here: the agent falls back)

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.STOP}
        if self.grace is not None:
            h["grace"] = self.grace
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Stop:
        _check(cls, h)
        return cls(grace=h.get("grace"))


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpStacks:
    """``dump_stacks``: answer request ``i`` with the stacks of ranks ``d``."""

    KIND: ClassVar[str] = K.DUMP_STACKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d", "i"}

    targets: list[int]
    request: str

    def encode(self) -> WireHeader:
        return {"k": K.DUMP_STACKS, "d": self.targets, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> DumpStacks:
        _check(cls, h)
        try:
            return cls(targets=h["d"], request=h["i"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class NewPort:
    """``new_port``: answer request ``i`` with a free port of the host."""

    KIND: ClassVar[str] = K.NEW_PORT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"i"}

    request: str | None

    def encode(self) -> WireHeader:
        return {"k": K.NEW_PORT, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> NewPort:
        _check(cls, h)
        try:
            return cls(request=h["i"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """``hb``: from the controller (no keys) or from host agent ``h``."""

    KIND: ClassVar[str] = K.HEARTBEAT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h"}

    host: int | None = None

    def encode(self) -> WireHeader:
        return {"k": K.HEARTBEAT} if self.host is None else {"k": K.HEARTBEAT, "h": self.host}

    @classmethod
    def decode(cls, h: WireHeader) -> Heartbeat:
        _check(cls, h)
        return cls(host=h.get("h"))


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReady:
    """``host_ready``: host agent ``h`` is up (its pid, hostname, address, free port)."""

    KIND: ClassVar[str] = K.HOST_READY
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "pid", "host", "addr", "port"}

    host: int
    pid: int
    hostname: str  #: ``host``
    addr: str  #: the address other hosts reach it at
    port: int  #: a free port (MASTER_PORT when this is host 0)

    def encode(self) -> WireHeader:
        return {
            "k": K.HOST_READY,
            "h": self.host,
            "pid": self.pid,
            "host": self.hostname,
            "addr": self.addr,
            "port": self.port,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> HostReady:
        _check(cls, h)
        try:
            return cls(
                host=h["h"], pid=h["pid"], hostname=h["host"], addr=h["addr"], port=h["port"]
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Port:
    """``port``: host agent ``h``'s answer to ``new_port`` request ``i``."""

    KIND: ClassVar[str] = K.PORT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "i", "port"}

    host: int
    request: str | None
    port: int

    def encode(self) -> WireHeader:
        return {"k": K.PORT, "h": self.host, "i": self.request, "port": self.port}

    @classmethod
    def decode(cls, h: WireHeader) -> Port:
        _check(cls, h)
        try:
            return cls(host=h["h"], request=h["i"], port=h["port"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStarted:
    """``rank_started``: host agent ``h`` forked rank ``r`` as ``pid``."""

    KIND: ClassVar[str] = K.RANK_STARTED
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "r", "pid"}

    host: int
    rank: int
    pid: int

    def encode(self) -> WireHeader:
        return {"k": K.RANK_STARTED, "h": self.host, "r": self.rank, "pid": self.pid}

    @classmethod
    def decode(cls, h: WireHeader) -> RankStarted:
        _check(cls, h)
        try:
            return cls(host=h["h"], rank=h["r"], pid=h["pid"])
        except KeyError as exc:
            raise _missing(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """``rank_exit``: rank ``r`` (``pid``) of host agent ``h`` ended."""

    KIND: ClassVar[str] = K.RANK_EXIT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {
        "h",
        "r",
        "pid",
        "code",
        "sig",
        "tail",
        "expected",
    }

    host: int
    rank: int
    pid: int
    code: int | None  #: exit status (None: killed by a signal)
    signal: int | None  #: ``sig``: the signal that killed it
    tail: list[str] = field(default_factory=list)  #: its last output lines
    expected: bool = False  #: the exit was asked for

    def encode(self) -> WireHeader:
        return {
            "k": K.RANK_EXIT,
            "h": self.host,
            "r": self.rank,
            "pid": self.pid,
            "code": self.code,
            "sig": self.signal,
            "tail": self.tail,
            "expected": self.expected,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> RankExit:
        _check(cls, h)
        try:
            return cls(
                host=h["h"],
                rank=h["r"],
                pid=h["pid"],
                code=h["code"],
                signal=h["sig"],
                tail=h["tail"],
                expected=h["expected"],
            )
        except KeyError as exc:
            raise _missing(cls, exc) from None


_SpawnActor = _maker(SpawnActor)
_Call = _maker(Call)
_Exec = _maker(Exec)
_StopActor = _maker(StopActor)
_Debug = _maker(Debug)
_Supervise = _maker(Supervise)
_Hello = _maker(Hello)
_ControlRequest = _maker(ControlRequest)
_Result = _maker(Result)
_Stream = _maker(Stream)
_Metric = _maker(Metric)

# -- the table ----------------------------------------------------------------------

#: Every control-message header class.
AnyHeader: TypeAlias = (
    SpawnActor
    | Call
    | Exec
    | StopActor
    | Debug
    | Supervise
    | Hello
    | ControlRequest
    | Cancel
    | InputReply
    | Ready
    | Result
    | Stream
    | Metric
    | RankNotice
    | Owned
    | PeerActor
    | Input
    | Resumed
    | SpawnRanks
    | SignalRanks
    | KillRanks
    | Stop
    | DumpStacks
    | NewPort
    | Heartbeat
    | HostReady
    | Port
    | RankStarted
    | RankExit
)

_CLASSES: tuple[Any, ...] = (
    SpawnActor,
    Call,
    Exec,
    StopActor,
    Debug,
    Supervise,
    Hello,
    Cancel,
    InputReply,
    Ready,
    Result,
    Stream,
    Metric,
    Owned,
    PeerActor,
    Input,
    Resumed,
    SpawnRanks,
    SignalRanks,
    KillRanks,
    Stop,
    DumpStacks,
    NewPort,
    Heartbeat,
    HostReady,
    Port,
    RankStarted,
    RankExit,
)
#: kind -> the decoder of its header
DECODERS: dict[str, Callable[[WireHeader], Any]] = {cls.KIND: cls.decode for cls in _CLASSES}
DECODERS.update(dict.fromkeys(ControlRequest.KINDS, ControlRequest.decode))
DECODERS.update(dict.fromkeys(RankNotice.KINDS, RankNotice.decode))
#: The kinds that go to a rank's inbox (its main thread, in ``q`` order).
ORDERED_KINDS = frozenset(
    {K.SPAWN_ACTOR, K.CALL, K.EXEC, K.STOP_ACTOR, K.DEBUG, K.SUPERVISE, K.HELLO}
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
