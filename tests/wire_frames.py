"""Taking a control message's envelope frame apart and building one by hand, for the
tests that forge, cut and tamper with messages (layout in ``monarch_kernel.wire.codec``)."""

from __future__ import annotations

from monarch_kernel.wire.codec import SEPARATE_PAYLOAD, SIGNATURE_SIZE


def envelope(
    header: bytes,
    signature: bytes = b"\0" * SIGNATURE_SIZE,
    payload: bytes = b"",
    *,
    separate: bool = False,
    length: int | None = None,
) -> bytes:
    """An envelope frame of these parts; ``length`` (default ``len(header)``) is what
    its word claims, ``separate`` its flag that the payload is the next frame."""
    word = len(header) if length is None else length
    if separate:
        word |= SEPARATE_PAYLOAD
    return word.to_bytes(4, "little") + header + signature + payload


def split(env: bytes) -> tuple[bytes, bytes, bytes, bool]:
    """``(header, signature, inline payload, separate)`` of a well-formed envelope."""
    word = int.from_bytes(env[:4], "little")
    n = word & (SEPARATE_PAYLOAD - 1)
    return (
        env[4 : 4 + n],
        env[4 + n : 4 + n + SIGNATURE_SIZE],
        env[4 + n + SIGNATURE_SIZE :],
        (word & SEPARATE_PAYLOAD != 0),
    )


def header_of(env: bytes) -> bytes:
    """The marshalled header inside an envelope."""
    return split(env)[0]
