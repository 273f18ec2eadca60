"""Where a rank is now (``controller/messaging/whereabouts.py``), as the controller answers a
process holding an old reference: over a mesh's records (real ``RankInfo`` s, no
processes)."""

from __future__ import annotations

import pytest

from monarch_kernel.controller.state.records import MeshPhase

pytestmark = pytest.mark.unit


class _Mesh:
    """A mesh's records as ``locate_rank`` reads them (a real RankInfo, no processes)."""

    def __init__(self, info, phase=MeshPhase.RUNNING, restarting=False):
        self.ranks, self.state, self.restarting = [info], phase, restarting

    def wait_recovered(self, timeout=None):
        from monarch_kernel.calls.errors import MeshStartError

        if self.restarting:
            raise MeshStartError("still restarting")

    def death_text(self, info):
        return f"rank {info.rank} of mesh 'b' died: killed by SIGKILL"


def test_locate_rank_answers():
    from monarch_kernel.calls.errors import DeathInfo
    from monarch_kernel.controller.messaging.whereabouts import locate_rank
    from monarch_kernel.controller.state.records import RankInfo, RankState
    from monarch_kernel.wire.peer_address import PeerAddress

    here = PeerAddress("m", "ipc:///x/pr0")
    info = RankInfo(0, 0, 0, (0,), state=RankState.IDLE, peer=here, restarts=2)
    where = locate_rank(_Mesh(info), "b", 0, 1.0)
    assert (where.address, where.incarnation, where.alive) == (here, 2, True)
    assert "the mesh was stopped" in locate_rank(None, "b", 0, 1.0).why
    assert "the mesh was stopped" in locate_rank(_Mesh(info, MeshPhase.STOPPED), "b", 0, 0).why
    with pytest.raises(ValueError, match="has no rank 3"):
        locate_rank(_Mesh(info), "b", 3, 1.0)
    late = locate_rank(_Mesh(info, restarting=True), "b", 0, 0.0)
    assert not late.alive and late.why == "rank 0 of mesh 'b' is still being restarted"
    info.state, info.death = RankState.DEAD, DeathInfo(rank=0, host="m", pid=1, signal=9)
    dead = locate_rank(_Mesh(info), "b", 0, 1.0)
    assert not dead.alive and not dead.address and "killed by SIGKILL" in dead.why
