"""Size limits of the wire, read from the environment of each process.

Two bounds, both set the same on every process of a mesh (a local mesh's ranks inherit
the kernel's environment; give other hosts ``%mesh ... --env NAME=VALUE``):

* :func:`max_message` (``MONARCH_KERNEL_MAX_MESSAGE``): the largest *frame* a socket
  accepts from a peer, enforced by libzmq before the frame is allocated
  (``ZMQ_MAXMSGSIZE``, :func:`limit_size`). Values larger than a chunk are streamed in
  chunks (:mod:`monarch_kernel.wire.chunks`), so legitimate frames stay small and this
  bound only stops a peer that announces a huge frame.
* :func:`max_value` (``MONARCH_KERNEL_MAX_VALUE``, or ``configure(max_value_size=...)``):
  the largest *value* (one message's pickle and buffers together) a process sends or
  reassembles. Default: half of this machine's memory. The sender refuses a larger value
  with an error naming the bound; a receiver refuses a stream that announces more.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

#: Largest header (marshal bytes). Headers are a few hundred bytes; a ``spawn_ranks``
#: for many ranks with a large ``--env`` a few KiB.
MAX_HEADER = 64 * 1024

#: Environment variable: largest frame (bytes) a socket accepts from a peer.
MAX_MESSAGE_ENV = "MONARCH_KERNEL_MAX_MESSAGE"
#: Its default: 64 MiB. Values above a chunk (4 MiB) travel in chunks, and the data
#: plane fetches and writes tensors a chunk per request, so no legitimate frame is
#: larger than a chunk plus a header: the margin is generous, the bound still tight.
DEFAULT_MAX_MESSAGE = 64 << 20

#: Bytes of one chunk of a streamed value on the wire (:mod:`monarch_kernel.wire.chunks`).
CHUNK_SIZE = 4 << 20
#: Messages whose payload and buffers total more than this are streamed in chunks (and
#: checked against :func:`max_value`; smaller ones never are).
STREAM_ABOVE = CHUNK_SIZE

#: The smallest frame limit that still lets chunks through.
MIN_MAX_MESSAGE = CHUNK_SIZE + MAX_HEADER

#: Environment variable: largest value (bytes) one message may carry, streamed.
MAX_VALUE_ENV = "MONARCH_KERNEL_MAX_VALUE"
#: Its default, as a fraction of this machine's physical memory.
DEFAULT_MAX_VALUE_FRACTION = 0.5

_SCALE = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(raw: str, name: str) -> int:
    """Bytes from ``raw`` (an integer, optionally with a K, M, G or T suffix, binary);
    ValueError naming the setting ``name`` otherwise."""
    text = raw.strip()
    scale = _SCALE.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a size in bytes (e.g. 8589934592 or 8G)") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive size")
    return value


def max_message() -> int:
    """The largest frame accepted from a peer (``MONARCH_KERNEL_MAX_MESSAGE``, bytes;
    suffixes K, M, G allowed; default :data:`DEFAULT_MAX_MESSAGE`)."""
    raw = os.environ.get(MAX_MESSAGE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MESSAGE
    value = parse_size(raw, MAX_MESSAGE_ENV)
    if value < MIN_MAX_MESSAGE:
        raise ValueError(
            f"{MAX_MESSAGE_ENV}={raw!r} is below {describe_size(MIN_MAX_MESSAGE)}: values "
            f"travel in chunks of {describe_size(CHUNK_SIZE)} plus a header; set at least 5M"
        )
    return value


def limit_size(sock: Any) -> None:
    """Set ``ZMQ_MAXMSGSIZE`` on a socket that receives from peers: a peer announcing a
    larger frame is disconnected before the frame is allocated."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message())


def physical_memory() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def max_value() -> int:
    """The largest value one message may carry (``MONARCH_KERNEL_MAX_VALUE``, bytes,
    suffixes K, M, G, T allowed; default half of the physical memory, at least 1 GiB)."""
    raw = os.environ.get(MAX_VALUE_ENV, "").strip()
    if raw:
        return parse_size(raw, MAX_VALUE_ENV)
    return max(1 << 30, int(physical_memory() * DEFAULT_MAX_VALUE_FRACTION))


def inherited_env() -> dict[str, str]:
    """The bounds of this process that ranks it starts take on (in their ``--env``):
    ``MONARCH_KERNEL_MAX_VALUE`` where it is set (``configure(max_value_size=...)``)."""
    raw = os.environ.get(MAX_VALUE_ENV, "").strip()
    return {MAX_VALUE_ENV: raw} if raw else {}


def describe_size(n: int) -> str:
    """``n`` bytes for a person: ``512 B``, ``3.2 MiB``, ``2.0 GiB``."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def too_large(what: str, size: int, limit: int) -> str:
    """The one-line error for a value of ``size`` bytes above the bound ``limit``."""
    return (
        f"{what} is {describe_size(size)}, above the {describe_size(limit)} bound on one "
        f"value ({MAX_VALUE_ENV}, default half of the machine's memory); raise it with "
        f"monarch_kernel.config.configure(max_value_size='16G') before the mesh starts, "
        f"or {MAX_VALUE_ENV}=16G in the environment of every process of the mesh"
    )
