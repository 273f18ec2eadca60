"""CUDA tensors in the results of a rank's calls to ranks of its machine come as
data-plane handles on copies (``rank.dataplane.cuda_results``), not pickled through host
memory: tested between real ranks with host shared memory in CUDA's place
(``tests/ipc_host_memory.py``), so that it runs on every machine. The caller sees each
tensor as it was returned (the called rank changes it before the caller reads), with its
requires_grad and Parameter-ness; the called rank's copies go once read, once the
caller drops the reply unread (also a gathered call failed by another rank), and once
the caller dies; the notebook's own calls are pickled as before. On a GPU:
``tests/test_gpu_dataplane.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import pid_alive
from cuda_args_actors import BIG, HANDLES, SEEN
from cuda_results_actors import ResultPeer
from helpers import wait_until

from monarch_kernel.actor import this_host

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def peers():
    """Rank 0 calls; ranks 1 and 2 are called."""
    mesh = this_host().spawn_procs(per_host={"gpus": 3})
    try:
        actors = mesh.spawn("results", ResultPeer)
        yield mesh, actors.slice(gpus=0), actors.slice(gpus=1), actors.slice(gpus=slice(1, 3))
    finally:
        mesh.stop()


def _kept(actor):
    return actor.kept.call_one().get(timeout=60)


@pytest.mark.parametrize("how", ["call_one", "call", "choose", "stream"])
def test_answered_calls_return_large_tensors_as_handles_seen_as_they_were_returned(peers, how):
    _, caller, called, _ = peers
    before = _kept(called)
    out = caller.fetch.call_one(called, how).get(timeout=120)
    weight = out["seen"].pop("weight")  # (its value: the next test)
    assert weight[1:] == (False, "Tensor", (BIG,))
    assert out["seen"] == SEEN
    after = _kept(called)
    assert after["sent"] - before["sent"] == HANDLES
    assert called.held_once.call_one(before["held"]).get(timeout=60) == before["held"], (
        "the called rank still holds copies the caller read"
    )
    # the four big tensors came through the data plane, the small one in the message
    assert out["bytes_in"] == HANDLES * BIG * 4


def test_the_value_is_the_one_returned_not_the_actors_tensor_as_it_is_later(peers):
    """``weight`` is the actor's own tensor; ``bump()`` adds 1 to it after the reply was
    sent and before the caller reads it: the caller sees the returned value."""
    _, caller, called, _ = peers
    now = float(called.give.call_one().get(timeout=60)["weight"].sum())  # pickled (notebook)
    out = caller.fetch.call_one(called, "call_one").get(timeout=120)
    assert out["seen"]["weight"][0] == now


@pytest.mark.parametrize("how", ["call_one", "call"])
def test_a_reply_dropped_unread_lets_the_copies_go_at_once(peers, how):
    """With the cyclic collector off in the caller: nothing of a dropped future is held
    by a reference cycle (a gathered call's future and its gather included)."""
    _, caller, called, _ = peers
    before = _kept(called)
    assert (
        caller.fetch_unread.call_one(called, how, before["held"]).get(timeout=90)
        == (before["held"])
    ), "the copies of a dropped reply are still held"
    assert _kept(called)["sent"] - before["sent"] == HANDLES


def test_a_read_stopped_by_an_unreadable_value_lets_every_copy_go(peers):
    """Rank 1's value cannot be unpickled: the read stops there; rank 1's copies (its
    read began) and rank 2's (never read) both go."""
    _, caller, called, both = peers
    other = both.slice(gpus=1)
    assert other.pid.call_one().get(timeout=60) != called.pid.call_one().get(timeout=60)
    before, other_before = _kept(called), _kept(other)
    held = [before["held"], other_before["held"]]
    text, counts = caller.fetch_unreadable.call_one(both, 1, held).get(timeout=150)
    assert "cannot be unpickled on the receiver" in text, text
    assert counts == held, "copies of the failed read are still held"
    assert _kept(called)["sent"] - before["sent"] == HANDLES
    assert _kept(other)["sent"] - other_before["sent"] == HANDLES


def test_a_gathered_call_failed_by_another_rank_lets_the_unread_copies_go(peers):
    """Rank 2 fails: the call raises, rank 1's reply (by handle) is never read."""
    _, caller, called, both = peers
    before = _kept(called)
    text = caller.fetch_failing.call_one(both, 2).get(timeout=60)
    assert "no tensors from this rank" in text, text
    assert _kept(called)["sent"] - before["sent"] == HANDLES
    assert called.held_once.call_one(before["held"]).get(timeout=60) == before["held"]


def test_the_notebooks_calls_are_pickled_as_before(peers):
    _, _, called, _ = peers
    before = _kept(called)
    value = called.give.call_one().get(timeout=60)
    assert type(value["param"]) is torch.nn.Parameter and value["grad"].requires_grad
    assert _kept(called) == before


def test_a_result_whose_rank_died_before_it_was_read_says_so(peers):
    """Rank 2 answers, then dies before the caller reads its reply: the read fails
    naming that death (rank 2 is not called again in this module)."""
    _, caller, _, both = peers
    text = caller.fetch_after_death.call_one(both.slice(gpus=1)).get(timeout=120)
    assert "rank 2" in text and "died before its tensor" in text, text


def test_a_caller_that_died_before_the_answer_leaves_the_called_rank_no_copy(tmp_path):
    """Rank 0 calls rank 1 and dies; rank 1 answers after that: whether its reply could
    be sent or not, the copies it made for it go. (A mesh of its own: its caller dies.)"""
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        actors = mesh.spawn("results", ResultPeer)
        _answer_a_dead_caller(actors.slice(gpus=0), actors.slice(gpus=1), tmp_path)
    finally:
        mesh.stop()


def _answer_a_dead_caller(caller, other, tmp_path):
    before = _kept(other)
    pid = caller.pid.call_one().get(timeout=60)
    go = tmp_path / "go"
    with pytest.raises(Exception, match="died|exit"):
        caller.call_and_die.call_one(other, str(go)).get(timeout=60)
    wait_until(lambda: not pid_alive(pid), timeout=30, what="the caller's exit")
    go.touch()
    wait_until(
        lambda: _kept(other)["sent"] - before["sent"] == HANDLES,
        timeout=60,
        what=f"rank 1 to answer the dead caller (before {before}, now {_kept(other)})",
    )
    assert other.held_once.call_one(before["held"]).get(timeout=60) == before["held"]


def test_a_caller_that_dies_with_an_unread_reply_leaves_the_called_rank_no_copy(peers):
    """Last in the module: the calling rank dies (the fixture's stop ends the mesh)."""
    _, caller, called, _ = peers
    before = _kept(called)
    pid = caller.pid.call_one().get(timeout=60)
    future = caller.fetch_and_die.call_one(called)
    with pytest.raises(Exception, match="died|exit"):
        future.get(timeout=60)
    wait_until(lambda: not pid_alive(pid), timeout=30, what="the caller's exit")
    assert _kept(called)["sent"] - before["sent"] == HANDLES
    assert called.held_once.call_one(before["held"]).get(timeout=60) == before["held"], (
        "a dead caller's copies are still held"
    )
