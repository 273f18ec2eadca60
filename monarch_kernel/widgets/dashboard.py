"""The live mesh dashboard: ipywidgets over the kernel's comm channel.

One :class:`Dashboard` per mesh (``dashboard(procs)`` returns the same one each time, so
showing it again in another cell is a second view of the same widget models).

Threads:

* controller threads call :meth:`MeshState.on_event` (a deque append, nothing more);
* the dashboard's updater thread wakes every ``interval`` seconds (0.25 s: at most four
  updates a second), folds the queued events in, renders each part and sends only the
  widgets whose value changed (each widget's changes as one comm message);
* button clicks (Cancel included) arrive on whichever thread the kernel handles the comm
  message on: a subshell thread when the frontend sends comms over subshells (JupyterLab
  >= 4.4 with ipykernel >= 7), so they work while a cell is busy; else the main thread,
  after the running cell. They only record the request; slow actions (restart, stop, cancel)
  run on a worker thread.
"""

from __future__ import annotations

import html
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.records import MeshPhase, RankState
from monarch_kernel.widgets import chart_pane, live_chart, panes, render, theme
from monarch_kernel.widgets.display import Display, prefer_frontend_subshell
from monarch_kernel.widgets.jobs import MAX_JOBS
from monarch_kernel.widgets.snapshot import snapshot_html, snapshot_text
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.views import TileView

if TYPE_CHECKING:
    from monarch_kernel.actor.meshes import ProcMesh
    from monarch_kernel.controller.mesh import MeshRuntime

log = logging.getLogger("monarch_kernel.widgets")

UPDATE_INTERVAL = 0.25  # seconds between two updates: at most 4 updates a second
CONFIRM_S = 4.0  # the stop button asks for a second click within this time


class Dashboard(W.VBox):
    """Live view of one process mesh: header, buttons, running jobs (each with a Cancel
    button), rank tiles, charts, errors and recoveries.

    Create it with :func:`monarch_kernel.widgets.dashboard`; display it like any widget.
    Frontends without widget support show a static HTML snapshot instead.
    """

    def __init__(self, runtime: MeshRuntime, interval: float = UPDATE_INTERVAL, start: bool = True):
        self.runtime = runtime
        self.state = MeshState(runtime)
        self.interval = interval
        self.selected: int | None = None
        self.status = ""
        self.flushes = 0
        self.flush_times: deque[float] = deque(maxlen=4096)
        self.messages = 0  # widget updates sent (one comm message each)
        self.cpu_seconds = 0.0  # CPU time spent in updates (all threads that ran them)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._confirm_stop_until = 0.0
        self._action: threading.Thread | None = None
        self._displays: list[Display] = []
        self._last_sample = 0.0
        self._last_flush = 0.0
        self._last_tiles = 0.0
        self._marked: int | None = None  # the tile shown as selected
        self._last_charts = 0.0
        self._chart_key: tuple[int, int] = (-1, -1)
        self._error_key = -1
        self._recoveries_seen = 0
        self._phase_seen = runtime.state
        n = runtime.world
        self.compact = n > render.FULL_TILES_MAX
        self.columns = render.grid_columns(self.state)
        # a full tile holds render.TILE_CHARS characters a line at the tile font
        width, height = (104, 44) if self.compact else (184, 108)
        self.chart_interval = 0.5 if n <= 8 else 1.0
        self.tile_text_period = max(1.0, n / 32)  # compact tiles: seconds between texts
        tile_layout = W.Layout(width=f"{width}px", height=f"{height}px", margin="0")
        self.tiles: list[W.Button] = []
        for r in range(n):
            tile = W.Button(description=f"rank {r}", layout=tile_layout)
            tile.add_class("mk-tile")
            tile.on_click(lambda _b, r=r: self.select(r))
            self.tiles.append(tile)
        self._views: list[TileView] = []  # what each tile shows (empty before the first tick)
        self.css = W.HTML(theme.CSS)
        self.header = W.HTML()
        self.hosts_html = W.HTML()  # machines still joining (join and engine backends)
        grid = W.GridBox(
            self.tiles,
            layout=W.Layout(
                grid_template_columns=f"repeat({self.columns}, {width}px)",
                grid_gap="4px",
                margin="2px 8px 4px 0",
                # rows keep the tiles' height when the detail pane beside the grid is
                # taller (stretched rows left a blank gap between tiles)
                align_content="flex-start",
            ),
        )
        self.detail = W.HTML(layout=W.Layout(flex="1 1 320px", min_width="300px"))
        self.interrupt_button = W.Button(
            description="Interrupt",
            icon="stop",
            tooltip="Raise KeyboardInterrupt in the user code every rank runs (SIGINT)",
        )
        self.restart_button = W.Button(
            description="Restart dead ranks", icon="refresh", disabled=True
        )
        self.stop_button = W.Button(
            description="Stop mesh", icon="power-off", tooltip="Stop every rank of this mesh"
        )
        for b in (self.interrupt_button, self.restart_button, self.stop_button):
            b.layout.width = "auto"
        self.interrupt_button.on_click(lambda _b: self.interrupt())
        self.restart_button.on_click(lambda _b: self.restart())
        self.stop_button.on_click(lambda _b: self.stop())
        self.status_html = W.HTML()
        # Charts: live uPlot charts (appends only) when anywidget is there, else the
        # static SVG charts in one HTML widget. ``charts`` holds the hint (no metrics yet)
        # in the first case, the SVG in the second.
        self.charts = W.HTML()
        self.live_charts: dict[str, live_chart.LiveChart] = {}
        self._rate_sent = 0  # transfer samples sent to the live chart
        self._rate_t0: float | None = None
        self.charts_box = W.Box(layout=W.Layout(display="flex", flex_flow="row wrap"))
        if live_chart.AVAILABLE:
            self.charts_box.children = (self._new_chart("throughput"),)
        self.errors = W.HTML()
        self.stacks_button = W.Button(
            description="Stacks",
            icon="list",
            tooltip="Every rank's Python stacks now, grouped; the odd ones out highlighted",
            layout=W.Layout(width="auto"),
        )
        self.stacks_button.on_click(lambda _b: self.show_stacks())
        prefer_frontend_subshell(self.stacks_button)
        self.stacks_html = W.HTML()  # filled by the Stacks button
        # Running jobs: a fixed pool of rows (hidden when unused). A job keeps its row
        # while it runs, so rows do not move under the pointer; each row's Cancel
        # cancels the job shown in it.
        self.jobs_title = W.HTML()
        self.job_labels: list[W.HTML] = []
        self.cancel_buttons: list[W.Button] = []
        self.job_rows: list[W.HBox] = []
        self._job_slots: list[str | None] = [None] * MAX_JOBS
        for i in range(MAX_JOBS):
            label = W.HTML()
            cancel = W.Button(
                description="Cancel",
                icon="times",
                tooltip="Interrupt this job on the ranks still running it",
                layout=W.Layout(width="auto", flex="0 0 auto"),
            )
            cancel.on_click(lambda _b, i=i: self._cancel_slot(i))
            self.job_labels.append(label)
            self.cancel_buttons.append(cancel)
            self.job_rows.append(
                W.HBox([label, cancel], layout=W.Layout(display="none", align_items="center"))
            )
        self.jobs_box = W.VBox(
            [self.jobs_title, *self.job_rows], layout=W.Layout(display="none", margin="0 0 2px")
        )
        for b in (self.interrupt_button, self.stacks_button, self.restart_button, self.stop_button):
            b.layout.flex = "0 0 auto"  # a long status wraps; the buttons keep their labels
        self.status_html.layout.flex = "1 1 auto"
        buttons = W.HBox(
            [
                self.interrupt_button,
                self.stacks_button,
                self.restart_button,
                self.stop_button,
                self.status_html,
            ]
        )
        body = W.Box(
            [grid, self.detail],
            layout=W.Layout(display="flex", flex_flow="row wrap", align_items="flex-start"),
        )
        super().__init__(
            [
                self.css,
                self.header,
                self.hosts_html,
                buttons,
                self.jobs_box,
                self.stacks_html,
                body,
                self.charts_box,
                self.charts,
                self.errors,
            ]
        )
        self.add_class("mk-dash")
        for w in (
            *self.tiles,
            *self.cancel_buttons,
            self.interrupt_button,
            self.restart_button,
            self.stop_button,
        ):
            prefer_frontend_subshell(w)
        self.state.attach()
        self._tick()
        self._thread = threading.Thread(
            target=self._run, name=f"mk-dashboard-{runtime.name}", daemon=True
        )
        if start:
            self._thread.start()

    # -- display -------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        data: dict[str, Any] | None = super()._repr_mimebundle_(**kwargs)
        if data is None:
            return None
        html, text = self.snapshot()
        data["text/html"] = html
        data["text/plain"] = text
        return data

    def snapshot(self) -> tuple[str, str]:
        """Static ``(html, text)`` views of the current state (for non-widget frontends)."""
        with self._lock:
            views = self._views
            return (
                snapshot_html(self.state, views, self.columns),
                snapshot_text(self.state, views),
            )

    def show(self) -> None:
        """Display the dashboard under the current cell (its fallback is refreshed when
        the mesh finishes starting and when it stops)."""
        from IPython.display import display

        display_id = f"mk-dash-{id(self):x}-{len(self._displays)}"
        display(self, display_id=display_id)
        self._displays.append(Display(display_id))

    def refresh(self) -> None:
        """Update now and refresh the displays' static fallback (the kernel calls this,
        through :func:`monarch_kernel.widgets.refresh`, once the mesh started or failed)."""
        self.update()
        self.refresh_displays()

    def refresh_displays(self) -> None:
        """Re-send the displays made by :meth:`show` (updates their static fallback)."""
        if not self._displays or self.comm is None:
            return
        data = self._repr_mimebundle_()
        if data is None:
            return
        for d in self._displays:
            try:
                d.update(data)
            except Exception:  # a closed kernel channel: nothing to do
                pass

    # -- actions (any thread) --------------------------------------------------------
    def select(self, rank: int | None) -> None:
        """Show ``rank``'s recent output and last error (``None``: clear; again: toggle)."""
        self.selected = None if rank == self.selected else rank
        self._wake.set()

    def _procs(self) -> ProcMesh:
        from monarch_kernel.actor.meshes import ProcMesh

        return ProcMesh(self.runtime)

    def _set_status(self, text: str) -> None:
        self.status = f"{time.strftime('%H:%M:%S')} {text}"
        self._wake.set()

    def interrupt(self) -> None:
        """Send SIGINT to every live rank (KeyboardInterrupt in their user code)."""
        rt = self.runtime
        alive = [i.rank for i in rt.ranks if i.alive]
        if rt.state.ended or not alive:
            self._set_status("nothing to interrupt")
            return
        self._procs().interrupt()
        self._set_status(f"interrupt sent to ranks {format_ranks(alive)}")

    def _cancel_slot(self, slot: int) -> None:
        """The Cancel button of row ``slot``: cancel the job it shows."""
        rid = self._job_slots[slot]
        if rid is None:
            self._set_status("that job had finished")
            return
        self.cancel(rid)

    def cancel(self, request_id: str) -> None:
        """Cancel a running job (a ``%%remote`` cell, ``--bg`` ones included, or an
        actor call): interrupt it on the ranks still running it and skip it where it has
        not started yet (``MeshRuntime.cancel_request``), on a worker thread; the status
        line says what was done."""
        what = self.state.errors.what(request_id) or f"request {request_id}"
        rt = self.runtime
        if rt.state.ended:
            self._set_status(f"the mesh is stopped: {what} is not running")
            return

        def work() -> None:
            try:
                ranks = rt.cancel_request(request_id)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"cancel of {what} failed: {exc}".split("\n")[0])
                return
            if not ranks:
                self._set_status(f"{what} had finished")
                return
            self.state.running.cancelling.add(request_id)  # its row says so until it ends
            many = "ranks" if len(ranks) > 1 else "rank"
            self._set_status(f"cancelled {what} on {many} {format_ranks(ranks)}")

        self._run_action(work, f"cancelling {what}…")

    def show_stacks(self) -> None:
        """Show every rank's Python stacks now, grouped, under the buttons (collected on
        a worker thread, in about a second at most; see ``%mesh stacks``)."""
        from monarch_kernel.widgets.stacks_view import mesh_stacks

        rt = self.runtime
        if rt.state.ended:
            self._set_status("the mesh is stopped: no stacks to show")
            return

        def work() -> None:
            try:
                view = mesh_stacks(rt)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"stacks failed: {exc}".split("\n")[0])
                return
            with self._lock:
                self._put(self.stacks_html, value=view._repr_html_())
            odd = view.odd_ranks
            self._set_status(
                f"stacks of {len(view.stacks)} ranks in {view.elapsed:.2f}s"
                + (f"; odd ones out: ranks {format_ranks(odd)}" if odd else "")
            )

        self._run_action(work, "collecting stacks…")

    def restart(self, ranks: list[int] | None = None) -> None:
        """Restart ``ranks`` (default: the selected rank if it is dead, else every dead
        rank) on a worker thread."""
        rt = self.runtime
        if ranks is None:
            dead = [i.rank for i in rt.ranks if i.state is RankState.DEAD]
            if self.selected is not None and self.selected in dead:
                dead = [self.selected]
            ranks = dead
        if not ranks:
            self._set_status("no dead ranks to restart")
            return
        label = format_ranks(ranks)

        def work() -> None:
            t0 = time.monotonic()
            try:
                report = self._procs().restart(ranks)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"restart of ranks {label} failed: {exc}".split("\n")[0])
            else:
                n = len(report.problems)
                problems = f"; {n} problem(s), see below" if n else ""
                self._set_status(
                    f"restarted ranks {label} in {time.monotonic() - t0:.1f}s{problems}"
                )

        self._run_action(work, f"restarting ranks {label}…")

    def stop(self, confirm: bool = True) -> None:
        """Stop the mesh; from the button the first click asks for a second one."""
        if confirm and time.monotonic() > self._confirm_stop_until:
            self._confirm_stop_until = time.monotonic() + CONFIRM_S
            self._set_status("click Stop again to stop every rank")
            return
        self._confirm_stop_until = 0.0

        def work() -> None:
            try:
                self.runtime.stop()
            except Exception as exc:
                self._set_status(f"stop failed: {exc}")
            else:
                self._set_status("mesh stopped")

        self._run_action(work, "stopping the mesh…")

    def _run_action(self, work: Callable[[], None], status: str) -> None:
        if self._action is not None and self._action.is_alive():
            self._set_status("still busy with the previous action")
            return
        self._set_status(status)
        self._action = threading.Thread(target=work, name="mk-dashboard-action", daemon=True)
        self._action.start()

    # -- the updater -----------------------------------------------------------------
    def _run(self) -> None:
        final = False
        while not self._closed:
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.update()
            except Exception:  # never let the dashboard thread die
                log.exception("dashboard update failed")
            if self.runtime.state is MeshPhase.STOPPED:
                if final:
                    break
                final = True  # one more round for events still in flight
        self.state.detach()
        if not self._closed:
            self.refresh_displays()

    def update(self) -> None:
        """Bring the widgets up to date now; waits out the throttle (at most one update
        per ``interval``) first."""
        with self._lock:
            wait = self._last_flush + self.interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._tick()

    def _tick(self) -> None:
        with self._lock:
            cpu0 = time.thread_time()
            try:
                self._tick_locked()
            finally:
                self.cpu_seconds += time.thread_time() - cpu0

    def _tick_locked(self) -> None:
        st = self.state
        st.drain()
        self._note_phase()
        now = time.monotonic()
        if now - self._last_sample >= 1.0:
            self._last_sample = now
            st.sample()
        # Big meshes: a tile's colour follows its state at once, its text (step, last
        # heard) every second or two; that keeps 64 tiles to ~32 messages a second.
        full = not self.compact or now - self._last_tiles >= self.tile_text_period
        if full:
            self._last_tiles = now
        marked = {self.selected, self._marked}  # selection moved: both tiles change
        self._marked = self.selected
        old_views = self._views
        views: list[TileView] = []
        sent = 0
        for r in range(self.runtime.world):
            view = old_views[r] if r < len(old_views) else None
            if full or view is None or r in marked or view.state != st.tile_state(r):
                view = st.tile(r, now)
                sent += self._put_tile(r, view)
            views.append(view)
        self._views = views
        sent += self._put(self.header, value=render.header_html(st, views))
        sent += self._put(self.hosts_html, value=render.hosts_html(self.runtime))
        sel = self.selected
        sent += self._put(
            self.detail,
            value=panes.detail_html(st, sel, views[sel] if sel is not None else None),
        )
        chart_key = (st.history.version, st.throughput.samples)
        if chart_key != self._chart_key and now - self._last_charts >= self.chart_interval:
            self._chart_key = chart_key
            self._last_charts = now
            if live_chart.AVAILABLE:
                sent += self._append_charts()
            else:
                sent += self._put(self.charts, value=chart_pane.charts_html(st))
        if st.error_version != self._error_key:
            self._error_key = st.error_version
            sent += self._put(self.errors, value=panes.errors_html(st))
        sent += self._put_jobs(now)
        sent += self._put_buttons(views, now)
        if sent:
            self._last_flush = time.monotonic()
            self.flushes += 1
            self.messages += sent
            self.flush_times.append(time.time())

    # -- live charts -------------------------------------------------------------------
    def _new_chart(self, chart_id: str) -> live_chart.LiveChart:
        """A live chart: ``throughput`` (transfer rates) or ``metric:NAME``."""
        if chart_id == "throughput":
            per_rank = self.state.throughput.per_rank_bytes
            chart = live_chart.LiveChart(
                self._rate_snapshot,
                chart_id=chart_id,
                title="transfer" + ("" if per_rank else " (mesh total)"),
                x_label="s",
                unit="B/s",
            )
        else:
            name = chart_id.split(":", 1)[1]
            chart = live_chart.LiveChart(
                lambda: self._metric_snapshot(name),
                chart_id=chart_id,
                title=name,
                x_label="step",
            )
        self.live_charts[chart_id] = chart
        return chart

    def _append_charts(self) -> int:
        """Send each live chart the points that arrived since the last update (one
        message per chart that has new points); new metrics get a chart."""
        st = self.state
        sent = 0
        new = [n for n in st.metrics if f"metric:{n}" not in self.live_charts]
        if new:
            added = tuple(self._new_chart(f"metric:{n}") for n in new)
            self.charts_box.children = (*self.charts_box.children, *added)
            sent += 1
        for name, per_rank in list(st.metrics.items()):
            batch: list[live_chart.Points] = []
            for rank, series in sorted(per_rank.items()):
                start, xs, ys = series.take_fresh()
                if xs:
                    key = f"r{rank}"
                    batch.append({"key": key, "label": key, "start": start, "x": xs, "y": ys})
            if batch:
                self.live_charts[f"metric:{name}"].append(batch)
                sent += 1
        rates = self._rate_points(self._rate_sent)
        self._rate_sent = st.throughput.samples
        if rates:
            self.live_charts["throughput"].append(rates)
            sent += 1
        hint = "" if st.metrics else chart_pane.metrics_hint()
        return sent + self._put(self.charts, value=hint)

    def _metric_snapshot(self, name: str) -> list[live_chart.Points]:
        """Every kept point of metric ``name`` (a chart view that just opened)."""
        with self._lock:
            out: list[live_chart.Points] = []
            for rank, series in sorted(self.state.metrics.get(name, {}).items()):
                xs, ys = series.arrays()
                key = f"r{rank}"
                out.append(
                    {"key": key, "label": key, "start": 0, "count": series.count, "x": xs, "y": ys}
                )
            return out

    def _rate_snapshot(self) -> list[live_chart.Points]:
        with self._lock:
            return self._rate_points(0, reset=True)

    def _rate_points(self, since: int, reset: bool = False) -> list[live_chart.Points]:
        """Transfer rates (bytes/s) of samples ``since`` on (sample numbers count from
        the first): per rank in and out, or the mesh totals."""
        st = self.state
        hist = list(st.throughput.history)
        first = st.throughput.samples - len(hist)  # sample number of hist[0]
        start = max(since, first)
        rows = hist[start - first :]
        if not rows:
            return []
        if self._rate_t0 is None:
            self._rate_t0 = rows[0][0]
        xs = [t - self._rate_t0 for t, _, _ in rows]
        out: list[live_chart.Points] = []

        def put(key: str, group: str, ys: list[float]) -> None:
            out.append(
                {
                    "key": key,
                    "label": key,
                    "group": group,
                    "dash": group == "out",
                    "start": start,
                    "x": xs,
                    "y": ys,
                }
            )
            if reset:
                out[-1]["count"] = st.throughput.samples

        for idx, direction in ((0, "in"), (1, "out")):
            if st.throughput.per_rank_bytes:
                for r in range(self.runtime.world):
                    ys = [rates[r][idx] if r in rates else 0.0 for _, rates, _ in rows]
                    put(f"r{r} {direction}", direction, ys)
            else:
                put(direction, direction, [tot[idx] for _, _, tot in rows])
        return out

    def _note_phase(self) -> None:
        """Say in the status line when the mesh starts recovering and what a recovery
        did (one the Restart button asked for says so itself)."""
        st = self.state
        if st.mesh_state is not self._phase_seen:
            self._phase_seen = st.mesh_state
            if st.mesh_state is MeshPhase.RECOVERING:
                self._set_status("recovering: restarting ranks…")
        if st.recovery_count > self._recoveries_seen:
            self._recoveries_seen = st.recovery_count
            self._set_status(st.recoveries[0].summary)

    def _put_jobs(self, now: float) -> int:
        """The running jobs: each keeps its row while it is listed; new ones take free
        rows; a row's Cancel cancels the job it shows."""
        st = self.state
        shown = st.running.view(now) if st.running.jobs else []
        by_id = {job.request: job for job in shown}
        slots = self._job_slots
        for i, rid in enumerate(slots):
            if rid is not None and rid not in by_id:
                slots[i] = None
        placed = set(slots)
        for job in shown:
            if job.request not in placed:
                slots[slots.index(None)] = job.request
        sent = self._put(self.jobs_title, value=panes.jobs_title_html(st, shown))
        sent += self._put(self.jobs_box.layout, display="flex" if shown else "none")
        for i, rid in enumerate(slots):
            row = self.job_rows[i]
            if rid is None or rid not in by_id:
                sent += self._put(row.layout, display="none")
                sent += self._put(self.job_labels[i], value="")
                sent += self._put(self.cancel_buttons[i], disabled=True)
                continue
            job = by_id[rid]
            sent += self._put(self.job_labels[i], value=panes.job_html(job))
            sent += self._put(  # still enabled while cancelling: a second try may help
                self.cancel_buttons[i],
                disabled=False,
                tooltip=f"Cancel {job.what}: interrupt it on the {job.ranks.split(' (')[0]} "
                "still running it",
            )
            sent += self._put(row.layout, display="flex")
        return sent

    def _put(self, widget: W.Widget, **values: Any) -> int:
        changed = {k: v for k, v in values.items() if getattr(widget, k) != v}
        if not changed:
            return 0
        with widget.hold_sync():
            for k, v in changed.items():
                setattr(widget, k, v)
        return 1

    def _put_tile(self, r: int, v: TileView) -> int:
        tile = self.tiles[r]
        classes = ("mk-tile", f"mk-s-{v.state}") + (("mk-selected",) if r == self.selected else ())
        return self._put(
            tile,
            description=render.tile_text(v, self.compact),
            tooltip=render.tile_tooltip(v),
            _dom_classes=classes,
        )

    def _put_buttons(self, views: list[TileView], now: float) -> int:
        stopped = self.runtime.state.ended
        dead = [v.rank for v in views if v.state == "dead"]
        if self.selected is not None and self.selected in dead:
            restart_label = f"Restart rank {self.selected}"
        else:
            restart_label = f"Restart dead ranks ({len(dead)})" if dead else "Restart dead ranks"
        confirming = now < self._confirm_stop_until
        sent = self._put(self.interrupt_button, disabled=stopped)
        sent += self._put(self.stacks_button, disabled=stopped)
        sent += self._put(
            self.restart_button, disabled=stopped or not dead, description=restart_label
        )
        sent += self._put(
            self.stop_button,
            disabled=stopped,
            description="Click again to stop" if confirming else "Stop mesh",
            button_style="danger" if confirming else "",
        )
        sent += self._put(
            self.status_html, value=f'<span class="mk-status">{html.escape(self.status)}</span>'
        )
        return sent

    # -- teardown --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed dashboard shows nothing more)."""
        return self._closed

    def close(self) -> None:
        """Stop updating and close every widget model (the mesh keeps running)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self.state.detach()
        if _dashboards.get(self.runtime) is self:
            del _dashboards[self.runtime]
        for w in self._parts():
            w.close()
        super().close()

    def _parts(self) -> list[W.Widget]:
        """Every widget model of the dashboard except the dashboard itself."""
        seen: dict[int, W.Widget] = {}
        stack: list[W.Widget] = [self]
        while stack:
            w = stack.pop()
            subs = (
                *getattr(w, "children", ()),
                getattr(w, "layout", None),
                getattr(w, "style", None),
            )
            for sub in subs:
                if isinstance(sub, W.Widget) and id(sub) not in seen and sub is not self:
                    seen[id(sub)] = sub
                    stack.append(sub)
        return list(seen.values())

    def __repr__(self) -> str:
        rt = self.runtime
        return f"<Dashboard of mesh {rt.name!r} {rt.shape.describe()} ({rt.state})>"


#: The one open dashboard of each mesh. Weak keys: the map itself keeps no mesh alive
#: (an open dashboard does, through its widgets, until it is closed).
_dashboards: weakref.WeakKeyDictionary[MeshRuntime, Dashboard] = weakref.WeakKeyDictionary()
_dashboards_lock = threading.Lock()


def dashboard_of(runtime: MeshRuntime) -> Dashboard:
    """``runtime``'s dashboard: the open one, else a new one."""
    with _dashboards_lock:
        dash = _dashboards.get(runtime)
        if dash is None or dash.closed:
            dash = _dashboards[runtime] = Dashboard(runtime)
        return dash


def existing(runtime: MeshRuntime) -> Dashboard | None:
    """``runtime``'s open dashboard, if it has one (never creates one)."""
    dash = _dashboards.get(runtime)
    return None if dash is None or dash.closed else dash
