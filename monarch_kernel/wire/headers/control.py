"""Headers of messages to a rank's control thread (served while its main thread is busy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import (
    CODEC_KEYS,
    HeaderError,
    WireHeader,
    check_keys,
    maker,
    missing_key,
)
from monarch_kernel.wire.headers.ordered import Ordered, envelope

# -- controller -> rank control thread ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRequest(Ordered):
    """``push``, ``pull``, ``ping``, ``stacks``, ``dap_breaks``, ``mesh_ref``, ``profile``:
    a request (or, without ``i``, a notice) to a rank's control thread (``kind``; all it
    needs is in the payload)."""

    KIND: ClassVar[str] = ""  #: one of KINDS: see ``kind``
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS
    KINDS: ClassVar[frozenset[str]] = frozenset(
        {K.PUSH, K.PULL, K.PING, K.STACKS, K.ATTACHED, K.TRAIN, K.DAP_BREAKS, K.MESH_REF}
        | {K.PROFILE}
    )

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
            *envelope(h),
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
        check_keys(cls, h)
        try:
            return cls(target=h["c"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorStop:
    """``tensor_stop``: the stop button stopped the tensor-engine ops numbered up to
    ``through``; those the rank has not run yet do not run (their outputs hold the
    interruption). Told to the control thread, so it holds however many ops are queued
    before it, and whenever the SIGINT that stops the running one lands."""

    KIND: ClassVar[str] = K.TENSOR_STOP
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"s"}

    through: int

    def encode(self) -> WireHeader:
        return {"k": K.TENSOR_STOP, "s": self.through}

    @classmethod
    def decode(cls, h: WireHeader) -> TensorStop:
        check_keys(cls, h)
        try:
            through = h["s"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        if type(through) is not int:
            raise HeaderError(f"'tensor_stop' header: 's' must be an int, not {through!r}")
        return cls(through=through)


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortPg:
    """``abort_pg``: abort the rank's process group; ``why`` goes into the errors of the
    collectives it cuts short (``rank 2 raised ValueError``)."""

    KIND: ClassVar[str] = K.ABORT_PG
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"why"}

    why: str = ""

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.ABORT_PG}
        if self.why:
            h["why"] = self.why
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> AbortPg:
        check_keys(cls, h)
        why = h.get("why", "")
        if not isinstance(why, str):
            raise HeaderError(f"'abort_pg' header: 'why' must be a string, got {why!r}")
        return cls(why=why)


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
        check_keys(cls, h)
        try:
            return cls(serial=h["n"], value=h.get("v"), error=h.get("e"))
        except KeyError as exc:
            raise missing_key(cls, exc) from None


#: The decoders' constructors (see ``base.maker``).
_ControlRequest = maker(ControlRequest)
