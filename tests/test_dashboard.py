"""The live mesh dashboard, driven through a real kernel with real ranks.

What the frontend sees is rebuilt from the kernel's IOPub messages (``comm_open`` and
``comm_msg`` updates of the ipywidgets models), so these tests check the widget model
values a browser would render, and the rate at which they arrive.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import time
from collections import defaultdict
from typing import Any

import pytest
from helpers import kill, wait_until
from kernel_client import Kernel, Result

THROTTLE = 0.25  # the dashboard's update interval (seconds)


def _safe(cond: Any) -> bool:
    try:
        return bool(cond())
    except (KeyError, IndexError, AttributeError):
        return False


class WidgetKernel(Kernel):
    """A kernel client that mirrors every ipywidgets model the kernel opens."""

    #: what the module's ``%mesh`` cell produced (set by the ``kernel`` fixture)
    first: Result

    def __init__(self) -> None:
        super().__init__()
        self.models: dict[str, dict[str, Any]] = {}
        self.history: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
        #: custom messages (a live chart's appends) per widget model
        self.custom: dict[str, list[dict[str, Any]]] = defaultdict(list)
        get = self.kc.get_iopub_msg

        def get_and_mirror(timeout: float | None = None) -> dict[str, Any]:
            m = get(timeout=timeout)
            self.feed(m)
            return m

        self.kc.get_iopub_msg = get_and_mirror  # type: ignore[method-assign]  # mirror every read

    def feed(self, m: dict[str, Any]) -> None:
        t, c = m["msg_type"], m["content"]
        when = m["header"]["date"].timestamp()
        if t == "comm_open" and c.get("target_name") == "jupyter.widget":
            state = dict(c["data"]["state"])
            self.models[c["comm_id"]] = state
            self.history[c["comm_id"]].append((when, dict(state)))
        elif t == "comm_msg" and c["comm_id"] in self.models:
            data = c["data"]
            if data.get("method") == "update":
                self.models[c["comm_id"]].update(data["state"])
                self.history[c["comm_id"]].append((when, dict(data["state"])))
            elif data.get("method") == "custom":
                self.custom[c["comm_id"]].append(data["content"])

    def pump(self, seconds: float) -> None:
        """Read IOPub for ``seconds`` (widget updates sent from the dashboard thread)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.other.append(self.kc.get_iopub_msg(timeout=left))
            except queue.Empty:
                return

    def wait_for(self, cond: Any, timeout: float = 15.0, what: str = "") -> None:
        """Read IOPub until ``cond()`` holds for the mirrored models."""

        def holds() -> bool:
            if _safe(cond):
                return True
            self.pump(0.1)
            return _safe(cond)

        wait_until(holds, timeout=timeout, interval=0, what=what or str(cond))

    # -- views of the mirrored models ------------------------------------------------
    def tiles(self, mesh: str) -> dict[int, dict[str, Any]]:
        """rank -> tile button state of the dashboard of ``mesh``."""
        grid = self._grid(mesh)
        out = {}
        for ref in grid["children"]:
            tile = self.models[ref.removeprefix("IPY_MODEL_")]
            m = re.match(r"(?:rank )?(\d+)", tile["description"])
            assert m, tile["description"]
            rank = int(m.group(1))
            out[rank] = tile
        return out

    def tile_state(self, mesh: str, rank: int) -> str:
        tile = self.tiles(mesh)[rank]
        return next(c for c in tile["_dom_classes"] if c.startswith("mk-s-"))[5:]

    def html(self, mesh: str, marker: str) -> str:
        """The value of the dashboard HTML widget of ``mesh`` containing ``marker``."""
        for comm_id in self._dashboard(mesh)["_all"]:
            value = self.models[comm_id].get("value", "")
            if isinstance(value, str) and marker in value:
                return value
        raise KeyError(marker)

    def chart_points(self, mesh: str, chart_id: str) -> dict[str, list[tuple[int, float]]]:
        """Series key -> ``(arrival index, x)`` of every point the live chart ``chart_id``
        of ``mesh`` was sent (appends, in order)."""
        for comm_id in self._dashboard(mesh)["_all"]:
            if self.models[comm_id].get("chart_id") == chart_id:
                out: dict[str, list[tuple[int, float]]] = defaultdict(list)
                for msg in self.custom[comm_id]:
                    for s in msg["series"]:
                        out[s["key"]] += [(s["start"] + i, x) for i, x in enumerate(s["x"])]
                return out
        raise KeyError(chart_id)

    def button(self, mesh: str, label: str) -> tuple[str, dict[str, Any]]:
        for comm_id in self._dashboard(mesh)["_all"]:
            m = self.models[comm_id]
            if m.get("_model_name") == "ButtonModel" and m.get("description", "").startswith(label):
                return comm_id, m
        raise KeyError(label)

    def cancel_button(self, mesh: str, what: str) -> str:
        """The comm id of the Cancel button of the running job ``what`` (``cell 12``)."""
        for comm_id in self._dashboard(mesh)["_all"]:
            m = self.models[comm_id]
            if (
                m.get("_model_name") == "ButtonModel"
                and m.get("description") == "Cancel"
                and f"Cancel {what}:" in m.get("tooltip", "")
                and not m.get("disabled")
            ):
                return comm_id
        raise KeyError(what)

    def job_row(self, mesh: str, what: str) -> str:
        """The running-jobs row of ``what`` ("" when it is not listed)."""
        for comm_id in self._dashboard(mesh)["_all"]:
            value = self.models[comm_id].get("value", "")
            if isinstance(value, str) and 'class="mk-job"' in value and f"<b>{what}</b>" in value:
                return value
        return ""

    def click(self, comm_id: str, subshell_id: str | None = None) -> None:
        msg = self.kc.session.msg(
            "comm_msg",
            {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}},
        )
        if subshell_id:
            msg["header"]["subshell_id"] = subshell_id
        self.kc.shell_channel.send(msg)

    def create_subshell(self) -> str:
        msg = self.kc.session.msg("create_subshell_request", {})
        self.kc.control_channel.send(msg)
        while True:
            reply = self.kc.get_control_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]["subshell_id"]

    def _dashboard(self, mesh: str) -> dict[str, Any]:
        """The newest dashboard VBox whose header names ``mesh`` (with all its models)."""
        found = None
        for comm_id, m in self.models.items():
            if m.get("_model_name") == "VBoxModel" and "mk-dash" in m.get("_dom_classes", ()):
                ids = self._descendants(comm_id)
                for cid in ids:
                    v = self.models[cid].get("value", "")
                    if isinstance(v, str) and f'<b style="font-size:14px">{mesh}</b>' in v:
                        found = {"id": comm_id, "_all": ids}
        if found is None:
            raise KeyError(f"no dashboard for mesh {mesh!r}")
        return found

    def _descendants(self, comm_id: str) -> list[str]:
        out, stack = [], [comm_id]
        while stack:
            cid = stack.pop()
            out.append(cid)
            for ref in self.models[cid].get("children", ()):
                stack.append(ref.removeprefix("IPY_MODEL_"))
        return out

    def _grid(self, mesh: str) -> dict[str, Any]:
        for cid in self._dashboard(mesh)["_all"]:
            m = self.models[cid]
            if m.get("_model_name") == "GridBoxModel":
                return m
        raise KeyError("grid")


@pytest.fixture(scope="module")
def kernel():
    k = WidgetKernel()
    # --on-failure continue: a dead rank stays dead until restarted (from the dashboard)
    r = k.run("%mesh m --gpus 4 --on-failure continue")
    assert "ready" in r.stdout, r.stderr + r.error_text
    k.first = r
    yield k
    k.shutdown_and_check()


@pytest.fixture(autouse=True)
def _dead_ranks_restarted(request):
    """The tests share one mesh: one that failed half-way must not leave the next ones
    a dead rank (that would fail them too, hiding which test really failed)."""
    yield
    if "kernel" in request.fixturenames:
        k = request.getfixturevalue("kernel")
        r = k.run("if any(not _r.alive for _r in m.runtime.ranks):\n    m.restart()")
        assert not r.errors, r.error_text


def test_mesh_displays_the_dashboard_while_ranks_start(kernel):
    r = kernel.first
    assert r.displays, "no dashboard displayed"
    data = r.displays[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data
    # the fallback for frontends without widgets: a static snapshot and a text view
    assert "gpus=4" in data["text/plain"] and "rank 3" in data["text/plain"]
    assert 'class="mk-dash-static"' in data["text/html"] and "starting" in data["text/html"]
    # what the JupyterLab extension reads to freeze it if the kernel dies (frozen.ts)
    assert 'data-mesh="m" data-detachable="0"' in data["text/html"]
    # each tile went through "starting" (sent while %mesh was still waiting) to "idle"
    tiles = kernel.tiles("m")
    assert sorted(tiles) == [0, 1, 2, 3]
    for rank, tile in tiles.items():
        comm_id = next(c for c, m in kernel.models.items() if m is tile)
        states = [
            cls[5:]
            for _, upd in kernel.history[comm_id]
            for cls in upd.get("_dom_classes", ())
            if cls.startswith("mk-s-")
        ]
        assert states[0] == "starting" and states[-1] == "idle", (rank, states)
        assert "pid " in tile["description"] and "cpu" in tile["description"]
    head = kernel.html("m", "mk-head")
    assert "gpus=4" in head and "local" in head and "<b>4/4</b> alive" in head
    assert "transfer in" in head and "up " in head
    # when start-up finished the static fallback was refreshed (update_display_data)
    updates = [d for d in r.displays if d["type"] == "update_display_data"]
    assert updates and "4 idle" in updates[-1]["data"]["text/html"]
    # ... which is what nbconvert shows for a notebook saved without widget state
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("%mesh m --gpus 4")
    cell.outputs = [nbformat.v4.new_output("display_data", data=updates[-1]["data"])]
    nb.cells = [cell]
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert "mk-dash-static" in html and "4 idle" in html


def test_busy_tiles_and_live_metrics_from_a_bg_loop(kernel):
    steps = 120
    r = kernel.run(
        "%%remote m --bg\nimport time, monarch_kernel\n"
        f"for i in range({steps}):\n"
        "    monarch_kernel.report(step=i, loss=1.0 / (i + 1))\n"
        "    time.sleep(0.01)\n"
    )
    assert "running" in r.shown, r.error_text
    m = re.search(r"RemoteJob cell (\S+) on", r.shown)
    assert m, r.shown
    cell = m.group(1)
    kernel.wait_for(
        lambda: all(kernel.tile_state("m", i) == "busy" for i in range(4)), what="busy tiles"
    )
    assert f"cell {cell}" in kernel.tiles("m")[0]["description"]
    seen_steps = []

    def chart_step() -> float:
        points = kernel.chart_points("m", "metric:loss").get("r0")
        return points[-1][1] if points else -1

    kernel.wait_for(lambda: chart_step() >= 0, what="loss chart")
    while chart_step() < steps - 1:
        seen_steps.append(chart_step())
        kernel.pump(0.3)
    assert len(set(seen_steps)) >= 2, "the chart did not move while the loop ran"
    kernel.wait_for(
        lambda: all(kernel.tile_state("m", i) == "idle" for i in range(4)), what="idle again"
    )
    assert f"step {steps - 1}" in kernel.tiles("m")[2]["description"]
    # the live chart was sent every point once, in order (appends only); its last points
    # may come up to a chart interval after the tiles turned idle
    kernel.wait_for(
        lambda: sum(len(p) for p in kernel.chart_points("m", "metric:loss").values()) >= 4 * steps,
        what="every point charted",
    )
    sent = kernel.chart_points("m", "metric:loss")
    assert sorted(sent) == [f"r{i}" for i in range(4)]
    assert all(pts == [(i, float(i)) for i in range(steps)] for pts in sent.values()), sent
    # every report arrived, in order, on every rank
    r = kernel.run(
        "from monarch_kernel.widgets import dashboard\n_d = dashboard(m)\n"
        "[(s.count, s.xs == [float(i) for i in range(len(s.xs))])"
        " for _, s in sorted(_d.state.metrics['loss'].items())]"
    )
    assert r.text == str([(steps, True)] * 4), r.text + r.error_text


def test_a_chart_view_that_opens_later_gets_the_whole_history(kernel):
    """The front end asks for the history when a view opens ("sync"); the kernel answers
    with every kept point and each series' count (appends that overlap it are dropped)."""
    kernel.run(
        "%%remote m\nimport monarch_kernel\nfor run in range(2):\n"
        "    for step in range(20):\n"
        "        monarch_kernel.report(step=step, acc=step / 20 + run)"
    )
    kernel.wait_for(lambda: kernel.chart_points("m", "metric:acc"), what="acc chart")
    comm_id = next(
        cid
        for cid in kernel._dashboard("m")["_all"]
        if kernel.models[cid].get("chart_id") == "metric:acc"
    )
    msg = kernel.kc.session.msg(
        "comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": {"type": "sync"}}}
    )
    kernel.kc.shell_channel.send(msg)
    kernel.wait_for(lambda: any(m["type"] == "reset" for m in kernel.custom[comm_id]), what="reset")
    reset = next(m for m in kernel.custom[comm_id] if m["type"] == "reset")
    r0 = next(s for s in reset["series"] if s["key"] == "r0")
    assert r0["count"] == 40 and r0["x"] == [float(i) for i in range(20)] * 2


def test_busy_tile_names_the_endpoint(kernel):
    r = kernel.run(
        "import time\nfrom monarch_kernel.actor import Actor, endpoint\n"
        "class Sleeper(Actor):\n"
        "    @endpoint\n"
        "    def nap(self, s: float) -> float:\n"
        "        time.sleep(s)\n"
        "        return s\n"
        "sleepers = m.spawn('sleepers', Sleeper)\n"
        "fut = sleepers.slice(gpus=1).nap.call_one(2.0)"
    )
    assert not r.errors, r.error_text
    kernel.wait_for(lambda: kernel.tile_state("m", 1) == "busy", what="busy endpoint")
    # state and text may reach the frontend in different throttled updates
    kernel.wait_for(
        lambda: "sleepers.nap" in kernel.tiles("m")[1]["description"], what="endpoint name"
    )
    assert kernel.tile_state("m", 0) == "idle"
    # ... and the running-jobs list has it (calls once they ran half a second)
    kernel.wait_for(lambda: kernel.job_row("m", "sleepers.nap"), what="the call listed")
    assert "running on rank 1 · " in kernel.job_row("m", "sleepers.nap")
    assert kernel.run("fut.get()").text == "2.0"
    kernel.wait_for(lambda: kernel.tile_state("m", 1) == "idle", what="idle again")
    assert "last: sleepers.nap" in kernel.tiles("m")[1]["description"]


def test_errors_are_grouped_root_cause_first(kernel):
    r = kernel.run(
        "%%remote m\nimport os, time\nrank = int(os.environ['RANK'])\n"
        "if rank == 2:\n    raise KeyError('first')\n"
        "time.sleep(0.2)\n"
        "if rank in (1, 3):\n    raise ValueError('bad batch')\n"
    )
    assert r.reply["status"] == "error"
    kernel.wait_for(
        lambda: [kernel.tile_state("m", i) for i in range(4)] == ["idle"] + ["error"] * 3,
        what="error tiles",
    )
    # the errors panel and the tiles can arrive in different throttled updates
    kernel.wait_for(
        lambda: "ranks 1-3 of 4" in kernel.html("m", "mk-errors").split('class="mk-incident"')[1],
        what="the incident of ranks 1-3",
    )
    errors = kernel.html("m", "mk-errors")
    incident = errors.split('class="mk-incident"')[1]
    first, second = incident.split("<details")[1:3]
    assert "root cause" in first and "KeyError" in first and "rank 2" in first
    assert "ValueError: bad batch — ranks 1, 3" in second and "root cause" not in second
    assert "line 8" in second  # the traceback points at the cell's line
    # the next run clears the error state
    kernel.run("%remote m 1")
    kernel.wait_for(lambda: kernel.tile_state("m", 1) == "idle", what="error cleared")


def test_dead_rank_shows_exit_and_output_then_restart_button(kernel):
    r = kernel.run(
        "%%remote m --ranks 2\nimport os, sys\nprint('about to exit', flush=True)\nos._exit(7)"
    )
    assert "exit code 7" in r.error_text
    kernel.wait_for(lambda: kernel.tile_state("m", 2) == "dead", what="dead tile")
    assert "exit code 7" in kernel.tiles("m")[2]["description"]
    # the tile, the header and the errors panel are separate widgets: their updates of
    # one tick reach the frontend one after another, and the errors may come a tick later
    kernel.wait_for(lambda: "<b>3/4</b> alive" in kernel.html("m", "mk-head"), what="3/4 alive")

    def newest_incident() -> str:
        return kernel.html("m", "mk-errors").split('class="mk-incident"')[1]

    kernel.wait_for(lambda: "died: exit code 7" in newest_incident(), what="rank 2's incident")
    newest = newest_incident()
    assert "about to exit" in newest
    # clicking the tile shows its recent output and last error
    tile_id = next(c for c, m in kernel.models.items() if m is kernel.tiles("m")[2])
    kernel.click(tile_id)
    kernel.wait_for(lambda: "<b>rank 2</b>" in kernel.html("m", "mk-detail"), what="detail")
    detail = kernel.html("m", "mk-detail")
    assert "about to exit" in detail and "died: exit code 7" in detail
    assert "mk-selected" in kernel.tiles("m")[2]["_dom_classes"]
    comm_id, button = kernel.button("m", "Restart rank 2")
    assert not button["disabled"]
    kernel.click(comm_id)
    kernel.wait_for(
        lambda: (
            kernel.tile_state("m", 2) == "idle" and "restarted" in kernel.html("m", "mk-status")
        ),
        timeout=30,
        what="restarted",
    )
    kernel.wait_for(
        lambda: (
            "<b>4/4</b> alive" in kernel.html("m", "mk-head")
            and kernel.button("m", "Restart dead ranks")[1]["disabled"]
        ),
        what="4/4 alive, nothing left to restart",
    )
    r = kernel.run("%remote m int(__import__('os').environ['RANK'])")
    assert "{gpus=2}: 2" in r.text


def test_cancel_a_bg_cell_from_the_running_jobs(kernel):
    """A ``--bg`` cell is listed while it runs (on which ranks, for how long); its
    Cancel button interrupts it on the ranks still running it, and it leaves the list."""
    r = kernel.run(
        "%%remote m --bg\nimport os, time\n"
        "if os.environ['RANK'] != '0':\n"
        "    for _ in range(600):\n"
        "        time.sleep(0.1)\n"
    )
    assert "running" in r.shown, r.error_text
    m = re.search(r"RemoteJob cell (\S+) on", r.shown)
    assert m, r.shown
    what = "cell " + m.group(1)
    # rank 0 finished at once: the row names the ranks still running it, and its time runs
    kernel.wait_for(
        lambda: "running on ranks 1-3 (1 of 4 done) · 1s" in kernel.job_row("m", what),
        what="the job listed, with its live time",
    )
    row = kernel.job_row("m", what)
    found = re.search(r'data-request="(\w+)"', row)
    assert found, row
    rid = found.group(1)
    kernel.click(kernel.cancel_button("m", what))
    kernel.wait_for(
        lambda: f"cancelled {what} on ranks 1-3" in kernel.html("m", "mk-status"),
        what="the status",
    )
    kernel.wait_for(lambda: not kernel.job_row("m", what), what="the job to leave the list")
    kernel.wait_for(
        lambda: all(kernel.tile_state("m", i) == "idle" for i in range(4)), what="idle again"
    )
    incident = kernel.html("m", "mk-errors").split('class="mk-incident"')[1]
    assert what in incident and "KeyboardInterrupt" in incident and "ranks 1-3" in incident
    # cancelling it again: it had finished
    r = kernel.run(f"from monarch_kernel.widgets import dashboard\ndashboard(m).cancel({rid!r})")
    assert not r.errors, r.error_text
    kernel.wait_for(
        lambda: f"{what} had finished" in kernel.html("m", "mk-status"), what="had finished"
    )
    assert kernel.run("%remote m 'alive'").text.count("'alive'") == 4


def test_recovery_shows_the_phase_and_what_was_lost(kernel):
    """While ranks restart in place the header says so; MeshRecovered's report (which
    ranks restarted, what was re-run, what state was lost) shows in the incident area."""
    start = time.time()
    r = kernel.run(
        "from monarch_kernel.controller.state.records import SetupCell\n"
        "m.runtime.remember_setup(SetupCell('import time\\ntime.sleep(0.8)', 'slow-setup'))\n"
        "try:\n"
        "    _rep = m.restart([1])\n"
        "finally:\n"
        "    m.runtime.setup_cells[:] = [c for c in m.runtime.setup_cells"
        " if c.label != 'slow-setup']\n"
        "print(_rep.describe('m'))"
    )
    assert "restarted rank(s) 1" in r.stdout, r.stdout + r.error_text

    def newest_recovery() -> str:
        return kernel.html("m", "mk-errors").split('class="mk-recovery"')[1]

    kernel.wait_for(lambda: "recovered · rank 1 of 4" in newest_recovery(), what="the report")
    assert "Errors and recoveries (newest first)" in kernel.html("m", "mk-errors")
    recovery = newest_recovery()
    assert "restarted rank(s) 1" in recovery and "re-ran setup cell(s) slow-setup" in recovery
    assert "lost on the restarted rank(s): variables and imports" in recovery
    kernel.wait_for(
        lambda: "restarted ranks 1 in" in kernel.html("m", "mk-status"), what="the status"
    )
    # the header showed the phase while the setup cell was re-run
    head_id = next(
        c for c in kernel._dashboard("m")["_all"] if "mk-head" in kernel.models[c].get("value", "")
    )
    shown = [u["value"] for t, u in kernel.history[head_id] if t >= start and "value" in u]
    assert any("recovering: restarting ranks" in v and "mk-phase-recovering" in v for v in shown)
    kernel.wait_for(lambda: "· running ·" in kernel.html("m", "mk-head"), what="running again")
    assert kernel.tiles("m")[1]["description"].startswith("rank 1 · idle")


def test_interrupt_button_works_while_a_cell_is_busy(kernel):
    """With comms over subshells (JupyterLab >= 4.4, ipykernel >= 7) the click is
    handled while the main shell is blocked in a long %%remote cell."""
    subshell = kernel.create_subshell()
    busy = kernel.submit("%%remote m\nimport time\ntime.sleep(60)")
    kernel.wait_for(lambda: all(kernel.tile_state("m", i) == "busy" for i in range(4)), what="busy")
    comm_id, _ = kernel.button("m", "Interrupt")
    kernel.click(comm_id, subshell_id=subshell)
    r = kernel.collect(busy, timeout=30)  # long before the 60 s sleep ends
    assert r.reply["status"] == "error" and "KeyboardInterrupt" in r.error_text
    kernel.wait_for(lambda: "interrupt sent" in kernel.html("m", "mk-status"), what="status")
    r = kernel.run("%remote m 'alive'")
    assert "{gpus=3}: 'alive'" in r.text


def test_updates_stay_within_the_throttle(kernel):
    kernel.pump(0.5)
    start = time.time()
    r = kernel.run(
        "%%remote m --bg\nimport time, monarch_kernel\nt0 = time.time()\ni = 0\n"
        "while time.time() - t0 < 3:\n"
        "    monarch_kernel.report(step=i, loss=1.0 / (i + 1)); i += 1\n"
        "    time.sleep(0.002)\n"
    )
    assert "running" in r.shown
    kernel.pump(3.5)
    stamps: dict[str, list[float]] = {}
    for comm_id, hist in kernel.history.items():
        ts = [t for t, _ in hist if t >= start]
        if len(ts) > 1:
            stamps[comm_id] = ts
    assert stamps, "no widget updates during the loop"
    for comm_id, ts in stamps.items():
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        assert min(gaps) >= THROTTLE * 0.8, (kernel.models[comm_id].get("_model_name"), gaps)
    # the updates come in bursts (one per tick): at most 4 a second
    all_ts = sorted(t for ts in stamps.values() for t in ts)
    bursts = [all_ts[0]] + [b for a, b in zip(all_ts, all_ts[1:]) if b - a > 0.1]
    span = all_ts[-1] - all_ts[0]
    assert len(bursts) <= span / THROTTLE + 1.5, (len(bursts), span)
    assert len(bursts) >= 6  # ... and they really were live
    kernel.run("import time; time.sleep(0.5)")


def test_dashboard_again_and_stop_button(kernel):
    r = kernel.run("%mesh s --gpus 2 --hosts 2")
    assert "ready" in r.stdout
    first = r.displays[0]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
    r = kernel.run("s.dashboard()")
    again = r.results[0]["data"]
    assert again["application/vnd.jupyter.widget-view+json"]["model_id"] == first
    assert "mk-dash-static" in again["text/html"] and "4/4 alive" in again["text/plain"]
    # the grid follows the dims: one row per host, one column per gpu
    assert "hosts=2 × gpus=2" in kernel.html("s", "mk-head")
    layout = kernel.models[kernel._grid("s")["layout"].removeprefix("IPY_MODEL_")]
    assert layout["grid_template_columns"].startswith("repeat(2,")
    assert kernel.tiles("s")[3]["description"].startswith("rank 3 (1,1) · idle")
    comm_id, _ = kernel.button("s", "Stop mesh")
    kernel.click(comm_id)
    kernel.wait_for(lambda: kernel.button("s", "Click again")[1], what="confirm")
    kernel.click(comm_id)
    kernel.wait_for(
        lambda: all(kernel.tile_state("s", i) == "stopped" for i in range(4)), what="stopped"
    )
    assert kernel.button("s", "Interrupt")[1]["disabled"]
    # Each rank's tile turns "stopped" as its end is told; the mesh itself is "stopped"
    # once its sockets are closed, a moment later ("stopping" until then).
    listed = re.compile(r"s\s+hosts=2 × gpus=2\s+local\s+0/4\s+stopped")
    wait_until(
        lambda: listed.search(kernel.run("%mesh").text),
        timeout=15,
        interval=0.2,
        what="%mesh lists mesh s as stopped",
        detail=lambda: kernel.run("%mesh").text,
    )


# -- without a kernel: the model and the charts -----------------------------------------


@pytest.mark.unit
def test_series_keeps_order_and_bounds_memory():
    from monarch_kernel.widgets.state import SERIES_CAP, Series

    one, batched = Series(), Series()
    for i in range(SERIES_CAP - 1):
        one.add(float(i), 1.0 / (i + 1))
    for start in range(0, SERIES_CAP - 1, 37):
        xs = [float(i) for i in range(start, min(start + 37, SERIES_CAP - 1))]
        batched.extend(xs, [1.0 / (x + 1) for x in xs])
    assert one.xs == batched.xs == [float(i) for i in range(SERIES_CAP - 1)]
    big = Series()
    for start in range(0, 100_000, 250):
        xs = [float(i) for i in range(start, start + 250)]
        big.extend(xs, xs)
    assert big.count == 100_000 and big.last == (99_999.0, 99_999.0)
    assert len(big.xs) < SERIES_CAP and big.xs == sorted(big.xs) and big.xs[0] == 0.0
    gaps = {b - a for a, b in zip(big.xs, big.xs[1:])}
    assert len(gaps) <= 2  # evenly thinned (one stride, or two around the last halving)
    assert big.arrays()[0][-1] == 99_999.0  # the latest point is always drawn


@pytest.mark.unit
def test_many_ranks_chart_as_mean_with_band():
    from monarch_kernel.widgets import charts

    lines = [(f"r{r}", list(range(100)), [r + x / 10 for x in range(100)]) for r in range(64)]
    svg = charts.line_chart("loss", lines, chart_id="metric:loss")
    assert 'data-label="mean of 64"' in svg and 'class="mk-band"' in svg
    assert svg.count("<polyline") == 1
    few = charts.line_chart("loss", lines[:4])
    assert few.count("<polyline") == 4 and "mk-band" not in few
    assert "waiting for data" in charts.line_chart("loss", [])


def test_64_ranks_reporting_every_10ms_in_process():
    """A 64-rank mesh with real ranks reporting every 10 ms: every report is folded in,
    in order, updates stay at <= 4/s, and big meshes (64 ranks: the heat-map threshold)
    get the grid, one state code a rank, and charts of the mean, min and max."""
    from monarch_kernel.actor import this_host
    from monarch_kernel.kernel.remote import RemoteJob
    from monarch_kernel.widgets import dashboard
    from monarch_kernel.widgets.heat_grid import HeatGrid

    procs = this_host().spawn_procs(per_host={"gpus": 64}, name="big")
    try:
        dash = procs.dashboard()
        assert dashboard(procs) is dash and dashboard(procs.runtime) is dash
        steps = 150
        code = (
            "import time, monarch_kernel\n"
            f"for i in range({steps}):\n"
            "    monarch_kernel.report(step=i, loss=1.0 / (i + 1))\n"
            "    time.sleep(0.01)\n"
        )
        t0 = time.time()
        RemoteJob(procs, code, "loop", None).start().wait(timeout=60)

        def all_folded_in() -> bool:  # the last reports may come just after the replies
            dash.update()
            series = dash.state.metrics.get("loss", {})
            return len(series) == 64 and all(s.count == steps for s in series.values())

        wait_until(all_folded_in, timeout=30, what="every rank's last report")
        series = dash.state.metrics["loss"]
        assert sorted(series) == list(range(64))
        assert all(s.count == steps and s.last == (steps - 1, 1.0 / steps) for s in series.values())
        assert all(s.xs == sorted(s.xs) for s in series.values())
        assert dash.state.dropped == 0
        stamps = [t for t in dash.flush_times if t >= t0]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert gaps and min(gaps) >= 0.24, gaps
        assert dash.heat and not dash.tiles and isinstance(dash.grid, HeatGrid)
        assert dash.grid.widget.states == "i" * 64
        # the live chart got every rank's points, as their mean, min and max per step;
        # the static fallback draws the band
        assert sorted(dash.live_charts) == ["metric:loss", "throughput"]
        # the charts take new points once a second (64 ranks): wait for the last take

        def all_taken() -> bool:
            dash.update()
            return all(s.fresh_x == [] and s.fresh_at == steps for s in series.values())

        wait_until(all_taken, timeout=10, what="the chart to take every point")
        bands = dash.chart_area.bands["loss"]
        assert bands.mean.count == steps and bands.lo.last == (steps - 1, 1.0 / steps)
        assert 'data-label="mean of 64"' in dash.snapshot()[0]
        assert "<b>64/64</b> alive" in dash.header.value
    finally:
        procs.stop()


def test_a_dead_rank_restarted_by_the_policy_in_process():
    """Under ``--on-failure restart`` a rank that dies mid-job: the job leaves the list,
    the header says the mesh is recovering, and the report says what was restarted."""
    import signal

    from monarch_kernel.actor import this_host
    from monarch_kernel.controller.state.records import SetupCell
    from monarch_kernel.kernel.remote import RemoteJob
    from monarch_kernel.widgets import dashboard

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="auto", grace=0.5)
    try:
        dash = dashboard(procs)
        heads: list[str] = []
        dash.header.observe(lambda change: heads.append(change["new"]), names="value")
        loop = "import time\nfor _ in range(600):\n    time.sleep(0.1)\n"
        job = RemoteJob(procs, loop, "9", None).start()
        wait_until(lambda: dash.job_labels[0].value, timeout=10, what="the job listed")
        assert "<b>cell 9</b> · running on ranks 0-1 · " in dash.job_labels[0].value
        assert not dash.cancel_buttons[0].disabled and dash.jobs_box.layout.display == "flex"
        # a setup cell that takes a while: the recovery is long enough to be seen
        procs.runtime.remember_setup(SetupCell("import time\ntime.sleep(0.8)", "slow-setup"))
        kill(procs.runtime.ranks[1].pid, signal.SIGKILL)
        wait_until(lambda: dash.state.recovery_count == 1, timeout=30, what="the recovery")
        wait_until(lambda: "recovered: restarted ranks 1" in dash.status, what="the status")
        assert any("recovering: restarting" in h and "mk-phase-recovering" in h for h in heads)
        wait_until(lambda: "mk-recovery" in dash.errors.value, what="the report")
        assert "restarted rank(s) 1" in dash.errors.value and "slow-setup" in dash.errors.value
        assert "lost on the restarted rank(s)" in dash.errors.value
        assert job.done() and not dash.state.jobs
        wait_until(lambda: dash.jobs_box.layout.display == "none", what="the list hidden")
        assert dash.job_labels[0].value == "" and dash.cancel_buttons[0].disabled
    finally:
        procs.stop()


@pytest.mark.unit
def test_series_hands_the_live_chart_each_point_once():
    from monarch_kernel.widgets.series import FRESH_CAP, Series

    s = Series()
    s.extend([0.0, 1.0], [5.0, 4.0])
    s.extend([2.0], [3.0])
    assert s.take_fresh() == (0, [0.0, 1.0, 2.0], [5.0, 4.0, 3.0])
    assert s.take_fresh() == (3, [], [])
    s.extend([0.0], [6.0])  # a new run: the chart is told where it starts (index 3)
    assert s.take_fresh() == (3, [0.0], [6.0])
    big = Series()  # nobody takes them: only the newest FRESH_CAP are held
    xs = [float(i) for i in range(FRESH_CAP + 10)]
    big.extend(xs, xs)
    start, fx, _ = big.take_fresh()
    assert start == 10 and len(fx) == FRESH_CAP and fx[0] == 10.0


@pytest.mark.unit
def test_a_run_that_starts_again_is_not_joined_to_the_last():
    from monarch_kernel.widgets import charts

    runs = charts.runs([0, 1, 2, 0, 1], [9, 8, 7, 9, 8])
    assert runs == [([0, 1, 2], [9, 8, 7]), ([0, 1], [9, 8])]
    svg = charts.line_chart("loss", [("r0", [0, 1, 2, 0, 1], [9, 8, 7, 9, 8])])
    assert svg.count('class="mk-old-run"') == 1 and svg.count('class="mk-line"') == 1
    assert 'data-last-x="1" data-last-y="8" data-points="2"' in svg


@pytest.mark.unit
def test_tile_text_is_cut_at_words_and_fits_the_tile():
    from monarch_kernel.widgets import render
    from monarch_kernel.widgets.state import TileView

    assert render.clip("short") == "short"
    cut = render.clip("interrupted: cell 12 of a notebook with long names")
    assert len(cut) <= render.TILE_CHARS and cut.endswith("…")
    assert cut == "interrupted: cell 12 of…"  # whole words only
    view = TileView(
        rank=3, state="busy", what="RemoteJob cell 12 calling an_endpoint_with_a_long_name",
        coords="gpus=3", host="a-very-long-hostname.cluster.example.com", pid="123456",
        device="cuda:3", mem="GPU 1.2 GB", step="1200", seen="<1s", rate_in=1.5e9,
        rate_out=2e6, restarts=0,
    )  # fmt: skip
    lines = render.tile_text(view, compact=False).split("\n")
    assert all(len(line) <= render.TILE_CHARS for line in lines), lines
    assert lines[2].endswith("· pid 123456")  # the host is what gets cut
    dead = render.tile_text(dataclasses.replace(view, state="dead"), compact=False)
    assert "in 1.5 GB/s" not in dead  # no transfer rate on a rank that is not up


def test_svg_charts_when_live_charts_are_off(monkeypatch):
    """``MONARCH_KERNEL_CHARTS=svg`` (or no anywidget): the static SVG charts, live."""
    from monarch_kernel.actor import this_host
    from monarch_kernel.kernel.remote import RemoteJob
    from monarch_kernel.widgets import live_chart
    from monarch_kernel.widgets.dashboard import Dashboard

    monkeypatch.setattr(live_chart, "AVAILABLE", False)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="svgcharts")
    try:
        dash = Dashboard(procs.runtime, start=False)
        code = (
            "import monarch_kernel\nfor i in range(5):\n"
            "    monarch_kernel.report(step=i, loss=1 / (i + 1))"
        )
        RemoteJob(procs, code, "loop", None).start().wait(timeout=30)

        def charted() -> bool:
            dash.update()
            return 'data-chart="metric:loss"' in dash.charts.value

        wait_until(charted, timeout=10, what="svg loss chart")
        assert dash.live_charts == {} and dash.charts_box.children == ()
        dash.close()
    finally:
        procs.stop()
