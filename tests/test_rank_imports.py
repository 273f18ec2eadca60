"""A rank that imports a module of actors written with Monarch's canonical import line
(``from monarch_kernel.actor import Actor, endpoint, this_host``) does not load the
controller: each rank of a big mesh would pay that import (0.1-0.2 s of CPU) for
nothing. The functions that start meshes are stand-ins there, which import the real
ones on their first call."""

from __future__ import annotations

import pytest

import monarch_kernel.actor as actor_api
from monarch_kernel.actor import hosts


@pytest.mark.unit
def test_a_stand_in_calls_the_real_function_and_is_made_once() -> None:
    made = actor_api._deferred("host_mesh")
    assert made is actor_api._deferred("host_mesh")
    assert (made.__module__, made.__name__) == ("monarch_kernel.actor", "host_mesh")
    with pytest.raises(ValueError, match="hosts must be a positive int, got 0"):
        made(hosts=0)


@pytest.mark.unit
def test_the_controller_gets_the_real_functions() -> None:
    assert actor_api.this_host is hosts.this_host
    assert actor_api.HostMesh is hosts.HostMesh


@pytest.mark.local
def test_a_rank_importing_the_canonical_line_does_not_load_the_controller(mesh2) -> None:
    from canonical_actors import ImportProbe

    probes = mesh2.spawn("probe", ImportProbe)
    assert probes.controller_modules.call().get().values() == [[], []]
    assert (
        probes.stand_ins.call().get().values()
        == [["monarch_kernel.actor.this_host", "monarch_kernel.actor.host_mesh"]] * 2
    )
    # The stand-in reaches the real function (which imports the controller then).
    first = probes.slice(gpus=0)
    said = first.call_host_mesh.call_one(0).get()
    assert said == "hosts must be a positive int, got 0"
    assert "monarch_kernel.controller.mesh" in first.controller_modules.call_one().get()
