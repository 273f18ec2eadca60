"""Headers of what a rank sends its controller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
from monarch_kernel.wire.headers.ordered import Owner

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
        check_keys(cls, h)
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
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """``res``: the answer to request ``i`` (``ok``: the payload is the value, else a
    failure report); from rank ``r``, or from host agent ``h`` on its behalf. ``x``: the
    value's large CUDA tensors are handles on copies the rank keeps for the caller (a
    rank's call that asked for it with ``rp``; ``rank.dataplane.cuda_results``)."""

    KIND: ClassVar[str] = K.RESULT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"i", "r", "ok", "h", "x"}

    request: str | None
    ok: bool
    rank: int | None = None
    host: int | None = None
    handles: bool = False

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.RESULT}
        if self.request is not None:
            h["i"] = self.request
        if self.rank is not None:
            h["r"] = self.rank
        h["ok"] = 1 if self.ok else 0
        if self.host is not None:
            h["h"] = self.host
        if self.handles:
            h["x"] = 1
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Result:
        check_keys(cls, h)
        try:
            return _Result(h.get("i"), bool(h["ok"]), h.get("r"), h.get("h"), bool(h.get("x")))
        except KeyError as exc:
            raise missing_key(cls, exc) from None


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
        check_keys(cls, h)
        try:
            return _Stream(h["r"], h["i"], h["n"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Display:
    """``display``: a rich display (or an update, or a clear) rank ``r`` made while
    serving request ``i``."""

    KIND: ClassVar[str] = K.DISPLAY
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i", "op", "di"}
    OPS: ClassVar[frozenset[str]] = frozenset({"display", "update", "clear", "clear_wait"})

    rank: int
    request: str | None  #: always on the wire (None while idle)
    op: str  #: ``display``, ``update``, ``clear`` or ``clear_wait``
    display_id: str | None  #: the rank's own display id (always on the wire)

    def encode(self) -> WireHeader:
        return {
            "k": K.DISPLAY,
            "r": self.rank,
            "i": self.request,
            "op": self.op,
            "di": self.display_id,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> Display:
        check_keys(cls, h)
        try:
            op = h["op"]
            if op not in cls.OPS:
                raise HeaderError(f"display: unknown op {op!r}")
            return _Display(h["r"], h["i"], op, h["di"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


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
        check_keys(cls, h)
        try:
            return _Metric(h["r"], h["i"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankNotice:
    """A rank -> controller message with no keys but its rank ``r`` (``kind``):
    ``fault``, ``stats``, ``stop_mesh``, ``ask``, ``train_notice``, ``steps`` (all they
    say is in the payload)."""

    KIND: ClassVar[str] = ""  #: one of KINDS: see ``kind``
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r"}
    KINDS: ClassVar[frozenset[str]] = frozenset(
        {K.FAULT, K.STATS, K.STOP_MESH, K.ASK, K.TRAIN_NOTICE, K.STEPS}
    )

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
        check_keys(cls, h)
        try:
            return cls(rank=h["r"], actor=h["a"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


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
        check_keys(cls, h)
        try:
            owner = Owner.decode(h) if "oa" in h else None
            return cls(rank=h["r"], actor=h["a"], spawned=bool(h["x"]), owner=owner)
        except KeyError as exc:
            raise missing_key(cls, exc) from None


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
        check_keys(cls, h)
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
            raise missing_key(cls, exc) from None


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
        check_keys(cls, h)
        try:
            return cls(rank=h["r"], request=h["i"], serial=h["n"], why=h["why"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneOn:
    """``lane_on``: rank ``r`` opened the lane its controller offered; this is the last
    message it sends over its socket (everything after comes through the lane)."""

    KIND: ClassVar[str] = K.LANE_ON
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r"}

    rank: int

    def encode(self) -> WireHeader:
        return {"k": K.LANE_ON, "r": self.rank}

    @classmethod
    def decode(cls, h: WireHeader) -> LaneOn:
        check_keys(cls, h)
        try:
            return cls(rank=h["r"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


#: The decoders' constructors (see ``base.maker``).
_Result = maker(Result)


def rank_result(request: str, ok: bool, rank: int, handles: bool = False) -> Result:
    """``Result(request=request, ok=ok, rank=rank, handles=handles)`` by the fast
    constructor: a rank makes one per reply (a frozen dataclass's ``__init__`` costs
    about 1 us more)."""
    return _Result(request, ok, rank, None, handles)


_Stream = maker(Stream)
_Display = maker(Display)
_Metric = maker(Metric)
