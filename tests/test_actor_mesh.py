"""The actor API against a real 4-rank local mesh."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from actors import AsyncActor, BadInit, Counter, Worker
from helpers import wait_for_rank_line, wait_until

from monarch_kernel.actor import (
    Actor,
    ActorError,
    SerializationError,
    SliceError,
    ValueMesh,
    endpoint,
)

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def workers(procs4):
    return procs4.spawn("workers", Worker)


def test_call_gathers_one_value_per_rank(procs4):
    counters = procs4.spawn("counters", Counter, 10)
    vm = counters.incr.call(2).get()
    assert isinstance(vm, ValueMesh) and len(vm) == 4
    assert vm.values() == [12, 12, 12, 12]
    assert [dict(p) for p, _ in vm.items()] == [{"gpus": i} for i in range(4)]
    assert vm.item(gpus=3) == 12


def test_call_one_and_slicing(procs4):
    counters = procs4.spawn("c1", Counter, 0)
    one = counters.slice(gpus=1)
    assert one.incr.call_one(5).get() == 5
    assert counters.value.call().get().values() == [0, 5, 0, 0]
    part = counters.slice(gpus=slice(2, 4))
    vm = part.incr.call().get()
    assert vm.extent == {"gpus": 2} and vm.values() == [1, 1]
    assert [p.rank for p, _ in vm.items()] == [0, 1]


def test_call_one_on_many_ranks_is_an_error(procs4):
    counters = procs4.spawn("c2", Counter)
    with pytest.raises(ValueError, match="exactly one rank.*4 ranks.*slice"):
        counters.incr.call_one()


def test_bad_slices(procs4):
    counters = procs4.spawn("c3", Counter)
    with pytest.raises(SliceError, match="no dimension 'hosts'"):
        counters.slice(hosts=0)
    with pytest.raises(SliceError, match="out of range"):
        counters.slice(gpus=9)
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        counters.nope  # noqa: B018


def test_broadcast_is_fifo_with_later_calls(procs4):
    counters = procs4.spawn("c4", Counter)
    for i in range(50):
        counters.record.broadcast(i)
    logs = counters.get_log.call().get()
    assert all(log == list(range(50)) for log in logs.values())


def test_fifo_across_direct_and_fanout_paths(procs4):
    from monarch_kernel.controller.messaging.transport import FANOUT_MIN_BYTES

    counters = procs4.spawn("c5", Counter)
    big = torch.zeros(100_000)  # sent once to the host agent, which fans it out
    assert big.numel() * 4 >= FANOUT_MIN_BYTES
    expected: dict[int, list[int]] = {r: [] for r in range(4)}
    for i in range(40):
        if i % 3 == 0:
            counters.record.broadcast(i, big)
            for r in range(4):
                expected[r].append(i)
        else:
            counters.slice(gpus=i % 4).record.broadcast(i)  # straight to one rank
            expected[i % 4].append(i)
    logs = counters.get_log.call().get()
    assert {p.rank: log for p, log in logs.items()} == expected


def test_choose_and_stream(procs4):
    counters = procs4.spawn("c6", Counter)
    assert counters.incr.choose().get() == 1
    got = [f.get() for f in counters.incr.stream(3)]
    assert sorted(got) == [3, 3, 3, 4]


def test_async_endpoints_and_await(procs4):
    actors = procs4.spawn("async", AsyncActor)
    assert actors.bump.call().get().values() == [1, 1, 1, 1]

    async def main():
        return await actors.slice(gpus=2).bump.call_one(0.01)

    assert asyncio.run(main()) == 2


def test_current_rank_size_and_torchrun_env(workers):
    infos = workers.whoami.call().get().values()
    for i, info in enumerate(infos):
        assert info["coords"] == {"gpus": i} and info["rank"] == i
        assert info["size"] == {"gpus": 4}
        env = info["env"]
        assert env["RANK"] == str(i) and env["LOCAL_RANK"] == str(i)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "4"
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RUN_ID"]
    assert len({info["pid"] for info in infos}) == 4
    assert len({info["env"]["MASTER_PORT"] for info in infos}) == 1


def test_grouped_errors_name_ranks_and_keep_actor_alive(workers):
    with pytest.raises(ActorError) as err:
        workers.fail_on.call([1, 3]).get()
    e = err.value
    text = str(e)
    assert "ValueError in Worker.fail_on on ranks 1, 3 of 4" in text
    assert text.count("ValueError in") == 1  # grouped: one error, not two
    assert "Remote traceback (rank 1, root cause)" in text
    assert 'raise ValueError(f"bad input' in text
    assert e.ranks == [1, 3]
    assert isinstance(e.exception, ValueError)
    assert workers.fail_on.call([]).get().values() == [0, 1, 2, 3]


def test_error_lists_tensors_in_failing_frame(workers):
    with pytest.raises(ActorError) as err:
        workers.slice(gpus=0).tensor_fail.call_one().get()
    text = str(err.value)
    assert "RuntimeError in Worker.tensor_fail on rank 0 of 1" in text
    assert "a: shape (2, 3) float32 on cpu" in text
    assert "b: shape (4, 5) float32 on cpu" in text


def test_constructor_failure_is_reported(procs4, monkeypatch):
    """Monarch's way: spawn() returns, supervision hears of it (here the fault hook, in
    the spawning thread), and calls raise SupervisionError naming the exception."""
    import monarch_kernel.actor as actor_api
    from monarch_kernel.actor import SupervisionError

    hooked: list[object] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", hooked.append)
    bad = procs4.spawn("bad", BadInit, 2)
    (failure,) = hooked
    mesh = procs4.name
    assert str(failure).startswith(
        f"MeshFailure(mesh_name={mesh}, crashed_ranks=[2], event=Supervision event: actor "
        f"{mesh}/bad[2] failed:\n  Traceback (most recent call last):\n"
    )
    assert str(failure).endswith("  RuntimeError: constructor refused\n)")
    # Monarch's words (the remote traceback in them), then what to do
    head = (
        f"Endpoint call bad.ok() failed, The actor {mesh}/bad[2] and all its descendants "
        "have failed:\n  Traceback (most recent call last):\n"
    )
    tail = (
        "  RuntimeError: constructor refused\n(BadInit.__init__ raised RuntimeError: "
        "constructor refused; spawn it again)"
    )
    with pytest.raises(SupervisionError) as info:
        bad.ok.call().get(timeout=30)
    assert str(info.value).startswith(head) and str(info.value).endswith(tail), str(info.value)
    with pytest.raises(SupervisionError) as info:
        bad.slice(gpus=0).ok.call_one().get(timeout=30)  # every slice of it
    assert str(info.value).startswith(head) and str(info.value).endswith(tail)
    good = procs4.spawn("bad", BadInit, -1)  # spawned again: a new actor mesh
    assert good.ok.call().get(timeout=30).values() == [0, 1, 2, 3]


def test_unpicklable_argument_and_result(workers):
    with pytest.raises(SerializationError, match="argument 0 of Worker.echo.*lock"):
        workers.echo.call(threading.Lock())
    with pytest.raises(ActorError, match="on rank 0 of 1.*result of Worker.unpicklable cannot be"):
        workers.slice(gpus=0).unpicklable.call_one().get()
    assert workers.echo.call(1).get().values() == [1] * 4


def test_spawn_rejects_non_actor(procs4):
    class NotAnActor:
        pass

    with pytest.raises(TypeError, match="subclass of monarch_kernel.actor.Actor"):
        procs4.spawn("x", NotAnActor)


def test_locally_defined_actor_class_is_pickled_by_value(procs4):
    class Local(Actor):
        def __init__(self, k):
            self.k = k

        @endpoint
        def times(self, x):
            return self.k * x

    assert procs4.spawn("local", Local, 3).times.call(2).get().values() == [6] * 4


def test_64mb_tensor_round_trip(workers):
    n = 16 * 1024 * 1024  # 64 MB of float32
    t = torch.rand(n)
    one = workers.slice(gpus=1)
    assert one.checksum.call_one(t).get() == pytest.approx(float(t.double().sum()))
    back = one.echo.call_one(t).get()
    assert back.shape == t.shape and torch.equal(back, t)
    made = one.make_tensor.call_one(n).get()
    assert made[-1].item() == n - 1 and made.numel() == n


def test_streams_reach_the_caller(workers, capsys):
    workers.say.call("hello").get()
    workers.slice(gpus=2).say_fd.call_one("raw").get()
    out = err = ""

    def all_arrived() -> bool:
        nonlocal out, err
        captured = capsys.readouterr()
        out, err = out + captured.out, err + captured.err
        return "raw via fd" in out and "raw via fd2" in err and out.count("hello from") == 4

    wait_until(
        all_arrived,
        timeout=5,
        what="the ranks' output to reach the caller",
        detail=lambda: f"stdout so far {out!r}, stderr so far {err!r}",
    )
    for r in range(4):
        assert f"[rank {r}] hello from {r}" in out
    assert "[rank 2] raw via fd" in out and "[rank 2] raw via fd2" in err


def test_ping_answers_while_busy(procs4, workers):
    fut = workers.slice(gpus=0).sleep.call_one(4.0)
    pings = procs4.ping().get(timeout=5)
    assert not fut.done()  # answered while rank 0 still sleeps
    assert all(p["rejected"] == 0 for p in pings.values())
    fut.get(timeout=30)
    assert fut.get(timeout=5) == "slept"


def test_interrupt_stops_running_endpoint(procs4, workers):
    fut = workers.slice(gpus=3).sleep.call_one(30, "to be interrupted")
    wait_for_rank_line(procs4, 3, "sleeping to be interrupted")  # the call is running
    procs4.slice(gpus=3).interrupt()
    with pytest.raises(ActorError, match="KeyboardInterrupt"):
        fut.get(timeout=2)
    assert workers.slice(gpus=3).echo.call_one("still here").get() == "still here"


def test_future_timeout(workers):
    fut = workers.slice(gpus=1).sleep.call_one(0.5)
    with pytest.raises(TimeoutError, match="still running"):
        fut.get(timeout=0.05)
    assert fut.get(timeout=5) == "slept"


def test_forged_messages_are_dropped_and_counted(procs4, workers):
    from monarch_kernel.wire import Codec
    from monarch_kernel.wire.codec import new_key
    from monarch_kernel.wire.codec import send as wire_send

    rt = procs4.runtime
    evil = Codec(new_key())
    with rt.transport.send_lock:
        wire_send(
            rt.transport.send_sock, evil.encode({"k": "call", "a": "workers", "m": "die"}), [b"r0"]
        )
    # a forged message sent straight to the controller's receive socket
    import zmq

    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(rt.transport.recv_addr)
    s.send_multipart(evil.encode({"k": "res", "i": "x", "r": 0, "ok": 1}, b"junk"))
    s.send_multipart([b"garbage"])
    try:
        wait_until(
            lambda: rt.codec.rejected >= 2,
            timeout=5,
            interval=0.02,
            what="the controller to reject both forged messages",
            detail=lambda: f"it rejected {rt.codec.rejected}",
        )
    finally:
        s.close(0)
    assert rt.codec.rejected == 2
    assert procs4.ping().get().item(gpus=0)["rejected"] == 1
    assert workers.echo.call(5).get().values() == [5] * 4  # nothing died


def test_control_plane_bytes_are_counted_per_rank(procs4, workers):
    rt = procs4.runtime
    before = [(r.bytes_in, r.bytes_out) for r in rt.ranks]
    workers.slice(gpus=2).checksum.call_one(torch.zeros(50_000)).get()
    after = [(r.bytes_in, r.bytes_out) for r in rt.ranks]
    assert after[2][1] - before[2][1] >= 200_000  # the tensor went to rank 2
    assert after[2][0] > before[2][0]  # and its reply came back
    assert after[0][1] == before[0][1]  # nothing was sent to rank 0
