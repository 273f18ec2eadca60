"""Wire layer: message framing, signing (keyed BLAKE2b) and zero-copy serialization.

Every control message is multipart ``[envelope, *buffers]``: one signed envelope frame
(header, signature and, when small, the payload), then zero-copy buffers.
"""

from monarch_kernel.wire.codec import Codec, Message, WireError, limit_size, max_message
from monarch_kernel.wire.serialize import SerializationError, dumps, loads

__all__ = [
    "Codec",
    "Message",
    "WireError",
    "SerializationError",
    "dumps",
    "limit_size",
    "loads",
    "max_message",
]
