"""Where the sockets of a rank, the kernel's reply socket and the controller go when the
temporary directory's path is too long for a unix socket (107 bytes): each moves its
directory to /tmp instead of failing to bind (or, for the controller, of silently
falling back to tcp), and the directory is one the next sweep removes if its owner is
killed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.dataplane import common as dataplane_common
from monarch_kernel.wire import tempdirs

pytestmark = pytest.mark.unit


@pytest.fixture
def long_tmp(tmp_path, monkeypatch):
    """A temporary directory whose path is 100 bytes long, in force for ``tempfile``."""
    deep = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    deep.mkdir()
    assert len(str(deep)) >= 100
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    return deep


@pytest.fixture
def own_dir_reset(monkeypatch):
    """A fresh ``dataplane_common.own_dir`` for this test; its directory removed after."""
    monkeypatch.setattr(dataplane_common, "_own_dir", None)
    yield
    made = dataplane_common._own_dir
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def test_the_controllers_directory_moves_to_tmp_and_keeps_unix_sockets(long_tmp):
    from monarch_kernel.controller.messaging.sockets import private_ipc_dir

    path = private_ipc_dir()
    try:
        assert path is not None, "a long $TMPDIR made the controller fall back to tcp"
        assert os.path.dirname(path) == "/tmp"
        assert os.path.basename(path).startswith("mk-mesh-")
        assert len(os.path.join(path, "recv")) <= tempdirs.SOCKET_PATH_MAX
        assert os.stat(path).st_mode & 0o777 == 0o700
        assert not tempdirs.owned_by_nobody(path)  # we own it: not swept while we live
    finally:
        shutil.rmtree(path or "", ignore_errors=True)


def test_a_rank_whose_agents_directory_is_too_deep_uses_its_own(long_tmp, own_dir_reset):
    agent_dir = long_tmp / "h"
    agent_dir.mkdir(mode=0o700)
    cfg = RankConfig(rank=3, log=str(agent_dir / "rank3.log"))
    assert dataplane_common.private_dir(cfg) == str(agent_dir)
    path = dataplane_common.socket_path(cfg, f"dp3-{os.getpid()}")
    assert len(path) <= tempdirs.SOCKET_PATH_MAX
    own = os.path.dirname(path)
    assert os.path.dirname(own) == "/tmp" and os.path.basename(own).startswith("mk-dp-")
    assert os.stat(own).st_mode & 0o777 == 0o700
    # a name that fits stays in the agent's directory; the rank's own one is made once
    assert dataplane_common.socket_path(cfg, "pr3") == str(agent_dir / "pr3")
    assert os.path.dirname(dataplane_common.socket_path(cfg, "c3-1234567")) == own
    assert dataplane_common.private_dir(RankConfig(rank=3, log="")) == own


def test_a_rank_with_room_keeps_its_sockets_in_its_agents_directory(tmp_path, own_dir_reset):
    agent_dir = tmp_path / "h"
    agent_dir.mkdir(mode=0o700)
    cfg = RankConfig(rank=0, log=str(agent_dir / "rank0.log"))
    assert dataplane_common.socket_path(cfg, "pr0") == str(agent_dir / "pr0")
    assert dataplane_common._own_dir is None  # nothing of its own made


#: A process that makes its rank directory and the kernel's reply socket directory,
#: says where, and waits to be killed.
MAKES_DIRS = """
import sys, time
from monarch_kernel.actor.peer.reply import reply_path
from monarch_kernel.rank.dataplane.common import own_dir
print(own_dir(), reply_path(), flush=True)
time.sleep(120)
"""


def test_the_directories_of_a_killed_process_are_swept(long_tmp):
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKES_DIRS], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        rank_dir, reply = proc.stdout.readline().split()
        peer_dir = os.path.dirname(reply)
        for made, prefix in ((rank_dir, "mk-dp-"), (peer_dir, "mk-peer-")):
            assert os.path.dirname(made) == "/tmp", made
            assert os.path.basename(made).startswith(prefix), made
        assert len(reply) <= tempdirs.SOCKET_PATH_MAX
        assert not set(tempdirs.sweep("/tmp")) & {rank_dir, peer_dir}  # alive: kept
    finally:
        proc.kill()
        proc.wait(30)
    removed = tempdirs.sweep("/tmp")
    assert rank_dir in removed and peer_dir in removed
    assert not os.path.exists(rank_dir) and not os.path.exists(peer_dir)
