"""``osutil.proc_state``: the state letter of a Linux ``stat`` file, read after the last
``)`` (a command name may hold spaces and parentheses); '' for what cannot be read."""

from __future__ import annotations

import os
import sys

import pytest

from monarch_kernel.wire.osutil import proc_state

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def test_this_running_thread_is_R():
    assert proc_state(f"/proc/{os.getpid()}/task/{os.getpid()}/stat") == "R"


def test_a_command_name_with_spaces_and_parentheses(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("4242 (a) b) (c) T 1 4242 4242 0 -1 4194560\n")
    assert proc_state(str(stat)) == "T"


def test_what_cannot_be_read_is_empty(tmp_path):
    assert proc_state(str(tmp_path / "no-such-process")) == ""
    (tmp_path / "cut").write_text("4242 (short")
    assert proc_state(str(tmp_path / "cut")) == ""
