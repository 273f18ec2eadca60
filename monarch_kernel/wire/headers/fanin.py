"""Headers of fan-in (:mod:`monarch_kernel.wire.fanin`): a host agent sends on its
ranks' answers to a fanned-out request as one message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import (
    CODEC_KEYS,
    HeaderError,
    WireHeader,
    check_keys,
    missing_key,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FanIn:
    """``fan_in``: host agent ``h`` sends on what its ranks sent for request ``i``
    (their output and replies, identical bytes combined; payload:
    :func:`monarch_kernel.wire.fanin.encode_parts`)."""

    KIND: ClassVar[str] = K.FAN_IN
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "i"}

    host: int
    request: str

    def encode(self) -> WireHeader:
        return {"k": K.FAN_IN, "h": self.host, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> FanIn:
        check_keys(cls, h)
        try:
            host, request = h["h"], h["i"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        if not isinstance(host, int) or not isinstance(request, str):
            raise HeaderError(f"{cls.KIND!r} header: bad 'h' or 'i'")
        return cls(host=host, request=request)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostStats:
    """``host_stats``: host agent ``h`` sends on the latest ``stats`` of its ranks, once
    a second for them all (payload: a pickled ``{rank: the rank's stats payload}``; with
    ``g`` (``gpu``) set, a pickled pair of that and ``{rank: wire.reports.GpuStats}``,
    the GPU each rank is on, sampled by the agent)."""

    KIND: ClassVar[str] = K.HOST_STATS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "g"}

    host: int
    gpu: bool = False

    def encode(self) -> WireHeader:
        if self.gpu:
            return {"k": K.HOST_STATS, "h": self.host, "g": 1}
        return {"k": K.HOST_STATS, "h": self.host}

    @classmethod
    def decode(cls, h: WireHeader) -> HostStats:
        check_keys(cls, h)
        try:
            host = h["h"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        gpu = h.get("g", 0)
        if not isinstance(host, int) or gpu not in (0, 1):
            raise HeaderError(f"{cls.KIND!r} header: bad 'h' or 'g'")
        return cls(host=host, gpu=bool(gpu))


@dataclass(frozen=True, slots=True, kw_only=True)
class FanInDirect:
    """``fan_direct`` (rank ``r`` -> its host agent): its reply to request ``i`` went to
    the controller directly (too large to combine); the agent waits no more for it."""

    KIND: ClassVar[str] = K.FAN_DIRECT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"r", "i"}

    rank: int
    request: str

    def encode(self) -> WireHeader:
        return {"k": K.FAN_DIRECT, "r": self.rank, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> FanInDirect:
        check_keys(cls, h)
        try:
            return cls(rank=h["r"], request=h["i"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSteps:
    """``host_steps``: host agent ``h`` sends on its ranks' step-telemetry batches of
    the last 0.1 s together (payload: a pickled ``{rank slot: [its steps payloads]}``,
    ``host.step_fanin``)."""

    KIND: ClassVar[str] = K.HOST_STEPS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h"}

    host: int

    def encode(self) -> WireHeader:
        return {"k": K.HOST_STEPS, "h": self.host}

    @classmethod
    def decode(cls, h: WireHeader) -> HostSteps:
        check_keys(cls, h)
        try:
            host = h["h"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        if not isinstance(host, int):
            raise HeaderError(f"{cls.KIND!r} header: bad 'h'")
        return cls(host=host)
