# mypy: disable-error-code="attr-defined,union-attr"
# (torch.ones() and the rest return mesh tensors under activate(): a torch.Tensor
# subclass with Monarch's reduce, to_mesh, slice_mesh, stream; torch's stubs say Tensor)
"""Outputs of remote functions that are views of their inputs are known as their
aliases on the controller (cached propagation and propagators alike): one storage, so
writes through one show through the others on the ranks, borrows and drops hold for
all of them, and a write that fails poisons them all. On a real 2x2 mesh (``host`` x
``gpus``) shared by the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from monarch_kernel import Stream, inspect, remote
from monarch_kernel.mesh_controller import RemoteException
from monarch_kernel.tensor_engine import remote_functions


@pytest.fixture(scope="module")
def pm():
    """A 2x2 mesh (``host`` x ``gpus``) shared by the module; checked for orphans after."""
    from conftest import local_mesh

    yield from local_mesh({"host": 2, "gpus": 2})


# -- run on the ranks (imported from here) -------------------------------------------------


def chunk4(t):
    return t.chunk(4, dim=0)


def as_int32(t):
    return t.view(torch.int32)


def doubled_and_its_tail(t):
    y = t * 2
    return y, y[1:]


def raise_on_rank_three(t):
    if int(os.environ["RANK"]) == 3:
        raise ValueError("on purpose")
    return t.clone()


# -- tests ---------------------------------------------------------------------------------


def test_a_write_through_a_cached_view_output_shows_through_its_input(pm):
    chunk = remote(chunk4)  # cached propagation: one real run on a rank
    with pm.activate():
        x = torch.zeros(8, 3)
        parts = chunk(x)
        assert all(p._aliases is x._aliases for p in parts)
        assert [p._fake.storage_offset() for p in parts] == [0, 6, 12, 18]
        parts[1].add_(1)  # rows 2..3 of x
        x.mul_(10)  # seen through the views too
        got_x, got_part = inspect((x, parts[1]), host=1, gpus=1)
    assert got_x.tolist() == [[0.0] * 3] * 2 + [[10.0] * 3] * 2 + [[0.0] * 3] * 4
    assert got_part.tolist() == [[10.0] * 3] * 2


def test_the_cache_tells_storage_offsets_and_dtypes_apart(pm):
    chunk, ints = remote(chunk4), remote(as_int32)
    with pm.activate():
        base = torch.zeros(12, 2)
        whole = chunk(torch.zeros(8, 2))
        hits = remote_functions._hit
        tail = chunk(base[4:])  # same shape and strides, another offset: run again
        assert remote_functions._hit == hits
        assert [p._fake.storage_offset() for p in tail] == [8, 12, 16, 20]
        assert tail[0]._aliases is base._aliases and whole[0]._aliases is not base._aliases
        again = chunk(torch.ones(8, 2))  # the first call's signature: from the cache
        assert remote_functions._hit == hits + 1 and again[3]._fake.storage_offset() == 12
        bits = ints(base)  # another dtype on the same storage
        assert bits.dtype == torch.int32 and bits._aliases is base._aliases
        tail[2].fill_(1.0)  # rows 8..9 of base: 1.0 is 0x3F800000 as int32
        got = inspect(bits, host=0, gpus=1)
    assert got[8].tolist() == [0x3F800000, 0x3F800000] and got[7].tolist() == [0, 0]


def test_outputs_that_share_a_storage_of_their_own_are_each_others_aliases(pm):
    both = remote(doubled_and_its_tail)
    with pm.activate():
        x = torch.ones(4)
        y, tail = both(x)
        assert y._aliases is tail._aliases and y._aliases is not x._aliases
        assert tail._fake.storage_offset() == 1
        tail.add_(1)
        assert inspect(y, host=0, gpus=0).tolist() == [2.0, 3.0, 3.0, 3.0]


def test_borrows_and_drops_hold_for_the_view_outputs_of_an_input(pm):
    chunk = remote(chunk4)
    propagated = remote(chunk4, propagate=lambda t: t.chunk(4, dim=0))
    other = Stream("other")
    with pm.activate():
        x = torch.zeros(8)
        for parts in (chunk(x), propagated(x)):
            _, borrow = other.borrow(x, mutable=True)
            with pytest.raises(TypeError, match="BORROWED"):
                torch.add(parts[0], 1)  # x is lent mutably: its views cannot be read either
            borrow.drop()
            _, borrow = other.borrow(parts[2])
            with pytest.raises(TypeError, match="MUTATING_BORROW"):
                x.add_(1)  # a view of x is lent: x is read only
            borrow.drop()
        same = remote(chunk4, propagate=lambda t: t)(x)  # the argument itself: an alias
        assert same is not x and same._aliases is x._aliases
        x.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            torch.add(parts[3], 1)


def test_a_write_that_fails_through_a_view_poisons_its_input(pm):
    chunk = remote(chunk4)
    fails = remote(raise_on_rank_three, propagate=lambda t: t.clone())
    with pm.activate():
        x = torch.zeros(8)
        parts = chunk(x)
        parts[1].add_(fails(parts[1]))  # fails on rank 3: what it wrote is unknown
        with pytest.raises(RemoteException) as info:
            inspect(x, host=0, gpus=0)
        assert info.value.rank == 3 and "on purpose" in info.value.message
        with pytest.raises(RemoteException, match="on purpose"):
            inspect(parts[0], host=1, gpus=0)  # another view of it: poisoned as well
        assert inspect(torch.ones(2) + 1, host=1, gpus=1).tolist() == [2.0, 2.0]
