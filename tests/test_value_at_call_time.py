"""A call sends its arguments' values as they were when it was made, and a reply the
value as it was when the endpoint returned, even though tensor data travels zero-copy:
a caller (or an endpoint) that changes the tensor right afterwards changes nothing on
the other side."""

from __future__ import annotations

import pytest
import torch

from monarch_kernel.actor import Actor, endpoint, this_host

pytestmark = pytest.mark.local

SIZES = [1 << 18, 1 << 20, 3 << 20]  # 1 MiB, 4 MiB (one message), 12 MiB (a stream of chunks)


class Keeper(Actor):
    def __init__(self) -> None:
        self.sums: list[float] = []
        self.w = torch.zeros(1)

    @endpoint
    def keep(self, t: torch.Tensor) -> None:
        self.sums.append(float(t.sum()))

    @endpoint
    def taken(self) -> list[float]:
        sums, self.sums = self.sums, []
        return sums

    @endpoint
    def weights(self) -> torch.Tensor:
        return self.w

    @endpoint
    def resize(self, n: int) -> None:
        self.w = torch.zeros(n)

    @endpoint
    def step(self) -> None:
        self.w.add_(1)  # in place, as an optimizer step does


def test_a_tensor_changed_right_after_a_call_arrives_as_it_was():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        one = procs.spawn("keeper", Keeper).slice(gpus=0)
        for n in SIZES:
            for _ in range(5):
                sent = torch.ones(n)
                one.keep.broadcast(sent)
                sent.fill_(0)
                called = torch.ones(n)
                fut = one.keep.call_one(called)
                called.fill_(0)
                fut.get(timeout=60)
                assert one.taken.call_one().get(timeout=60) == [float(n), float(n)], n
    finally:
        procs.stop()


@pytest.mark.parametrize("n", [1 << 18, 3 << 20])  # 1 MiB: one message; 12 MiB: a stream
def test_a_returned_tensor_changed_by_the_next_call_arrives_as_it_was(n):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        one = procs.spawn("keeper", Keeper).slice(gpus=0)
        one.resize.call_one(n).get(timeout=60)
        for i in range(10):
            # the next call runs on the rank while the first one's reply may still be
            # on its way (both were sent before either reply is waited for)
            fut = one.weights.call_one()
            stepped = one.step.call_one()
            got = fut.get(timeout=60)
            stepped.get(timeout=60)
            assert got.min() == got.max() == float(i), (i, got.min(), got.max())
    finally:
        procs.stop()


class Caller(Actor):
    def __init__(self, target) -> None:
        self.target = target.slice(gpus=0)

    @endpoint
    def send_then_zero(self, n: int) -> list[float]:
        """Calls the other mesh's actor with ones, zeroes them before the reply."""
        t = torch.ones(n)
        fut = self.target.keep.call_one(t)
        t.fill_(0)
        fut.get(timeout=60)
        return self.target.taken.call_one().get(timeout=60)


def test_an_actor_calling_another_meshs_actor_sends_the_value_at_call_time():
    keepers = this_host().spawn_procs(per_host={"gpus": 1})
    callers = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        keeper = keepers.spawn("keeper", Keeper)
        caller = callers.spawn("caller", Caller, keeper).slice(gpus=0)
        for n in (1 << 18, 3 << 20):
            for _ in range(3):
                assert caller.send_then_zero.call_one(n).get(timeout=120) == [float(n)]
    finally:
        callers.stop()
        keepers.stop()
