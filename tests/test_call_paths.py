"""The hot path of a call, under the conditions it must survive: callers on several
threads at once (waited calls, pipelined calls, broadcasts) each keep their order on a
rank; Ctrl-C (the stop button) releases a caller blocked on a reply and leaves the mesh
working; tensors of every kind travel both ways intact through real ranks."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from actors import Batched, Worker
from helpers import wait_for_rank_line

pytestmark = pytest.mark.local

K = 400  # calls per caller


def test_callers_on_three_threads_each_keep_their_order_on_a_rank(mesh2):
    log = mesh2.spawn("log", Batched).slice(gpus=0)
    errors: list[BaseException] = []

    def waited() -> None:  # each call sent, then its reply received, on this thread
        for i in range(K):
            log.record.call_one(i).get(timeout=60)

    def pipelined() -> None:  # sent back to back, replies collected after
        futures = [log.record.call_one(10_000 + i) for i in range(K)]
        for f in futures:
            f.get(timeout=60)

    def broadcasts() -> None:
        for i in range(K):
            log.record.broadcast(20_000 + i)

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # reported below: a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in (waited, pipelined, broadcasts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    got = log.get_log.call_one().get(timeout=60)
    assert len(got) == 3 * K
    for base in (0, 10_000, 20_000):
        assert [x - base for x in got if base <= x < base + K] == list(range(K))
    assert mesh2.runtime.ranks[0].outstanding == 0


def test_ctrl_c_releases_a_caller_blocked_on_a_reply(mesh2, python_sigint):
    worker = mesh2.spawn("worker", Worker).slice(gpus=0)
    assert threading.current_thread() is threading.main_thread()
    nap = worker.sleep.call_one(60, "until interrupted")

    pressed: list[float] = []  # when the signal was sent
    presser_failed: list[BaseException] = []

    def press_stop() -> None:
        try:
            wait_for_rank_line(mesh2, 0, "sleeping until interrupted", timeout=60)
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler in the main thread
            pressed.append(time.monotonic())
        except BaseException as exc:  # reported below, with the caller's side
            presser_failed.append(exc)

    presser = threading.Thread(target=press_stop, daemon=True)
    presser.start()
    began = time.monotonic()
    try:
        nap.get(timeout=120)  # blocked receiving its own reply when the signal comes
    except KeyboardInterrupt:
        pass
    else:  # say which side failed: the signal never sent, or sent and not raised
        presser.join(5)
        sent = f"sent after {pressed[0] - began:.2f}s" if pressed else "never sent"
        pytest.fail(
            f"Ctrl-C did not release the caller: the signal was {sent}; presser errors "
            f"{presser_failed!r}; SIGINT handler now {signal.getsignal(signal.SIGINT)!r}; "
            f"rank 0's last lines {list(mesh2.runtime.ranks[0].tail)[-3:]!r}"
        )
    presser.join(30)
    assert not presser_failed
    # the call goes on on the rank; stopping it there answers it with the interrupt
    mesh2.interrupt()
    with pytest.raises(Exception, match="KeyboardInterrupt"):
        nap.get(timeout=60)
    # the receive token was given back: calls from this thread and another one work
    assert worker.echo.call_one("after").get(timeout=30) == "after"
    other: list[object] = []
    t = threading.Thread(target=lambda: other.append(worker.echo.call_one(7).get(timeout=30)))
    t.start()
    t.join(60)
    assert other == [7]


TENSORS = {
    "float32 1 MiB": torch.rand(1 << 18),
    "bfloat16 matrix": torch.rand(64, 300).to(torch.bfloat16),
    "int64 3-d": torch.arange(24_000).reshape(2, 3, 4000),
    "bool": torch.rand(20_000) > 0.5,
    "complex64": torch.randn(5000, dtype=torch.complex64),
    "non-contiguous": torch.arange(40_000.0).reshape(200, 200).t()[::2],
    "requires grad": torch.ones(3000, requires_grad=True),
    "empty": torch.empty(0, 5),
    "scalar": torch.tensor(3.5),
}


def test_tensors_and_arrays_travel_to_a_rank_and_back_intact(mesh2):
    worker = mesh2.spawn("echo", Worker).slice(gpus=1)
    array = np.arange(30_000, dtype=np.int32).reshape(100, 300)
    sent = (dict(TENSORS), [array, 5, "text"])
    back_tensors, back_rest = worker.echo.call_one(sent).get(timeout=60)
    assert back_tensors.keys() == TENSORS.keys()
    for name, t in TENSORS.items():
        got = back_tensors[name]
        assert type(got) is torch.Tensor, name
        assert (got.dtype, got.shape, got.requires_grad) == (t.dtype, t.shape, t.requires_grad)
        assert torch.equal(got.detach(), t.detach()), name
    assert back_rest[1:] == [5, "text"]
    assert back_rest[0].dtype == array.dtype and (back_rest[0] == array).all()
