"""``fsdp_reset.param_groups``: an FSDP2 state's parameter groups across torch versions
(2.12 on: a list, ``_fsdp_param_groups``; 2.11, the GPU machine's: one
``_fsdp_param_group``, where the list's name raised AttributeError in the replica check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from monarch_kernel.rank.replicas.fsdp_reset import param_groups

pytestmark = pytest.mark.unit


def test_the_list_where_torch_has_several_groups_per_state():
    a, b = object(), object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]


def test_the_one_group_of_an_older_torch_and_none():
    group = object()
    assert param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_a_real_fsdp2_state_of_this_torch():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        groups = param_groups(model._get_fsdp_state())
        assert len(groups) == 1 and hasattr(groups[0], "fsdp_params")
    finally:
        dist.destroy_process_group()
