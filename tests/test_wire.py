import hashlib
import hmac
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from wire_frames import envelope, split

from monarch_kernel.wire import Codec, SerializationError, WireError, dumps, loads
from monarch_kernel.wire.codec import new_key, signer

pytestmark = pytest.mark.unit


class _Tripwire:
    """Unpickling this creates a file: proof that a payload was (not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_signed_roundtrip_with_buffers():
    codec = Codec(new_key())
    t = torch.arange(100_000, dtype=torch.float32)
    payload, buffers = dumps({"t": t, "a": np.arange(5)})
    assert len(buffers) == 1 and len(payload) < 1000  # tensor data stays out of the pickle
    frames = codec.encode({"k": "call", "i": "x"}, payload, buffers)
    msg = codec.decode(frames)
    out = loads(msg.payload, msg.buffers)
    assert torch.equal(out["t"], t) and out["a"].tolist() == [0, 1, 2, 3, 4]
    assert msg.header["b"] == [400_000]


def test_forged_message_is_dropped_before_unpickling(tmp_path):
    good, evil = Codec(new_key()), Codec(new_key())
    trip = tmp_path / "tripwire"
    payload, _ = dumps(_Tripwire(str(trip)))
    with pytest.raises(WireError, match="signature"):
        good.decode(evil.encode({"k": "call"}, payload))
    assert good.rejected == 1 and not trip.exists()
    # tampering with the payload of a correctly signed message is caught too
    (env,) = good.encode({"k": "call"}, b"harmless")
    hb, sig, harmless, separate = split(env)
    assert harmless == b"harmless" and not separate  # a small payload is in the envelope
    with pytest.raises(WireError, match="signature"):
        good.decode([envelope(hb, sig, payload)])
    # ... and so is moving it out of the envelope into a frame of its own
    with pytest.raises(WireError, match="signature"):
        good.decode([envelope(hb, sig, separate=True), b"harmless"])
    assert good.rejected == 3 and not trip.exists()


def test_signature_is_keyed_blake2b_over_word_header_and_payload():
    """The documented algorithm (SECURITY.md, protocol 14): keyed BLAKE2b-256 with the
    wire's personalisation over the envelope's word and header and the payload; a peer
    that still signs HMAC-SHA256 (protocol 13) is refused as forged."""
    key = new_key()
    codec = Codec(key)
    (env,) = codec.encode({"k": "call"}, b"payload")
    hb, sig, payload, _ = split(env)
    word = env[:4]
    want = hashlib.blake2b(
        word + hb + payload, key=key, digest_size=32, person=b"monarch-wire-v14"
    ).digest()
    assert sig == want and payload == b"payload"
    old = hmac.new(key, word + hb + payload, "sha256").digest()
    with pytest.raises(WireError, match="forged or wrong mesh key"):
        Codec(key).decode([envelope(hb, old, payload)])
    # unpersonalised BLAKE2b with the same key is not a signature either
    plain = hashlib.blake2b(word + hb + payload, key=key, digest_size=32).digest()
    with pytest.raises(WireError, match="does not verify"):
        Codec(key).decode([envelope(hb, plain, payload)])


def test_keys_longer_than_64_bytes_sign_and_verify():
    long_key = os.urandom(100)  # above BLAKE2b's 64-byte key: hashed down to 64 bytes
    a, b = Codec(long_key), Codec(long_key)
    assert b.decode(a.encode({"k": "call"}, b"x")).payload == b"x"
    down = signer(hashlib.blake2b(long_key).digest())
    mac = signer(long_key)
    mac.update(b"m")
    down.update(b"m")
    assert mac.digest() == down.digest()
    with pytest.raises(WireError, match="does not verify"):
        Codec(long_key[:64]).decode(a.encode({"k": "call"}, b"x"))


def test_large_payload_is_a_frame_of_its_own_and_signed():
    codec = Codec(new_key())
    big = bytes(range(256)) * 1000  # above INLINE_PAYLOAD
    frames = codec.encode({"k": "call"}, big, [b"buf"])
    assert len(frames) == 3 and frames[1] is big  # not copied into the envelope
    hb, sig, inline, separate = split(frames[0])
    assert separate and inline == b""
    msg = codec.decode(frames)
    assert bytes(msg.payload) == big and [bytes(b) for b in msg.buffers] == [b"buf"]
    tampered = big[:-1] + b"x"
    with pytest.raises(WireError, match="signature"):
        codec.decode([frames[0], tampered, b"buf"])
    # the same bytes inside the envelope, the flag cleared: the flag is signed too
    with pytest.raises(WireError, match="signature"):
        codec.decode([envelope(hb, sig, big), b"buf"])
    with pytest.raises(WireError, match="payload frame is missing"):
        codec.decode(frames[:1])
    with pytest.raises(WireError, match="payload both"):
        codec.decode([frames[0] + b"x", big, b"buf"])
    assert codec.rejected == 4


def test_malformed_messages_are_rejected():
    codec = Codec(new_key())
    with pytest.raises(WireError, match="0 frames"):
        codec.decode([])
    with pytest.raises(WireError, match="envelope of 8 bytes"):
        codec.decode([b"only one"])
    frames = codec.encode({"k": "x"}, b"p", [b"0123456789"])
    assert len(frames) == 2  # the envelope and the buffer
    with pytest.raises(WireError, match="buffer"):
        codec.decode(frames[:1])  # a buffer frame went missing
    frames = codec.encode({"k": "x"}, b"p")
    frames[0] = b"not json" * 10
    with pytest.raises(WireError):
        codec.decode(frames)
    assert codec.rejected == 4


def test_tensor_dtypes_and_shapes_roundtrip():
    for t in (
        torch.randn(3, 4).to(torch.bfloat16),
        torch.randn(5, 5)[:, 1:3],  # non-contiguous
        torch.zeros(0, 3),
        torch.tensor(7),
        torch.nn.Parameter(torch.ones(2)),
        torch.randint(0, 9, (64, 1024), dtype=torch.int64),
    ):
        p, b = dumps(t)
        out = loads(p, [memoryview(x) for x in b])
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out.detach(), t.detach())
        assert type(out) is type(t)


def test_received_tensor_is_writable():
    p, b = dumps(torch.zeros(50_000))
    out = loads(p, [bytearray(memoryview(x)) for x in b])
    out += 1
    assert out.sum().item() == 50_000


def test_unpicklable_value_names_what():
    with pytest.raises(SerializationError, match="argument 0 of X.y cannot be pickled.*lock"):
        dumps(threading.Lock(), "argument 0 of X.y")


def test_local_classes_pickle_by_value():
    class Local:
        def __init__(self):
            self.v = 3

    p, b = dumps(Local())
    assert b"Local" in p
    assert pickle.loads(p).v == 3
    assert os.getpid()  # keeps the import used
