"""What every header class shares: the wire types, :class:`HeaderError`, the key
check and the fast constructor of the decoders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeAlias, TypeVar

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


def check_keys(cls: type[Any], h: WireHeader) -> None:
    if not h.keys() <= cls.KEYS:
        unknown = sorted(h.keys() - cls.KEYS)
        raise HeaderError(f"{cls.KIND!r} header: unknown key(s) {unknown}")


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of ``cls`` taking every field positionally, in declaration order
    (the base class's first), for the decoders: a frozen dataclass's own ``__init__``
    goes through ``object.__setattr__`` per field, which costs about three times as much
    (1 us for a ``call``); here the slots' descriptors are set directly.

    The constructor is generated as straight-line code (one descriptor call per field,
    as ``dataclasses`` generates ``__init__``): a loop over ``zip(setters, values)``
    costs about 1 us more for a ``call``'s nine fields, on every message a rank
    receives and every reply the controller decodes. Every field must be given."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    scope: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    for i, name in enumerate(names):
        scope[f"_set{i}"] = getattr(cls, name).__set__
    params = ", ".join(f"v{i}" for i in range(len(names)))
    body = "".join(f"    _set{i}(obj, v{i})\n" for i in range(len(names)))
    source = f"def make({params}):\n    obj = _new(_cls)\n{body}    return obj\n"
    exec(compile(source, f"<maker of {cls.__name__}>", "exec"), scope)
    make: Callable[..., T] = scope["make"]
    return make


def missing_key(cls: type[Any], exc: KeyError) -> HeaderError:
    return HeaderError(f"{cls.KIND!r} header: missing key {exc.args[0]!r}")
