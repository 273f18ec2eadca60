"""A host agent whose join token is refused says why and exits non-zero (the join
endpoint counts it too), on this machine's loopback: no network namespaces needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monarch_kernel.launchers.base import HostConfig
from monarch_kernel.launchers.join import JoinLauncher

pytestmark = pytest.mark.local


def _agent(url: str, token: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "monarch_kernel.host", "--join", url, "--token", token]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_refused_join_says_why_and_exits_non_zero():
    shown: list[str] = []
    launcher = JoinLauncher(bind="127.0.0.1", allow_loopback=True, on_progress=shown.append)
    try:
        cfg = HostConfig(0, "00" * 32, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 5.0, "m")
        launcher.start_hosts([cfg])
        command = shown[0].split("host 0: ", 1)[1]
        url, token = command.split(" --join ", 1)[1].split(" --token ")
        forged = "0-" + "0" * 32 + "-" + token.rsplit("-", 1)[1]
        refused = _agent(url, forged)
        assert refused.returncode != 0, refused
        assert f"the controller at {url} refused to join" in refused.stderr, refused.stderr
        assert launcher.refused == 1
    finally:
        launcher.shutdown()
