"""A big mesh raises the descriptor limit it needs (``wire.fd_limit``), or is refused
before anything starts when the hard limit is too low. Each case runs in a child
process whose limits it lowers first (this test process keeps its own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.local


def _run(code: str) -> subprocess.CompletedProcess[str]:
    prologue = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 900))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_soft_limit_is_raised_as_far_as_a_mesh_needs():
    done = _run(
        """
        from monarch_kernel.wire import fd_limit
        fd_limit.ensure(10)                      # 296 needed: 300 is enough
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, 900)
        fd_limit.ensure(100)                     # 656 needed: raised, not beyond
        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert limits == (656, 900), limits
        try:
            fd_limit.ensure(200)                 # 1,056 needed: above the hard limit
        except ValueError as exc:
            print(exc)
        else:
            raise SystemExit("not refused")
        """
    )
    assert done.returncode == 0, done.stderr
    assert "may open at most 900 files" in done.stdout
    assert "1,056" in done.stdout and "ulimit -n" in done.stdout


def test_a_mesh_above_the_hard_limit_is_refused_before_anything_starts():
    done = _run(
        """
        import os
        os.environ["MONARCH_KERNEL_MAX_LOCAL_RANKS"] = "1000"
        from monarch_kernel.actor import this_host
        try:
            this_host().spawn_procs(per_host={"gpus": 200})
        except ValueError as exc:
            print("refused:", exc)
        else:
            raise SystemExit("started")
        import psutil
        assert not psutil.Process().children(recursive=True), "something was started"
        """
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "refused: this controller may open at most 900 files" in done.stdout
