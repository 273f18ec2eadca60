"""Wire layer: message framing, HMAC signing and zero-copy serialization.

Every control message is multipart ``[header, signature, payload, *buffers]``.
"""

from monarch_kernel.wire.codec import Codec, Message, WireError
from monarch_kernel.wire.serialize import SerializationError, dumps, loads

__all__ = ["Codec", "Message", "WireError", "SerializationError", "dumps", "loads"]
