"""128 ranks from one notebook: 8 local host agents of 16 ranks each, in a real kernel.

A ``%%remote`` cell with output and a value, a failure on 3 ranks (each rank's detail
kept), ``%mesh stacks``, fan-in (the controller receives one reply-carrying message
per host per gathered call, read from its own counters), and a stop that leaves
nothing behind. One mesh for the whole module: starting 128 ranks is most of its time.
"""

from __future__ import annotations

import json
import time

import pytest
from kernel_client import Kernel

pytestmark = pytest.mark.local

HOSTS, PER_HOST = 8, 16
RANKS = HOSTS * PER_HOST
#: A window long enough that, even on a loaded machine, each agent sends its 16
#: replies together (it sends at once when all replied: the window only bounds a
#: straggler's hold-up, which no rank here is).
#: No late ``torch._dynamo`` import in the 8 templates (for ranks restarted later,
#: which this module has none of): 8 of them at once cost the 2-core machine the
#: seconds the tests run in (torch itself is pre-imported as ever).
ENV = {
    "MONARCH_KERNEL_FANIN_WINDOW": "5",
    "MONARCH_KERNEL_MAX_LOCAL_RANKS": str(RANKS),
    "MONARCH_KERNEL_PREIMPORT_LATE": "",
}

#: A kernel cell printing the controller's counters of messages received by kind.
COUNTS = "import json; print(json.dumps(big.runtime.inbound.kinds))"


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env=ENV)
    t0 = time.monotonic()
    r = k.run(f"%mesh big --gpus {PER_HOST} --hosts {HOSTS} --on-failure continue", timeout=300)
    assert "ready" in r.stdout, r.stderr + r.error_text
    print(f"128-rank mesh ready in {time.monotonic() - t0:.1f} s")
    yield k
    r = k.run("%mesh stop big", timeout=120)
    assert not r.errors, r.error_text
    k.shutdown_and_check(timeout=60)


def labelled(line: str) -> list[int]:
    """The ranks a collapsed line's label names: ``[0-15, 48-63] text``."""
    out: list[int] = []
    for item in line[1 : line.index("]")].split(","):
        first, _, last = item.strip().partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def counts(kernel: Kernel) -> dict[str, int]:
    r = kernel.run(COUNTS)
    assert not r.errors, r.error_text
    out: dict[str, int] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_cell_with_output_and_a_value_on_128_ranks(kernel):
    r = kernel.run(
        "%%remote big\nimport os\nprint('hello from a rank')\nint(os.environ['RANK']) * 2",
        timeout=120,
    )
    assert not r.errors, r.error_text
    # identical lines collapsed (by each host agent, then by the cell's window): at
    # most one line per host, and every rank's line is there
    lines = [ln for ln in r.stdout.splitlines() if ln.endswith("] hello from a rank")]
    assert 1 <= len(lines) <= HOSTS, r.stdout
    assert sorted(r for ln in lines for r in labelled(ln)) == list(range(RANKS)), r.stdout
    assert "{hosts=7, gpus=15}: 254" in r.text, r.text
    assert "{hosts=0, gpus=0}: 0" in r.text


def test_fan_in_one_message_per_host_per_gathered_call(kernel):
    kernel.run("%%remote big\n0", timeout=120)  # warm
    before = counts(kernel)
    calls = 3
    for _ in range(calls):
        r = kernel.run("%%remote big\n1", timeout=120)
        assert not r.errors, r.error_text
    after = counts(kernel)

    def delta(kind: str) -> int:
        return after.get(kind, 0) - before.get(kind, 0)

    assert delta("res") == 0, (before, after)  # no rank replied on its own
    assert delta("fan_in") == HOSTS * calls, (before, after)


def test_failure_on_3_ranks_keeps_each_ranks_detail(kernel):
    r = kernel.run(
        "%%remote big\nimport os\nrank = int(os.environ['RANK'])\n"
        "if rank in (5, 70, 127):\n    raise ValueError(f'bad rank {rank}')\n",
        timeout=120,
    )
    assert r.errors, r.text
    text = r.error_text
    for rank in (5, 70, 127):  # each failing rank named, with its own message
        assert f"ValueError in the cell on rank {rank} of {RANKS}" in text, text
        assert f"bad rank {rank}" in text, text
    assert "Remote traceback (rank 5, root cause)" in text, text
    # the mesh lives on: every rank answers the next cell
    r = kernel.run("%%remote big\n3", timeout=120)
    assert not r.errors, r.error_text


def test_mesh_stacks_on_128_ranks(kernel):
    t0 = time.monotonic()
    r = kernel.run("%mesh stacks big", timeout=60)
    took = time.monotonic() - t0
    assert not r.errors, r.error_text
    assert f"of {RANKS})" in r.text, r.text
    print(f"%mesh stacks on {RANKS} ranks: {took:.2f} s")
