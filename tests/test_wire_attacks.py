"""Attacks on the wire: forged, replayed, truncated, oversized and random messages
against a real running mesh (its controller, host agent and ranks), and a fuzz of the
frame decoder. Nothing is ever unpickled (a marker file a malicious pickle would create
stays absent), every rejection is counted, and the mesh keeps working."""

from __future__ import annotations

import marshal
import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq
from actors import Counter
from helpers import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_frames import envelope, header_of, split

from monarch_kernel.wire import Codec, WireError, dumps, loads
from monarch_kernel.wire import codec as C
from monarch_kernel.wire.codec import new_key

LIMIT = 64 << 20  # MONARCH_KERNEL_MAX_MESSAGE for the test mesh
MARKER = Path(f"/tmp/monarch-wire-attack-{os.getpid()}")


class Evil:
    """Unpickling this creates MARKER."""

    def __reduce__(self):
        return (open, (str(MARKER), "w"))


EVIL = pickle.dumps(Evil())


@pytest.fixture(autouse=True)
def _no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a malicious pickle was unpickled"


@pytest.fixture(scope="module")
def workers():
    """A 2-rank local mesh with a 64 MiB message limit (name: a shared fixture, so the
    orphan check runs once, at its teardown)."""
    from conftest import wait_no_orphans

    from monarch_kernel.actor import this_host

    old = os.environ.get(C.MAX_MESSAGE_ENV)
    os.environ[C.MAX_MESSAGE_ENV] = str(LIMIT)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2})
    finally:
        if old is None:
            del os.environ[C.MAX_MESSAGE_ENV]
        else:
            os.environ[C.MAX_MESSAGE_ENV] = old
    counters = procs.spawn("attacked", Counter, 0)
    yield procs, counters
    procs.stop()
    left = wait_no_orphans()
    assert not left, f"mesh left processes behind: {[p.pid for p in left]}"


def _works(workers) -> None:
    procs, counters = workers
    before = counters.value.call().get().values()
    assert counters.incr.call(1).get().values() == [v + 1 for v in before]


def _rank_rejected(procs) -> list[int]:
    return [v["rejected"] for v in procs.ping().get().values()]


def _attacker(addr: str, ident: bytes = b"attacker") -> zmq.Socket:
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def _agent() -> tuple[psutil.Process, str]:
    """The host agent among our children, and its fan-out socket's address."""
    for p in psutil.Process().children(recursive=True):
        try:
            conns = p.net_connections(kind="unix")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if isinstance(c.laddr, str) and c.laddr.endswith("/fan"):
                return p, f"ipc://{c.laddr}"
    raise AssertionError("no host agent with a fan-out socket found")


def _wait_rejected(codec: Codec, target: int, timeout: float = 20.0) -> None:
    wait_until(
        lambda: codec.rejected >= target,
        timeout=timeout,
        what=f"{target} rejected messages",
        detail=lambda: codec.rejected,
    )


# -- decoder, no mesh ----------------------------------------------------------------
@pytest.mark.unit
def test_nothing_unpickled_before_the_signature():
    good, evil = Codec(new_key()), Codec(new_key())
    with pytest.raises(WireError, match="signature"):
        good.decode(evil.encode({"k": "call"}, EVIL))
    # a signed message is decoded without unpickling its payload either
    msg = good.decode(good.encode({"k": "call"}, EVIL))
    assert bytes(msg.payload) == EVIL
    assert good.rejected == 1


@pytest.mark.unit
def test_replay_window():
    enc, dec = Codec(b"k" * 32), Codec(b"k" * 32)
    msgs = [enc.encode({"k": "hb"}) for _ in range(3000)]
    # slightly reordered: accepted once each
    for i in [1, 0, 3, 2, 5, 4]:
        dec.decode(msgs[i])
    for i in [0, 5, 3]:
        with pytest.raises(WireError, match="replayed"):
            dec.decode(msgs[i])
    for i in range(6, 2900):
        dec.decode(msgs[i])
    assert len(dec._windows[enc.nonce][1]) <= 3  # a dense sender is compacted
    dec.decode(msgs[2999])
    dec.decode(msgs[2950])  # reordered by 49
    assert len(dec._windows[enc.nonce][1]) <= 3
    for i in [100, 2000, 2899, 2999]:  # seen, or long gone
        with pytest.raises(WireError, match="replayed"):
            dec.decode(msgs[i])
    assert dec.replayed == 7 and dec.rejected == 7
    # a second sender has a window of its own
    other = Codec(b"k" * 32)
    dec.decode(other.encode({"k": "hb"}))


@pytest.mark.unit
def test_sparse_sender_held_back_message_survives():
    """A receiver that sees one in ten of a sender's counters (like a rank, of the
    controller's), with one message held back while many newer ones arrive."""
    enc, dec = Codec(b"k" * 32), Codec(b"k" * 32)
    msgs = [enc.encode({"k": "hb"}) for _ in range(20000)]
    held = msgs[5]
    for m in msgs[10::10]:
        dec.decode(m)
    dec.decode(held)  # 1999 newer messages later
    with pytest.raises(WireError, match="replayed"):
        dec.decode(held)
    assert len(dec._windows[enc.nonce][1]) <= C.MAX_CHUNKS
    for m in msgs[10::10][-100:]:
        with pytest.raises(WireError, match="replayed"):
            dec.decode(m)


@pytest.mark.unit
def test_dense_sender_held_back_message_survives():
    """Compaction never passes a counter not seen yet (a message held back on another
    path, like a busy rank's inbox while its control thread reads on)."""
    enc, dec = Codec(b"k" * 32), Codec(b"k" * 32)
    msgs = [enc.encode({"k": "hb"}) for _ in range(20000)]
    for i, m in enumerate(msgs):
        if i != 100:
            dec.decode(m)
    dec.decode(msgs[100])
    assert dec.rejected == 0
    with pytest.raises(WireError, match="replayed"):
        dec.decode(msgs[100])
    dec.decode(enc.encode({"k": "hb"}))
    assert len(dec._windows[enc.nonce][1]) <= 3  # compacted again once it came


@pytest.mark.unit
def test_concurrent_encoders_and_decoders_lose_nothing():
    import threading

    enc, dec = Codec(b"k" * 32), Codec(b"k" * 32)
    out: list[list] = [[] for _ in range(4)]

    def encode(i: int) -> None:
        for _ in range(2000):
            out[i].append(enc.encode({"k": "hb"}))

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    msgs = sorted(
        (m for part in out for m in part), key=lambda m: marshal.loads(header_of(m[0]))["sc"]
    )
    rnd = random.Random(3)
    for i in range(0, len(msgs) - 50, 50):  # reordered by up to 100 places
        chunk = msgs[i : i + 100]
        rnd.shuffle(chunk)
        msgs[i : i + 100] = chunk
    halves = [msgs[0::2], msgs[1::2]]  # two threads decode, like a rank's two sockets

    def decode(part: list) -> None:
        for m in part:
            dec.decode(m)

    threads = [threading.Thread(target=decode, args=(h,)) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dec.rejected == 0
    for m in msgs[-500:]:
        with pytest.raises(WireError, match="replayed"):
            dec.decode(m)
    assert dec.replayed == 500


@pytest.mark.unit
def test_replay_state_is_bounded():
    dec = Codec(b"k" * 32)
    first = Codec(b"k" * 32)
    dec.decode(first.encode({"k": "hb"}))
    for _ in range(C.MAX_SENDERS + 10):
        dec.decode(Codec(b"k" * 32).encode({"k": "hb"}))
    assert len(dec._windows) == C.MAX_SENDERS
    assert first.nonce not in dec._windows  # least recently seen evicted


@pytest.mark.unit
def test_unsigned_counter_or_nonce_is_refused():
    codec = Codec(b"k" * 32)
    for header in ({"k": "hb"}, {"k": "hb", "sn": 1}, {"k": "hb", "sn": "x", "sc": 1}):
        hb = marshal.dumps(header, 4)
        with pytest.raises(WireError, match="malformed"):
            codec.decode(codec._seal(hb))
    assert codec.rejected == 3


def test_forked_child_gets_a_new_nonce():
    codec = Codec(b"k" * 32)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, codec.nonce.to_bytes(8, "little"))
        os._exit(0)
    os.waitpid(pid, 0)
    assert int.from_bytes(os.read(r, 8), "little") != codec.nonce
    os.close(r)
    os.close(w)


@pytest.mark.unit
def test_bounds_checked_before_anything(monkeypatch):
    codec = Codec(b"k" * 32)
    ok = codec.encode({"k": "hb"})
    assert len(ok) == 1
    hb, sig, _, _ = split(ok[0])
    big = C.MAX_HEADER + 1
    cases = [
        ([], "0 frames"),
        ([b""], "envelope of 0 bytes"),
        ([ok[0][:3]], "envelope of 3 bytes"),  # not even a length word
        ([*ok, *([b"x"] * C.MAX_BUFFERS + [b"y"])], "more than 1024 buffers"),
        ([*ok, *([b"x"] * C.MAX_FRAMES)], f"expected 1 to {C.MAX_FRAMES}"),
        ([envelope(b"\0" * big, sig)], f"header of {big} bytes"),  # oversized header
        ([envelope(b"", sig, length=big)], f"header of {big} bytes"),  # a word that lies
        ([envelope(hb, sig[:-1])], "too short for its header"),  # truncated signature
        ([ok[0][:-1]], "too short for its header"),  # truncated
        ([envelope(hb, sig, length=len(hb) - 1)], "signature"),  # header cut by its word
        ([envelope(hb, sig, length=len(hb) + 1)], "signature"),  # ... or grown
        ([envelope(hb, sig, b"x")], "signature"),  # a payload appended
        ([*ok, b"unannounced buffer"], "buffer"),
    ]
    for frames, why in cases:
        with pytest.raises(WireError, match=why):
            codec.decode(frames)
    assert codec.rejected == len(cases)
    sizes = codec.encode({"k": "res"}, b"", [b"x" * 10, b"y" * 20])
    assert len(sizes) == 3
    sizes[2] = b"y" * 19  # a buffer frame that does not match the header's size
    with pytest.raises(WireError, match="buffer frames do not match"):
        codec.decode(sizes)


@pytest.mark.unit
def test_encode_refuses_what_no_peer_accepts(monkeypatch):
    monkeypatch.setenv(C.MAX_MESSAGE_ENV, "8M")
    codec = Codec(b"k" * 32)
    with pytest.raises(WireError, match="MONARCH_KERNEL_MAX_MESSAGE"):
        codec.encode({"k": "res"}, b"", [bytes(9 << 20)])
    with pytest.raises(WireError, match="MONARCH_KERNEL_MAX_MESSAGE"):
        codec.encode({"k": "res"}, bytes(9 << 20))
    with pytest.raises(WireError, match="at most 1024 buffers"):
        codec.encode({"k": "res"}, b"", [b"x"] * 1025)
    with pytest.raises(WireError, match="header"):
        codec.encode({"k": "res", "x": "y" * C.MAX_HEADER})
    monkeypatch.setenv(C.MAX_MESSAGE_ENV, "lots")
    with pytest.raises(ValueError, match="not a size"):
        C.max_message()
    monkeypatch.setenv(C.MAX_MESSAGE_ENV, "1M")  # below a chunk: streams could not pass
    with pytest.raises(ValueError, match="in chunks of 4.0 MiB plus a header; set at least"):
        C.max_message()


@pytest.mark.unit
def test_many_buffers_travel_in_band_beyond_the_limit():
    import numpy as np

    values = [np.full(4096, i, dtype=np.int64) for i in range(C.MAX_BUFFERS + 50)]
    payload, buffers = dumps(values)
    assert len(buffers) == C.MAX_BUFFERS
    codec = Codec(b"k" * 32)
    msg = codec.decode(codec.encode({"k": "res"}, payload, buffers))
    back = loads(msg.payload, msg.buffers)
    assert all((a == b).all() for a, b in zip(values, back))


_frames = st.lists(st.binary(max_size=300), max_size=8)


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=_frames)
def test_fuzz_decode_random_frames(frames):
    codec = Codec(b"k" * 32)
    try:
        codec.decode(frames)
    except WireError:
        assert codec.rejected == 1
    assert not MARKER.exists()


_SIGNED = Codec(b"k" * 32)


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_decode_mutated_signed_messages(data):
    frames = [bytes(f) for f in _SIGNED.encode({"k": "call", "i": "x"}, EVIL, [b"b" * 100])]
    i = data.draw(st.integers(0, len(frames) - 1))
    f = bytearray(frames[i])
    op = data.draw(st.sampled_from(["flip", "cut", "grow", "drop"]))
    if op == "flip" and f:
        j = data.draw(st.integers(0, len(f) - 1))
        f[j] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "cut":
        del f[data.draw(st.integers(0, len(f))) :]
    elif op == "grow":
        f += data.draw(st.binary(min_size=1, max_size=50))
    frames[i] = bytes(f)
    if op == "drop":
        del frames[i]
    decoder = Codec(b"k" * 32)
    try:
        msg = decoder.decode(frames)
    except WireError:
        return
    # unchanged (a no-op mutation): the message is intact, its payload still a pickle
    assert bytes(msg.payload) == EVIL


# -- a real mesh -----------------------------------------------------------------------
def test_no_key_and_wrong_key(workers):
    procs, _ = workers
    rt = procs.runtime
    controller = rt.codec
    before = controller.rejected
    ranks_before = _rank_rejected(procs)
    s = _attacker(rt.transport.recv_addr)
    hb = marshal.dumps({"k": "res", "r": 0, "i": "x", "ok": 1}, 4)
    s.send_multipart([envelope(hb, b"\0" * 32, EVIL)])  # no key
    s.send_multipart(Codec(new_key()).encode({"k": "res", "r": 0, "i": "x", "ok": 1}, EVIL))
    _wait_rejected(controller, before + 2)
    # the host agent's fan-out socket (it reads ranks' greetings there)
    _, fan = _agent()
    g = _attacker(fan, b"g-attacker")
    g.send_multipart([envelope(marshal.dumps({"k": "hello", "r": 0}, 4), b"\0" * 32, EVIL)])
    g.send_multipart(Codec(new_key()).encode({"k": "hello", "r": 0}, EVIL))
    # to the ranks, forged frames through the controller's own send socket
    for frames in ([envelope(hb, b"\0" * 32, EVIL)], Codec(new_key()).encode({"k": "push"}, EVIL)):
        with rt.transport.send_lock:
            rt.transport.send_sock.send_multipart([b"c0", *frames])
    wait_until(lambda: _rank_rejected(procs)[0] == ranks_before[0] + 2, what="rank 0 rejects")
    s.close()
    g.close()
    _works(workers)


def test_replayed_messages_are_dropped_and_counted(workers):
    procs, _ = workers
    rt = procs.runtime
    controller = rt.codec
    rejected, replayed = controller.rejected, controller.replayed
    s = _attacker(rt.transport.recv_addr)
    frames = controller.encode({"k": "hb", "h": 0})  # a real signed message
    s.send_multipart(frames)
    s.send_multipart(frames)
    _wait_rejected(controller, rejected + 1)
    assert controller.replayed == replayed + 1
    # to a rank (its control thread): the same signed frames twice
    ranks_before = _rank_rejected(procs)
    frames = controller.encode({"k": "cancel", "c": "no-such-request"})
    for _ in range(2):
        with rt.transport.send_lock:
            rt.transport.send_sock.send_multipart([b"c1", *frames])
    wait_until(
        lambda: _rank_rejected(procs) == [ranks_before[0], ranks_before[1] + 1],
        what="rank 1 drops the replay",
    )
    s.close()
    _works(workers)


def test_truncated_malformed_and_too_many_frames(workers):
    procs, _ = workers
    rt = procs.runtime
    controller = rt.codec
    before = controller.rejected
    (env,) = controller.encode({"k": "hb", "h": 0}, b"payload")
    hb, sig, payload, _ = split(env)
    cases = [
        [env[:3]],
        [env[:-1]],  # truncated payload: the signature fails
        [envelope(hb[:-3], sig, payload)],  # truncated header: the signature fails
        [envelope(hb, sig[:16], payload, length=len(hb))],  # truncated signature
        [envelope(hb, sig, separate=True)],  # its payload frame missing
        [envelope(hb, sig, separate=True), payload],  # moved out: the signature fails
        [env, *([b"x"] * (C.MAX_BUFFERS + 1))],
        [envelope(b"\x80" * (C.MAX_HEADER + 1), sig, payload)],
        [envelope(hb, sig, EVIL), b"unannounced"],
    ]
    s = _attacker(rt.transport.recv_addr)
    for frames in cases:
        s.send_multipart(frames)
    _wait_rejected(controller, before + len(cases))
    s.close()
    _works(workers)


_SENDER = """
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 2000)
s.connect(sys.argv[1])
# an envelope (a header of 40 bytes, a signature, the payload in the next frame), then
# the payload frame, far above the limit
s.send_multipart([(40 | 1 << 31).to_bytes(4, "little") + b"h" * 72, bytes(int(sys.argv[2]))])
time.sleep(1.5)
"""


def _rss_after_big_frame(target: psutil.Process, addr: str) -> int:
    """Send a 256 MiB frame to ``addr`` from another process; target's RSS growth."""
    before = target.memory_info().rss
    peak = before
    p = subprocess.Popen([sys.executable, "-c", _SENDER, addr, str(256 << 20)])
    deadline = time.monotonic() + 30
    while p.poll() is None and time.monotonic() < deadline:
        peak = max(peak, target.memory_info().rss)
        time.sleep(0.02)
    p.kill()
    p.wait()
    return peak - before


def test_oversized_frame_drops_the_connection(workers):
    procs, _ = workers
    rt = procs.runtime
    agent, fan = _agent()
    grew = _rss_after_big_frame(agent, fan)
    assert grew < 64 << 20, f"host agent grew {grew >> 20} MiB"
    grew = _rss_after_big_frame(psutil.Process(), rt.transport.recv_addr)
    assert grew < 64 << 20, f"controller grew {grew >> 20} MiB"
    _works(workers)


def test_ten_thousand_random_messages(workers):
    procs, _ = workers
    rt = procs.runtime
    controller = rt.codec
    before = controller.rejected
    rnd = random.Random(12)
    s = _attacker(rt.transport.recv_addr)
    n = 10_000
    for _ in range(n):
        s.send_multipart([rnd.randbytes(rnd.randint(0, 64)) for _ in range(rnd.randint(1, 6))])
    _wait_rejected(controller, before + n, timeout=60)
    assert controller.rejected == before + n
    _, fan = _agent()
    g = _attacker(fan, b"g-random")
    for _ in range(1000):
        g.send_multipart([rnd.randbytes(rnd.randint(0, 64)) for _ in range(rnd.randint(1, 6))])
    s.close()
    g.close()
    _works(workers)
