"""A big mesh's dashboard and stacks, without ranks: the compact state string, the
heat-map grid's widget, grouped errors and grouped stacks at 256 ranks."""

from __future__ import annotations

import pytest

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.widgets import compact
from monarch_kernel.widgets.heat_grid import HeatGrid, static_grid_html
from monarch_kernel.widgets.incidents import IncidentLog
from monarch_kernel.widgets.stacks_view import MAX_GROUPS, StacksView
from monarch_kernel.widgets.theme import STATES
from monarch_kernel.wire.reports import FailureReport
from monarch_kernel.wire.stacks import Frame, RankStacks, ThreadStack

pytestmark = pytest.mark.unit


def test_states_round_trip_one_character_per_rank():
    states = [STATES[r % len(STATES)] for r in range(1024)]
    codes = compact.encode(states)
    assert len(codes) == 1024 and compact.decode(codes) == states
    assert compact.encode(["idle", "busy", "error", "dead", "stopped"]) == "ibedx"
    assert set(compact.LEGEND.values()) == set(STATES)


def test_threshold_is_a_named_constant_with_an_override(monkeypatch):
    monkeypatch.delenv("MONARCH_KERNEL_GRID_MIN_RANKS", raising=False)
    assert compact.grid_min_ranks() == compact.GRID_MIN_RANKS == 64
    assert not compact.use_grid(63) and compact.use_grid(64) and compact.use_grid(1024)
    monkeypatch.setenv("MONARCH_KERNEL_GRID_MIN_RANKS", "8")
    assert compact.use_grid(8) and not compact.use_grid(7)
    monkeypatch.setenv("MONARCH_KERNEL_GRID_MIN_RANKS", "lots")
    assert compact.grid_min_ranks() == 64  # nonsense: the default


def test_grid_columns_keep_hosts_whole():
    assert compact.grid_columns(64, 16) == 32  # two hosts of 16 a row
    assert compact.grid_columns(1024, 8) == 32
    assert compact.grid_columns(256, 64) == 32  # one host wider than a row
    assert compact.grid_columns(72, 9) == 27  # three hosts of 9
    assert compact.grid_columns(10, 16) == 10


def test_heat_grid_sends_the_states_string_only_when_it_changed():
    selected: list[int] = []
    asked: list[int] = []

    def detail(rank: int) -> str:
        asked.append(rank)
        return f"host h{rank // 16}"

    grid = HeatGrid(32, selected.append, detail)
    try:
        states = "i" * 255 + "d"
        assert grid.put(states, None) == 1
        assert grid.put(states, None) == 0  # nothing changed: nothing sent
        assert grid.put(states, 3) == 1  # the selection moved
        # what the front end sends: a click selects, a hover asks for that rank's details
        grid._on_front_end(grid.widget, {"type": "select", "rank": 7}, [])
        grid._on_front_end(grid.widget, {"type": "hover", "rank": 255}, [])
        grid._on_front_end(grid.widget, {"type": "hover", "rank": "x"}, [])  # ignored
        assert selected == [7] and asked == [255] and grid.details_sent == 1
    finally:
        grid.widget.close()


def test_static_grid_is_one_small_cell_per_rank():
    html = static_grid_html("ii" + "e" * 3 + "d", columns=4, selected=5)
    assert html.count("data-rank=") == 6 and 'title="rank 3: error"' in html
    assert html.count('<div style="line-height:0">') == 2  # rows of 4
    assert "outline:2px solid" in html  # the selected rank


def _report(message: str) -> FailureReport:
    return {
        "type": "ValueError",
        "message": message,
        "line": {"line": 3, "code": "raise ValueError(...)"},
        "traceback": f"ValueError: {message}",
    }


def test_the_same_error_on_many_ranks_is_one_entry():
    log = IncidentLog()
    log.name_request("req1", "cell 4")
    for r in (9, 3, 4, 5):
        log.add_report("req1", r, _report("bad batch"), "exception")
    log.add_report("req1", 200, _report("other"), "exception")
    (incident,) = log.incidents
    first, second = incident.entries
    assert format_ranks(first.ranks) == "3-5, 9" and first.title == "ValueError: bad batch"
    assert second.ranks == [200] and incident.what == "cell 4"


def test_an_incident_of_many_different_errors_stays_short():
    from monarch_kernel.widgets.panes import MAX_ENTRIES, _incident_html, hosts_text

    log = IncidentLog()
    for r in range(256):  # every rank fails its own way
        log.add_report("req", r, _report(f"rank {r} saw {r * 7}"), "exception")
    (incident,) = log.incidents

    class World:  # what _incident_html reads of the mesh state: its size
        class rt:
            world = 256

    html = _incident_html(World(), incident, open_first=True)  # type: ignore[arg-type]
    assert html.count("<details") == MAX_ENTRIES
    assert f"+{256 - MAX_ENTRIES} more different errors on ranks {MAX_ENTRIES}-255" in html
    assert hosts_text([f"h{i}" for i in range(16)]) == " on h0, h1, h2, h3 +12 more hosts"


def _rank(r: int, *functions: str) -> RankStacks:
    frames = tuple(Frame("/u/train.py", i + 1, fn, f"{fn}()") for i, fn in enumerate(functions))
    main = ThreadStack("MainThread", r, True, frames)
    helper = ThreadStack(
        "loader", 10_000 + r, False, (Frame("/u/data.py", 9, "prefetch", "q.get()"),)
    )
    return RankStacks(r, f"h{r // 16}", 1000 + r, (main, helper), "python")


def test_stacks_of_256_ranks_group_and_name_the_odd_ranks_out():
    stacks = [_rank(r, "main", "step", "all_reduce") for r in range(256)]
    for r in (3, 4, 5, 200):
        stacks[r] = _rank(r, "main", "step", "load_batch")
    stacks[77] = RankStacks(77, "h4", None, (), "none", "rank 77 died (SIGKILL)")
    view = StacksView("big", stacks, 0.5)
    text, html = repr(view), view._repr_html_()
    assert [len(g.ranks) for g in view.groups] == [251, 4, 1]
    assert view.summary() == "odd ranks out: 3-5, 77, 200 (5 of 256)"
    assert "odd ranks out: 3-5, 77, 200" in text and "ranks 3-5, 200 (4 of 256)" in text
    assert "mk-stacks-summary" in html and html.count("odd one out") == 2


def test_stacks_everywhere_different_show_the_oddest_first():
    stacks = [_rank(r, "main", "step", "all_reduce") for r in range(200)]
    stacks += [_rank(r, "main", f"f{r}") for r in range(200, 256)]  # 56 groups of one
    view = StacksView("big", stacks, 0.5)
    shown, more = view.shown_groups()
    assert len(shown) == MAX_GROUPS and shown[0].ranks == tuple(range(200))
    assert len(more) == 56 - (MAX_GROUPS - 1)
    text = repr(view)
    assert f"+{len(more)} more groups (ranks " in text and text.count("<< odd one out") == 11


def test_a_big_mesh_metric_is_three_lines_whatever_its_size():
    from monarch_kernel.widgets.bands import StepBands

    bands = StepBands(settle=2.0)
    for r in range(256):  # steps 0-2 from every rank, step 3 from all but rank 7
        steps = [0.0, 1.0, 2.0] + ([3.0] if r != 7 else [])
        bands.add(steps, [s + r / 100 for s in steps], now=0.0)
    # 256 ranks heard of for the first time: complete steps wait for the next look, in
    # case more ranks report (their first points can come an update later)
    assert bands.settle(256, now=0.4) == 0
    assert bands.settle(256, now=0.5) == 3  # step 3 waits for rank 7
    xs, means = bands.mean.arrays()
    assert xs == [0.0, 1.0, 2.0] and means[0] == pytest.approx(1.275)
    assert bands.lo.arrays()[1] == [0.0, 1.0, 2.0] and bands.hi.arrays()[1] == [2.55, 3.55, 4.55]
    assert bands.settle(256, now=2.5) == 1  # ... not for ever
    bands.add([3.0], [3.07], now=2.6)  # rank 7, late: that step is drawn already
    bands.add([0.0], [9.0], now=2.6)
    assert bands.settle(256, now=5.0) == 0 and bands.dropped == 2
    for _ in range(200):  # the run starts over at step 0: a new line
        bands.add([0.0], [1.0], now=6.0)
    assert bands.settle(256, now=9.0) == 1 and bands.mean.arrays()[0][-1] == 0.0


def test_a_first_step_waits_for_the_ranks_whose_first_reports_come_an_update_later():
    """The dashboard's first look may have heard only some ranks' points of step 0 (56 of
    64 here: CI drew a max of 55 where the ranks reported 0..63); the step is drawn once
    the count of reporting ranks stops growing, with every rank in it."""
    from monarch_kernel.widgets.bands import StepBands

    bands = StepBands(settle=2.0)
    for r in range(56):
        bands.add([0.0], [float(r)], now=0.0)
    assert bands.settle(56, now=0.1) == 0  # 56 ranks heard of, just now
    for r in range(56, 64):
        bands.add([0.0], [float(r)], now=0.9)
    assert bands.settle(64, now=1.1) == 0  # 8 more: still growing
    assert bands.settle(64, now=2.1) == 1  # stable: step 0 has all 64
    assert bands.hi.arrays()[1] == [63.0] and bands.lo.arrays()[1] == [0.0]
    assert bands.dropped == 0
    bands.add([1.0], [5.0], now=2.2)  # one rank reports the metric from now on ...
    assert bands.settle(64, now=2.3) == 0  # ... step 1 waits for the others
    assert bands.settle(64, now=4.3) == 1  # ... or SETTLE_S


def test_a_metric_only_one_rank_reports_is_drawn_from_the_second_look_on():
    from monarch_kernel.widgets.bands import StepBands

    bands = StepBands(settle=2.0)
    bands.add([0.0], [1.0], now=0.0)
    assert bands.settle(1, now=0.0) == 0
    assert bands.settle(1, now=1.0) == 1
    bands.add([1.0], [2.0], now=1.5)
    assert bands.settle(1, now=1.5) == 1  # known: at once
