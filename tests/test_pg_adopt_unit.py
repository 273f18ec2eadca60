"""``rank.pg.adopt``: which storages the process-group worker uses in place, and that
every region it was given is handed back for unmapping once its storage is gone."""

from __future__ import annotations

import itertools

import pytest
import torch

from monarch_kernel.rank.pg.adopt import ADOPT_MIN_BYTES, AdoptedStorages

pytestmark = pytest.mark.unit

BIG = ADOPT_MIN_BYTES // 4  # float32 elements: one adoptable tensor


def storages() -> AdoptedStorages:
    ids = itertools.count(1)
    return AdoptedStorages(lambda: next(ids))


def op(adopted: AdoptedStorages, *tensors: torch.Tensor) -> list[int | None]:
    """Lay out one op of ``tensors``: the region id of each (None: copied)."""
    adopted.begin_op()
    out = []
    for t in tensors:
        placed = adopted.place(t)
        out.append(None if placed is None else placed[0].id)
    return out


def test_a_storage_seen_in_a_second_op_is_adopted_and_stays():
    a = storages()
    t = torch.ones(BIG)
    assert op(a, t) == [None]  # seen once: copied
    (region,) = op(a, t)
    assert region is not None and t.untyped_storage().is_shared()
    assert op(a, t) == [region]  # the same region from then on
    assert a.forget_dropped() == []


def test_two_tensors_of_one_op_on_one_storage_are_not_a_second_sighting():
    # FSDP2 all-gathers from a view of the output, into a buffer it allocates every step
    a = storages()
    for _ in range(5):
        out = torch.zeros(4 * BIG)
        assert op(a, out, out[:BIG]) == [None, None]
        assert not out.untyped_storage().is_shared()
        del out
    assert a.forget_dropped() == []


def test_a_new_storage_at_a_freed_ones_address_is_a_first_sighting():
    a = storages()
    seen_at = set()
    for _ in range(5):
        t = torch.zeros(BIG)
        seen_at.add(t.untyped_storage().data_ptr())
        assert op(a, t) == [None]
        del t
    assert not any(isinstance(x, int) for x in op(a, torch.zeros(BIG)))


def test_every_region_of_a_dropped_storage_is_handed_back_once():
    a = storages()
    given: list[int] = []
    for _ in range(6):
        t = torch.ones(BIG)
        op(a, t)
        (region,) = op(a, t)
        assert region is not None
        given.append(region)
        del t  # its address may be reused by the next storage, adopted or not
    back: list[int] = []
    back += a.forget_dropped()
    op(a, torch.ones(BIG))  # a later op finds any that are gone only now
    back += a.forget_dropped()
    assert sorted(back) == given, (back, given)
