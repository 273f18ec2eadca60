"""TrainingState on its own (no mesh): what a step is, what is put back when one fails,
the whole state as one dict, which errors count as a peer's failure, sharded models,
and the local collectives a restarted rank's set-up cells run with."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from monarch_kernel.rank.training import reform as train_pg
from monarch_kernel.rank.training.state import sharded_part
from monarch_kernel.training import TrainingState, is_peer_failure

pytestmark = pytest.mark.unit


class Position:
    """A data source whose state is its position."""

    def __init__(self) -> None:
        self.pos = 0

    def next(self) -> int:
        self.pos += 1
        return self.pos

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.pos = s["pos"]


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, Position]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.1), Position()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Position) -> None:
    data.next()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_a_completed_step_advances_the_counter():
    model, opt, data = _parts()
    state = TrainingState(model=model, optimizer=opt, data=data)
    while state.step < 3:
        with state.stepping():
            _step(model, opt, data)
    assert state.step == 3 and data.pos == 3


def _seed(n: int) -> None:
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def _draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_a_step_that_fails_before_the_optimizer_is_put_back():
    model, opt, data = _parts()
    losses = [1.0]
    state = TrainingState(model=model, optimizer=opt, data=data, extra={"losses": losses})
    _seed(5)
    expected = _draws()
    _seed(5)

    def failing_step() -> None:
        with state.stepping():
            data.next()
            losses.append(2.0)
            _draws()
            raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        failing_step()
    assert state.step == 0 and data.pos == 0 and losses == [1.0]
    assert _draws() == expected  # the RNGs are where the step began: the same batch again


def test_a_step_whose_optimizer_ran_counts_as_completed():
    model, opt, data = _parts()
    state = TrainingState(model=model, optimizer=opt, data=data)

    def step_then_fail() -> None:
        with state.stepping():
            _step(model, opt, data)
            raise RuntimeError("logging after the step failed")

    with pytest.raises(RuntimeError):
        step_then_fail()
    assert state.step == 1 and data.pos == 1  # the step happened: nothing put back


def test_the_whole_state_round_trips_through_state_dict():
    model, opt, data = _parts()
    state = TrainingState(model=model, optimizer=opt, data=data, extra={"note": "a"})
    for _ in range(2):
        with state.stepping():
            _step(model, opt, data)
    saved = state.state_dict()
    model2, opt2, data2 = _parts()
    other = TrainingState(model=model2, optimizer=opt2, data=data2, extra={"note": "b"})
    other.load_state_dict(saved)
    assert other.step == 2 and data2.pos == 2 and other.extra == {"note": "a"}
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": 3}, "TrainingState(model=...) needs an object with state_dict()"),
        ({"data": [1, 2]}, "TrainingState(data=...) needs an object with state_dict()"),
        ({"extra": [1]}, "TrainingState(extra=...) takes a dict"),
        ({"step": -1}, "TrainingState(step=...) must be an int >= 0"),
    ],
)
def test_bad_parts_are_refused_with_what_to_do(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as err:
        TrainingState(**kwargs)
    assert message in str(err.value)


def test_unpicklable_extra_is_named():
    state = TrainingState(extra={"lock": __import__("threading").Lock()})
    with pytest.raises(TypeError, match="cannot be pickled"):
        state.stepping().__enter__()


@pytest.mark.parametrize(
    "exc, peer",
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer"), True),
        (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), True),
        (ConnectionResetError("Connection reset"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x12 and 16x4)"), False),
        (ValueError("bad batch on rank 1"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_which_errors_are_a_peers_failure(exc, peer):
    assert is_peer_failure(exc) is peer


@pytest.fixture
def world_of_one():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_model_is_named(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))

    class Holder(torch.nn.Module):
        def __init__(self, placement: Any) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [placement]))

    assert sharded_part(Holder(Shard(0))) == "w"
    assert sharded_part(Holder(Replicate())) == ""
    assert sharded_part(torch.nn.Linear(2, 2)) == ""


def test_local_collectives_answer_as_if_every_peer_sent_this_ranks_data(world_of_one):
    t = torch.tensor([1.0, 2.0])
    train_pg.local_collectives(True)
    try:
        assert dist.broadcast(t, 0) is None and t.tolist() == [1.0, 2.0]
        assert dist.all_reduce(t, async_op=True).wait()
        out = [torch.zeros(2), torch.zeros(2)]
        dist.all_gather(out, t)
        assert [o.tolist() for o in out] == [[1.0, 2.0]] * 2
        flat = torch.zeros(4)
        dist.all_gather_into_tensor(flat, t)
        assert flat.tolist() == [1.0, 2.0, 1.0, 2.0]
        objs: list[object] = [None, None]
        dist.all_gather_object(objs, {"a": 1})
        assert objs == [{"a": 1}, {"a": 1}]
        dist.barrier()
    finally:
        train_pg.local_collectives(False)
    assert dist.all_reduce is not train_pg._REPLACEMENTS["all_reduce"]
    dist.all_reduce(t)  # the real one again (a world of one)
    assert t.tolist() == [1.0, 2.0]
