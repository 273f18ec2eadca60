"""A mesh past the heat-map threshold in a real kernel: 4 host agents × 16 ranks = 64
ranks (``GRID_MIN_RANKS``, the real threshold, no override). The dashboard is one grid
widget (a state string, no tiles), an error on 3 ranks is one grouped error in the cell
and in the dashboard, hovering a cell answers that rank's details, ``%mesh stacks``
groups the 64 ranks and names the odd one out, and stopping leaves nothing running.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from helpers import wait_until
from test_dashboard import WidgetKernel

from monarch_kernel.widgets.compact import GRID_MIN_RANKS

HOSTS, PER_HOST = 4, 16
WORLD = HOSTS * PER_HOST

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kernel():
    assert WORLD >= GRID_MIN_RANKS
    k = WidgetKernel()
    r = k.run(f"%mesh big --gpus {PER_HOST} --hosts {HOSTS} --on-failure continue", timeout=240)
    assert "ready" in r.stdout, r.stderr + r.error_text
    # a big mesh's start says how far it is on one rewritten line (issue 27)
    assert f"host agents {HOSTS}/{HOSTS} ready in" in r.stdout, r.stdout
    assert f"ranks {WORLD}/{WORLD} ready (" in r.stdout, r.stdout
    k.first = r
    yield k
    k.shutdown_and_check(timeout=30)


def grid_model(kernel: WidgetKernel) -> tuple[str, dict[str, Any]]:
    """The comm id and state of the (newest) heat-map grid widget."""
    found = [(cid, m) for cid, m in kernel.models.items() if "states" in m and "legend" in m]
    assert found, "no heat-map grid widget"
    return found[-1]


def states(kernel: WidgetKernel) -> str:
    """The grid's state string decoded back to one state name per rank, joined."""
    _, m = grid_model(kernel)
    return m["states"]


def send_custom(kernel: WidgetKernel, comm_id: str, content: dict[str, Any]) -> None:
    """What the grid's front end sends (a hover, a click)."""
    msg = kernel.kc.session.msg(
        "comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": content}}
    )
    kernel.kc.shell_channel.send(msg)


def test_a_big_mesh_gets_the_grid_and_not_tiles(kernel):
    data = kernel.first.displays[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data
    # the static fallback is a grid too, and its text one line per state
    assert 'class="mk-heat-static"' in data["text/html"] and "<table" not in data["text/html"]
    assert re.search(r"(starting|idle)\s+ranks 0-63$", data["text/plain"], re.M), data
    kernel.wait_for(lambda: states(kernel) == "i" * WORLD, what="64 idle cells")
    assert not any(m.get("_model_name") == "GridBoxModel" for m in kernel.models.values())
    _, m = grid_model(kernel)
    assert m["columns"] == 32 and m["legend"]["d"] == "dead"


def test_an_error_on_three_ranks_is_grouped_and_hover_tells_it(kernel):
    r = kernel.run(
        "%%remote big\nimport os\nrank = int(os.environ['RANK'])\n"
        "print(f'rank {rank} here', flush=True)\n"
        "if rank in (3, 4, 9):\n    raise ValueError('bad shard')\nrank * 2"
    )
    text = r.error_text
    assert "ValueError" in text and "ranks 3-4, 9 of 64" in text, text
    assert text.count("bad shard") <= 3, text  # one grouped error, not three tracebacks
    want = "".join("e" if i in (3, 4, 9) else "i" for i in range(WORLD))
    kernel.wait_for(lambda: states(kernel) == want, what="three error cells")
    errors = kernel.html("big", "mk-errors")
    assert "ValueError: bad shard — ranks 3-4, 9" in errors and errors.count("<details") == 1
    # hover on rank 9: its host, last line and last error come back
    comm_id, _ = grid_model(kernel)
    send_custom(kernel, comm_id, {"type": "hover", "rank": 9})

    def detail() -> str:
        got = [m for m in kernel.custom[comm_id] if m.get("type") == "detail" and m["rank"] == 9]
        return got[-1]["text"] if got else ""

    kernel.wait_for(lambda: detail(), what="rank 9's details")
    assert "last error: ValueError: bad shard" in detail(), detail()
    assert "last line: rank 9 here" in detail() and "pid " in detail(), detail()
    # a click selects it: the detail pane shows its output, the cell is marked
    send_custom(kernel, comm_id, {"type": "select", "rank": 9})
    kernel.wait_for(lambda: grid_model(kernel)[1]["selected"] == 9, what="rank 9 selected")
    kernel.wait_for(
        lambda: "rank 9 here" in kernel.html("big", "<b>rank 9</b>"), what="rank 9's output"
    )


def test_mesh_stacks_groups_64_ranks_and_names_the_odd_one_out(kernel):
    r = kernel.run(
        "%%remote big --ranks 7 --bg\nimport time\n"
        "def stuck_in_loader():\n    time.sleep(120)\nstuck_in_loader()"
    )
    assert not r.errors, r.error_text
    kernel.run("%mesh stacks big")  # warm up: the first view imports its modules
    seen: list[str] = []

    def settled():
        res = kernel.run("%mesh stacks big")
        seen.append(res.text)
        return "stuck_in_loader" in res.text and res

    r = wait_until(settled, timeout=30, what="rank 7 in the stacks", detail=lambda: seen[-1])
    assert "odd ranks out: 7 (1 of 64)" in r.text, r.text
    assert "ranks 0-6, 8-63 (63 of 64)" in r.text and "rank 7 (1 of 64)" in r.text, r.text
    # every rank answered in time (else "no answer"); how long it takes at 256 ranks is
    # the scale bench's `%mesh stacks` column
    assert "no answer" not in r.text, r.text
    html = r.results[-1]["data"]["text/html"]
    assert "mk-stacks-summary" in html and html.count("odd one out") == 1
    kernel.run("big.interrupt()")
    kernel.wait_for(lambda: states(kernel)[7] in "ie", what="rank 7 interrupted")


def test_a_metric_is_charted_as_mean_min_max_over_the_ranks(kernel):
    r = kernel.run(
        "%%remote big\nimport os, monarch_kernel\nr = int(os.environ['RANK'])\n"
        "for step in range(3):\n    monarch_kernel.report(step=step, loss=step + r)"
    )
    assert not r.errors, r.error_text

    def lines() -> dict[str, list[tuple[int, float]]]:
        return kernel.chart_points("big", "metric:loss")

    kernel.wait_for(lambda: all(len(lines()[k]) == 3 for k in ("mean", "min", "max")))
    assert set(lines()) == {"mean", "min", "max"}  # no line per rank
    comm_id = next(c for c, m in kernel.models.items() if m.get("chart_id") == "metric:loss")
    sent = [s for msg in kernel.custom[comm_id] for s in msg["series"]]
    top = [y for s in sent if s["key"] == "max" for y in s["y"]]
    assert top == [63.0, 64.0, 65.0] and "over ranks" in kernel.models[comm_id]["title"]
    # transfer: the mesh's totals, not two lines a rank
    kernel.wait_for(lambda: kernel.chart_points("big", "throughput"), what="transfer points")
    assert set(kernel.chart_points("big", "throughput")) <= {"in", "out"}


def test_stop_leaves_the_grid_stopped(kernel):
    t0 = time.monotonic()
    r = kernel.run("%mesh stop big", timeout=120)
    assert not r.errors, r.error_text
    kernel.wait_for(lambda: set(states(kernel)) == {"x"}, what="64 stopped cells")
    assert time.monotonic() - t0 < 60
