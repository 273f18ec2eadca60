"""Typed message headers (``wire/headers.py``): every kind's wire dict decodes to its
record and encodes back to the very same dict (the wire bytes do not change); missing
and unknown keys are clear errors."""

from __future__ import annotations

import marshal

import pytest

from monarch_kernel.wire import Codec
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import new_key

ADDR = ["box", "ipc:///tmp/x/pr0", "", ""]

#: One wire dict per form of every kind, as the processes write them today.
WIRE: list[dict] = [
    {"k": K.SPAWN_ACTOR, "a": "counters"},
    {"k": K.SPAWN_ACTOR, "a": "c", "oa": ADDR, "ox": "ab" * 16, "on": "owner", "i": "p1-0"},
    {"k": K.SPAWN_ACTOR, "a": "c", "i": "7", "w": 1, "q": 3},
    {"k": K.CALL, "a": "c", "m": "incr", "i": "7", "w": 1, "q": 0},
    {
        "k": K.CALL,
        "a": "c",
        "m": "incr",
        "sl": [["gpus"], [2], [1], 0],
        "d": [0, 1],
        "f": 1,
        "q": [4, 5],
    },
    {"k": K.CALL, "a": "c", "m": "incr", "i": "p1-2", "w": 1, "rt": ADDR},
    {"k": K.CALL, "a": "c", "m": "incr", "i": "p1-3", "w": 1, "rt": ADDR, "rp": 4242},
    {"k": K.BATCH, "n": 3, "d": [0, 1], "q": [4, 9]},
    {"k": K.BATCH, "n": 64, "f": 1, "d": [8, 9], "q": [0, 0]},
    {"k": K.EXEC, "i": "9", "w": 1, "q": 2},
    {"k": K.STOP_ACTOR, "a": "c", "q": 1},
    {"k": K.DEBUG, "x": 1, "i": "3", "w": 1, "q": 7},
    {"k": K.DEBUG, "q": 7},
    {"k": K.SUPERVISE, "on": "owner"},
    {"k": K.HELLO},
    {"k": K.TENSOR_OPS, "n": 3, "q": 4},
    {"k": K.TENSOR_OPS, "n": 1, "i": "p1-9", "w": 1, "q": 5},
    {"k": K.TENSOR_OPS, "n": 2, "f": 1, "d": [0, 1], "q": [6, 7]},
    {"k": K.HELLO, "r": 3},
    {
        "k": K.LANE,
        "q": 0,
        "p": "/proc/7/fd/9",
        "wk": "/proc/7/fd/10",
        "bl": "/proc/7/fd/11",
        "n": 262144,
        "cp": 7,
    },
    {"k": K.PUSH, "i": "1", "w": 1},
    {"k": K.PULL, "i": "1", "w": 1},
    {"k": K.PING, "i": "1", "w": 1},
    {"k": K.TRAIN, "i": "1", "w": 1},
    {"k": K.DAP_BREAKS, "i": "1", "w": 1},
    {"k": K.MESH_REF},
    {"k": K.STACKS, "i": "1", "w": 1},
    {"k": K.PROFILE, "i": "1", "w": 1},
    {"k": K.ABORT_PG},
    {"k": K.ABORT_PG, "why": "rank 2 raised ValueError"},
    {"k": K.CANCEL, "c": "12"},
    {"k": K.TENSOR_STOP, "s": 41},
    {"k": K.INPUT_REPLY, "n": 2, "v": "yes"},
    {"k": K.INPUT_REPLY, "n": 2, "e": "interrupted"},
    {"k": K.READY, "r": 1, "pid": 42, "host": "box", "dev": "cpu", "rc": 0, "pa": ADDR},
    {"k": K.RESULT, "i": "7", "r": 1, "ok": 1},
    {"k": K.RESULT, "i": "7", "r": 1, "ok": 0},
    {"k": K.RESULT, "i": "7", "r": 2, "ok": 1, "h": 0},
    {"k": K.RESULT, "i": "p1-3", "r": 1, "ok": 1, "x": 1},
    {"k": K.STREAM, "r": 1, "i": None, "n": "stdout"},
    {"k": K.STREAM, "r": 1, "i": "7", "n": "stderr"},
    {"k": K.DISPLAY, "r": 1, "i": "7", "op": "display", "di": None},
    {"k": K.DISPLAY, "r": 1, "i": None, "op": "update", "di": "progress"},
    {"k": K.METRIC, "r": 1, "i": "7"},
    {"k": K.FAULT, "r": 1},
    {"k": K.STATS, "r": 1},
    {"k": K.STEPS, "r": 1},
    {"k": K.TRAIN_NOTICE, "r": 1},
    {"k": K.STOP_MESH, "r": 1},
    {"k": K.ASK, "r": 1},
    {"k": K.OWNED, "r": 1, "a": "c"},
    {"k": K.PEER_ACTOR, "r": 1, "a": "c", "x": 0},
    {"k": K.PEER_ACTOR, "r": 1, "a": "c", "x": 1, "oa": ADDR, "ox": "ab", "on": "o"},
    {"k": K.INPUT, "r": 1, "i": "7", "n": 1, "p": "name? ", "pw": 0},
    {
        "k": K.INPUT,
        "r": 1,
        "i": None,
        "n": 2,
        "p": "(Pdb) ",
        "pw": 0,
        "dbg": 1,
        "at": "cell line 3",
        "pm": 1,
    },
    {"k": K.RESUMED, "r": 1, "i": "7", "n": 2, "why": "continue"},
    {"k": K.LANE_ON, "r": 2},
    {"k": K.SPAWN_RANKS, "ranks": [{"rank": 0, "local_rank": 0}], "common": {"run_id": "x"}},
    {"k": K.SPAWN_RANKS, "ranks": [{"rank": 1, "slot": 2}], "common": {"run_id": "x"}},
    {"k": K.SIGNAL_RANKS, "d": [0, 1], "sig": 2},
    {"k": K.KILL_RANKS, "d": [1]},
    {"k": K.STOP},
    {"k": K.STOP, "grace": 0.0},
    {"k": K.DUMP_STACKS, "d": [0], "i": "5"},
    {"k": K.NEW_PORT, "i": "5"},
    {"k": K.HEARTBEAT},
    {"k": K.HEARTBEAT, "h": 1},
    {"k": K.FAN_IN, "h": 1, "i": "q1"},
    {"k": K.FAN_DIRECT, "r": 3, "i": "q1"},
    {"k": K.HOST_STATS, "h": 2},
    {"k": K.HOST_STEPS, "h": 2},
    {"k": K.CHUNK, "st": "s1", "x": 0, "o": 4194304},
    {"k": K.CHUNK, "st": "s1", "x": 1, "o": 0, "f": 1, "d": [0, -1, 1]},
    {"k": K.HOST_READY, "h": 0, "pid": 9, "host": "box", "addr": "127.0.0.1", "port": 2900},
    {
        "k": K.HOST_READY,
        "h": 0,
        "pid": 9,
        "host": "box",
        "addr": "127.0.0.1",
        "port": 2900,
        "desk": "ipc:///tmp/d/desk",
    },
    {"k": K.DETACH},
    {"k": K.ATTACHED, "i": "a1", "w": 1},
    {"k": K.TAKEN_OVER, "h": 1, "by": [123, "box"]},
    {"k": K.PORT, "h": 0, "i": "5", "port": 2901},
    {"k": K.RANK_STARTED, "h": 0, "r": 1, "pid": 10},
    {
        "k": K.RANK_EXIT,
        "h": 0,
        "r": 1,
        "pid": 10,
        "code": None,
        "sig": 9,
        "tail": ["x"],
        "expected": False,
    },
]


def _id(h: dict) -> str:
    return "-".join(sorted(h))


def test_every_kind_is_covered():
    kinds = {v for k, v in vars(K).items() if k.isupper() and isinstance(v, str)}
    assert kinds == {h["k"] for h in WIRE}
    assert kinds == set(H.DECODERS)


@pytest.mark.parametrize("wire", WIRE, ids=[f"{h['k']}:{_id(h)}" for h in WIRE])
def test_round_trip_is_exact(wire):
    header = H.decode(wire)
    assert H.DECODERS[wire["k"]].__self__ is type(header)  # type: ignore[attr-defined]
    again = header.encode()
    assert again == wire
    assert list(again) == list(wire) or set(again) == set(wire)
    # the same bytes on the wire (marshal keeps types: 1 stays 1, never True)
    assert marshal.dumps(dict(sorted(again.items())), 4) == marshal.dumps(
        dict(sorted(wire.items())), 4
    )
    assert H.decode(again) == header


@pytest.mark.parametrize("wire", WIRE, ids=[f"{h['k']}:{_id(h)}" for h in WIRE])
def test_codec_keys_are_ignored(wire):
    """What ``Codec.encode`` adds (``sn``, ``sc``, ``b``) decodes as nothing."""
    codec = Codec(new_key())
    msg = codec.decode(codec.encode(dict(wire), b"", [b"x"]))
    assert H.decode(msg.header).encode() == wire


@pytest.mark.parametrize(
    "wire", [h for h in WIRE if len(h) > 1], ids=[_id(h) for h in WIRE if len(h) > 1]
)
def test_unknown_key_is_an_error(wire):
    with pytest.raises(H.HeaderError, match=r"unknown key\(s\) \['zz'\]"):
        H.decode(dict(wire, zz=1))


REQUIRED = [
    (H.Call, {"k": K.CALL, "a": "c"}, "m"),
    (H.Batch, {"k": K.BATCH, "q": 1}, "n"),
    (H.TensorOps, {"k": K.TENSOR_OPS, "q": 1}, "n"),
    (H.SpawnActor, {"k": K.SPAWN_ACTOR}, "a"),
    (H.StopActor, {"k": K.STOP_ACTOR}, "a"),
    (H.Supervise, {"k": K.SUPERVISE}, "on"),
    (H.Cancel, {"k": K.CANCEL}, "c"),
    (H.TensorStop, {"k": K.TENSOR_STOP}, "s"),
    (H.InputReply, {"k": K.INPUT_REPLY}, "n"),
    (H.Ready, {"k": K.READY, "r": 1}, "pid"),
    (H.Result, {"k": K.RESULT, "i": "1"}, "ok"),
    (H.Stream, {"k": K.STREAM, "r": 1, "i": None}, "n"),
    (H.Display, {"k": K.DISPLAY, "r": 1, "i": None, "di": None}, "op"),
    (H.RankExit, {"k": K.RANK_EXIT, "h": 0, "r": 1, "pid": 2}, "code"),
    (H.SpawnRanks, {"k": K.SPAWN_RANKS, "ranks": []}, "common"),
]


@pytest.mark.parametrize("cls,wire,key", REQUIRED, ids=[c.__name__ for c, _, _ in REQUIRED])
def test_missing_key_is_an_error(cls, wire, key):
    with pytest.raises(H.HeaderError, match=f"{wire['k']!r} header: missing key {key!r}"):
        H.decode(wire)


def test_unknown_kind_is_an_error():
    with pytest.raises(H.HeaderError, match="no header class for kind 'nope'"):
        H.decode({"k": "nope"})


def test_inbox_decoding_keeps_the_sequence_of_what_it_cannot_read():
    """An unknown kind or a malformed header still yields its envelope (the rank takes
    its sequence number and answers the request with an error)."""
    other = H.decode_ordered({"k": "later", "q": 4, "i": "9", "w": 1})
    assert isinstance(other, H.OtherOrdered)
    assert (other.kind, other.seq, other.request, other.wants_reply, other.error) == (
        "later",
        4,
        "9",
        True,
        "",
    )
    bad = H.decode_ordered({"k": K.CALL, "a": "c", "q": 5})
    assert isinstance(bad, H.OtherOrdered) and "missing key 'm'" in bad.error
    assert bad.seq == 5


def test_seq_for_a_fan_out():
    h = H.decode_ordered({"k": K.EXEC, "f": 1, "d": [2, 3], "q": [7, 9]})
    assert (h.seq_for(3), h.seq_for(2), h.seq_for(5)) == (9, 7, -1)
    assert H.decode_ordered({"k": K.EXEC, "q": 4}).seq_for(0) == 4
    assert H.decode_ordered({"k": K.EXEC}).seq_for(0) is None


def test_headers_are_frozen_and_named():
    call = H.Call(actor="c", method="m", request="1", wants_reply=True)
    with pytest.raises(AttributeError):
        call.actor = "d"  # type: ignore[misc]
    assert call.encode() == {"k": K.CALL, "a": "c", "m": "m", "i": "1", "w": 1}
    owner = H.Owner(address=ADDR, key="ab", name="o")
    assert H.Owner.decode(owner.encode()) == owner
    assert H.Owner.decode({}) is None


def _batch(*items: object) -> bytes:
    return marshal.dumps(list(items), 4)


def test_a_batch_unpacks_into_its_calls_in_order():
    batch = H.decode_ordered({"k": K.BATCH, "n": 2, "d": [3, 5], "q": [7, 1]})
    assert isinstance(batch, H.Batch) and batch.seq_for(5) == 1
    first, second = {"k": K.CALL, "a": "c", "m": "incr"}, {"k": K.CALL, "a": "c", "m": "get"}
    calls = H.unbatch(batch, _batch([first, b"p1"], [second, b"p2"]))
    assert [(c.method, h, p) for c, h, p in calls] == [
        ("incr", first, b"p1"),
        ("get", second, b"p2"),
    ]


@pytest.mark.parametrize(
    "payload,why",
    [
        (b"\xff", "unreadable"),
        (_batch([{"k": K.CALL, "a": "c", "m": "m"}, b""]), "list of 2 calls"),
        (_batch([{"k": K.EXEC}, b""], [{"k": K.EXEC}, b""]), "not a call"),
        (_batch(*[[{"k": K.CALL, "a": "c", "m": "m", "q": 3}, b""]] * 2), "envelope keys"),
        (
            _batch([{"k": K.CALL, "a": "c", "m": "m", "i": "1", "w": 1}, b""], [{}, b""]),
            "envelope keys",
        ),
        (_batch([{"k": K.CALL, "a": "c"}, b""], [{"k": K.CALL, "a": "c"}, b""]), "missing key"),
        (_batch(["x", b""], ["y", b""]), "not a call"),
    ],
)
def test_a_malformed_batch_runs_nothing(payload, why):
    batch = H.decode_ordered({"k": K.BATCH, "n": 2, "q": 0})
    assert isinstance(batch, H.Batch)
    with pytest.raises(H.HeaderError, match=why):
        H.unbatch(batch, payload)


def test_a_batch_of_fewer_than_two_is_malformed():
    assert isinstance(H.decode_ordered({"k": K.BATCH, "n": 1, "q": 2}), H.OtherOrdered)
    assert H.decode_ordered({"k": K.BATCH, "n": True, "q": 2}).seq == 2


def test_the_fast_constructor_sets_every_field_in_order_and_needs_them_all():
    from dataclasses import fields

    from monarch_kernel.wire.headers.base import maker

    make = maker(H.Call)
    values = (
        "r7",
        True,
        [3, 4],
        True,
        [0, 1],
        ["m", "ipc", "", ""],
        "a",
        "m",
        [["x"], [2], [1], 0],
        4242,
    )
    call = make(*values)
    assert type(call) is H.Call
    assert tuple(getattr(call, f.name) for f in fields(H.Call)) == values
    assert call == H.Call(
        request="r7",
        wants_reply=True,
        seq=[3, 4],
        fanout=True,
        targets=[0, 1],
        reply_to=["m", "ipc", "", ""],
        actor="a",
        method="m",
        slice=[["x"], [2], [1], 0],
        results_pid=4242,
    )
    with pytest.raises(TypeError):  # a field left out is an error, never an unset slot
        make(*values[:-1])
    with pytest.raises(AttributeError):  # still frozen
        call.actor = "b"  # type: ignore[misc]


@pytest.mark.parametrize("rp", [0, -1, "4242", 4.5, True, None])
def test_a_call_asks_for_results_by_handle_only_with_a_process_id(rp):
    """``rp`` (a rank of the caller's machine takes the result's CUDA tensors as handles):
    anything but a positive int reads as absent, so the result is pickled."""
    h = {"k": K.CALL, "a": "c", "m": "m", "i": "p1-2", "w": 1, "rp": rp}
    assert H.Call.decode(h).results_pid is None
    assert H.Call.decode(dict(h, rp=77)).results_pid == 77


def test_a_result_by_handle_says_so_and_the_fast_constructor_keeps_it():
    assert H.Result.decode({"k": K.RESULT, "i": "1", "ok": 1, "x": 1}).handles is True
    assert H.Result.decode({"k": K.RESULT, "i": "1", "ok": 1}).handles is False
    assert H.rank_result("1", True, 3, True).encode() == {
        "k": K.RESULT, "i": "1", "r": 3, "ok": 1, "x": 1,
    }  # fmt: skip
    assert "x" not in H.rank_result("1", True, 3).encode()
