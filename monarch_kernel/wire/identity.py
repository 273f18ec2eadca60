"""Routing identities on CURVE meshes, shared by the controller, host agents and ranks."""

from __future__ import annotations

import hashlib


def ident_tag(curve_secret: str | bytes) -> bytes:
    """The suffix of every routing id (``r3`` + tag) a host agent and its ranks use on
    a CURVE mesh: derived from that host's CURVE secret key, which only the host and the
    controller (that made it) know, so no peer of another host can claim these ids.
    Empty without CURVE (unix sockets: the user only)."""
    if not curve_secret:
        return b""
    raw = curve_secret.encode() if isinstance(curve_secret, str) else curve_secret
    return b"." + hashlib.blake2s(raw, digest_size=12, person=b"mk-ident").hexdigest().encode()
