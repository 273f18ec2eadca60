"""Which survivors the failure policy's abort released: named by the error each one
answered with, not by when its answer came (CI, a loaded 2-core machine: ranks 0 and 3
answered a DDP step's abort more than 0.5 s after it and were named "interrupted")."""

from __future__ import annotations

import pytest

from monarch_kernel.calls.errors import released_by_abort

pytestmark = pytest.mark.unit


def test_the_abort_error_itself_and_as_torch_wraps_it_in_a_ddp_step():
    assert released_by_abort({"type": "ProcessGroupAborted", "message": "allreduce: aborted"})
    # what a rank blocked in DDP's backward answered (its reducer re-raises it from C++)
    wrapped = {
        "type": "RuntimeError",
        "message": "ProcessGroupAborted: the mesh aborted the process group "
        "(rank 2 raised RuntimeError)",
    }
    assert released_by_abort(wrapped)


@pytest.mark.parametrize(
    "report",
    [
        {"type": "KeyboardInterrupt", "message": ""},
        {"type": "RuntimeError", "message": "Connection closed by peer"},
        {"type": "RuntimeError", "message": "mat1 and mat2 shapes cannot be multiplied"},
        {"type": "RuntimeError", "message": "see ProcessGroupAborted: not at the start"},
        {"type": "RuntimeError"},
        {},
    ],
)
def test_other_failures_are_not_the_abort(report):
    assert not released_by_abort(report)
