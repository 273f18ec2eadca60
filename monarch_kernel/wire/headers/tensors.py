"""The header of the tensor engine's one message kind, ``tensor_ops`` (to a rank's
inbox, in ``q`` order with its cells and actor calls)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import HeaderError, WireHeader, check_keys, maker, missing_key
from monarch_kernel.wire.headers.ordered import Ordered, envelope


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorOps(Ordered):
    """``tensor_ops``: ``n`` tensor-engine records (payload: a pickled list of
    :mod:`monarch_kernel.wire.tensor_ops` records), run in order. With ``i``/``w`` it is
    a request: the rank answers with a ``FetchReply`` once all of them ran."""

    KIND: ClassVar[str] = K.TENSOR_OPS
    KEYS: ClassVar[frozenset[str]] = Ordered.KEYS | {"n"}

    count: int

    def encode(self) -> WireHeader:
        return self._put({"k": K.TENSOR_OPS, "n": self.count})

    @classmethod
    def decode(cls, h: WireHeader) -> TensorOps:
        check_keys(cls, h)
        try:
            count = h["n"]
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        if type(count) is not int or count < 0:
            raise HeaderError(f"tensor_ops: n must be a non-negative int, got {count!r}")
        return _TensorOps(*envelope(h), count)


_TensorOps = maker(TensorOps)
